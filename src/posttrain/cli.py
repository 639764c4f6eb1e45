"""The `posttrain` command: `posttrain RECIPE [--config FILE.yaml] [dotted.key=value ...]`."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from posttrain.config import (
    ConfigError,
    DistillConfig,
    DPOConfig,
    EvalConfig,
    GenerateConfig,
    QuickstartConfig,
    RecipeConfig,
    RMConfig,
    SFTConfig,
    load_config,
)
from posttrain.config.loader import tagged_members, type_name
from posttrain.config.presets import quickstart_base_config
from posttrain.config.trl import TRL_NAMES
from posttrain.config.schema import GRPOConfig, PPOConfig, Section
from posttrain.data.errors import DataError
from posttrain.envs.rewards import RewardError, RewardFunctionImportError
from posttrain.envs.cua.environment import CuaEnvironment, prompt_rows
from posttrain.envs.cua.scripted import ScriptedPolicy, load_scripts, run_tasks, write_reports
from posttrain.envs.cua.tasks import CuaTaskError
from posttrain.envs.cua.tasks import load_tasks as load_cua_tasks
from posttrain.envs.swe.bundled import ensure_bundled_tasks
from posttrain.envs.swe.evaluate import check_predictions, evaluate, gold_predictions, summary_line
from posttrain.envs.swe.tasks import SweTaskError, load_predictions, load_tasks
from posttrain.errors import RunError
from posttrain.hub import push_export
from posttrain.models.errors import ModelNotFoundError
from posttrain.process_group import barrier, is_main, leave_together
from posttrain.preemption import PREEMPTION_SIGNALS, Preempted


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
    if is_main():
        print(line)


def _finished(cfg: Any, result: Any, shown: tuple[str, ...]) -> None:
    """The closing line of a training recipe (logging.report.describe_finished_run), by rank 0."""
    from posttrain.logging.report import describe_finished_run

    _done(describe_finished_run(result.output_dir, result.steps, result.final_dir, shown))


def _run_sft(cfg: SFTConfig, args: argparse.Namespace) -> int:
    from posttrain.algorithms.sft import train_sft

    _finished(cfg, train_sft(cfg), ("loss", "eval_loss"))
    return 0


def _check_weight_sync(cfg: GRPOConfig | PPOConfig) -> int:
    """--check-weight-sync: the comparison of algorithms/weight_check.py instead of training; 0 when it passes."""
    from posttrain.algorithms.weight_check import check_weight_sync

    check = check_weight_sync(cfg)
    print(check.summary())
    return 0 if check.passed else 1


def _run_ppo(cfg: PPOConfig, args: argparse.Namespace) -> int:
    if args.check_weight_sync:
        return _check_weight_sync(cfg)
    from posttrain.algorithms.ppo import train_ppo

    _finished(cfg, train_ppo(cfg), ("reward/mean", "val/", "value/explained_variance"))
    return 0


def _run_grpo(cfg: GRPOConfig, args: argparse.Namespace) -> int:
    if args.check_weight_sync:
        return _check_weight_sync(cfg)
    from posttrain.algorithms.grpo import train_grpo

    _finished(cfg, train_grpo(cfg), ("reward/mean", "val/"))
    return 0


def _run_dpo(cfg: DPOConfig, args: argparse.Namespace) -> int:
    from posttrain.algorithms.dpo import train_dpo

    _finished(cfg, train_dpo(cfg), ("loss", "eval_loss", "eval_reward_accuracy"))
    return 0


def _run_rm(cfg: RMConfig, args: argparse.Namespace) -> int:
    from posttrain.algorithms.rm import train_rm

    _finished(cfg, train_rm(cfg), ("loss", "eval_loss", "eval_accuracy"))
    return 0


def _run_distill(cfg: DistillConfig, args: argparse.Namespace) -> int:
    from posttrain.algorithms.distill import train_distill

    result = train_distill(cfg)
    _done(f"done: {result.steps} steps, final loss {result.final_loss}, eval nll {result.eval_nll}, "
          f"model in {result.final_dir}")
    return 0


def _run_eval(cfg: EvalConfig, args: argparse.Namespace) -> int:
    from posttrain.algorithms.evaluate import (EvalReport, HarnessReport, MultipleChoiceReport, describe_harness,
                                               describe_multiple_choice, describe_report, run_eval)

    result = run_eval(cfg)
    if isinstance(result, HarnessReport):  # lm-eval's tasks
        print(json.dumps({"model": cfg.model.name_or_path, **result.to_json()}) if args.json
              else describe_harness(result, cfg.model.name_or_path))
        return 0
    if isinstance(result, MultipleChoiceReport):  # multiple-choice questions scored by log-likelihood
        print(f"data: {result.data_summary}", file=sys.stderr)
        what = f"{cfg.model.name_or_path} on {', '.join(cfg.data.files) or 'arithmetic_mc'} (multiple choice)"
        print(json.dumps({"model": cfg.model.name_or_path, "scoring": "multiple_choice", **result.to_json()})
              if args.json else describe_multiple_choice(result, what))
        return 0
    if isinstance(result, EvalReport):  # data.files scored by an environment
        print(f"data: {result.data_summary}", file=sys.stderr)
        what = f"{cfg.model.name_or_path} on {', '.join(cfg.data.files)} ({cfg.environment.kind})"
        print(json.dumps({"model": cfg.model.name_or_path, "environment": cfg.environment.kind, **result.to_json()})
              if args.json else describe_report(result, what))
        return 0
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(f"{result.task}: exact-match accuracy {result.accuracy:.1%} on {result.num_examples} held-out examples")
        for sample in result.samples:
            print(f"  {sample['prompt']}{sample['completion']!r:8}  (answer {sample['answer']})")
    return 0


def _run_generate(cfg: GenerateConfig, args: argparse.Namespace) -> int:
    from posttrain.algorithms.generate import generate

    for sample in generate(cfg):
        if args.json:
            print(json.dumps(sample.to_json()))
        else:
            if sample.sample == 0:
                print(f"### prompt {sample.prompt_index + 1}\n{sample.prompt}")
            print(f"### completion {sample.sample + 1} of {cfg.num_samples} ({sample.num_tokens} tokens, "
                  f"{sample.finish_reason})\n{sample.completion}")
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
        Recipe("ppo", PPOConfig, "online RL with a learned critic: PPO with GAE, KL in the reward or the loss",
               _run_ppo),
        Recipe("distill", DistillConfig, "knowledge distillation from a teacher's top-k (forward, reverse, mixed "
               "KL, generalized JSD) on a dataset; on-policy distillation is grpo's advantage.estimator=opd",
               _run_distill),
        Recipe("eval", EvalConfig, "evaluate a model: prompt files scored by an environment (reward, accuracy, "
               "pass@k), or a built-in task's greedy exact match", _run_eval),
        Recipe("generate", GenerateConfig, "sample completions of a few prompts from a model, for a quick look",
               _run_generate),
        Recipe("quickstart", QuickstartConfig, "build the tiny model, train it on arithmetic, show before/after",
               _run_quickstart, quickstart_base_config),
    )
}


def describe_fields(schema: type[BaseModel], defaults: dict[str, Any] | None = None, prefix: str = "",
                    variants: bool = True) -> list[str]:
    """One entry per leaf config key: `key  type = default` and its docstring. A section whose kinds have options
    of their own (environment) lists each kind's options, or with `variants` false only its kinds."""
    lines: list[str] = []
    defaults = defaults or {}
    for name, info in schema.model_fields.items():
        key = f"{prefix}{name}"
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, Section):
            lines += describe_fields(annotation, defaults.get(name) or {}, prefix=f"{key}.", variants=variants)
            continue
        if tagged_members(annotation) and not variants:
            lines.append(f"  {key}  {type_name(annotation)}: its kind, options and other keys are those of "
                         "`posttrain eval --help`'s environment")
            continue
        if tagged_members(annotation):
            lines += describe_variants(key, tagged_members(annotation), info.default_factory(), defaults.get(name) or {})
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
        item = typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else None
        if isinstance(item, type) and issubclass(item, Section):  # a list of sections (evaluation sets): their keys
            lines.append(f"    each item of {key} has these keys:")
            lines += ["  " + line for line in describe_fields(item, prefix=f"{key}[].", variants=False)]
    return lines


def describe_variants(key: str, members: dict[str, type[BaseModel]], default: BaseModel,
                      defaults: dict[str, Any]) -> list[str]:
    """The keys of a section that is a union discriminated on `kind` (environment): its kind, the keys every
    variant has, then each variant's options under the kind that takes them."""
    kind = defaults.get("kind", default.kind)
    variant = members[kind]
    lines = [f"  {key}.kind  one of {', '.join(repr(tag) for tag in members)} = {json.dumps(kind)}"]
    if variant.model_fields["kind"].description:
        lines += textwrap.wrap(variant.model_fields["kind"].description, width=96, initial_indent=" " * 6,
                               subsequent_indent=" " * 6)
    shared = {name: info for name, info in variant.model_fields.items() if name not in ("kind", "options")}
    lines += describe_fields(_fields_only(variant, shared), defaults, prefix=f"{key}.")
    for tag, member in members.items():
        options = member.model_fields["options"].annotation
        chosen = defaults.get("options") or {} if tag == kind else {}
        described = describe_fields(options, chosen, prefix=f"{key}.options.")
        lines += [f"  {key}.options with {key}.kind={tag}:" + ("" if described else " none")]
        lines += ["  " + line for line in described]
    return lines


def _fields_only(model: type[BaseModel], fields: dict[str, Any]) -> type[BaseModel]:
    """A view of `model` listing only `fields`, for describe_fields."""
    return type(model.__name__, (), {"model_fields": fields})


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
        + f"\n\nother commands:\n  {'report':<12}{REPORT_SUMMARY}\n  {'push':<12}{PUSH_SUMMARY}"
        + "\n\nkeys every training recipe has:\n" + common
        + "\n\nexample:\n  posttrain sft --config configs/sft_arithmetic.yaml trainer.max_steps=200 output_dir=runs/a",
    )
    subparsers = parser.add_subparsers(dest="recipe", metavar="RECIPE")
    parser.recipe_parsers = {}
    for recipe in RECIPES.values():
        sub = parser.recipe_parsers[recipe.name] = subparsers.add_parser(
            recipe.name, help=recipe.summary, description=recipe.schema.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_recipe_epilog(recipe),
        )
        sub.add_argument("--config", help="YAML config file (may include others with `defaults: [base.yaml]`)")
        sub.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.max_steps=10")
        if recipe.name in ("sft", "dpo", "rm", "grpo", "ppo"):
            sub.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                             help="data-parallel FSDP2 over N processes on this machine (starts torchrun; the "
                                  "same as `torchrun --nproc-per-node N -m posttrain ...`)")
        if recipe.name in ("grpo", "ppo"):
            sub.add_argument("--check-weight-sync", action="store_true",
                             help="instead of training: push the policy's weights to the configured generator "
                                  "(cluster.backend) after one optimizer step and compare them and the "
                                  "log-probabilities of a sampled batch with the trainer's; exit 1 on a mismatch")
        if recipe.name == "eval":
            sub.add_argument("--model", help="shortcut for model.name_or_path=...")
            sub.add_argument("--task", help="shortcut for task=...")
            sub.add_argument("--json", action="store_true", help="print one JSON object (with `accuracy`)")
            sub.add_argument("--data", action="append", metavar="FILE",
                             help="prompt file or dataset to evaluate on (repeatable): data.files")
            sub.add_argument("--environment", metavar="KIND", help="shortcut for environment.kind=...; its options "
                             "as environment.options.NAME=VALUE")
            sub.add_argument("--output", metavar="FILE.jsonl", help="write every sample to this file: output=...")
            sub.add_argument("--chat-template", action="store_true", help="send each prompt through the tokenizer's "
                             "chat template as a user message: prompt.use_chat_template=true (default: the prompt "
                             "text as it is, as in generate)")
            sub.add_argument("--multiple-choice", action="store_true", help="score the rows of --data as "
                             "multiple-choice questions by log-likelihood (acc, acc_norm): scoring=multiple_choice")
            sub.add_argument("--lm-eval-tasks", metavar="TASKS", help="run these lm-evaluation-harness tasks "
                             "(comma-separated) on the model: lm_eval_tasks (needs pip install 'posttrain[lm-eval]')")
            sub.add_argument("--lm-eval-include-path", metavar="DIR", help="a folder of lm-eval task YAML files: "
                             "lm_eval_include_path")
        if recipe.name == "generate":
            sub.add_argument("--model", help="shortcut for model.name_or_path=...")
            sub.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt to complete (repeatable)")
            sub.add_argument("--data", action="append", metavar="FILE", help="complete the `prompt` column of "
                             "this file (repeatable): data.files")
            for flag, kind in (("--temperature", float), ("--top-p", float), ("--top-k", int),
                               ("--max-new-tokens", int), ("--num-samples", int), ("--seed", int)):
                sub.add_argument(flag, type=kind, help=f"shortcut for {flag[2:].replace('-', '_')}=...")
            sub.add_argument("--chat-template", action="store_true", help="send each prompt through the "
                             "tokenizer's chat template as a user message: chat_template=true (default: the prompt "
                             "text as it is, as in eval)")
            sub.add_argument("--no-chat-template", action="store_true",
                             help="the prompt text as it is (the default): chat_template=false")
            sub.add_argument("--json", action="store_true", help="print one JSON object per completion")
    report = subparsers.add_parser("report", help=REPORT_SUMMARY, description=_run_report.__doc__)
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's output directory (OUTPUT/)")
    report.add_argument("--output", metavar="FILE.html",
                        help="where to write it (default: RUN_DIR/report.html for one run, ./report.html for several)")
    push = subparsers.add_parser("push", help=PUSH_SUMMARY, description=_run_push.__doc__)
    push.add_argument("run_dir", metavar="RUN_DIR", help="a finished run's output directory (OUTPUT/)")
    push.add_argument("--repo-id", required=True, metavar="ID", help="the Hub repository, NAMESPACE/NAME")
    push.add_argument("--private", action="store_true", help="create the repository private")
    push.add_argument("--adapter", action="store_true", help="upload OUTPUT/adapter/ (the LoRA adapter alone) "
                      "instead of OUTPUT/final/")
    swe = subparsers.add_parser("swe-eval", help=SWE_EVAL_SUMMARY, description=_run_swe_eval.__doc__)
    swe.add_argument("--tasks", metavar="TASKS.jsonl", help="SWE-bench rows (default: the bundled tasks)")
    swe.add_argument("--predictions", metavar="PREDS.jsonl", help="rows of instance_id, model_patch, "
                     "model_name_or_path (required unless --gold)")
    swe.add_argument("--gold", action="store_true", help="score each task's own gold patch (validates the tasks)")
    swe.add_argument("--repos", metavar="DIR", help="the folder holding the tasks' repositories as owner__name "
                     "(default: repos/ beside the tasks file)")
    swe.add_argument("--output", metavar="DIR", default="swe-eval", help="where the reports go (default: swe-eval)")
    swe.add_argument("--test-timeout", type=float, default=120.0, metavar="S",
                     help="wall-clock limit of one instance's test run (default: 120)")
    cua = subparsers.add_parser("cua-run", help=CUA_RUN_SUMMARY, description=_run_cua.__doc__)
    cua.add_argument("--tasks", metavar="TASKS", help="OSWorld-style tasks: a .jsonl file, a .json file or a folder "
                     "of .json files (default: the bundled tasks)")
    cua.add_argument("--scripts", metavar="SCRIPTS.json", help="the scripted policy's steps per task id (default: "
                     "the bundled tasks' solutions)")
    cua.add_argument("--output", metavar="DIR", default="cua-run", help="where the reports and episodes go "
                     "(default: cua-run)")
    cua.add_argument("--max-steps", type=int, default=10, metavar="N", help="actions per episode (default: 10)")
    cua.add_argument("--write-prompts", metavar="FILE.jsonl", help="instead of running: write the tasks' data rows "
                     "({prompt, task_id}, the prompt holding the first accessibility tree) for posttrain eval or grpo "
                     "with environment.kind=cua")
    return parser


CUA_RUN_SUMMARY = "run computer-use tasks on an Xvfb desktop with a scripted policy (or write their prompts)"


def _run_cua(args: argparse.Namespace) -> int:
    """Run each task's episode with the scripted policy: a desktop per task, the task's setup, the script's actions
    (widgets named by role and name are found in the accessibility tree), the task's evaluator at the end. Writes
    OUTPUT/tasks/ID.json per task, OUTPUT/report.json, and each episode's folder (screenshots, the app's files)
    under OUTPUT/episodes/. With --write-prompts, writes the tasks' data rows instead. See docs/agents.md."""
    try:
        tasks = load_cua_tasks(args.tasks)
        if args.write_prompts:
            rows = prompt_rows(tasks)
            with open(args.write_prompts, "w", encoding="utf-8") as file:
                file.writelines(json.dumps(row) + "\n" for row in rows)
            print(f"wrote {len(rows)} prompts to {args.write_prompts}")
            return 0
        policy = ScriptedPolicy(load_scripts(args.scripts))
        environment = CuaEnvironment(tasks, episodes_dir=Path(args.output) / "episodes", max_steps=args.max_steps)
    except (CuaTaskError, ValueError) as err:
        print(f"posttrain cua-run: {err}", file=sys.stderr)
        return 1
    try:
        reports = run_tasks(tasks, policy, environment)
    except (CuaTaskError, RunError) as err:
        print(f"posttrain cua-run: {err}", file=sys.stderr)
        return 1
    finally:
        environment.close()
    write_reports(reports, Path(args.output))
    for report in reports:
        outcome = "solved" if report.correct else ("error" if report.reward is None else "not solved")
        print(f"{report.task_id}: {outcome}, {report.actions} actions ({report.seconds:.2f} s)"
              + (f": {report.error}" if report.error else ""))
    print(f"{sum(r.correct for r in reports)} of {len(reports)} tasks solved; report: "
          f"{os.path.join(args.output, 'report.json')}")
    return 0


SWE_EVAL_SUMMARY = "score patches on SWE-style repository tasks (SWE-bench's predictions format) in the sandbox"


def _run_swe_eval(args: argparse.Namespace) -> int:
    """Apply each prediction's model_patch to a fresh checkout of its task's base_commit, apply the task's
    test_patch, run its FAIL_TO_PASS and PASS_TO_PASS tests with pytest in the sandbox, and write
    OUTPUT/instances/ID.json per instance and OUTPUT/report.json; an instance is resolved when every one of those
    tests passed. See docs/agents.md."""
    if args.gold == bool(args.predictions):
        print("posttrain swe-eval: give --predictions PREDS.jsonl or --gold (not both)", file=sys.stderr)
        return 2
    try:
        tasks = load_tasks(args.tasks or ensure_bundled_tasks(), args.repos)
        predictions = gold_predictions(tasks) if args.gold else load_predictions(args.predictions)
        if not args.gold:
            check_predictions(tasks, predictions, args.predictions)
    except SweTaskError as err:
        print(f"posttrain swe-eval: {err}", file=sys.stderr)
        return 1

    def show(result: Any) -> None:
        print(f"{result.instance_id}: {result.status} ({result.seconds:.2f} s)"
              + (f": {result.error}" if result.error else ""))

    report = evaluate(tasks, predictions, Path(args.output), test_timeout_s=args.test_timeout, on_result=show)
    print(summary_line(report))
    print(f"report: {os.path.join(args.output, 'report.json')}")
    return 0


PUSH_SUMMARY = "upload a run's final/ (or adapter/) with its model card to the Hugging Face Hub"


def _run_push(args: argparse.Namespace) -> int:
    """Upload RUN_DIR/final/ (or, with --adapter, RUN_DIR/adapter/) to a Hugging Face Hub repository, creating it
    if needed, in one commit; its README.md model card is written again first, with the repository id in its
    loading example. The token is huggingface_hub's: HF_TOKEN, or the one `hf auth login` stored. HF_ENDPOINT
    chooses another Hub endpoint. The same happens at the end of a run with hub.push_at_end=true."""
    try:
        url = push_export(args.run_dir, args.repo_id, private=args.private,
                          folder="adapter" if args.adapter else "final")
    except RunError as err:
        print(f"posttrain push: {err}", file=sys.stderr)
        return 1
    print(f"pushed {os.path.join(args.run_dir, 'adapter' if args.adapter else 'final')} to {url}")
    return 0


REPORT_SUMMARY = "write a run's report.html again (curves, config, samples), or one comparing several runs"


def _run_report(args: argparse.Namespace) -> int:
    """Write one self-contained HTML page about a run: its curves, final metrics, time per phase, data summary,
    samples and config. Several runs: their curves overlaid, one colour per run. Needs no network to view."""
    from posttrain.logging.report import REPORT_FILENAME, write_report

    if args.output is not None:
        output = args.output
    else:
        output = os.path.join(args.run_dirs[0], REPORT_FILENAME) if len(args.run_dirs) == 1 else REPORT_FILENAME
    try:
        path = write_report(args.run_dirs, output)
    except (OSError, ValueError) as err:  # a folder that is no run (ReportError), a corrupt line, an unwritable file
        print(f"posttrain report: {err}", file=sys.stderr)
        return 1
    print(f"report: {path}")
    return 0


def flags_as_overrides(recipe: Recipe, options: dict[str, bool], argv: list[str]) -> tuple[list[str], str | None]:
    """`--KEY VALUE` and `--KEY=VALUE` in a recipe's arguments, where KEY (dashes read as underscores) starts with
    one of the recipe's config keys and is no option of its own, as the override `KEY=VALUE`. A TRL argument name
    is answered with the key=value to type instead; any other unknown option with how keys are given. Returns
    (the arguments, with those rewritten) and the message of the first that cannot be taken, or None. `options`:
    the recipe's own options, each with whether it takes a value (which is passed on untouched, whatever it
    looks like: a prompt may start with dashes)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        item = argv[i]
        i += 1
        flag, has_value, value = item.partition("=")
        if flag in options:
            out.append(item)
            if options[flag] and not has_value and i < len(argv):
                out.append(argv[i])
                i += 1
            continue
        if not item.startswith("--") or len(flag) < 3:
            out.append(item)
            continue
        key = flag[2:].replace("-", "_")
        if not has_value and i < len(argv) and not argv[i].startswith("--"):
            value, has_value = argv[i], "="
            i += 1
        if key.split(".")[0] in recipe.schema.model_fields:
            if not has_value:
                return out, (f"{flag} needs a value; config keys are given as key=value, here {key}=VALUE "
                             f"(posttrain {recipe.name} --help lists them)")
            out.append(f"{key}={value}")
            continue
        trl = TRL_NAMES.get(key)
        if trl is not None and trl.applies_to(recipe.name):
            target = trl.key_for(recipe.name)
            if target is None:
                return out, f"{flag}: {trl.explain(key, recipe.name)}"
            typed = target if "=" in target else f"{target}={value if has_value else 'VALUE'}"
            return out, f"{flag}: {trl.explain(key, recipe.name)}; type {typed}"
        return out, (f"unrecognized option {flag}: config keys are given as key=value "
                     f"(posttrain {recipe.name} --help lists them)")
    return out, None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in RECIPES:
        recipe = RECIPES[argv[0]]
        options = {flag: action.nargs != 0
                   for flag, action in parser.recipe_parsers[recipe.name]._option_string_actions.items()}
        rest, problem = flags_as_overrides(recipe, options, argv[1:])
        if problem is not None:
            print(f"posttrain {recipe.name}: {problem}", file=sys.stderr)
            return 2
        argv = [argv[0], *rest]
    args, extra = parser.parse_known_args(argv)
    # Overrides after an option (`key=v --nproc-per-node 2 other=w`): argparse gives a positional list one run of
    # arguments, and would blame the later ones as unrecognized.
    unknown = [item for item in extra
               if item.startswith("-") or "=" not in item or args.recipe in (None, "report", "push", "swe-eval", "cua-run")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.recipe is None:
        parser.print_help()
        return 2
    if args.recipe == "report":
        return _run_report(args)
    if args.recipe == "push":
        return _run_push(args)
    if args.recipe == "swe-eval":
        return _run_swe_eval(args)
    if args.recipe == "cua-run":
        return _run_cua(args)
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
        cfg = load_config(recipe.schema, args.config, overrides, base=recipe.base(), flags=_flag_settings(args))
    except ConfigError as err:
        print(f"posttrain {recipe.name}: invalid config\n{err}", file=sys.stderr)
        return 2
    _quiet_libraries()
    try:
        status = recipe.run(cfg, args)
        leave_together()
        return status
    except Preempted as stop:
        return _stopped_by_signal(recipe.name, cfg, stop)
    except (DataError, ModelNotFoundError, RewardError, RewardFunctionImportError, RunError) as err:
        # What a user can fix, said in one line: bad data, a missing model, a broken reward, a run that cannot go on.
        kind = "bad data: " if isinstance(err, DataError) else "reward failed: " if isinstance(err, RewardError) else ""
        print(f"posttrain {recipe.name}: {kind}{err}", file=sys.stderr)
        return 1
    except OSError as err:
        # Only what the file system refuses to store (checkpoints and exports say so themselves, as RunError).
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        print(f"posttrain {recipe.name}: could not write {err.filename or 'a file'}: {os.strerror(err.errno)}; "
              "the run resumes from its newest checkpoint once this is fixed", file=sys.stderr)
        return 1


def _stopped_by_signal(name: str, cfg: Any, stop: Preempted) -> int:
    """A run that SIGTERM or SIGUSR1 stopped at a step boundary, its checkpoint written: say where things are and
    how to resume; exit 128 + the signal number. In a data-parallel run every rank waits here until rank 0 has
    written the report (it does on its way out of the recipe), so that no rank's exit makes torchrun end rank 0
    before that."""
    from posttrain.logging.report import REPORT_FILENAME

    if is_main():
        report = os.path.join(cfg.output_dir, REPORT_FILENAME)
        print(f"posttrain {name}: {stop}" + (f"; report: {report}" if os.path.isfile(report) else ""),
              file=sys.stderr)
    barrier()
    return stop.exit_status


def _flag_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys that `eval` and `generate` options set, as a tree whose values are taken as given (a prompt
    or a file name may hold any character, which dotted override text could not)."""
    flags: dict[str, Any] = {}
    if args.recipe not in ("eval", "generate"):
        return flags
    if args.data:
        flags["data"] = {"files": args.data}
    if args.recipe == "eval":
        flags |= {"environment": {"kind": args.environment}} if args.environment else {}
        flags |= {"output": args.output} if args.output else {}
        flags |= {"prompt": {"use_chat_template": True}} if args.chat_template else {}
        flags |= {"scoring": "multiple_choice"} if args.multiple_choice else {}
        if args.lm_eval_tasks:
            flags["lm_eval_tasks"] = [task.strip() for task in args.lm_eval_tasks.split(",") if task.strip()]
        flags |= {"lm_eval_include_path": args.lm_eval_include_path} if args.lm_eval_include_path else {}
        return flags
    flags |= {"model": {"name_or_path": args.model}} if args.model else {}
    flags |= {"prompts": args.prompt} if args.prompt else {}
    if args.chat_template and args.no_chat_template:
        raise ConfigError("--chat-template and --no-chat-template: give one")
    flags |= {"chat_template": True} if args.chat_template else {}
    flags |= {"chat_template": False} if args.no_chat_template else {}
    for name in ("temperature", "top_p", "top_k", "max_new_tokens", "num_samples", "seed"):
        if vars(args)[name] is not None:
            flags[name] = vars(args)[name]
    return flags


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
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "posttrain", *argv]
    print(f"posttrain: starting {nproc} processes: torchrun --standalone --nproc-per-node={nproc} -m posttrain "
          f"{' '.join(argv)}", file=sys.stderr)
    torchrun = subprocess.Popen(command)

    def forward(number: int, frame) -> None:
        # torchrun passes SIGTERM on to every rank (and ends them 30 s later); SIGUSR1 it does not handle, and it
        # would die of it leaving the ranks behind: both reach it as SIGTERM.
        torchrun.send_signal(signal.SIGTERM)

    for number in PREEMPTION_SIGNALS:
        signal.signal(number, forward)
    return torchrun.wait()


def _quiet_libraries() -> None:
    """Our own progress display replaces the libraries' per-file bars and advisory warnings."""
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("posttrain").setLevel(logging.INFO)


if __name__ == "__main__":
    sys.exit(main())
