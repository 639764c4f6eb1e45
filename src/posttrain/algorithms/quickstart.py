"""The quickstart: reinforcement learning from a verifier, on two CPU cores, in a few minutes.

Stages:
  base     the untrained embedded tiny model, measured on held-out 2-digit additions
  sft      supervised fine-tuning on a small fixed pool of labelled examples (configs/sft_arithmetic_small.yaml):
           it learns the answer format and memorizes the pool, far below mastery on held-out problems
  control  the same SFT continued for `control_steps` more steps on the same pool: more demonstrations of the
           same few examples do not get further
  grpo     GRPO from the SFT model on fresh, unlabelled training prompts, rewarded only by an exact-match
           verifier (configs/grpo_arithmetic.yaml)

Prints a before/after table (held-out accuracy, mean reward, response length, time), writes OUTPUT/summary.json
with one key per stage and OUTPUT/curves.png. Re-running with the same output_dir resumes each stage.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from posttrain.algorithms.evaluate import EvalResult, evaluate_arithmetic
from posttrain.algorithms.grpo import train_grpo
from posttrain.algorithms.sft import train_sft
from posttrain.config.schema import QuickstartConfig
from posttrain.logging import read_metrics
from posttrain.models.loading import default_device, load_causal_lm, load_tokenizer
from posttrain.rundir import one_run_per_output_dir


def _measure(cfg: QuickstartConfig, model_path: str) -> EvalResult:
    model_cfg = cfg.sft.model.model_copy(update={"name_or_path": model_path})
    tokenizer = load_tokenizer(model_cfg)
    model = load_causal_lm(model_cfg, device=default_device())
    e = cfg.eval
    return evaluate_arithmetic(model, tokenizer, e.num_examples, e.seed, e.batch_size, e.max_new_tokens)


def _stage(evaluation: EvalResult, seconds: float, **extra: Any) -> dict[str, Any]:
    # On arithmetic the verifier's reward is exact match, so the mean reward equals the accuracy.
    return {"accuracy": evaluation.accuracy, "mean_reward": evaluation.accuracy,
            "mean_response_tokens": evaluation.mean_response_tokens, "seconds": round(seconds, 1), **extra}


@one_run_per_output_dir
def run_quickstart(cfg: QuickstartConfig) -> dict[str, Any]:
    console = Console()
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    results: dict[str, EvalResult] = {}
    started = time.perf_counter()
    pool = ", ".join(cfg.sft.data.train_files)
    console.print(f"[bold]posttrain quickstart[/bold]: {cfg.sft.model.name_or_path} learns 2-digit addition "
                  f"from {pool}, then from a verifier")

    results["base"] = _measure(cfg, cfg.sft.model.name_or_path)
    summary["base"] = _stage(results["base"], 0.0)
    console.print(f"base model: held-out accuracy {results['base'].accuracy:.1%}")

    stage_started = time.perf_counter()
    sft = train_sft(cfg.sft.model_copy(update={"output_dir": str(output_dir / "sft")}))
    results["sft"] = _measure(cfg, str(sft.final_dir))
    summary["sft"] = _stage(results["sft"], time.perf_counter() - stage_started, steps=sft.steps,
                            final_loss=sft.final_loss, model=str(sft.final_dir))
    console.print(f"sft: held-out accuracy {results['sft'].accuracy:.1%} after {sft.steps} steps on {pool}")

    if cfg.control_steps:
        stage_started = time.perf_counter()
        control_cfg = cfg.sft.model_copy(update={"output_dir": str(output_dir / "control")})
        control_cfg.model = control_cfg.model.model_copy(update={"name_or_path": str(sft.final_dir)})
        control_cfg.trainer = control_cfg.trainer.model_copy(update={"max_steps": cfg.control_steps})
        control = train_sft(control_cfg)
        results["sft+more sft"] = _measure(cfg, str(control.final_dir))
        summary["control"] = _stage(results["sft+more sft"], time.perf_counter() - stage_started,
                                    steps=cfg.control_steps, model=str(control.final_dir))
        console.print(f"control (sft for {cfg.control_steps} more steps on the same pool): held-out accuracy "
                      f"{results['sft+more sft'].accuracy:.1%}")

    stage_started = time.perf_counter()
    grpo_cfg = cfg.grpo.model_copy(update={"output_dir": str(output_dir / "grpo")})
    grpo_cfg.model = grpo_cfg.model.model_copy(update={"name_or_path": str(sft.final_dir)})
    grpo = train_grpo(grpo_cfg)
    results["sft+grpo"] = _measure(cfg, str(grpo.final_dir))
    summary["grpo"] = _stage(results["sft+grpo"], time.perf_counter() - stage_started, steps=grpo.steps,
                             train_reward_mean=grpo.final_metrics.get("reward/mean"), model=str(grpo.final_dir))

    table = Table(title=f"held-out exact match, {cfg.eval.num_examples} unseen 2-digit additions")
    for column in ("stage", "accuracy", "mean reward", "response tokens", "time"):
        table.add_column(column)
    keys = {"base": "base", "sft": "sft", "sft+more sft": "control", "sft+grpo": "grpo"}
    for name, evaluation in results.items():
        stage = summary[keys[name]]
        table.add_row(name, f"{evaluation.accuracy:.1%}", f"{stage['mean_reward']:.3f}",
                      f"{evaluation.mean_response_tokens:.1f}", f"{stage['seconds']:.0f}s")
    console.print(table)
    for sample in results["sft+grpo"].samples[:3]:
        console.print(f"  {sample['prompt']}{sample['completion']}   (answer {sample['answer']})")
    curves = plot_quickstart(output_dir)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"summary: {output_dir / 'summary.json'}   curves: {curves}   "
                  f"total {time.perf_counter() - started:.0f}s")
    return summary


def plot_quickstart(output_dir: Path) -> Path:
    """OUTPUT/curves.png: the SFT (and control) loss, and GRPO's training reward and held-out accuracy."""
    figure = Figure(figsize=(12, 3.5), layout="constrained")
    loss_axes, reward_axes = figure.subplots(1, 2)
    for stage in ("sft", "control"):
        records = read_metrics(output_dir / stage / "metrics.jsonl") if (output_dir / stage).is_dir() else []
        offset = 0 if stage == "sft" else len(read_metrics(output_dir / "sft" / "metrics.jsonl"))
        if records:
            loss_axes.plot([offset + r["step"] for r in records], [r["loss"] for r in records], label=stage)
    loss_axes.set(title="SFT loss on the labelled pool", xlabel="step")
    grpo = read_metrics(output_dir / "grpo" / "metrics.jsonl")
    reward_axes.plot([r["step"] for r in grpo], [r["reward/mean"] for r in grpo], label="train reward (sampled)",
                     alpha=0.6)
    validation = [(r["step"], r["val/accuracy"]) for r in grpo if "val/accuracy" in r]
    if validation:
        reward_axes.plot(*zip(*validation), marker="o", label="held-out accuracy (greedy)")
    reward_axes.set(title="GRPO", xlabel="step")
    for axes in (loss_axes, reward_axes):
        axes.grid(alpha=0.3)
        axes.legend()
    path = output_dir / "curves.png"
    figure.savefig(path, dpi=100)
    return path
