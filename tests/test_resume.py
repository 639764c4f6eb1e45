"""Checkpoints: a run killed at any moment and re-run logs exactly the losses of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from posttrain.checkpoint import latest_checkpoint, list_checkpoints

ARGS = [
    "data.train_files=['posttrain/arithmetic:train[:256]']",
    "data.eval_files=['posttrain/arithmetic:heldout[:32]']",
    "trainer.max_steps=60", "trainer.save_every=10", "trainer.keep_last=2", "trainer.eval_every=20",
    "trainer.micro_batch_size=16", "trainer.gradient_accumulation_steps=2", "trainer.learning_rate=3e-3",
    "trainer.warmup_steps=5", "logging.progress=none", "logging.plot=false",
]


def _command(output_dir: Path) -> list[str]:
    return [sys.executable, "-m", "posttrain.cli", "sft", *ARGS, f"output_dir={output_dir}"]


def _records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def _kill_after(output_dir: Path, min_step: int) -> None:
    """Start a run and SIGKILL it once it has checkpointed and logged a few steps past the checkpoint."""
    process = subprocess.Popen(_command(output_dir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    metrics = output_dir / "metrics.jsonl"
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= min_step and list_checkpoints(output_dir):
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    process.wait()
    assert process.returncode == -signal.SIGKILL, f"run ended by itself before it could be killed: {process.stderr.read()}"


def test_killed_run_resumes_to_identical_losses(tmp_path: Path):
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    subprocess.run(_command(reference), check=True, capture_output=True)
    _kill_after(interrupted, min_step=13)
    killed_at = len(_records(interrupted))
    checkpoint = latest_checkpoint(interrupted)
    assert checkpoint is not None and checkpoint.step < killed_at < 60

    subprocess.run(_command(interrupted), check=True, capture_output=True)
    expected, resumed = _records(reference), _records(interrupted)
    assert [r["step"] for r in resumed] == list(range(1, 61))  # steps redone after the checkpoint are not duplicated
    for a, b in zip(expected, resumed):
        assert (a["step"], a["loss"], a["grad_norm"], a["learning_rate"]) == (b["step"], b["loss"], b["grad_norm"], b["learning_rate"])
        assert a.get("eval_loss") == b.get("eval_loss")
    assert [c.step for c in list_checkpoints(interrupted)] == [50, 60]  # keep_last=2


def test_kill_during_checkpoint_write_is_never_resumed_from(tmp_path: Path, monkeypatch):
    from posttrain import checkpoint as ckpt
    from posttrain.algorithms.sft import train_sft
    from posttrain.config import SFTConfig, load_config

    cfg = load_config(SFTConfig, None, ARGS + [f"output_dir={tmp_path}", "trainer.max_steps=20"])
    real_save = torch.save

    def dying_save(obj, path, *args, **kwargs):
        if "step_20" in str(path) and str(path).endswith("scheduler.pt"):
            raise KeyboardInterrupt("simulated kill in the middle of writing checkpoint 20")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        train_sft(cfg)
    assert latest_checkpoint(tmp_path).step == 10
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert leftovers, "the half-written checkpoint should be in a hidden staging directory"

    monkeypatch.setattr(ckpt.torch, "save", real_save)
    train_sft(cfg)
    assert latest_checkpoint(tmp_path).step == 20
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_finished_run_rerun_does_no_work(tmp_path: Path):
    from posttrain.algorithms.sft import train_sft
    from posttrain.config import SFTConfig, load_config

    cfg = load_config(SFTConfig, None, ARGS + [f"output_dir={tmp_path}", "trainer.max_steps=4", "trainer.save_every=0"])
    train_sft(cfg)
    before = (tmp_path / "metrics.jsonl").read_text()
    result = train_sft(cfg)
    assert result.steps == 4
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert os.path.isdir(tmp_path / "final")
