"""HV-11: the Ray policy group on GPUs (cluster.policy_workers with cluster.gpus_per_policy_worker=1: placement on
GPU bundles, NCCL among the policy actors, gathered weights pushed to CPU generation actors) against the policy
trained in the driver on a GPU.

    .venv/bin/python scripts/hardware/hv11_ray_policy_gpu.py [--steps 4]

Two GRPO runs of the tiny arithmetic set-up (posttrain/tiny, 8 prompts x 4 samples, digit-fraction reward), both
with cluster.backend=ray and one CPU generation and environment actor: once with the policy in the driver process
(cluster.policy_workers=0, on GPU 0), once as a policy group of min(2, GPUs) actors of one GPU each (FSDP2 over
NCCL; with a single GPU, one rank, which still checks placement, the NCCL rendezvous and the weight push).

Prints one JSON object (also $OUT/hv11.json when OUT is set); exit 0 when every check passes, 1 on a failed check,
2 without CUDA or ray. Checks (first estimates, in THRESHOLDS): the group joined over NCCL; the rewards of every
step equal (the generation actors sample on the CPU from the weights pushed); losses and gradient norms within
1e-3 relative (GPU reductions in another order); weight_sync/bytes > 0 each step; a sharded checkpoint written.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

THRESHOLDS = {"loss_rel_diff_max": 1e-3, "grad_norm_rel_diff_max": 1e-3}
TESTS = Path(__file__).resolve().parents[2] / "tests"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available() or importlib.util.find_spec("ray") is None:
        print(json.dumps({"skipped": "needs CUDA and the ray extra"}))
        return 2
    sys.path.insert(0, str(TESTS))
    from rl_configs import DIGITS, TINY_RL

    from posttrain.algorithms.grpo import train_grpo
    from posttrain.config import load_config
    from posttrain.config.schema import GRPOConfig
    from posttrain.distributed import ray_policy
    from posttrain.logging import read_metrics

    backends = []
    connect = ray_policy.RankGroup.connect

    def recording_connect(self) -> None:
        connect(self)
        backends.append(self.backend)

    ray_policy.RankGroup.connect = recording_connect
    ranks = min(2, torch.cuda.device_count())
    common = [*TINY_RL, *DIGITS, f"trainer.max_steps={args.steps}", f"trainer.save_every={args.steps}",
              "cluster.backend=ray", "cluster.timeout_s=600", "cluster.num_cpus=4"]
    with tempfile.TemporaryDirectory(prefix="hv11-") as scratch:
        driver, group = Path(scratch) / "driver", Path(scratch) / "group"
        train_grpo(load_config(GRPOConfig, None, [*common, f"output_dir={driver}"]))
        train_grpo(load_config(GRPOConfig, None, [*common, f"output_dir={group}", f"cluster.policy_workers={ranks}",
                                                  "cluster.gpus_per_policy_worker=1"]))
        a, b = read_metrics(driver / "metrics.jsonl"), read_metrics(group / "metrics.jsonl")
        sharded = (group / "checkpoints" / f"step_{args.steps}" / "policy" / ".metadata").is_file() or ranks == 1

    def rel(key: str) -> float:
        return max(abs(x[key] - y[key]) / max(abs(x[key]), 1e-8) for x, y in zip(a, b))

    result = {"ranks": ranks, "backends": backends, "steps": len(b),
              "rewards": [[x["reward/mean"], y["reward/mean"]] for x, y in zip(a, b)],
              "loss_rel_diff_max": rel("loss"), "grad_norm_rel_diff_max": rel("grad_norm"),
              "weight_sync_bytes": [y["weight_sync/bytes"] for y in b], "sharded_checkpoint": sharded}
    checks = {"nccl": backends == ["nccl"], "all_steps": len(a) == len(b) == args.steps,
              "rewards_equal": all(x["reward/mean"] == y["reward/mean"] for x, y in zip(a, b)),
              "loss": result["loss_rel_diff_max"] <= THRESHOLDS["loss_rel_diff_max"],
              "grad_norm": result["grad_norm_rel_diff_max"] <= THRESHOLDS["grad_norm_rel_diff_max"],
              "weights_pushed": all(v > 0 for v in result["weight_sync_bytes"]), "sharded": sharded}
    result |= {"checks": checks, "passed": all(checks.values()), "thresholds": THRESHOLDS}
    text = json.dumps(result, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "hv11.json").write_text(text + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
