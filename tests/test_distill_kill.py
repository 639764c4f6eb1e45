"""posttrain distill killed with SIGKILL and run again with the same command logs exactly what an uninterrupted run
logs, step for step: off-policy with the teacher's top-k precomputed (the file is reused, not scored again), on-policy
with lmbda 0.5 (the per-step draws and the student's samples after the resume are the uninterrupted run's), and
when the kill lands while a checkpoint is being written (the run resumes from the one before). Every run is a real
`posttrain distill` process; the interrupted one is killed from outside once a checkpoint exists and steps past it
are logged, which the re-run then does again."""

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

from posttrain.algorithms.distill import TEACHER_TOPK_DIR
from posttrain.checkpoint import latest_checkpoint, list_checkpoints

from teachers_for_tests import ARITHMETIC_64, TINY_DISTILL, perturbed_tiny_teacher

STEPS, SAVE_EVERY = 30, 4
RUN = [*TINY_DISTILL, ARITHMETIC_64, "trainer.num_threads=1", f"trainer.max_steps={STEPS}",
       f"trainer.save_every={SAVE_EVERY}"]
CASES = {
    "precompute": ["teachers=[{{name_or_path: '{teacher}', precompute: true}}]"],
    "on_policy": ["teachers=[{{name_or_path: '{teacher}'}}]", "mode=on_policy", "lmbda=0.5", "seed=3",
                  "rollout.max_new_tokens=6"],
}
TIMINGS = ("step_seconds", "tokens_per_second", "teacher_seconds", "sample_seconds")
"""Wall-clock metrics, the only ones that may differ between two runs of the same steps."""
DEADLINE_S = 240


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return perturbed_tiny_teacher(tmp_path_factory.mktemp("teacher"))


def arguments(case: str, teacher: Path, output_dir: Path) -> list[str]:
    return ["distill", *RUN, *(each.format(teacher=teacher) for each in CASES[case]), f"output_dir={output_dir}"]


def run(argv: list[str], launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """argv run to its end by `python -m posttrain.cli` (or by the launcher script), with a deadline."""
    return subprocess.run([sys.executable, *(launcher or ["-m", "posttrain.cli"]), *argv], capture_output=True,
                          text=True, timeout=DEADLINE_S, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def uninterrupted(teacher_dir, tmp_path_factory):
    """The uninterrupted run of each case (run once per module, when a test first asks for it): its records."""
    done: dict[str, list[dict]] = {}

    def records(case: str) -> list[dict]:
        if case not in done:
            output_dir = tmp_path_factory.mktemp(f"uninterrupted-{case}")
            finished = run(arguments(case, teacher_dir, output_dir))
            assert finished.returncode == 0, finished.stderr[-3000:]
            done[case] = read_records(output_dir)
        return done[case]

    return records


def read_records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def kill_past_a_checkpoint(argv: list[str], output_dir: Path, need_topk_file: bool) -> int:
    """Start the run and SIGKILL it once a checkpoint exists (and the teacher's top-k file, when asked) and two
    steps past that checkpoint are logged; return the step logged last before the kill."""
    process = subprocess.Popen([sys.executable, "-m", "posttrain.cli", *argv], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics, topk = output_dir / "metrics.jsonl", output_dir / TEACHER_TOPK_DIR / "manifest.json"
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and process.poll() is None:
        checkpoints = list_checkpoints(output_dir)
        if checkpoints and (topk.is_file() or not need_topk_file) and metrics.is_file():
            if metrics.read_text().count("\n") >= checkpoints[-1].step + 2:
                process.send_signal(signal.SIGKILL)
                break
        time.sleep(0.005)
    else:
        process.kill()
        _, stderr = process.communicate()
        raise AssertionError(f"the run ended by itself or did not checkpoint within {DEADLINE_S} s, before it "
                             f"could be killed: {stderr[-3000:]}")
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    return read_records(output_dir)[-1]["step"]


def assert_same_records(resumed: list[dict], expected: list[dict]) -> None:
    """Step for step, every metric but the wall-clock ones equal: the same process count, threads and machine
    make the same float operations in the same order, so nothing is left to a tolerance."""
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))  # the steps done again are not duplicated
    for got, want in zip(resumed, expected, strict=True):
        assert {k: v for k, v in got.items() if k not in TIMINGS} == {
            k: v for k, v in want.items() if k not in TIMINGS}, f"step {want['step']}"


def test_killed_off_policy_run_reuses_the_teacher_file_and_logs_the_uninterrupted_runs_metrics(
        tmp_path, teacher_dir, uninterrupted):
    output_dir = tmp_path / "run"
    argv = arguments("precompute", teacher_dir, output_dir)
    killed_at = kill_past_a_checkpoint(argv, output_dir, need_topk_file=True)
    checkpoint = latest_checkpoint(output_dir)
    assert checkpoint is not None and checkpoint.step < killed_at < STEPS
    path = output_dir / TEACHER_TOPK_DIR / "topk.safetensors"
    before = (path.stat().st_ino, path.stat().st_mtime_ns, path.read_bytes())

    rerun = run(argv)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming from {checkpoint.path} (step {checkpoint.step})" in rerun.stdout
    assert f"teacher top-k: reusing {path} (checksum verified)" in rerun.stdout
    assert "teacher top-k: scored" not in rerun.stdout  # the teacher was not loaded again
    assert (path.stat().st_ino, path.stat().st_mtime_ns, path.read_bytes()) == before
    assert_same_records(read_records(output_dir), uninterrupted("precompute"))


def test_killed_on_policy_run_logs_the_uninterrupted_runs_draws_and_metrics(tmp_path, teacher_dir, uninterrupted):
    output_dir = tmp_path / "run"
    argv = arguments("on_policy", teacher_dir, output_dir)
    killed_at = kill_past_a_checkpoint(argv, output_dir, need_topk_file=False)
    checkpoint = latest_checkpoint(output_dir)
    assert checkpoint is not None and checkpoint.step < killed_at < STEPS

    rerun = run(argv)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming from {checkpoint.path} (step {checkpoint.step})" in rerun.stdout
    expected = uninterrupted("on_policy")
    after = [r["distill/on_policy"] for r in expected[checkpoint.step:]]
    assert 0.0 in after and 1.0 in after  # both kinds of step are done again after the resume
    assert_same_records(read_records(output_dir), expected)


KILL_WHILE_SAVING = textwrap.dedent(r"""
    # posttrain.cli with a SIGKILL of its own process while checkpoint step_{step} is being written: every file of it
    # is in its staging folder, its manifest is not. (Anything before the rename that publishes the folder is alike.)
    import os, re, signal, sys

    import posttrain.checkpoint as checkpoint
    from posttrain.cli import main

    write_manifest = checkpoint.write_manifest

    def killed_before_the_manifest(staging):
        if re.search(r"step_{step}\b", staging.name):
            os.kill(os.getpid(), signal.SIGKILL)
        return write_manifest(staging)

    checkpoint.write_manifest = killed_before_the_manifest
    sys.exit(main(sys.argv[1:]))
""")


def test_a_kill_while_a_checkpoint_is_written_resumes_from_the_one_before(tmp_path, teacher_dir, uninterrupted):
    output_dir = tmp_path / "run"
    argv = arguments("precompute", teacher_dir, output_dir)
    launcher = tmp_path / "kill_while_saving.py"
    launcher.write_text(KILL_WHILE_SAVING.format(step=2 * SAVE_EVERY))
    killed = run(argv, launcher=[str(launcher)])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [c.step for c in list_checkpoints(output_dir)] == [SAVE_EVERY]
    staged = [p for p in (output_dir / "checkpoints").iterdir() if p.name.startswith(f".tmp-step_{2 * SAVE_EVERY}-")]
    assert len(staged) == 1 and (staged[0] / "policy").is_dir()  # the half-written one, left where resume ignores it

    rerun = run(argv)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming from {output_dir / 'checkpoints' / f'step_{SAVE_EVERY}'} (step {SAVE_EVERY})" in rerun.stdout
    assert "teacher top-k: reusing" in rerun.stdout
    assert not [p for p in (output_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert_same_records(read_records(output_dir), uninterrupted("precompute"))
