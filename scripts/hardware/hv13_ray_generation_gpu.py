"""HV-13: Ray generation actors on GPUs (cluster.gpus_per_generation_worker, docs/ray.md): the transformers actor
sampling on the GPU Ray granted it, the vLLM generation actor (rollout.backend=vllm with cluster.backend=ray),
LoRA adapters-only sync to it (weight_sync.lora=adapters), and colocated generation on a GPU policy rank
(cluster.colocated=true with cluster.policy_workers=1).

    .venv/bin/python scripts/hardware/hv13_ray_generation_gpu.py [--steps 4] \
        [--phases transformers,vllm,adapters,colocated]
    .venv/bin/python scripts/hardware/hv13_ray_generation_gpu.py --allow-cpu   # transformers, colocated on CPUs

Every phase is a GRPO run of the tiny arithmetic set-up (posttrain/tiny, 8 prompts x 4 samples, digit-fraction
reward) with cluster.backend=ray, the policy in the driver process (on GPU 0), one generation actor of one GPU and one
CPU environment actor:
  transformers  the transformers generation actor, weights by the object store, then by broadcast (NCCL between two
                GPUs; on one GPU the driver and the actor share it, NCCL refuses that, and the group goes over gloo:
                reported, not a failure);
  vllm          the vLLM generation actor (bfloat16 engine), weights by the object store, then by broadcast;
  adapters      a LoRA policy (r 8) pushing its adapters alone to the vLLM actor, against the same run pushing the
                merged weights;
  colocated     no generation actor: the policy on one Ray rank of one GPU (FSDP2), sampling from the copy it refills
                on that GPU in its own process after each optimizer step.
Checks per run (first estimates, in THRESHOLDS): the actor samples where it should (cuda:0; "cpu" in the dry run);
every step pushed its version (weight_sync/version equals the step) and every trained episode of step s was sampled
by version s - 1 (samples.jsonl's policy_version: the actor stamped each push); the generator-vs-trainer
log-probability mismatch (generator_logprob_error, mean |difference| on the sampled tokens) at every step below the
phase's threshold; the broadcast run's rewards equal the object-store run's at every step (the same weights reach
the same sampler) and its group's backend is nccl with two or more GPUs; an adapters push carries under a fifth of
the merged bytes.

Prints one JSON object (also $OUT/hv13.json when OUT is set); exit 0 when every check passes, 1 on a failed check
(or a run that raised: its error is in the JSON), 2 without CUDA or ray (without vllm the vllm and adapters phases
are skipped and reported; the exit is then 2 unless --allow-cpu).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

THRESHOLDS = {
    "transformers_logprob_error_max": 1e-2,  # float32 trainer and sampler (TF32 matmuls possible): far below a stale copy
    "vllm_logprob_error_max": 0.1,  # a bfloat16 engine against the float32 trainer (HV-2's bf16 bound is 0.15)
    "adapters_bytes_fraction_max": 0.2,
}
TESTS = Path(__file__).resolve().parents[2] / "tests"
PHASES = ("transformers", "vllm", "adapters", "colocated")


def run_checks(metrics: list[dict], samples: list[dict], devices: list[str], expected_device: str, steps: int,
               logprob_error_max: float) -> dict[str, bool]:
    """The checks every run gets, from its metrics.jsonl and samples.jsonl records and where its actors sampled."""
    train = [s for s in samples if s.get("split") == "train"]
    return {
        "all_steps": [m["step"] for m in metrics] == list(range(1, steps + 1)),
        "device": devices == [expected_device],
        "version_pushed_each_step": [m["weight_sync/version"] for m in metrics] == list(range(1, steps + 1)),
        "episodes_sampled_by_previous_version": bool(train) and all(s["policy_version"] == s["step"] - 1
                                                                    for s in train),
        "logprob_error": all(m["generator_logprob_error"] <= logprob_error_max for m in metrics),
    }


def same_rewards(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x["reward/mean"] == y["reward/mean"] for x, y in zip(a, b))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--allow-cpu", action="store_true",
                        help="without CUDA: run the transformers phase with CPU generation actors (a dry run)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if importlib.util.find_spec("ray") is None or not (cuda or args.allow_cpu):
        print(json.dumps({"hv": "HV-13", "skipped": "needs CUDA (or --allow-cpu) and the ray extra"}))
        return 2
    sys.path.insert(0, str(TESTS))
    from rl_configs import DIGITS, TINY_RL

    from posttrain.algorithms.grpo import train_grpo
    from posttrain.config import load_config
    from posttrain.config.schema import GRPOConfig
    from posttrain.distributed import ray_groups
    from posttrain.logging import read_metrics
    from posttrain.logging.samples import read_samples

    made: list[tuple[list[str], object]] = []
    def recording(real):
        def make(self, *a, **k):
            generator = real(self, *a, **k)
            made.append((generator.sampling_devices(), generator))
            return generator
        return make

    ray_groups.RayCluster.generator = recording(ray_groups.RayCluster.generator)
    ray_groups.RayCluster.colocated_generator = recording(ray_groups.RayCluster.colocated_generator)
    gpus = torch.cuda.device_count() if cuda else 0
    gpu = ["cluster.gpus_per_generation_worker=1"] if cuda else []
    common = [*TINY_RL, *DIGITS, f"trainer.max_steps={args.steps}", "trainer.save_every=0",
              "logging.samples_per_step=32", "cluster.backend=ray", "cluster.timeout_s=600", "cluster.num_cpus=4"]
    vllm_ok = importlib.util.find_spec("vllm") is not None and cuda
    result: dict = {"hv": "HV-13", "device": torch.cuda.get_device_name(0) if cuda else "cpu", "gpus": gpus,
                    "torch": torch.__version__, "steps": args.steps, "thresholds": THRESHOLDS, "runs": {},
                    "checks": {}, "skipped": {}}

    def run(name: str, scratch: Path, *overrides: str) -> tuple[list[dict], list[dict], list[str], object] | None:
        output = scratch / name
        started = time.perf_counter()
        made.clear()  # this run's generator only: a run that built none through the cluster must not pass on another's
        try:
            train_grpo(load_config(GRPOConfig, None, [*common, f"output_dir={output}", *overrides]))
        except Exception as error:  # the JSON reports a failed run; the next phases still run
            result["runs"][name] = {"error": f"{type(error).__name__}: {error}",
                                    "traceback": traceback.format_exc()[-4000:]}
            result["checks"][f"{name}/ran"] = False
            return None
        if len(made) != 1:
            result["runs"][name] = {"error": f"{len(made)} generators were built through the Ray cluster, not 1"}
            result["checks"][f"{name}/ran"] = False
            return None
        metrics, samples = read_metrics(output / "metrics.jsonl"), read_samples(output / "samples.jsonl")
        devices, generator = made[-1]
        result["runs"][name] = {
            "seconds": time.perf_counter() - started, "generator": type(generator).__name__, "devices": devices,
            "sync_backend": getattr(generator, "sync_backend", None),
            "sync_backend_note": getattr(generator, "sync_backend_note", None),
            "rewards": [m["reward/mean"] for m in metrics],
            "generator_logprob_error": [m["generator_logprob_error"] for m in metrics],
            "generator_logprob_error_max": [m["generator_logprob_error_max"] for m in metrics],
            "weight_sync_bytes": [m["weight_sync/bytes"] for m in metrics],
            "weight_sync_seconds": [m["weight_sync/seconds"] for m in metrics]}
        return metrics, samples, devices, generator

    def check(name: str, outcome, expected_device: str, bound: float) -> None:
        if outcome is not None:
            metrics, samples, devices, _ = outcome
            for key, ok in run_checks(metrics, samples, devices, expected_device, args.steps, bound).items():
                result["checks"][f"{name}/{key}"] = ok

    def broadcast_checks(name: str, store, broadcast) -> None:
        if store is None or broadcast is None:
            return
        result["checks"][f"{name}/broadcast_rewards_equal"] = same_rewards(store[0], broadcast[0])
        if gpus >= 2:
            result["checks"][f"{name}/broadcast_over_nccl"] = broadcast[3].sync_backend == "nccl"

    phases = [p for p in args.phases.split(",") if p]
    with tempfile.TemporaryDirectory(prefix="hv13-") as scratch_dir:
        scratch = Path(scratch_dir)
        if "transformers" in phases:
            device = "cuda:0" if cuda else "cpu"
            bound = THRESHOLDS["transformers_logprob_error_max"]
            store = run("transformers-object-store", scratch, *gpu)
            broadcast = run("transformers-broadcast", scratch, *gpu, "weight_sync.method=broadcast")
            check("transformers-object-store", store, device, bound)
            check("transformers-broadcast", broadcast, device, bound)
            broadcast_checks("transformers", store, broadcast)
        vllm = [*gpu, "rollout.backend=vllm", "rollout.vllm_gpu_memory_utilization=0.2"]
        if "vllm" in phases and not vllm_ok:
            result["skipped"]["vllm"] = "needs CUDA and the vllm extra"
        elif "vllm" in phases:
            bound = THRESHOLDS["vllm_logprob_error_max"]
            store = run("vllm-object-store", scratch, *vllm)
            broadcast = run("vllm-broadcast", scratch, *vllm, "weight_sync.method=broadcast")
            check("vllm-object-store", store, "cuda:0 (vllm)", bound)
            check("vllm-broadcast", broadcast, "cuda:0 (vllm)", bound)
            broadcast_checks("vllm", store, broadcast)
        if "adapters" in phases and not vllm_ok:
            result["skipped"]["adapters"] = "needs CUDA and the vllm extra"
        elif "adapters" in phases:
            lora = ["lora.enabled=true", "lora.r=8", "lora.alpha=16", "trainer.learning_rate=1e-2"]
            bound = THRESHOLDS["vllm_logprob_error_max"]
            merged = run("adapters-merged", scratch, *vllm, *lora)
            adapters = run("adapters-only", scratch, *vllm, *lora, "weight_sync.lora=adapters")
            check("adapters-merged", merged, "cuda:0 (vllm)", bound)
            check("adapters-only", adapters, "cuda:0 (vllm)", bound)
            if merged is not None and adapters is not None:
                fraction = max(b["weight_sync/bytes"] for b in adapters[0]) / min(m["weight_sync/bytes"]
                                                                                  for m in merged[0])
                result["adapters_bytes_fraction"] = fraction
                result["checks"]["adapters/bytes_fraction"] = fraction <= THRESHOLDS["adapters_bytes_fraction_max"]
        if "colocated" in phases:
            rank_gpu = ["cluster.gpus_per_policy_worker=1"] if cuda else []
            colocated = run("colocated-policy-rank", scratch, "cluster.colocated=true", "cluster.policy_workers=1",
                            "trainer.num_threads=1", *rank_gpu)
            check("colocated-policy-rank", colocated, "cuda:0" if cuda else "cpu",
                  THRESHOLDS["transformers_logprob_error_max"])
    result["passed"] = bool(result["checks"]) and all(result["checks"].values())
    text = json.dumps(result, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "hv13.json").write_text(text + "\n")
    if not result["passed"]:
        return 1
    return 2 if result["skipped"] and not args.allow_cpu else 0


if __name__ == "__main__":
    sys.exit(main())
