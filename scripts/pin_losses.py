"""Pin the first optimizer steps of the five recipes on the embedded tiny model, so that a refactor of the loops
can show it changed nothing they learn.

Each recipe runs a few steps of a small config chosen to go through the paths a refactor touches: SFT and DPO
with gradient accumulation (and DPO against a frozen reference), reward-model training, GRPO off-policy (two
minibatches, so the old-logprob pass runs) with a reference KL penalty and micro-batches smaller than the
minibatch, PPO with a critic, KL-in-reward and two micro-batches per minibatch. The per-step losses (and
gradient norms, and PPO's value loss) are read from OUTPUT/metrics.jsonl.

    python scripts/pin_losses.py            # rewrite tests/data/pinned_losses.json from the code as it is
    python scripts/pin_losses.py --check    # rerun and demand bit-identical values (same machine, before/after)
    python scripts/pin_losses.py --print    # rerun and print the values as JSON, writing nothing

The runs go through the `posttrain` command line (posttrain.cli.main), the interface that stays put when config
classes move. tests/test_pinned_losses.py reruns the same configs and compares within a tolerance measured across
CPU code paths (AVX-512 and ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "data" / "pinned_losses.json"
TESTS_DIR = "{tests}"
"""Stands for the absolute path of tests/ in the recorded overrides, so that the fixture does not depend on where
the checkout lives."""

MAX_STEPS = 3

_RL = [
    "model.name_or_path=posttrain/tiny",
    "data.train_files=['posttrain/arithmetic[:256]']",
    "data.max_length=32",
    "rollout.prompts_per_step=8",
    "rollout.num_generations_per_prompt=4",
    "rollout.max_new_tokens=6",
    "trainer.learning_rate=1e-3",
    "trainer.lr_scheduler=constant",
    "environment.kind=python",
    f"environment.options={{functions: ['{TESTS_DIR}/reward_fns_for_tests.py:digit_fraction'], num_workers: 0}}",
    # 32 samples a step, 2 minibatches of 16, micro-batches of 8: two forward/backward passes per optimizer step.
    "update.num_minibatches=2",
    "trainer.micro_batch_size=8",
]

_OFFLINE = [
    "model.name_or_path=posttrain/tiny",
    "data.max_length=32",
    "trainer.micro_batch_size=8",
    "trainer.gradient_accumulation_steps=2",
    "trainer.learning_rate=1e-3",
    "trainer.lr_scheduler=constant",
]

_COMMON = [f"trainer.max_steps={MAX_STEPS}", "trainer.save_every=0", "logging.progress=none", "logging.plot=false"]

RECIPES: dict[str, list[str]] = {
    "sft": [*_OFFLINE, "data.train_files=['posttrain/arithmetic:train[:64]']", *_COMMON],
    "dpo": [*_OFFLINE, "data.train_files=['posttrain/arithmetic-preference[:64]']", "loss.beta=0.5",
            "reference=frozen_copy", *_COMMON],
    "rm": [*_OFFLINE, "data.train_files=['posttrain/arithmetic-preference[:64]']", *_COMMON],
    "grpo": [*_RL, "loss.reference_kl_penalty=0.1", *_COMMON],
    "ppo": [*_RL, "critic.learning_rate=1e-3", "gae.kl_coef=0.1", *_COMMON],
}
"""Overrides of each recipe's defaults; the recipe name is the `posttrain` subcommand."""

KEYS: dict[str, tuple[str, ...]] = {
    "sft": ("loss", "grad_norm"),
    "dpo": ("loss", "grad_norm"),
    "rm": ("loss", "grad_norm"),
    "grpo": ("loss", "grad_norm", "kl"),
    "ppo": ("loss", "grad_norm", "value/loss", "value/grad_norm"),
}
"""Metrics pinned per step."""


def resolve(overrides: list[str]) -> list[str]:
    """The overrides with the placeholder for tests/ replaced by this checkout's path."""
    return [o.replace(TESTS_DIR, str(REPO / "tests")) for o in overrides]


def run_recipe(recipe: str, overrides: list[str], keys: tuple[str, ...], output_dir: Path) -> list[dict[str, float]]:
    """Run `posttrain RECIPE OVERRIDES output_dir=OUTPUT_DIR` in this process; per step, the pinned metrics."""
    from posttrain.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        code = main([recipe, *resolve(overrides), f"output_dir={output_dir}"])
    if code != 0:
        raise SystemExit(f"posttrain {recipe} exited with {code}")
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], **{k: r[k] for k in keys}} for r in records if "step" in r and "loss" in r]


def measure(recipes: list[str]) -> dict[str, dict]:
    """Run each recipe in a fresh temporary directory; its config and per-step values."""
    pinned = {}
    for recipe in recipes:
        with tempfile.TemporaryDirectory() as tmp:
            steps = run_recipe(recipe, RECIPES[recipe], KEYS[recipe], Path(tmp) / recipe)
        pinned[recipe] = {"overrides": RECIPES[recipe], "keys": list(KEYS[recipe]), "steps": steps}
    return pinned


def check(pinned: dict[str, dict], recorded: dict[str, dict]) -> list[str]:
    """Every difference from the recorded fixture, exact float equality: the same machine before and after a change."""
    problems = []
    for recipe, fresh in pinned.items():
        old = recorded["recipes"][recipe]
        if old["overrides"] != fresh["overrides"] or old["keys"] != fresh["keys"]:
            problems.append(f"{recipe}: the config or keys differ from the fixture's; regenerate it")
        for was, now in zip(old["steps"], fresh["steps"], strict=True):
            for key in ("step", *fresh["keys"]):
                if was[key] != now[key]:
                    problems.append(f"{recipe} step {was['step']} {key}: recorded {was[key]!r}, now {now[key]!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="assert bit-identical values against the fixture")
    mode.add_argument("--print", action="store_true", help="print fresh values as JSON; write nothing")
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    args = parser.parse_args(argv)

    pinned = measure(args.recipes)
    if args.print:
        print(json.dumps(pinned, indent=1))
        return 0
    if args.check:
        problems = check(pinned, json.loads(FIXTURE.read_text()))
        print("\n".join(problems) or f"bit-identical to {FIXTURE.relative_to(REPO)}: {', '.join(args.recipes)}")
        return 1 if problems else 0
    if args.recipes != list(RECIPES):
        raise SystemExit("writing the fixture needs every recipe; drop --recipes")
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps({"written_by": "scripts/pin_losses.py", "max_steps": MAX_STEPS,
                                   "recipes": pinned}, indent=1) + "\n")
    print(f"wrote {FIXTURE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
