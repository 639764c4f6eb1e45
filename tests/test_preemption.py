"""Preemption is survivable: SIGTERM and SIGUSR1 (what `timeout`, Slurm and Kubernetes send) finish the step, write a
checkpoint and the report, say how to resume and exit non-zero, in one process and on two ranks; a second signal
ends the process at once; trainer.save_every_minutes checkpoints a run that is never told. Each test sends a real
signal to a real `posttrain` process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from posttrain.checkpoint import latest_checkpoint, list_checkpoints, verify_checkpoint

ARGS = ["data.train_files=['posttrain/arithmetic:train[:256]']", "model.name_or_path=posttrain/tiny",
        "trainer.micro_batch_size=8", "trainer.learning_rate=3e-3", "trainer.warmup_steps=1",
        "logging.progress=none", "logging.plot=false", "trainer.num_threads=1"]


def _start(output_dir: Path, *extra: str, nproc: int = 1) -> subprocess.Popen:
    command = [sys.executable, "-m", "posttrain", "sft", *ARGS, f"output_dir={output_dir}", *extra]
    if nproc > 1:
        command += ["--nproc-per-node", str(nproc)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_for_steps(process: subprocess.Popen, output_dir: Path, steps: int, timeout: float = 240) -> None:
    metrics = output_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= steps:
            return
        time.sleep(0.02)
    process.kill()
    raise AssertionError(f"the run did not reach step {steps}: {process.communicate()[1][-3000:]}")


def _steps(output_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, pytest.param(signal.SIGUSR1, marks=pytest.mark.slow)])
def test_a_signal_saves_a_checkpoint_and_the_report_and_the_run_resumes(tmp_path, tiny_model_dir, signal_number,
                                                                       capsys):
    # Issue 34: SIGTERM ended a run silently, with no checkpoint (save_every 0, the default) and no report.
    out = tmp_path / "run"
    process = _start(out, "trainer.max_steps=100000")
    _wait_for_steps(process, out, 3)
    process.send_signal(signal_number)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal_number, stderr[-3000:]
    name = signal.Signals(signal_number).name
    newest = latest_checkpoint(out)
    assert newest is not None and verify_checkpoint(newest.path) is None
    assert newest.step == _steps(out)[-1] >= 3  # the step under way was finished, logged and saved
    assert f"{name} received: finishing this step" in stderr
    assert (f"stopped by {name} after step {newest.step} of 100000; checkpoint {newest.path} written. Run the same "
            f"command again to resume from step {newest.step}; report: {out / 'report.html'}") in stderr
    assert "Traceback" not in stderr and (out / "report.html").is_file() and not (out / "final").exists()
    # The report written on the way out says how the run ended, and flags it.
    page = (out / "report.html").read_text()
    assert f"ended by Preempted: stopped by {name} after step {newest.step} of 100000" in page.split("</header>")[0]
    assert f"<li>the run did not finish: ended by Preempted: stopped by {name}" in page
    # The same command, with an end in sight, carries on from that step (here in this process: quicker).
    from posttrain.cli import main

    assert main(["sft", *ARGS, f"output_dir={out}", f"trainer.max_steps={newest.step + 2}"]) == 0
    printed = capsys.readouterr().out
    assert f"resuming from {newest.path}" in printed
    assert f"done: trained steps {newest.step + 1}-{newest.step + 2} of {newest.step + 2} (resumed from step " \
           f"{newest.step})" in printed
    assert _steps(out)[-2:] == [newest.step + 1, newest.step + 2]


def test_a_second_signal_ends_the_process_at_once(tmp_path):
    # The first signal asks for a clean stop at the step's end; one more, later, is someone who wants it gone now.
    # A repeat within DUPLICATE_WINDOW_S is the same request (torchrun forwards the SIGTERM each rank also got).
    script = textwrap.dedent("""
        import os, signal, time
        from posttrain.preemption import preemption_handlers, step_boundary
        with preemption_handlers():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the duplicate
            time.sleep(0.1)
            print("asked to stop:", step_boundary(0).stop_signal == signal.SIGTERM, flush=True)
            time.sleep(1.2)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            print("still running")
    """)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert result.stdout == "asked to stop: True\n" and time.monotonic() - started < 20
    assert result.stderr.count("SIGTERM received") == 1


def test_save_every_minutes_checkpoints_a_run_that_is_never_told(tmp_path):
    # A killed default run (save_every 0) had nothing to resume from; now a checkpoint is written at the first
    # step end save_every_minutes after the last one. (Here a tiny interval: every step.)
    from posttrain.algorithms.sft import train_sft
    from posttrain.config import SFTConfig, load_config

    out = tmp_path / "run"
    train_sft(load_config(SFTConfig, None, [*ARGS, f"output_dir={out}", "trainer.max_steps=3", "trainer.keep_last=5",
                                            "trainer.save_every_minutes=1e-9"]))
    assert [c.step for c in list_checkpoints(out)] == [1, 2, 3]
    default = load_config(SFTConfig, None, [*ARGS, f"output_dir={tmp_path / 'default'}", "trainer.max_steps=3",
                                            "trainer.keep_last=5"])
    assert 0 < default.trainer.save_every_minutes <= 30
    train_sft(default)
    assert [c.step for c in list_checkpoints(tmp_path / "default")] == [3]  # the default: not every few seconds


@pytest.mark.slow
def test_sigterm_on_two_ranks_saves_a_sharded_checkpoint_and_the_report(tmp_path, tiny_model_dir):
    # `posttrain ... --nproc-per-node 2` gets SIGTERM (as from `timeout` or a scheduler): it passes it to torchrun,
    # which passes it to both ranks; they agree at the step's end, write the checkpoint together and stop.
    out = tmp_path / "run"
    process = _start(out, "trainer.max_steps=100000", "trainer.micro_batch_size=4",
                     "trainer.gradient_accumulation_steps=2", nproc=2)
    _wait_for_steps(process, out, 3)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode != 0
    newest = latest_checkpoint(out)
    assert newest is not None and verify_checkpoint(newest.path) is None, stderr[-3000:]
    assert newest.step == _steps(out)[-1] >= 3
    assert f"stopped by SIGTERM after step {newest.step}" in stderr and (out / "report.html").is_file()
    rerun = subprocess.run([sys.executable, "-m", "posttrain", "sft", *ARGS, f"output_dir={out}",
                            "trainer.micro_batch_size=4", "trainer.gradient_accumulation_steps=2",
                            f"trainer.max_steps={newest.step + 1}", "--nproc-per-node", "2"],
                           capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _steps(out)[-1] == newest.step + 1
