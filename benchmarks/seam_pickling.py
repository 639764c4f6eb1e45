"""What the worker seam costs when every call crosses a process boundary: GRPO steps with local workers against
the same steps through the pickling stand-in (tests/pickled_workers.py), which pickles every call's arguments and
result as an actor would, and streams the weights to the generator's own copy after every update.

    .venv/bin/python benchmarks/seam_pickling.py                       # the tiny model, 12 steps, 3 repeats
    .venv/bin/python benchmarks/seam_pickling.py --shape vocab152k --steps 4 --repeats 1 --max-new-tokens 32

Reported per step (medians over repeats, first --skip-steps left out): seconds with local workers and through the
stand-in, the pickled bytes and the seconds spent pickling and unpickling them, split into worker calls (batches,
log-probabilities, metrics) and the weight push (the whole model, every step: what a generator in another process
receives). Both runs sample the same episodes and make the same updates (tests/test_seam.py checks it).
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import pickled_workers  # noqa: E402
from posttrain.algorithms.grpo import train_grpo  # noqa: E402
from posttrain.config import load_config  # noqa: E402
from posttrain.config.schema import GRPOConfig  # noqa: E402
from posttrain.logging import read_metrics  # noqa: E402

SHAPES = {
    "tiny": ("posttrain/tiny", "posttrain/arithmetic[:512]", 32),
    "vocab152k": ("posttrain/bench-vocab152k", "posttrain/arithmetic[:512]", 64),
}


class Counter:
    """Bytes and seconds of every pickle round trip, by kind."""

    def __init__(self):
        self.bytes = {"calls": 0, "weights": 0}
        self.seconds = {"calls": 0.0, "weights": 0.0}
        self.kind = "calls"

    def round_trip(self, value):
        started = time.perf_counter()
        data = pickle.dumps(value)
        result = pickle.loads(data)
        self.bytes[self.kind] += len(data)
        self.seconds[self.kind] += time.perf_counter() - started
        return result


def run(shape: str, steps: int, pickled: bool, counter: Counter, max_new_tokens: int, work: Path) -> list[float]:
    model, data, max_length = SHAPES[shape]
    output = work / ("pickled" if pickled else "local")
    cfg = load_config(GRPOConfig, None, [
        f"model.name_or_path={model}", f"data.train_files=['{data}']", f"data.max_length={max_length}",
        "rollout.prompts_per_step=8", "rollout.num_generations_per_prompt=4", f"rollout.max_new_tokens={max_new_tokens}",
        "update.num_minibatches=2", "loss.reference_kl_penalty=0.05", "trainer.micro_batch_size=8",
        f"trainer.max_steps={steps}", "trainer.save_every=0", "trainer.num_threads=1", "logging.progress=none",
        "logging.plot=false", "environment.kind=arithmetic", f"output_dir={output}",
    ])
    if pickled:
        real_push = pickled_workers.PickledCalls.push_weights

        def push(self, generator):
            counter.kind = "weights"
            try:
                return real_push(self, generator)
            finally:
                counter.kind = "calls"

        pickled_workers.round_trip = counter.round_trip
        pickled_workers.PickledCalls.push_weights = push
        originals = {}
        for module in (pickled_workers.sft, pickled_workers.dpo, pickled_workers.rm, pickled_workers.grpo,
                       pickled_workers.ppo, pickled_workers.rl):
            for builder in ("build_policy", "build_critic", "build_scorer"):
                if hasattr(module, builder):
                    originals[module, builder] = getattr(module, builder)
        pickled_workers.pickle_every_worker()
        try:
            train_grpo(cfg)
        finally:
            for (module, builder), original in originals.items():
                setattr(module, builder, original)
            pickled_workers.PickledCalls.push_weights = real_push
    else:
        train_grpo(cfg)
    return [r["time/step"] for r in read_metrics(output / "metrics.jsonl")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip-steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    local_steps, pickled_steps, per_step = [], [], []
    for repeat in range(args.repeats):
        for pickled in ((False, True) if repeat % 2 == 0 else (True, False)):
            counter = Counter()
            with tempfile.TemporaryDirectory() as work:
                times = run(args.shape, args.steps, pickled, counter, args.max_new_tokens, Path(work))
            kept = times[args.skip_steps:]
            (pickled_steps if pickled else local_steps).append(statistics.median(kept))
            if pickled:
                per_step.append({kind: (counter.bytes[kind] / args.steps, counter.seconds[kind] / args.steps)
                                 for kind in counter.bytes})
    local, remote = statistics.median(local_steps), statistics.median(pickled_steps)
    calls_mb = statistics.median(p["calls"][0] for p in per_step) / 2**20
    calls_s = statistics.median(p["calls"][1] for p in per_step)
    weights_mb = statistics.median(p["weights"][0] for p in per_step) / 2**20
    weights_s = statistics.median(p["weights"][1] for p in per_step)
    print(f"GRPO on {args.shape}, {args.steps} steps (first {args.skip_steps} left out), medians of {args.repeats}")
    print("| | seconds per step |")
    print("|---|---|")
    print(f"| local workers | {local:.3f} |")
    print(f"| every call through pickle | {remote:.3f} ({remote / local:.2f}x) |")
    print(f"| of which worker calls: {calls_mb:.2f} MiB pickled per step | {calls_s:.4f} |")
    print(f"| of which the weight push: {weights_mb:.1f} MiB per step | {weights_s:.4f} |")
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "local_step_seconds": local_steps,
                                         "pickled_step_seconds": pickled_steps, "per_step": per_step}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
