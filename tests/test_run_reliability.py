"""Nothing lost, nothing silent: one run per output directory, verified checkpoints with fallback, the
non-finite guard, a full disk, and the output directory's own guards. Each test reproduces a failure a
careless or hostile user met, and asserts what happens now."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.checkpoint import DAMAGED_SUFFIX, latest_checkpoint, list_checkpoints
from posttrain.errors import RunError

ARGS = [
    "data.train_files=['posttrain/arithmetic:train[:256]']",
    "trainer.micro_batch_size=8", "trainer.learning_rate=3e-3", "trainer.warmup_steps=1", "trainer.lr_scheduler=constant",
    "logging.progress=none", "logging.plot=false",
]


def _config(output_dir: Path, *overrides: str):
    from posttrain.config import SFTConfig, load_config

    return load_config(SFTConfig, None, ARGS + [f"output_dir={output_dir}", *overrides])


def _train(output_dir: Path, *overrides: str):
    from posttrain.algorithms.sft import train_sft

    return train_sft(_config(output_dir, *overrides))


def _command(output_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "posttrain.cli", "sft", *ARGS, f"output_dir={output_dir}", *overrides]


def _losses(output_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())]


# ---- row 1: one run per output directory -------------------------------------------------------------------


def test_second_run_on_a_busy_output_dir_fails_at_once_and_the_first_completes(tmp_path: Path):
    out = tmp_path / "run"
    first = subprocess.Popen(_command(out, "trainer.max_steps=300", "trainer.save_every=10", "trainer.num_threads=1"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").is_file() and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.02)
    assert first.poll() is None, f"the first run ended before the second started: {first.stderr.read()}"

    with pytest.raises(RunError, match=f"{out} is in use by another run \\(PID {first.pid}, lock .*\\.lock\\)"):
        _train(out, "trainer.max_steps=300", "trainer.save_every=10")
    assert first.poll() is None, "the second run was refused only because the first had already finished"

    assert first.wait(timeout=600) == 0, first.stderr.read()
    assert [step for step, _ in _losses(out)] == list(range(1, 301))  # the first run's metrics are whole
    assert [c.step for c in list_checkpoints(out)] == [290, 300]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def test_lock_of_a_killed_run_is_taken_over_with_a_message(tmp_path: Path):
    out = tmp_path / "run"
    victim = subprocess.Popen(_command(out, "trainer.max_steps=400", "trainer.save_every=5", "trainer.num_threads=1"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list_checkpoints(out) and time.monotonic() < deadline:
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert (out / ".lock").read_text().strip() == str(victim.pid)

    rerun = subprocess.run(_command(out, "trainer.max_steps=12", "trainer.save_every=5"), capture_output=True,
                           text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"taking over the lock of PID {victim.pid}, which is no longer running" in rerun.stdout + rerun.stderr
    assert (out / ".lock").read_text() == ""  # released: the next run finds no dead holder


def test_staging_cleanup_removes_only_dead_runs_folders(tmp_path: Path):
    from posttrain.rundir import claim_output_dir

    out = tmp_path / "run"
    claim_output_dir(out)  # a run directory, where runs that died left their staging folders
    (out / "checkpoints").mkdir(parents=True)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        live_staging = out / "checkpoints" / f".tmp-step_5-{alive.pid}"
        dead_staging = out / "checkpoints" / f".tmp-step_5-{dead.pid}"
        dead_final = out / f".tmp-final-{dead.pid}"
        for folder in (live_staging, dead_staging, dead_final):
            folder.mkdir()
            (folder / "model.safetensors").write_bytes(b"x" * 1000)
        _train(out, "trainer.max_steps=2", "trainer.save_every=1")
        assert live_staging.is_dir()
        assert not dead_staging.exists() and not dead_final.exists()
    finally:
        alive.kill()
        alive.wait()


# ---- rows 2 and 3: damaged checkpoints -------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _delete(path: Path) -> None:
    path.unlink()


def _overwrite_4kb(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(os.urandom(4096))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> list[tuple[int, float]]:
    out = tmp_path_factory.mktemp("reference")
    _train(out, "trainer.max_steps=6", "trainer.save_every=2")
    return _losses(out)


@pytest.mark.parametrize("damage,file", [
    (_truncate, "policy/model.safetensors"),
    (_truncate, "policy/optimizer.pt"),
    (_truncate, "rng_state.pt"),
    (_truncate, "trainer_state.json"),
    (_overwrite_4kb, "policy/model.safetensors"),
    (_delete, "manifest.json"),
], ids=["truncated-model", "truncated-optimizer", "truncated-rng", "truncated-trainer-state", "4kb-overwritten-model",
        "manifest-deleted"])
def test_damaged_newest_checkpoint_is_skipped_for_the_intact_one(tmp_path: Path, capsys, reference_run, damage, file):
    out = tmp_path / "run"
    _train(out, "trainer.max_steps=4", "trainer.save_every=2")
    newest = latest_checkpoint(out)
    assert newest.step == 4
    damage(newest.path / file)
    capsys.readouterr()

    _train(out, "trainer.max_steps=6", "trainer.save_every=2")
    err = capsys.readouterr().err
    assert f"checkpoint {newest.path} is damaged" in err and file.split("/")[-1] in err
    # Resumed from step 2, the intact one, so steps 3-6 were trained again: exactly the uninterrupted run's.
    assert _losses(out) == reference_run
    assert (out / "checkpoints" / f"step_4{DAMAGED_SUFFIX}").is_dir()  # kept for inspection, out of rotation
    weights = load_file(out / "final" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_no_intact_checkpoint_stops_with_a_message(tmp_path: Path):
    out = tmp_path / "run"
    _train(out, "trainer.max_steps=4", "trainer.save_every=2")
    for checkpoint in list_checkpoints(out):
        _overwrite_4kb(checkpoint.path / "policy" / "model.safetensors")
    with pytest.raises(RunError, match="no intact checkpoint in .*checkpoints"):
        _train(out, "trainer.max_steps=6", "trainer.save_every=2")
    assert not list_checkpoints(out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2.damaged", "step_4.damaged"]


# ---- row 4: non-finite numbers ---------------------------------------------------------------------------------


def test_infinite_learning_rate_is_refused_by_the_config(tmp_path: Path):
    result = subprocess.run(_command(tmp_path / "run", "trainer.learning_rate=inf"), capture_output=True, text=True)
    assert result.returncode == 2
    assert "trainer.learning_rate" in result.stderr and "finite number" in result.stderr
    assert not (tmp_path / "run").exists()


def test_diverging_run_stops_naming_the_step_and_writes_no_final(tmp_path: Path):
    out = tmp_path / "run"
    # A learning rate of 1e30 is finite, so the config takes it; the first update makes the weights huge and
    # the next loss is NaN.
    with pytest.raises(RunError, match=r"step 2: the (loss|gradient norm) is nan.*the run stopped without applying it") \
            as caught:
        _train(out, "trainer.max_steps=20", "trainer.save_every=1", "trainer.learning_rate=1e30",
               "trainer.max_grad_norm=null")
    assert not (out / "final").exists()
    newest = latest_checkpoint(out)
    assert newest is not None and f"the newest checkpoint, {newest.path}, is kept" in str(caught.value)
    weights = load_file(newest.path / "policy" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


def _nan_at(steps: set[int], monkeypatch) -> None:
    """Make the SFT loss NaN at the given optimizer steps (counted by calls to optim_step)."""
    from posttrain.workers.local import LocalPolicyWorker
    from posttrain.workers.objectives import NLLObjective

    calls = {"step": 1}
    real_objective, real_step = NLLObjective.__call__, LocalPolicyWorker.optim_step

    def objective(self, logprobs, batch, normalizer):
        loss, metrics = real_objective(self, logprobs, batch, normalizer)
        return (loss * float("nan") if calls["step"] in steps else loss), metrics

    def optim_step(self):
        calls["step"] += 1
        return real_step(self)

    monkeypatch.setattr(NLLObjective, "__call__", objective)
    monkeypatch.setattr(LocalPolicyWorker, "optim_step", optim_step)


def test_skip_mode_skips_and_counts_a_nonfinite_step_without_applying_it(tmp_path: Path, monkeypatch):
    out = tmp_path / "run"
    two_clean_steps = _train(tmp_path / "clean", "trainer.max_steps=2").final_dir
    _nan_at({3}, monkeypatch)
    result = _train(out, "trainer.max_steps=3", "trainer.on_nonfinite=skip")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["nonfinite_skipped_steps"] == 1
    # Step 3 was not applied: the weights are those of a clean two-step run (a constant learning rate, so the
    # schedule's length does not matter), bit for bit.
    skipped, clean = load_file(result.final_dir / "model.safetensors"), load_file(two_clean_steps / "model.safetensors")
    assert skipped.keys() == clean.keys()
    assert all(torch.equal(skipped[name], clean[name]) for name in clean)


def test_skip_mode_stops_after_too_many_nonfinite_steps_in_a_row(tmp_path: Path, monkeypatch):
    _nan_at(set(range(2, 100)), monkeypatch)
    with pytest.raises(RunError, match=r"step 4: .*; 3 non-finite steps in a row, more than .*max_nonfinite_skips=2"):
        _train(tmp_path / "run", "trainer.max_steps=10", "trainer.on_nonfinite=skip", "trainer.max_nonfinite_skips=2")
    assert not (tmp_path / "run" / "final").exists()


# ---- row 10: disk full ----------------------------------------------------------------------------------------


def _can_mount_tmpfs() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs $d"], capture_output=True)
    return None if probe.returncode == 0 else f"cannot mount a tmpfs here: {probe.stderr.decode().strip()}"


@pytest.mark.skipif(_can_mount_tmpfs() is not None, reason=str(_can_mount_tmpfs()))
def test_disk_full_or_read_only_is_named_cleaned_up_and_resumable(tmp_path: Path):
    # In a private mount namespace: a 20 MB tmpfs holds one 13 MB checkpoint of the tiny model, not two.
    mount, small = tmp_path / "disk", tmp_path / "small"
    mount.mkdir()
    small.mkdir()
    out = mount / "run"
    cli = shlex.join(_command(out, "trainer.max_steps=6", "trainer.save_every=2", "logging.plot=true"))
    # 3 MB cannot hold even the 4.3 MB model.safetensors: the weights' own writer (safetensors) fails first.
    tiny_disk = shlex.join(_command(small / "run", "trainer.max_steps=2", "trainer.save_every=2"))
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    on_readonly = shlex.join(_command(readonly / "run", "trainer.max_steps=2"))
    script = textwrap.dedent(f"""
        mount -t tmpfs -o ro,size=1m tmpfs {readonly}
        {on_readonly} > {tmp_path}/ro.out 2> {tmp_path}/ro.err; echo $? > {tmp_path}/ro.rc
        mount -t tmpfs -o size=3m tmpfs {small}
        {tiny_disk} > {tmp_path}/small.out 2> {tmp_path}/small.err; echo $? > {tmp_path}/small.rc
        ls -a {small}/run/checkpoints > {tmp_path}/after_small.ls
        mount -t tmpfs -o size=20m tmpfs {mount}
        {cli} > {tmp_path}/first.out 2> {tmp_path}/first.err; echo $? > {tmp_path}/first.rc
        ls -a {out}/checkpoints > {tmp_path}/after_first.ls
        mount -o remount,size=80m {mount}
        {cli} > {tmp_path}/second.out 2> {tmp_path}/second.err; echo $? > {tmp_path}/second.rc
        ls -a {out}/checkpoints > {tmp_path}/after_second.ls
        ls {out}/final > {tmp_path}/final.ls
    """)
    subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], check=True, timeout=600)
    read = lambda name: (tmp_path / name).read_text()  # noqa: E731

    assert read("first.rc").strip() == "1"
    first_err = read("first.err")
    assert "could not write checkpoint step 4" in first_err and "no space left on the device" in first_err
    assert "step_2 is intact" in first_err and "resume from step 2" in first_err
    assert "Traceback" not in first_err
    assert not [name for name in read("after_first.ls").split() if name.startswith(".tmp-")]

    assert read("second.rc").strip() == "0", read("second.err")
    assert "resuming from" in read("second.out") and "(step 2)" in read("second.out")
    assert read("after_second.ls").split() == [".", "..", "step_4", "step_6"]
    assert "model.safetensors" in read("final.ls").split()

    assert read("ro.rc").strip() == "1"
    assert f"could not write {readonly / 'run'}: Read-only file system" in read("ro.err")
    assert "Traceback" not in read("ro.err")

    assert read("small.rc").strip() == "1"
    small_err = read("small.err")
    assert "could not write checkpoint step 2" in small_err and "no space left on the device" in small_err
    assert "there is no earlier checkpoint" in small_err and "Traceback" not in small_err
    assert read("after_small.ls").split() == [".", ".."]


# ---- row 15: the output directory itself ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["''", "' '", "."])
def test_empty_output_dir_is_refused(tmp_path: Path, value: str):
    command = [sys.executable, "-m", "posttrain.cli", "sft", *ARGS, "trainer.max_steps=1", f"output_dir={value}"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "output_dir" in result.stderr and "current directory" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_users_files_in_final_are_not_deleted(tmp_path: Path):
    from posttrain.rundir import claim_output_dir

    out = tmp_path / "run"
    claim_output_dir(out)  # a run directory of posttrain's, where the user then put notes into final/
    (out / "final").mkdir(parents=True)
    (out / "final" / "notes.txt").write_text("my notes")
    with pytest.raises(RunError, match=r"final holds files this run did not write \(notes.txt\)"):
        _train(out, "trainer.max_steps=2")
    assert (out / "final" / "notes.txt").read_text() == "my notes"
    assert not (out / "metrics.jsonl").exists()  # refused before training, not after

    (out / "final" / "notes.txt").unlink()
    _train(out, "trainer.max_steps=2")  # an empty final/, or a previous export, is replaced
    _train(out, "trainer.max_steps=3")
    assert (out / "final" / "model.safetensors").is_file()


# ---- issue 34: a run writes only what it owns -------------------------------------------------------------------


def test_a_folder_posttrain_did_not_make_is_refused_before_anything_is_written(tmp_path: Path):
    # Row 2: an existing folder of the user's was written over (config.yaml, report.html, the plot); with a foreign
    # metrics.jsonl config.yaml was overwritten first, then the run died with a raw ValueError.
    out = tmp_path / "mine"
    out.mkdir()
    mine = {"config.yaml": "my: config\n", "report.html": "<p>my report</p>", "training_curves.png": "png",
            "metrics.jsonl": "not json\n"}
    for name, text in mine.items():
        (out / name).write_text(text)
    with pytest.raises(RunError, match=r"already holds files posttrain did not write \(config.yaml, metrics.jsonl, "
                                       r"report.html, training_curves.png\).*overwrite_output_dir=true"):
        _train(out, "trainer.max_steps=1")
    assert sorted(p.name for p in out.iterdir()) == sorted(mine)  # no lock, no marker, nothing else
    assert all((out / name).read_text() == text for name, text in mine.items())
    # A new or empty folder is made a run directory; a run directory is resumed as before.
    _train(tmp_path / "new", "trainer.max_steps=1")
    _train(tmp_path / "new", "trainer.max_steps=2")
    assert latest_checkpoint(tmp_path / "new").step == 2
    # overwrite_output_dir=true writes into the user's folder anyway (and marks it).
    (out / "metrics.jsonl").unlink()
    _train(out, "trainer.max_steps=1", "overwrite_output_dir=true")
    assert (out / ".posttrain-run").is_file() and (out / "final").is_dir()


def test_a_run_directory_from_before_the_marker_is_still_resumed(tmp_path: Path):
    out = tmp_path / "run"
    _train(out, "trainer.max_steps=2", "trainer.save_every=1")
    (out / ".posttrain-run").unlink()
    _train(out, "trainer.max_steps=3")
    assert latest_checkpoint(out).step == 3 and (out / ".posttrain-run").is_file()


def test_a_user_folder_among_the_checkpoints_is_never_deleted(tmp_path: Path):
    # Row 3: OUTPUT/checkpoints/step_2/notes.txt was deleted by a run with save_every=2, keep_last=1.
    from posttrain.rundir import claim_output_dir

    out = tmp_path / "run"
    claim_output_dir(out)
    (out / "checkpoints" / "step_2").mkdir(parents=True)
    (out / "checkpoints" / "step_2" / "notes.txt").write_text("my notes")
    with pytest.raises(RunError, match=r"step_2 holds files posttrain did not write \(notes.txt\)"):
        _train(out, "trainer.max_steps=4", "trainer.save_every=2", "trainer.keep_last=1")
    assert (out / "checkpoints" / "step_2" / "notes.txt").read_text() == "my notes"
    assert not (out / "metrics.jsonl").exists()


def test_rotation_deletes_only_checkpoints_whose_manifest_lists_every_file(tmp_path: Path):
    from posttrain.checkpoint import save_checkpoint

    class Worker:
        def save(self, directory: Path) -> None:
            directory.mkdir(parents=True)
            (directory / "weights.bin").write_bytes(b"w")

    workers = {"policy": Worker()}
    save_checkpoint(tmp_path, 1, workers, {}, keep_last=1)
    save_checkpoint(tmp_path, 2, workers, {}, keep_last=1)
    assert [c.step for c in list_checkpoints(tmp_path)] == [2]  # posttrain's own step_1 rotated away
    (tmp_path / "checkpoints" / "step_2" / "policy" / "notes.txt").write_text("my notes")
    save_checkpoint(tmp_path, 3, workers, {}, keep_last=1)
    assert (tmp_path / "checkpoints" / "step_2" / "policy" / "notes.txt").read_text() == "my notes"
    with pytest.raises(RunError, match=r"step_2 holds files posttrain did not write \(policy/notes.txt\)"):
        save_checkpoint(tmp_path, 2, workers, {}, keep_last=1)  # nor replaced by a save of the same step
    assert (tmp_path / "checkpoints" / "step_2" / "policy" / "notes.txt").is_file()
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


# ---- issue 34: the closing line says what happened ----------------------------------------------------------------


def test_the_closing_line_says_what_was_trained_skipped_and_where_things_are(tmp_path: Path, monkeypatch, capsys):
    # Row 16: re-running a finished run printed "final loss None"; an on_nonfinite=skip run did not mention the
    # steps it skipped.
    from posttrain.cli import main

    out = tmp_path / "run"
    command = ["sft", *ARGS, f"output_dir={out}", "trainer.max_steps=3", "trainer.on_nonfinite=skip"]
    _nan_at({2}, monkeypatch)
    assert main(command) == 0
    first = capsys.readouterr().out.strip().splitlines()[-1]
    assert first.startswith("done: trained steps 1-3 of 3, 1 of them skipped (non-finite loss or gradient norm")
    loss = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["loss"]
    assert f", loss {loss:.4g}; model: {out / 'final'}; report: {out / 'report.html'}" in first
    assert main(command) == 0
    again = capsys.readouterr().out.strip().splitlines()[-1]
    assert again.startswith(f"done: {out} had already trained its 3 steps; nothing to train, loss {loss:.4g}; model:")
    assert "None" not in again


def test_a_foreign_metrics_file_in_a_run_directory_stops_the_run_before_config_is_written(tmp_path: Path):
    # Row 2: with a foreign metrics.jsonl the run overwrote config.yaml first, then died with a raw ValueError.
    from posttrain.rundir import claim_output_dir

    out = tmp_path / "run"
    claim_output_dir(out)
    (out / "config.yaml").write_text("mine: true\n")
    (out / "metrics.jsonl").write_text("step,loss\n1,2.0\n")
    with pytest.raises(RunError, match=r"metrics.jsonl:1: not a JSON object .*was not written by a run"):
        _train(out, "trainer.max_steps=1")
    assert (out / "config.yaml").read_text() == "mine: true\n"
