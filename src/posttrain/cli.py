"""The `posttrain` command: `posttrain RECIPE [--config FILE.yaml] [dotted.key=value ...]`."""

from __future__ import annotations

import argparse
import os
import json
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from posttrain.config import (
    ConfigError,
    DPOConfig,
    EvalConfig,
    QuickstartConfig,
    RecipeConfig,
    RMConfig,
    SFTConfig,
    load_config,
)
from posttrain.config.loader import type_name
from posttrain.config.presets import quickstart_base_config
from posttrain.config.schema import GRPOConfig, Section
from posttrain.data.errors import DataError
from posttrain.envs.rewards import RewardError
from posttrain.errors import RunError
from posttrain.models.errors import ModelNotFoundError


@dataclass(frozen=True)
class Recipe:
    name: str
    schema: type[BaseModel]
    summary: str
    run: Callable[[Any, argparse.Namespace], int]
    base: Callable[[], dict[str, Any]] = dict
    """Config tree the YAML file and overrides are merged over (the quickstart's packaged preset)."""


def _done(line: str) -> None:
    """The recipe's closing line, printed once (by rank 0 of a data-parallel run)."""
    from posttrain.distributed.env import is_main

    if is_main():
        print(line)


def _run_sft(cfg: SFTConfig, args: argparse.Namespace) -> int:
    from posttrain.algorithms.sft import train_sft

    result = train_sft(cfg)
    _done(f"done: {result.steps} steps, final loss {result.final_loss}, model in {result.final_dir}")
    return 0


def _run_grpo(cfg: GRPOConfig, args: argparse.Namespace) -> int:
    from posttrain.algorithms.grpo import train_grpo

    result = train_grpo(cfg)
    shown = {k: round(v, 4) for k, v in result.final_metrics.items() if k.startswith(("val/", "reward/mean"))}
    print(f"done: {result.steps} steps, {shown}, model in {result.final_dir}")
    return 0


def _run_dpo(cfg: DPOConfig, args: argparse.Namespace) -> int:
    from posttrain.algorithms.dpo import train_dpo

    result = train_dpo(cfg)
    _done(f"done: {result.steps} steps, final loss {result.final_loss}, eval reward accuracy "
          f"{result.eval_reward_accuracy}, model in {result.final_dir}")
    return 0


def _run_rm(cfg: RMConfig, args: argparse.Namespace) -> int:
    from posttrain.algorithms.rm import train_rm

    result = train_rm(cfg)
    _done(f"done: {result.steps} steps, final loss {result.final_loss}, eval accuracy {result.eval_accuracy}, "
          f"model in {result.final_dir}")
    return 0


def _run_eval(cfg: EvalConfig, args: argparse.Namespace) -> int:
    from posttrain.algorithms.evaluate import run_eval

    result = run_eval(cfg)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(f"{result.task}: exact-match accuracy {result.accuracy:.1%} on {result.num_examples} held-out examples")
        for sample in result.samples:
            print(f"  {sample['prompt']}{sample['completion']!r:8}  (answer {sample['answer']})")
    return 0


def _run_quickstart(cfg: QuickstartConfig, args: argparse.Namespace) -> int:
    from posttrain.algorithms.quickstart import run_quickstart

    run_quickstart(cfg)
    return 0


RECIPES = {
    r.name: r
    for r in (
        Recipe("sft", SFTConfig, "supervised fine-tuning (completion-only loss, chat templates, packing)", _run_sft),
        Recipe("dpo", DPOConfig, "offline preference optimization: DPO, IPO, cDPO, DPOP, R-DPO, SimPO, ORPO", _run_dpo),
        Recipe("rm", RMConfig, "reward model: scalar head, Bradley-Terry loss on preference pairs", _run_rm),
        Recipe("grpo", GRPOConfig, "online RL with verifiable rewards: GRPO, DAPO, GSPO, CISPO, RLOO, Dr. GRPO, "
               "GDPO, REINFORCE++", _run_grpo),
        Recipe("eval", EvalConfig, "greedy exact-match accuracy of a model on a built-in task", _run_eval),
        Recipe("quickstart", QuickstartConfig, "build the tiny model, train it on arithmetic, show before/after",
               _run_quickstart, quickstart_base_config),
    )
}


def describe_fields(schema: type[BaseModel], defaults: dict[str, Any] | None = None, prefix: str = "") -> list[str]:
    """One entry per leaf config key: `key  type = default` and its docstring."""
    lines: list[str] = []
    defaults = defaults or {}
    for name, info in schema.model_fields.items():
        key = f"{prefix}{name}"
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, Section):
            lines += describe_fields(annotation, defaults.get(name) or {}, prefix=f"{key}.")
            continue
        if name in defaults:
            default = defaults[name]
        elif info.default is not PydanticUndefined:
            default = info.default
        elif info.default_factory is not None:
            default = info.default_factory()
        else:
            default = "(required)"
        lines.append(f"  {key}  {type_name(annotation)} = {json.dumps(default) if default != '(required)' else default}")
        if info.description:
            lines += textwrap.wrap(info.description, width=96, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return lines


def _recipe_epilog(recipe: Recipe) -> str:
    lines = describe_fields(recipe.schema, recipe.base())
    return "config keys (set in the YAML file or as dotted.key=value):\n" + "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    common = "\n".join(describe_fields(RecipeConfig))
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Post-training for language models. Run `posttrain RECIPE --help` for a recipe's keys.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="recipes:\n" + "\n".join(f"  {r.name:<12}{r.summary}" for r in RECIPES.values())
        + "\n\nkeys every training recipe has:\n" + common
        + "\n\nexample:\n  posttrain sft --config configs/sft_arithmetic.yaml trainer.max_steps=200 output_dir=runs/a",
    )
    subparsers = parser.add_subparsers(dest="recipe", metavar="RECIPE")
    for recipe in RECIPES.values():
        sub = subparsers.add_parser(
            recipe.name, help=recipe.summary, description=recipe.schema.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_recipe_epilog(recipe),
        )
        sub.add_argument("--config", help="YAML config file (may include others with `defaults: [base.yaml]`)")
        sub.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.max_steps=10")
        if recipe.name in ("sft", "dpo", "rm", "grpo"):
            sub.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                             help="data-parallel FSDP2 over N processes on this machine (starts torchrun; the "
                                  "same as `torchrun --nproc-per-node N -m posttrain ...`)")
        if recipe.name == "eval":
            sub.add_argument("--model", help="shortcut for model.name_or_path=...")
            sub.add_argument("--task", help="shortcut for task=...")
            sub.add_argument("--json", action="store_true", help="print one JSON object (with `accuracy`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.recipe is None:
        parser.print_help()
        return 2
    recipe = RECIPES[args.recipe]
    nproc = getattr(args, "nproc_per_node", None)
    if nproc is not None:
        if nproc < 1:
            print(f"posttrain {recipe.name}: --nproc-per-node must be at least 1, got {nproc}", file=sys.stderr)
            return 2
        if nproc > 1 and "RANK" not in os.environ:
            return _launch_torchrun(nproc, _without_option(argv, "--nproc-per-node"))
    overrides = list(args.overrides)
    if recipe.name == "eval":
        overrides += [f"model.name_or_path={args.model}"] * bool(args.model) + [f"task={args.task}"] * bool(args.task)
    try:
        cfg = load_config(recipe.schema, args.config, overrides, base=recipe.base())
    except ConfigError as err:
        print(f"posttrain {recipe.name}: invalid config\n{err}", file=sys.stderr)
        return 2
    _quiet_libraries()
    try:
        return recipe.run(cfg, args)
    except (DataError, ModelNotFoundError, RewardError, RunError) as err:
        # What a user can fix, said in one line: bad data, a missing model, a broken reward, a run that cannot go on.
        kind = "bad data: " if isinstance(err, DataError) else "reward failed: " if isinstance(err, RewardError) else ""
        print(f"posttrain {recipe.name}: {kind}{err}", file=sys.stderr)
        return 1
    except OSError as err:
        import errno

        # Only what the file system refuses to store (checkpoints and exports say so themselves, as RunError).
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        print(f"posttrain {recipe.name}: could not write {err.filename or 'a file'}: {os.strerror(err.errno)}; "
              "the run resumes from its newest checkpoint once this is fixed", file=sys.stderr)
        return 1


def _without_option(argv: list[str], option: str) -> list[str]:
    """argv without `option VALUE` / `option=VALUE`."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == option:
            skip = True
        elif not item.startswith(option + "="):
            out.append(item)
    return out


def _launch_torchrun(nproc: int, argv: list[str]) -> int:
    """Run this command again under torchrun with `nproc` processes on this machine; its exit status."""
    import subprocess

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "posttrain", *argv]
    print(f"posttrain: starting {nproc} processes: torchrun --standalone --nproc-per-node={nproc} -m posttrain "
          f"{' '.join(argv)}", file=sys.stderr)
    return subprocess.call(command)


def _quiet_libraries() -> None:
    """Our own progress display replaces the libraries' per-file bars and advisory warnings."""
    import logging

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("posttrain").setLevel(logging.INFO)


if __name__ == "__main__":
    sys.exit(main())
