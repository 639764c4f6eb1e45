"""Which torch operators a few SFT or GRPO steps run, with their input shapes: a count that load cannot disturb.

Timings on a busy machine move by 10% from run to run; the operators a step runs do not. Comparing two versions'
counts shows whether one of them does more work per step (more kernels, larger shapes) or only looks slower:

    .venv/bin/python benchmarks/op_counts.py --recipe sft --steps 5 --json /tmp/ops_current.json
    (cd /path/to/other/checkout && PYTHONPATH=src /path/to/.venv/bin/python /path/to/benchmarks/op_counts.py \\
        --recipe sft --steps 5 --json /tmp/ops_base.json)
    .venv/bin/python benchmarks/op_counts.py --compare /tmp/ops_base.json /tmp/ops_current.json

The run is the recipe's preset (configs/sft_arithmetic.yaml or configs/grpo_arithmetic.yaml) on the embedded tiny
model, `--steps` optimizer steps of 16 x 4 examples (SFT) or of the preset's rollout size (GRPO), no evaluation, one
thread, under torch.profiler with shapes recorded; every `aten::` operator is counted by (name, input shapes).
--compare prints each (operator, shapes) whose count differs, as per-step differences.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

RECIPES = {
    "sft": ("sft_arithmetic.yaml", ["trainer.micro_batch_size=16", "trainer.gradient_accumulation_steps=4",
                                    "data.eval_files=[]", "trainer.warmup_steps=0"]),
    "grpo": ("grpo_arithmetic.yaml", ["data.eval_files=[]"]),
}


def count_ops(recipe: str, steps: int) -> dict[str, int]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import posttrain.algorithms  # noqa: F401  (registers the embedded models' builder)
    from posttrain.algorithms.grpo import train_grpo
    from posttrain.algorithms.sft import train_sft
    from posttrain.config.loader import load_config
    from posttrain.config.presets import preset_path
    from posttrain.config.schema import GRPOConfig, SFTConfig

    torch.set_num_threads(1)
    preset, overrides = RECIPES[recipe]
    schema, train = (SFTConfig, train_sft) if recipe == "sft" else (GRPOConfig, train_grpo)
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(schema, preset_path(preset), [
            *overrides, f"output_dir={out}/run", f"trainer.max_steps={steps}", "trainer.eval_every=0",
            "trainer.save_every=100000", "logging.plot=false", "evaluation=[]"])
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            train(cfg)
    counts = collections.Counter(f"{e.name} {e.input_shapes}" for e in prof.events() if e.name.startswith("aten::"))
    return dict(sorted(counts.items()))


def compare(base: dict, current: dict) -> list[str]:
    steps = base["steps"]
    if current["steps"] != steps or current["recipe"] != base["recipe"]:
        raise SystemExit("the two files count different runs (recipe or steps differ)")
    lines = [f"{base['recipe']}, {steps} steps: {sum(base['ops'].values()) / steps:.0f} operators per step (base), "
             f"{sum(current['ops'].values()) / steps:.0f} (current)"]
    for key in sorted(set(base["ops"]) | set(current["ops"])):
        b, c = base["ops"].get(key, 0), current["ops"].get(key, 0)
        if b != c:
            lines.append(f"  {(c - b) / steps:+.1f} per step  {key[:160]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="sft")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the counts here")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BASE.json", "CURRENT.json"))
    args = parser.parse_args(argv)
    if args.compare:
        base, current = (json.loads(p.read_text()) for p in args.compare)
        print("\n".join(compare(base, current)))
        return 0
    result = {"recipe": args.recipe, "steps": args.steps, "ops": count_ops(args.recipe, args.steps)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(f"{sum(result['ops'].values())} operator calls in {args.steps} steps", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
