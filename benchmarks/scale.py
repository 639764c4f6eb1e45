"""Weight-sync throughput from the policy to generators with their own copy, against a plain memcpy of the same bytes.

For each model: the policy (a local worker on the CPU) pushes its weights `--repeats` times to
  - a copy in this process (`InProcessCopy`: what each rank of a data-parallel run keeps), and
  - one Ray generation actor (`cluster.backend=ray`: buckets of weight_sync.bucket_mb through Ray's object store),
and the same tensors are copied `--repeats` times into preallocated buffers (memcpy). Medians in MB/s (10^6 bytes),
each path's share of memcpy's. The in-process generator of `cluster.backend=local` samples from the trained module
itself and copies nothing, so it has no row.

    .venv/bin/python benchmarks/scale.py                           # posttrain/tiny and posttrain/bench-vocab152k
    .venv/bin/python benchmarks/scale.py --models posttrain/tiny --bucket-mb 1

Planned here (docs/ray.md): GRPO steps/s in-process vs Ray synchronous vs asynchronous.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
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


def measure(name: str, repeats: int, bucket_mb: float, scratch: Path) -> dict[str, float]:
    from posttrain.distributed.ray_groups import RayCluster  # the ray extra

    model = ModelConfig(name_or_path=resolve_model_path(name))
    tokenizer = load_tokenizer(model)
    policy = build_policy(model, LoraSection(), TrainerConfig(), tokenizer, torch.device("cpu"))
    tensors = [tensor for _, tensor in policy.named_weights()]
    size = sum(t.numel() * t.element_size() for t in tensors)
    buffers = [torch.empty_like(t) for t in tensors]

    def memcpy() -> None:
        for buffer, tensor in zip(buffers, tensors):
            buffer.copy_(tensor)

    copy = InProcessCopy(model, tokenizer, batch_size=8, seed=0, device=torch.device("cpu"))
    cluster = RayCluster(ClusterSection(backend="ray", num_cpus=2), WeightSyncSection(bucket_mb=bucket_mb), scratch)
    try:
        generator = cluster.generator(model, tokenizer, batch_size=8, seed=0)
        policy.push_weights(generator)  # warm-up: the object store's first allocation
        seconds = {"memcpy": median_seconds(memcpy, repeats),
                   "in_process_copy": median_seconds(lambda: policy.push_weights(copy), repeats),
                   "ray_actor": median_seconds(lambda: policy.push_weights(generator), repeats)}
    finally:
        cluster.close()
    return {"mib": size / 2**20, **{path: size / s / 1e6 for path, s in seconds.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="posttrain/tiny,posttrain/bench-vocab152k")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    args = parser.parse_args()
    print(f"| model | MiB | memcpy MB/s | in-process copy MB/s (of memcpy) | Ray actor MB/s (of memcpy) |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="scale-") as scratch:
            r = measure(name, args.repeats, args.bucket_mb, Path(scratch))
        print(f"| {name} | {r['mib']:.1f} | {r['memcpy']:.0f} | {r['in_process_copy']:.0f} "
              f"({r['in_process_copy'] / r['memcpy']:.0%}) | {r['ray_actor']:.0f} ({r['ray_actor'] / r['memcpy']:.0%}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
