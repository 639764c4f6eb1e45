"""An asynchronous Ray GRPO run (rollout.asynchronous) killed with SIGKILL between two checkpoints and run again with
the same command trains on exactly the prompts of an uninterrupted run, step for step: none repeated, none skipped,
each sampled by the same policy version (the staleness state). Every run is a real `posttrain grpo` process with its
own Ray instance; the interrupted one is killed from outside once a checkpoint exists and a step past it is logged."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.checkpoint import latest_checkpoint, list_checkpoints

from rl_configs import DIGITS, REWARDS, TINY_RL

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra"),
              pytest.mark.slow]  # about 2 minutes: three runs, each starting a Ray instance and two actors

STEPS, SAVE_EVERY = 6, 2
EPISODES_PER_STEP = 8 * 4  # rl_configs: 8 prompts x 4 samples
RUN = ["grpo", *TINY_RL, *DIGITS, "trainer.num_threads=1", f"trainer.max_steps={STEPS}",
       f"trainer.save_every={SAVE_EVERY}", f"logging.samples_per_step={EPISODES_PER_STEP}",
       "cluster.backend=ray", "cluster.timeout_s=600", "rollout.asynchronous=true", "loss.importance_correction=tis"]
STALENESS = ("rollout/staleness_max", "rollout/staleness_mean", "rollout/stale_groups_dropped", "weight_sync/version")
TRAINED = ("reward/mean", "loss", "grad_norm", "generator_logprob_error", "is_weight_mean")
DEADLINE_S = 420


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain.cli", *argv], capture_output=True, text=True,
                          timeout=DEADLINE_S, env={**os.environ, "OMP_NUM_THREADS": "1"})


def records(output_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (output_dir / name).read_text().splitlines()]


def prompts_by_step(output_dir: Path) -> dict[int, list[tuple[int, str, int]]]:
    """Per step, every trained episode's (group id, prompt, policy version that sampled it), in order."""
    steps: dict[int, list[tuple[int, str, int]]] = {}
    for sample in records(output_dir, "samples.jsonl"):
        if sample["split"] == "train":
            steps.setdefault(sample["step"], []).append(
                (sample["group_id"], sample["prompt"], sample["policy_version"]))
    return steps


def kill_past_a_checkpoint(argv: list[str], output_dir: Path) -> int:
    """Start the run, SIGKILL it once a checkpoint exists and a step past it is logged; the step logged last."""
    process = subprocess.Popen([sys.executable, "-m", "posttrain.cli", *argv], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = output_dir / "metrics.jsonl"
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and process.poll() is None:
        checkpoints = list_checkpoints(output_dir)
        if checkpoints and metrics.is_file() and metrics.read_text().count("\n") >= checkpoints[-1].step + 1:
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
    return records(output_dir, "metrics.jsonl")[-1]["step"]


def kill_past_a_checkpoint_and_rerun(argv: list[str], output_dir: Path) -> None:
    """Kill the run past a checkpoint (`kill_past_a_checkpoint`), then re-run the same command to the end and check
    that it resumed from that checkpoint, the newest one the killed run wrote."""
    killed_at = kill_past_a_checkpoint(argv, output_dir)
    checkpoint = latest_checkpoint(output_dir)
    assert checkpoint is not None and checkpoint.step < killed_at < STEPS
    rerun = run(argv)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming from {checkpoint.path} (step {checkpoint.step})" in rerun.stdout


def test_a_killed_asynchronous_run_resumes_without_repeating_or_skipping_a_prompt(tmp_path, tiny_model_dir):
    full_dir, killed_dir = tmp_path / "full", tmp_path / "killed"
    finished = run([*RUN, f"output_dir={full_dir}"])
    assert finished.returncode == 0, finished.stderr[-3000:]
    full = records(full_dir, "metrics.jsonl")
    assert [r["rollout/staleness_max"] for r in full] == [0] + [1] * (STEPS - 1)

    kill_past_a_checkpoint_and_rerun([*RUN, f"output_dir={killed_dir}"], killed_dir)

    # The prompts: every step trained on the uninterrupted run's groups, each sampled by the same policy version; no
    # group id appears twice over the run and none is missing (they count up from 0 in prompt-draw order).
    expected, resumed = prompts_by_step(full_dir), prompts_by_step(killed_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert resumed[step] == expected[step], f"step {step}"
        assert len(resumed[step]) == EPISODES_PER_STEP
    group_ids = sorted({(step, group) for step, episodes in resumed.items() for group, _, _ in episodes})
    assert [group for _, group in group_ids] == list(range(STEPS * 8))

    # The staleness state and what was trained: the uninterrupted run's, step for step.
    again = records(killed_dir, "metrics.jsonl")
    assert [r["step"] for r in again] == list(range(1, STEPS + 1))
    for want, got in zip(full, again, strict=True):
        for key in STALENESS:
            assert got[key] == want[key], (want["step"], key)
        for key in TRAINED:
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), (want["step"], key)


DAPO = ["environment.kind=python", "environment.options={functions: ['" + REWARDS +
        ":digit_fraction_or_constant'], num_workers: 0}", "rollout.dynamic_sampling=true",
        "rollout.max_sampling_rounds=3"]
SAMPLING = ("sampling/rounds", "sampling/groups_kept", "sampling/groups_filtered")


def trained_groups(output_dir: Path) -> dict[int, dict[int, list[float]]]:
    """Per step, every trained group's rewards."""
    steps: dict[int, dict[int, list[float]]] = {}
    for sample in records(output_dir, "samples.jsonl"):
        if sample["split"] == "train":
            steps.setdefault(sample["step"], {}).setdefault(sample["group_id"], []).append(sample["reward"])
    return steps


def test_a_killed_asynchronous_dynamic_sampling_run_resumes_exactly(tmp_path, tiny_model_dir):
    argv = [arg for arg in RUN if not arg.startswith("environment.")]
    full_dir, killed_dir = tmp_path / "full", tmp_path / "killed"
    finished = run([*argv, *DAPO, f"output_dir={full_dir}"])
    assert finished.returncode == 0, finished.stderr[-3000:]
    full = records(full_dir, "metrics.jsonl")
    # Groups with equal rewards were filtered and more rounds drawn; every batch within the staleness bound, counted
    # from the oldest weights of each group (rounds drawn later in a step are newer, never older).
    assert any(r["sampling/rounds"] > 1 for r in full) and all(r["sampling/groups_kept"] > 0 for r in full)
    assert all(r["rollout/staleness_max"] <= 1 and r["rollout/stale_groups_dropped"] == 0 for r in full)
    groups = trained_groups(full_dir)
    for step, kept in groups.items():
        assert len(kept) == full[step - 1]["sampling/groups_kept"]
        assert all(len(rewards) == 4 and max(rewards) > min(rewards) for rewards in kept.values()), step
    ids = [group for kept in groups.values() for group in kept]
    assert ids == sorted(set(ids))  # none twice, in draw order

    kill_past_a_checkpoint_and_rerun([*argv, *DAPO, f"output_dir={killed_dir}"], killed_dir)

    expected, resumed = prompts_by_step(full_dir), prompts_by_step(killed_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert resumed[step] == expected[step], f"step {step}"
    again = records(killed_dir, "metrics.jsonl")
    assert [r["step"] for r in again] == list(range(1, STEPS + 1))
    for want, got in zip(full, again, strict=True):
        for key in (*STALENESS, *SAMPLING):
            assert got[key] == want[key], (want["step"], key)
        for key in TRAINED:
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), (want["step"], key)
