"""The loop that DPO (algorithms/dpo.py) and reward-model training (algorithms/rm.py) share.

Both train on (prompt, chosen, rejected) pairs: load the pairs, load the model (or resume it), then for each
optimizer step draw micro_batch_size x gradient_accumulation_steps pairs, collate each micro-batch as ONE batch
(2B rows, chosen then rejected; or, for DPO's shared prompt, B rows of prompt + chosen + rejected), take the recipe's loss normalized by the pair count of the whole
step, backward; clip, step, log, evaluate, checkpoint; at the end export the final model. The recipe supplies
only how a micro-batch of pairs becomes a loss (`PairLoss`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from posttrain.algorithms.common import (
    announce_run,
    batch_to,
    configure_torch,
    export_model,
    is_eval_step,
    is_save_step,
    log_step,
    optimizer_step,
    prepare_output_dir,
    resume_training,
    seed_everything,
)
from posttrain.checkpoint import Checkpoint, latest_checkpoint, save_checkpoint
from posttrain.config.schema import RecipeConfig
from posttrain.data.dataset import DataStats
from posttrain.data.preference import collate_preference, load_preference_examples
from posttrain.data.sampler import EpochSampler
from posttrain.data.types import PreferenceExample, SFTBatch, SharedPromptBatch
from posttrain.logging import RunLogger
from posttrain.models.loading import default_device, load_tokenizer
from posttrain.optim import build_optimizer, build_scheduler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PairBatch = SFTBatch | SharedPromptBatch
PairCollate = Callable[[Sequence[PreferenceExample], int], PairBatch]
"""(pairs, pad token id) -> one batch of them: collate_preference or collate_shared_prompt."""

PairLoss = Callable[[PairBatch, Sequence[int], "float | None"], tuple[torch.Tensor, dict[str, float]]]
"""(batch of B pairs, on the device; the pairs' indices in their example list; pairs in the whole
optimizer step, or None for a mean over this batch) -> (loss, metrics as floats)."""


@dataclass(frozen=True)
class PairRun:
    """What a pair recipe has set up before it loads its model."""

    output_dir: Path
    changed_keys: list[str]
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    train_examples: list[PreferenceExample]
    train_stats: DataStats
    eval_examples: list[PreferenceExample]
    resume: Checkpoint | None


def start_pair_run(cfg: RecipeConfig) -> PairRun:
    """Output directory, torch settings, seed, tokenizer, the pairs (before any model: a malformed row should
    fail before minutes go into loading a large model) and the checkpoint to resume from, if any."""
    output_dir, changed_keys = prepare_output_dir(cfg, cfg.output_dir)
    configure_torch(cfg.trainer)
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    train_examples, train_stats = load_preference_examples(cfg.data.train_files, tokenizer, cfg.data)
    eval_examples: list[PreferenceExample] = []
    if cfg.data.eval_files:
        eval_examples, _ = load_preference_examples(cfg.data.eval_files, tokenizer, cfg.data)
        eval_examples = eval_examples[: cfg.data.max_eval_examples]
    return PairRun(output_dir, changed_keys, default_device(), tokenizer, train_examples, train_stats, eval_examples,
                   latest_checkpoint(output_dir))


def accumulate_gradients(micro_batches: Sequence[tuple[PairBatch, list[int]]], pair_loss: PairLoss,
                         device: torch.device) -> dict[str, float]:
    """Forward and backward every micro-batch of one optimizer step; gradients add up in .grad.

    Each micro-batch's summed per-pair loss is divided by the pair count of the whole step, so the accumulated
    gradient is that of the mean over the step's pairs however they are split. Returns the step's metrics: the
    loss, and the pair-weighted means of the loss function's other metrics.
    """
    num_pairs_in_step = sum(len(indices) for _, indices in micro_batches)
    step_metrics: dict[str, float] = {}
    for batch, indices in micro_batches:
        loss, metrics = pair_loss(batch_to(batch, device), indices, num_pairs_in_step)
        loss.backward()
        metrics["loss"] = loss.item()  # already divided by the step's pairs: these add up to the step's loss
        for key, value in metrics.items():
            weight = 1.0 if key == "loss" else len(indices) / num_pairs_in_step
            step_metrics[key] = step_metrics.get(key, 0.0) + weight * value
    return step_metrics


@torch.no_grad()
def evaluate_pairs(model: torch.nn.Module, examples: Sequence[PreferenceExample], pair_loss: PairLoss,
                   keys: Sequence[str], batch_size: int, pad_token_id: int, device: torch.device,
                   collate: PairCollate = collate_preference) -> dict[str, float]:
    """Pair-weighted means of the metrics `keys` over `examples`, named eval_<key>; the model in eval mode."""
    was_training = model.training
    model.eval()
    totals = dict.fromkeys(keys, 0.0)
    for start in range(0, len(examples), batch_size):
        indices = list(range(start, min(start + batch_size, len(examples))))
        batch = batch_to(collate([examples[i] for i in indices], pad_token_id), device)
        _, metrics = pair_loss(batch, indices, None)
        for key in totals:
            totals[key] += metrics[key] * len(indices)
    model.train(was_training)
    return {f"eval_{key}": value / len(examples) for key, value in totals.items()}


def train_on_pairs(run: PairRun, cfg: RecipeConfig, model: torch.nn.Module, recipe: str, what: str,
                   train_loss: PairLoss, evaluate: Callable[[], dict[str, float]] | None,
                   collate: PairCollate = collate_preference) -> tuple[dict, dict, Path]:
    """The optimization loop; returns (last step's metrics, last evaluation's metrics, OUTPUT/final)."""
    trainer = cfg.trainer
    tokenizer = run.tokenizer
    model.train()
    optimizer = build_optimizer(model, trainer)
    scheduler = build_scheduler(optimizer, trainer)
    sampler = EpochSampler(len(run.train_examples), seed=cfg.seed, shuffle=cfg.data.shuffle)
    start_step = resume_training(run.resume, optimizer, scheduler, sampler)

    pairs_per_step = trainer.micro_batch_size * trainer.gradient_accumulation_steps
    with RunLogger(run.output_dir, cfg.logging, recipe=recipe, total_steps=trainer.max_steps, start_step=start_step,
                   run_config=cfg.model_dump(mode="json")) as run_log:
        announce_run(run_log, run.train_stats.summary(), run.resume, run.changed_keys, model,
                     f"{what}, {pairs_per_step} pairs per step ({len(run.train_examples)} in the training set)")

        metrics: dict[str, float] = {}
        eval_metrics: dict[str, float] = {}
        for step in range(start_step + 1, trainer.max_steps + 1):
            started = time.perf_counter()
            micro_batches = []
            for _ in range(trainer.gradient_accumulation_steps):
                indices = sampler.next_indices(trainer.micro_batch_size)
                batch = collate([run.train_examples[i] for i in indices], tokenizer.pad_token_id)
                micro_batches.append((batch, indices))
            learning_rate = scheduler.get_last_lr()[0]
            step_metrics = accumulate_gradients(micro_batches, train_loss, run.device)
            grad_norm = optimizer_step(model, optimizer, scheduler, trainer.max_grad_norm)
            elapsed = time.perf_counter() - started

            metrics = {
                **step_metrics,
                "learning_rate": learning_rate,
                "grad_norm": grad_norm,
                "tokens_per_second": sum(batch.num_tokens for batch, _ in micro_batches) / elapsed,
                "step_seconds": elapsed,
                "epoch": sampler.epochs_completed,
            }
            if evaluate is not None and is_eval_step(step, trainer):
                eval_metrics = evaluate()
                metrics.update(eval_metrics)
            log_step(run_log, step, metrics, trainer)
            if is_save_step(step, trainer):
                save_checkpoint(run.output_dir, step, model, tokenizer, optimizer, scheduler,
                                {"sampler": sampler.state_dict()}, trainer.keep_last)

        final_dir = export_model(run.output_dir, model, tokenizer, run_log)
    return metrics, eval_metrics, final_dir
