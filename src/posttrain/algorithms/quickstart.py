"""The quickstart: the embedded tiny model learns 2-digit addition on two CPU cores.

Stages: measure the untrained model (`base`), fine-tune it with SFT on the arithmetic task (`sft`),
measure again. Prints a before/after table and writes OUTPUT/summary.json with one key per stage.
Re-running with the same output_dir resumes (a finished stage is not trained again).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from posttrain.algorithms.evaluate import EvalResult, evaluate_arithmetic
from posttrain.algorithms.sft import train_sft
from posttrain.config.schema import QuickstartConfig
from posttrain.models.loading import default_device, load_causal_lm, load_tokenizer


def _measure(cfg: QuickstartConfig, model_path: str) -> EvalResult:
    model_cfg = cfg.sft.model.model_copy(update={"name_or_path": model_path})
    tokenizer = load_tokenizer(model_cfg)
    model = load_causal_lm(model_cfg, device=default_device())
    e = cfg.eval
    return evaluate_arithmetic(model, tokenizer, e.num_examples, e.seed, e.batch_size, e.max_new_tokens)


def run_quickstart(cfg: QuickstartConfig) -> dict[str, Any]:
    console = Console()
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    sft_cfg = cfg.sft.model_copy(update={"output_dir": str(output_dir / "sft")})
    summary: dict[str, Any] = {}

    console.print(f"[bold]posttrain quickstart[/bold]: {cfg.sft.model.name_or_path} learns 2-digit addition")
    started = time.perf_counter()
    base = _measure(cfg, cfg.sft.model.name_or_path)
    summary["base"] = {"accuracy": base.accuracy, "mean_response_tokens": base.mean_response_tokens, "seconds": 0.0}
    console.print(f"base model: held-out accuracy {base.accuracy:.1%} on {base.num_examples} problems")

    stage_started = time.perf_counter()
    result = train_sft(sft_cfg)
    sft_eval = _measure(cfg, str(result.final_dir))
    summary["sft"] = {
        "accuracy": sft_eval.accuracy,
        "mean_response_tokens": sft_eval.mean_response_tokens,
        "final_loss": result.final_loss,
        "eval_loss": result.eval_loss,
        "steps": result.steps,
        "seconds": round(time.perf_counter() - stage_started, 1),
        "model": str(result.final_dir),
    }

    table = Table(title=f"held-out exact match, {base.num_examples} unseen 2-digit additions")
    for column in ("stage", "accuracy", "response tokens", "time"):
        table.add_column(column)
    for stage, evaluation in (("base", base), ("sft", sft_eval)):
        table.add_row(stage, f"{evaluation.accuracy:.1%}", f"{evaluation.mean_response_tokens:.1f}",
                      f"{summary[stage]['seconds']:.0f}s")
    console.print(table)
    for sample in sft_eval.samples[:3]:
        console.print(f"  {sample['prompt']}{sample['completion']}   (answer {sample['answer']})")
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"summary: {output_dir / 'summary.json'}   total {time.perf_counter() - started:.0f}s")
    return summary
