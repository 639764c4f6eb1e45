"""HV-13's script (scripts/hardware/hv13_ray_generation_gpu.py): its per-run checks on hand-made records, each
failing when what it guards is broken; the CPU dry run end to end (the transformers phase with CPU generation
actors, the colocated phase on a CPU policy rank; the GPU runs are HV-13's job)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hardware" / "hv13_ray_generation_gpu.py"


def load_script():
    spec = importlib.util.spec_from_file_location("hv13_ray_generation_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def records(steps: int = 3) -> tuple[list[dict], list[dict]]:
    """A healthy run: version s pushed at step s, step s trained on version s - 1's samples, small mismatch."""
    metrics = [{"step": s, "weight_sync/version": float(s), "generator_logprob_error": 0.02} for s in range(1, steps + 1)]
    samples = [{"step": s, "split": "train", "policy_version": s - 1} for s in range(1, steps + 1) for _ in range(4)]
    return metrics, samples


def test_each_check_passes_a_healthy_run_and_fails_when_its_part_breaks():
    script = load_script()
    metrics, samples = records()
    assert all(script.run_checks(metrics, samples, ["cuda:0 (vllm)"], "cuda:0 (vllm)", 3, 0.1).values())

    def failed(metrics, samples, devices=("cuda:0 (vllm)",)) -> set[str]:
        checks = script.run_checks(metrics, samples, list(devices), "cuda:0 (vllm)", 3, 0.1)
        return {key for key, ok in checks.items() if not ok}

    assert failed(metrics, samples, ["cpu"]) == {"device"}
    assert failed(metrics[:2], samples) == {"all_steps", "version_pushed_each_step"}
    stale = [dict(m, **{"weight_sync/version": 1.0}) for m in metrics]  # the push never stamped a new version
    assert failed(stale, samples) == {"version_pushed_each_step"}
    unstamped = [dict(s, policy_version=0) for s in samples]  # episodes all report the first version
    assert failed(metrics, unstamped) == {"episodes_sampled_by_previous_version"}
    assert failed(metrics, []) == {"episodes_sampled_by_previous_version"}
    drifted = [dict(m, generator_logprob_error=0.5) if m["step"] == 2 else m for m in metrics]  # weights not loaded
    assert failed(drifted, samples) == {"logprob_error"}
    assert script.same_rewards([{"reward/mean": 0.5}], [{"reward/mean": 0.5}])
    assert not script.same_rewards([{"reward/mean": 0.5}], [{"reward/mean": 0.25}])


@pytest.mark.slow  # about 150 s on 2 shared cores: three 2-step Ray runs
def test_cpu_dry_run_passes_the_transformers_and_colocated_phases_and_skips_the_vllm_phases(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(SCRIPT.parents[2] / "src")}
    done = subprocess.run([sys.executable, str(SCRIPT), "--allow-cpu", "--steps", "2"], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "hv13.json").read_text())
    assert result["passed"] and set(result["skipped"]) == {"vllm", "adapters"}
    assert result["runs"]["transformers-broadcast"]["sync_backend"] == "gloo"
    assert result["runs"]["transformers-object-store"]["devices"] == ["cpu"]
    assert result["runs"]["colocated-policy-rank"]["generator"] == "RankGenerator"  # sampling on the policy rank
    assert result["runs"]["colocated-policy-rank"]["devices"] == ["cpu"]
    assert result["runs"]["transformers-object-store"]["generator"] == "RayGenerator"
    assert result["checks"]["colocated-policy-rank/version_pushed_each_step"]
