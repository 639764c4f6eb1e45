"""Per-call cost of a reference scored by a Ray group of its own (cluster.reference_workers) against the same
reference in this process, on one rollout batch.

The batch is what a GRPO step on the tiny set-up scores: `--rows` rows (8 prompts x 4 samples) of `--length` tokens,
in micro-batches of `--micro-batch-size` rows. The same frozen model scores it `--repeats` times in this process
(a local worker, as with cluster.backend=local) and through RayScoringGroup with 1 and with 2 actors; every answer
is checked against the in-process one (bitwise); the three take turns within each repeat, and the medians are
printed with each path's ratio to the in-process median of the same run.

    .venv/bin/python benchmarks/remote_scoring.py
    .venv/bin/python benchmarks/remote_scoring.py --model posttrain/bench-vocab152k --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from posttrain.config.schema import ClusterSection, ModelConfig, TrainerConfig, WeightSyncSection
from posttrain.data.types import RolloutBatch
from posttrain.models.loading import resolve_model_path
from posttrain.workers.local import build_scorer


def rollout_batch(rows: int, length: int, vocab: int) -> RolloutBatch:
    """Random token ids, the last two thirds of each row a completion."""
    ids = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(0))
    loss_mask = (torch.arange(length) >= length // 3).float().expand(rows, length).clone()
    return RolloutBatch(ids, torch.ones(rows, length, dtype=torch.long), loss_mask, torch.zeros(rows, length),
                        torch.zeros(rows), {}, torch.ones(rows, dtype=torch.bool), torch.arange(rows),
                        torch.zeros(rows, dtype=torch.bool), loss_mask.sum(-1).long())


def interleaved_medians(actions: dict[str, object], repeats: int) -> dict[str, float]:
    """Median seconds of each action, the actions taking turns within every repeat (so that a change in the
    machine's load reaches all of them alike)."""
    times: dict[str, list[float]] = {name: [] for name in actions}
    for _ in range(repeats):
        for name, action in actions.items():
            started = time.perf_counter()
            action()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    from posttrain.distributed.ray_groups import RayCluster  # the ray extra

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="posttrain/tiny")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--length", type=int, default=38)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()

    torch.set_num_threads(1)  # the actors take the driver's thread count: one each, as two ranks on two cores
    model = ModelConfig(name_or_path=resolve_model_path(args.model))
    trainer = TrainerConfig(micro_batch_size=args.micro_batch_size)
    local = build_scorer(model, trainer, torch.device("cpu"))
    vocab = local.model.config.vocab_size
    batch = rollout_batch(args.rows, args.length, vocab)
    expected = local.logprobs(batch)
    actions = {"in-process": lambda: local.logprobs(batch)}

    with tempfile.TemporaryDirectory(prefix="pt-bench-") as scratch:
        # Two groups side by side (1 and 2 actors; the second named teacher only so that both can be held at once):
        # the first cluster starts the instance, the second joins it.
        sections = [ClusterSection(backend="ray", num_cpus=4, reference_workers=1, timeout_s=600),
                    ClusterSection(backend="ray", num_cpus=4, teacher_workers=2, timeout_s=600)]
        clusters = []
        try:
            for section, role in zip(sections, ("reference", "teacher")):
                clusters.append(RayCluster(section, WeightSyncSection(), Path(scratch)))
                remote = clusters[-1].scoring_group(model, trainer, role=role)
                assert torch.equal(remote.logprobs(batch), expected), "the group's answer differs"
                actions[f"Ray group, {section.scoring_workers(role)} actor(s)"] = (
                    lambda remote=remote: remote.logprobs(batch))
            results = interleaved_medians(actions, args.repeats)
        finally:
            for cluster in reversed(clusters):  # the first started the instance: it shuts it down last
                cluster.close()

    base = results["in-process"]
    print(f"{args.model}: logprobs of {args.rows} rows x {args.length} tokens, micro-batches of "
          f"{args.micro_batch_size}, median of {args.repeats} calls; load average {os.getloadavg()[0]:.1f}")
    for name, seconds in results.items():
        print(f"  {name:<24} {seconds * 1e3:8.1f} ms   {seconds / base:5.2f}x in-process")


if __name__ == "__main__":
    main()
