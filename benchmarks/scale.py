"""Weight-sync throughput from the policy to generators with their own copy, against a plain memcpy of the same bytes.

For each model: the policy (a local worker on the CPU) pushes its weights `--repeats` times to
  - a copy in this process (`InProcessCopy`: what each rank of a data-parallel run keeps), and
  - one Ray generation actor (`cluster.backend=ray`: buckets of weight_sync.bucket_mb through Ray's object store),
  - one Ray generation actor synced by broadcast (`weight_sync.method=broadcast`: the driver, holding the weights,
    and the actor form a gloo group; each bucket of the sorted plan is one broadcast),
and the same tensors are copied `--repeats` times into preallocated buffers (memcpy). Medians in MB/s (10^6 bytes),
each path's share of memcpy's. The in-process generator of `cluster.backend=local` samples from the trained module
itself and copies nothing, so it has no row.

    .venv/bin/python benchmarks/scale.py                           # posttrain/tiny and posttrain/bench-vocab152k
    .venv/bin/python benchmarks/scale.py --models posttrain/tiny --bucket-mb 1

With --policy-group: the weights of a policy trained on two FSDP2 ranks (Ray actors, gloo) pushed to one generation
actor through the object store, and refilled into the copy each rank keeps for colocated generation
(`cluster.colocated=true` with `cluster.policy_workers=2`: every rank gathers the full weights, then copies them in
its own process), against a memcpy of the same bytes in the driver. Both include the ranks' gather.

    .venv/bin/python benchmarks/scale.py --policy-group --repeats 5

With --steps-per-second: the same GRPO job (posttrain/tiny, 8 prompts x 4 samples of up to 6 tokens, the digit-
fraction reward) in-process, on Ray synchronously and on Ray asynchronously (max_staleness 1, tis), once with a
reward that sleeps --reward-seconds per call (a slow judge; benchmarks/slow_reward.py) and once with the reward
taking no time: steps/s over the steps after the first two, and the last step's mean reward, per seed.

    .venv/bin/python benchmarks/scale.py --steps-per-second --steps 12 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from posttrain.config.schema import ClusterSection, LoraSection, ModelConfig, TrainerConfig, WeightSyncSection
from posttrain.distributed.weight_check import InProcessCopy
from posttrain.models.loading import load_tokenizer, resolve_model_path
from posttrain.workers.local import build_policy


def median_seconds(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def memcpy_of(policy) -> tuple[int, Callable[[], None]]:
    """The bytes of `policy`'s full weights, and the reference: a copy of those tensors into preallocated ones."""
    tensors = [tensor for _, tensor in policy.named_weights()]
    buffers = [torch.empty_like(t) for t in tensors]

    def memcpy() -> None:
        for buffer, tensor in zip(buffers, tensors):
            buffer.copy_(tensor)

    return sum(t.numel() * t.element_size() for t in tensors), memcpy


def measure(name: str, repeats: int, bucket_mb: float, scratch: Path) -> dict[str, float]:
    from posttrain.distributed.ray_groups import RayCluster  # the ray extra

    model = ModelConfig(name_or_path=resolve_model_path(name))
    tokenizer = load_tokenizer(model)
    policy = build_policy(model, LoraSection(), TrainerConfig(), tokenizer, torch.device("cpu"))
    size, memcpy = memcpy_of(policy)
    copy = InProcessCopy(model, tokenizer, batch_size=8, seed=0, device=torch.device("cpu"))
    cluster = RayCluster(ClusterSection(backend="ray", num_cpus=2), WeightSyncSection(bucket_mb=bucket_mb), scratch)
    try:
        generator = cluster.generator(model, tokenizer, batch_size=8, seed=0)
        policy.push_weights(generator)  # warm-up: the object store's first allocation
        cluster.weight_sync = WeightSyncSection(bucket_mb=bucket_mb, method="broadcast")
        broadcast = cluster.generator(model, tokenizer, batch_size=8, seed=0)
        policy.push_weights(broadcast)  # warm-up: the weight-sync group forms
        seconds = {"memcpy": median_seconds(memcpy, repeats),
                   "in_process_copy": median_seconds(lambda: policy.push_weights(copy), repeats),
                   "ray_actor": median_seconds(lambda: policy.push_weights(generator), repeats),
                   "ray_broadcast": median_seconds(lambda: policy.push_weights(broadcast), repeats)}
    finally:
        cluster.close()
    return {"mib": size / 2**20, **{path: size / s / 1e6 for path, s in seconds.items()}}


def measure_policy_group(name: str, repeats: int, bucket_mb: float, scratch: Path) -> dict[str, float]:
    """A policy of two FSDP2 ranks on Ray actors (gloo) pushing its gathered weights to one generation actor through
    the object store (rank 0 -> the driver -> the object store -> the actor), and refilling the generator each rank
    keeps for colocated generation (cluster.colocated: the gather, then a copy inside each rank's process), against a
    memcpy of the same bytes in the driver."""
    from posttrain.distributed.ray_groups import RayCluster  # the ray extra

    model = ModelConfig(name_or_path=resolve_model_path(name))
    tokenizer = load_tokenizer(model)
    section = ClusterSection(backend="ray", num_cpus=3, policy_workers=2)
    cluster = RayCluster(section, WeightSyncSection(bucket_mb=bucket_mb), scratch)
    try:
        policy = cluster.policy(model, LoraSection(), TrainerConfig(), tokenizer)
        size, memcpy = memcpy_of(policy)
        generator = cluster.generator(model, tokenizer, batch_size=8, seed=0)
        policy.push_weights(generator)  # warm-up: the object store's first allocation
        colocated = cluster.colocated_generator(policy, model, tokenizer, batch_size=8, seed=0)  # filled once here
        seconds = {"memcpy": median_seconds(memcpy, repeats),
                   "ray_actor": median_seconds(lambda: policy.push_weights(generator), repeats),
                   "colocated": median_seconds(lambda: policy.push_weights(colocated), repeats)}
    finally:
        cluster.close()
    return {"mib": size / 2**20, **{path: size / s / 1e6 for path, s in seconds.items()}}


LAYOUTS = {"in-process": [], "ray sync": ["cluster.backend=ray"],
           "ray async": ["cluster.backend=ray", "rollout.asynchronous=true", "loss.importance_correction=tis"]}
TINY_GRPO = ["model.name_or_path=posttrain/tiny", "data.train_files=['posttrain/arithmetic[:256]']",
             "data.max_length=32", "rollout.prompts_per_step=8", "rollout.num_generations_per_prompt=4",
             "rollout.max_new_tokens=6", "trainer.learning_rate=1e-3", "trainer.lr_scheduler=constant",
             "trainer.micro_batch_size=16", "logging.progress=none", "logging.plot=false",
             "trainer.save_every_minutes=0"]


def grpo_rates(steps: int, seeds: list[int], reward_seconds: float, scratch: Path) -> None:
    """Print the table of the module docstring's --steps-per-second."""
    import os

    from posttrain.algorithms.grpo import train_grpo
    from posttrain.config import load_config
    from posttrain.config.schema import GRPOConfig
    from posttrain.logging import read_metrics

    reward = Path(__file__).with_name("slow_reward.py")
    print("| reward | layout | seed | steps/s | last step's reward |")
    print("|---|---|---|---|---|")
    for seconds in (reward_seconds, 0.0):
        os.environ["POSTTRAIN_BENCH_REWARD_SECONDS"] = str(seconds)  # read in the environment's process
        environment = ["environment.kind=python", f"environment.options={{functions: ['{reward}:slow_digit_fraction'], "
                       "num_workers: 0, samples_per_call: 32}"]
        for layout, overrides in LAYOUTS.items():
            for seed in seeds:
                out = scratch / f"{seconds}-{layout.replace(' ', '-')}-{seed}"
                train_grpo(load_config(GRPOConfig, None, [*TINY_GRPO, *environment, *overrides, f"seed={seed}",
                                                          f"trainer.max_steps={steps}", f"output_dir={out}"]))
                records = read_metrics(out / "metrics.jsonl")
                timed = [r["time/step"] for r in records[2:]]
                print(f"| {seconds:g} s per call | {layout} | {seed} | {len(timed) / sum(timed):.2f} | "
                      f"{records[-1]['reward/mean']:.3f} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="posttrain/tiny,posttrain/bench-vocab152k")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--steps-per-second", action="store_true", help="the GRPO step-rate comparison instead")
    parser.add_argument("--policy-group", action="store_true",
                        help="pushes from a 2-rank Ray policy group instead: to a generation actor and colocated")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--reward-seconds", type=float, default=0.5)
    args = parser.parse_args()
    if args.steps_per_second:
        with tempfile.TemporaryDirectory(prefix="scale-") as scratch:
            grpo_rates(args.steps, [int(s) for s in args.seeds.split(",")], args.reward_seconds, Path(scratch))
        return 0
    if args.policy_group:
        measure_one, paths = measure_policy_group, {"ray_actor": "policy group to a Ray actor, object store",
                                                    "colocated": "policy group, colocated on its ranks"}
    else:
        measure_one, paths = measure, {"in_process_copy": "in-process copy", "ray_actor": "Ray actor, object store",
                                       "ray_broadcast": "Ray actor, broadcast"}
    print("| model | MiB | memcpy MB/s | " + " | ".join(f"{title} MB/s (of memcpy)" for title in paths.values()) + " |")
    print("|---|---|---|" + "---|" * len(paths))
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="scale-") as scratch:
            r = measure_one(name, args.repeats, args.bucket_mb, Path(scratch))
        print(f"| {name} | {r['mib']:.1f} | {r['memcpy']:.0f} | "
              + " | ".join(f"{r[path]:.0f} ({r[path] / r['memcpy']:.0%})" for path in paths) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
