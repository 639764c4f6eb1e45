"""posttrain.logging: metrics.jsonl, progress output, experiment trackers and the curves plot."""

from __future__ import annotations

import io
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from posttrain.config.schema import LoggingConfig
from posttrain.logging import RunLogger
from posttrain.logging.metrics import MetricsFile, read_metrics, truncate_metrics
from posttrain.logging.plots import _panels, plot_training_curves
from posttrain.logging.progress import (
    PlainProgress,
    RichProgress,
    create_progress,
    format_duration,
    format_metrics,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_steps(path: Path, steps: range) -> None:
    with MetricsFile(path) as metrics_file:
        for step in steps:
            metrics_file.write(step, {"loss": 10.0 / step})


# --- metrics.jsonl -------------------------------------------------------------------------


def test_metrics_file_writes_plain_numbers_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with MetricsFile(path) as metrics_file:
        metrics_file.write(1, {"loss": 2.5, "num_tokens": 128})
        metrics_file.write(2, {"loss": np.float32(1.25), "grad_norm": torch.tensor(0.5)})

    lines = path.read_text().splitlines()
    assert lines == [
        '{"step": 1, "loss": 2.5, "num_tokens": 128}',
        '{"step": 2, "loss": 1.25, "grad_norm": 0.5}',
    ]
    assert read_metrics(path) == [
        {"step": 1, "loss": 2.5, "num_tokens": 128},
        {"step": 2, "loss": 1.25, "grad_norm": 0.5},
    ]


def test_metrics_file_rejects_reserved_key_and_non_numbers(tmp_path: Path) -> None:
    with MetricsFile(tmp_path / "metrics.jsonl") as metrics_file:
        with pytest.raises(ValueError, match="'step' is reserved"):
            metrics_file.write(1, {"step": 3.0})
        with pytest.raises(TypeError, match="metric 'loss' is not a number"):
            metrics_file.write(1, {"loss": "low"})


def test_read_metrics_ignores_a_truncated_last_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write_steps(path, range(1, 4))
    with path.open("a") as file:
        file.write('{"step": 4, "loss": 2.')  # what kill -9 mid-write leaves

    records = read_metrics(path)
    assert [record["step"] for record in records] == [1, 2, 3]
    assert records[2]["loss"] == pytest.approx(10.0 / 3)


def test_read_metrics_fails_on_a_corrupt_line_in_the_middle(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2:"):
        read_metrics(path)


def test_truncate_metrics_keeps_steps_up_to_last_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write_steps(path, range(1, 7))
    original_lines = path.read_text().splitlines()
    with path.open("a") as file:
        file.write('{"step": 7, "lo')

    dropped = truncate_metrics(path, last_step=3)

    assert dropped == 3
    assert path.read_text().splitlines() == original_lines[:3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary file left
    # Appending after the truncation continues a well-formed file.
    _write_steps(path, range(4, 6))
    assert [record["step"] for record in read_metrics(path)] == [1, 2, 3, 4, 5]


# --- console progress ----------------------------------------------------------------------


def test_format_metrics_and_duration() -> None:
    latest = {"loss": 1.23449, "learning_rate": 1e-4, "tokens_per_second": 5300.0, "grad_norm": 3.0}
    assert format_metrics(latest, ("loss", "eval_loss", "learning_rate", "tokens_per_second"), compact=True) == (
        "loss 1.234 lr 1.0e-04 tok/s 5.3k"
    )
    assert format_metrics(latest, ("loss", "tokens_per_second"), compact=False) == "loss 1.234 tok/s 5300"
    assert [format_duration(seconds) for seconds in (9, 72, 3720)] == ["9s", "1m12s", "1h02m"]


def test_plain_progress_prints_first_every_nth_and_last_step(capsys: pytest.CaptureFixture[str]) -> None:
    progress = PlainProgress(recipe="sft", total_steps=20, every_steps=5, every_seconds=1e9)
    for step in range(1, 21):
        metrics = {"loss": 1.234, "learning_rate": 1e-4, "tokens_per_second": 5300.0}
        if step == 8:
            metrics["eval_loss"] = 1.5
        progress.update(step, metrics)
    progress.message("saved checkpoint")
    progress.close()

    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines[:-1]] == ["1/20", "5/20", "10/20", "15/20", "20/20"]
    assert lines[1].startswith("[sft] step 5/20 (25%) loss 1.234 lr 1.0e-04 tok/s 5300 eta ")
    assert "eval_loss 1.5" in lines[2]  # the latest eval_loss stays shown after its step
    assert "eta" not in lines[4]
    assert lines[-1] == "saved checkpoint"


def test_rich_progress_shows_steps_and_metrics() -> None:
    output = io.StringIO()
    console = Console(file=output, force_terminal=True, width=160, color_system=None)
    progress = RichProgress(recipe="sft", total_steps=200, start_step=40, console=console)
    progress.update(41, {"loss": 1.234, "learning_rate": 1e-4, "tokens_per_second": 5300.0})
    progress.message("resumed")
    progress.close()

    text = output.getvalue()
    assert "41/200" in text
    assert "loss 1.234 lr 1.0e-04 tok/s 5.3k" in text
    assert "resumed" in text


def test_auto_progress_is_plain_when_stdout_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert isinstance(create_progress("auto", recipe="sft", total_steps=10), PlainProgress)


# --- RunLogger and the plot ----------------------------------------------------------------


def test_run_logger_writes_metrics_and_plot_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output_dir = tmp_path / "my_run"
    cfg = LoggingConfig(progress="plain")
    with RunLogger(output_dir, cfg, recipe="sft", total_steps=10) as run_logger:
        for step in range(1, 11):
            if step % 2 == 0:
                metrics = {"loss": 3.0 / step, "learning_rate": 1e-4, "grad_norm": 0.5, "tokens_per_second": 900.0}
                if step % 4 == 0:
                    metrics["eval_loss"] = 4.0 / step
                run_logger.log(step, metrics)
            else:
                run_logger.advance(step)
        run_logger.message("done")

    records = read_metrics(output_dir / "metrics.jsonl")
    assert [record["step"] for record in records] == [2, 4, 6, 8, 10]
    assert records[1] == {
        "step": 4,
        "loss": 0.75,
        "learning_rate": 1e-4,
        "grad_norm": 0.5,
        "tokens_per_second": 900.0,
        "eval_loss": 1.0,
    }
    assert run_logger.plot_path == output_dir / "training_curves.png"
    assert run_logger.plot_path.read_bytes().startswith(PNG_MAGIC)
    output = capsys.readouterr().out
    assert "[sft] step 1/10 (10%)" in output
    assert "[sft] step 10/10 (100%) loss 0.3" in output

    # Resume from the checkpoint of step 6: steps 8 and 10 are redone, not duplicated.
    with RunLogger(output_dir, cfg, recipe="sft", total_steps=10, start_step=6) as run_logger:
        for step in (8, 10):
            run_logger.log(step, {"loss": 100.0 + step})
    records = read_metrics(output_dir / "metrics.jsonl")
    assert [(record["step"], record["loss"]) for record in records] == [
        (2, 1.5),
        (4, 0.75),
        (6, 0.5),
        (8, 108.0),
        (10, 110.0),
    ]
    assert capsys.readouterr().out.splitlines()[0].startswith("[sft] step 8/10 (80%) loss 108")


def test_run_logger_without_plot_writes_no_png(tmp_path: Path) -> None:
    with RunLogger(tmp_path, LoggingConfig(progress="none", plot=False), recipe="dpo", total_steps=2) as run_logger:
        run_logger.log(1, {"loss": 0.69})
    assert not (tmp_path / "training_curves.png").exists()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 0.69}]


def test_plot_returns_none_without_records(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    assert plot_training_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png") is None
    assert not (tmp_path / "curves.png").exists()


def test_plot_panels_put_known_metrics_first_and_cap_their_number(tmp_path: Path) -> None:
    records = [
        {"step": step, "zeta": 1.0, "alpha": 2.0, "eval_loss": 1.5, "loss": 1.0, "learning_rate": 1e-4}
        | {f"reward_{index}": float(index) for index in range(10)}
        for step in range(1, 4)
    ]
    assert _panels(records)[:4] == [("loss", "eval_loss"), ("learning_rate",), ("alpha",), ("reward_0",)]

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    png_path = plot_training_curves(path, tmp_path / "curves.png")
    assert png_path is not None and png_path.read_bytes().startswith(PNG_MAGIC)


# --- experiment trackers -------------------------------------------------------------------


def test_tensorboard_scalars_read_back_and_resume_purges_redone_steps(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggingConfig(progress="none", tensorboard=True, plot=False)
    with RunLogger(tmp_path, cfg, recipe="sft", total_steps=5) as run_logger:
        for step in range(1, 6):
            run_logger.log(step, {"loss": 1.0 / step, "learning_rate": 1e-3})
    with RunLogger(tmp_path, cfg, recipe="sft", total_steps=5, start_step=3) as run_logger:
        for step in (4, 5):
            run_logger.log(step, {"loss": 10.0 + step})

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    loss = [(event.step, event.value) for event in events.Scalars("loss")]
    assert [step for step, _ in loss] == [1, 2, 3, 4, 5]
    assert [value for _, value in loss] == pytest.approx([1.0, 0.5, 1 / 3, 14.0, 15.0])
    assert [event.value for event in events.Scalars("learning_rate")] == pytest.approx([1e-3] * 3)


def test_wandb_offline_run_is_written_and_resumed_with_the_same_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    for variable, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DIR": str(tmp_path / "wandb_dir"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
    }.items():
        monkeypatch.setenv(variable, value)
    output_dir = tmp_path / "run"
    cfg = LoggingConfig(progress="none", wandb=True, plot=False)

    with RunLogger(output_dir, cfg, recipe="grpo", total_steps=4, run_config={"seed": 7}) as run_logger:
        run_logger.log(1, {"loss": 1.2345678})
        run_logger.log(2, {"loss": 0.8765432})
    run_id = (output_dir / "wandb_run_id.txt").read_text().strip()
    with RunLogger(output_dir, cfg, recipe="grpo", total_steps=4, start_step=2) as run_logger:
        run_logger.log(3, {"loss": 0.5432109})

    # One directory per start, both for the same run id (W&B adds "-1" when two starts share a second).
    run_files = sorted((output_dir / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))
    assert len(run_files) == 2
    # The values are stored as JSON text inside the .wandb records.
    assert _wait_for_contents(run_files[0], [b"1.2345678", b"0.8765432"])
    assert _wait_for_contents(run_files[1], [b"0.5432109"])


def _wait_for_contents(path: Path, needles: list[bytes], timeout_seconds: float = 10.0) -> bool:
    """Whether all ``needles`` appear in ``path`` within the timeout.

    wandb's offline ``finish()`` returns before its service process has written the last
    records of the .wandb file (wandb 0.31), so the file can be incomplete for a few ms.
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        contents = path.read_bytes()
        if all(needle in contents for needle in needles):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_mlflow_file_store_metrics_params_and_status_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    # RunLogger opts into MLflow's file store through this variable; restore it after the test.
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    cfg = LoggingConfig(progress="none", mlflow=True, plot=False)
    run_config = {"trainer": {"learning_rate": 1e-4, "max_steps": 3}, "seed": 0}
    with RunLogger(tmp_path, cfg, recipe="sft", total_steps=3, run_config=run_config) as run_logger:
        run_logger.log(1, {"loss": 2.0, "learning_rate": 1e-4})
        run_logger.log(2, {"loss": 1.5})
    run_id = (tmp_path / "mlflow_run_id.txt").read_text().strip()
    client = MlflowClient((tmp_path / "mlruns").resolve().as_uri())

    history = client.get_metric_history(run_id, "loss")
    assert [(metric.step, metric.value) for metric in history] == [(1, 2.0), (2, 1.5)]
    run = client.get_run(run_id)
    assert run.data.params == {"trainer.learning_rate": "0.0001", "trainer.max_steps": "3", "seed": "0"}
    assert run.data.tags["posttrain.recipe"] == "sft"
    assert run.info.status == "FINISHED"

    # A resumed run continues the same MLflow run; a crash marks it FAILED.
    with pytest.raises(RuntimeError, match="out of memory"):
        with RunLogger(tmp_path, cfg, recipe="sft", total_steps=3, start_step=2, run_config=run_config) as run_logger:
            run_logger.log(3, {"loss": 1.25})
            raise RuntimeError("out of memory")
    assert [metric.step for metric in client.get_metric_history(run_id, "loss")] == [1, 2, 3]
    assert client.get_run(run_id).info.status == "FAILED"


@pytest.mark.parametrize(
    ("flag", "module", "pip_name"),
    [("tensorboard", "tensorboard", "tensorboard"), ("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow-skinny")],
)
def test_missing_tracker_package_names_flag_and_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str, module: str, pip_name: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    cfg = LoggingConfig(progress="none", **{flag: True})
    expected = (
        f"logging.{flag}=true needs the {pip_name} package: "
        f"pip install {pip_name} (or pip install 'posttrain[loggers]')"
    )
    with pytest.raises(ModuleNotFoundError, match=re.escape(expected)):
        RunLogger(tmp_path, cfg, recipe="sft", total_steps=1)


def test_missing_package_fails_before_any_tracker_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)
    cfg = LoggingConfig(progress="none", tensorboard=True, mlflow=True)
    with pytest.raises(ModuleNotFoundError, match="logging.mlflow=true"):
        RunLogger(tmp_path, cfg, recipe="sft", total_steps=1)
    assert not (tmp_path / "tensorboard").exists()
