"""HV-12's script (scripts/hardware/hv12_weight_refit_gpu.py): its pass/fail logic on hand-made results, and its CPU
dry run end to end (gloo and shared memory instead of NCCL and CUDA IPC; the GPU figures are HV-12's job)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hardware" / "hv12_weight_refit_gpu.py"


def load_script():
    spec = importlib.util.spec_from_file_location("hv12_weight_refit_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def raw_results(nccl_seconds: float, receiver_digests: dict | None = None) -> dict:
    """What the phases report for a 1 GB push: a same-device copy in 0.01 s (100 GB/s), NCCL in `nccl_seconds`."""
    digests = {"w": "a"}
    nbytes = 10**9
    local = {"phase": "local", "rank": 0, "holder_digests": digests, "bytes_per_push": nbytes, "parameters": 5 * 10**8,
             "d2d_same_device": [0.02, 0.01, 0.01, 0.01]}
    holder = {"phase": "nccl", "rank": 0, "backend": "nccl", "device": "cuda:0", "holder_digests": digests}
    receiver = {"phase": "nccl", "rank": 1, "backend": "nccl", "device": "cuda:1"}
    for mb in (64, 256):
        local[f"bytes_{mb}"], local[f"bytes_{mb}_digests"] = [1.0, 0.5, 0.5, 0.5], digests
        for member in (holder, receiver):
            member[f"plan_{mb}"] = {"digest": "p", "buckets": 4, "bytes": nbytes}
            member[f"nccl_{mb}"] = [1.0] + [nccl_seconds] * 3
        receiver[f"nccl_{mb}_digests"] = receiver_digests or digests
    return {"local": [local], "nccl": [holder, receiver]}


def test_nccl_bandwidth_is_checked_from_256_mb_against_the_reference_copy():
    script = load_script()
    # 1 GB in 0.03 s = 33 GB/s, 33% of the copy's 100 GB/s: passes the 30% threshold.
    fast = script.evaluate(raw_results(0.03), [64, 256], cuda=True)
    assert fast["figures"]["nccl_256"]["gb_per_s"] == pytest.approx(1e9 / 0.03 / 1e9)
    assert fast["figures"]["nccl_256"]["of_reference"] == pytest.approx(1 / 3)
    assert fast["checks"]["nccl_256_bandwidth"] is True and "nccl_64_bandwidth" not in fast["checks"]
    assert fast["passed"] is True
    # 0.04 s = 25 GB/s, 25%: fails, and so does the run.
    slow = script.evaluate(raw_results(0.04), [64, 256], cuda=True)
    assert slow["checks"]["nccl_256_bandwidth"] is False and slow["passed"] is False
    # On the CPU (a dry run) the bandwidth is reported, not checked.
    dry = script.evaluate(raw_results(0.04), [64, 256], cuda=False)
    assert "nccl_256_bandwidth" not in dry["checks"] and dry["passed"] is True


def test_with_two_gpus_the_reference_is_the_peer_copy():
    script = load_script()
    raw = raw_results(0.06)  # 1 GB in 0.06 s: 16.7 GB/s, 17% of the same-device copy
    raw["local"][0]["d2d_peer"] = [0.05, 0.025, 0.025, 0.025]  # 40 GB/s from GPU 0 to GPU 1
    result = script.evaluate(raw, [64, 256], cuda=True)
    assert result["figures"]["reference"] == "d2d_peer"
    assert result["figures"]["nccl_256"]["of_reference"] == pytest.approx(0.025 / 0.06)
    assert result["figures"]["nccl_256"]["of_d2d_same_device"] == pytest.approx(0.01 / 0.06)
    assert result["checks"]["nccl_256_bandwidth"] is True


def test_a_wrong_copy_or_a_failed_member_fails_the_run():
    script = load_script()
    wrong = script.evaluate(raw_results(0.03, receiver_digests={"w": "b"}), [64, 256], cuda=True)
    assert wrong["checks"]["nccl_64_bitwise"] is False and wrong["passed"] is False
    raw = raw_results(0.03)
    raw["nccl"] = [{"phase": "nccl", "rank": 0, "error": "DistBackendError: Duplicate GPU detected"},
                   {"phase": "nccl", "rank": 1, "error": "stopped: another member of the phase failed"}]
    refused = script.evaluate(raw, [64, 256], cuda=True)
    assert refused["checks"]["nccl_ran"] is False and refused["passed"] is False
    assert refused["errors"]["nccl rank 0"] == "DistBackendError: Duplicate GPU detected"


@pytest.mark.slow  # about 40 s on 2 cores: four processes each importing torch and transformers, a Ray instance
def test_cpu_dry_run_passes_with_bitwise_copies(tmp_path):
    hidden, layers, vocab = 256, 1, 8192
    run = subprocess.run([sys.executable, str(SCRIPT), "--allow-cpu", "--hidden", str(hidden), "--layers",
                          str(layers), "--vocab", str(vocab), "--bucket-mb", "1,4", "--repeats", "1",
                          "--timeout-s", "120"], capture_output=True, text=True, timeout=400,
                         env={**os.environ, "OUT": str(tmp_path)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert json.loads((tmp_path / "hv12.json").read_text()) == result
    assert result["dry_run_on_cpu"] is True and result["errors"] == {}
    expected = {"local_ran", "nccl_ran"} | {f"{path}_{mb}_bitwise" for path in ("bytes", "nccl", "cuda_ipc")
                                            for mb in (1, 4)} | {f"nccl_{mb}_same_plan" for mb in (1, 4)}
    assert set(result["checks"]) == expected and all(result["checks"].values())
    figures = result["figures"]
    assert figures["nccl_backend"] == "gloo"
    # bfloat16, and the tied embedding's bytes pushed a second time under lm_head.weight.
    assert figures["bytes_per_push"] == 2 * (figures["parameters"] + vocab * hidden)
    assert figures["nccl_1"]["buckets"] > figures["nccl_4"]["buckets"] >= 1
