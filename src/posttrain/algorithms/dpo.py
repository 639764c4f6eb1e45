"""Offline preference optimization (DPO and its family) against a frozen reference model.

The loop, top to bottom: load the preference pairs and the policy, resume from the newest checkpoint if
the output directory has one, set up the reference (a frozen copy of the starting model, or its
log-probabilities of every pair computed once up front; none for the reference-free simpo and orpo),
then for each optimizer step draw micro_batch_size x gradient_accumulation_steps pairs; per micro-batch
run chosen and rejected sequences through the policy in ONE forward pass, reduce token log-probabilities
to one per completion, take the preference loss normalized by the pair count of the whole step, backward;
clip, step, log, evaluate, checkpoint. At the end write OUTPUT/final/ (a Hugging Face model directory).

The reference is always the starting model (model.name_or_path), also when resuming: a checkpoint holds
only the policy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from posttrain.algorithms.common import (
    announce_run,
    autocast,
    batch_to,
    chunks,
    configure_torch,
    forward_logits,
    is_eval_step,
    is_save_step,
    log_step,
    optimizer_step,
    prepare_output_dir,
    resume_training,
    seed_everything,
)
from posttrain.checkpoint import export_final, latest_checkpoint, save_checkpoint
from posttrain.config.schema import DPOConfig, PreferenceLossSection, TrainerConfig
from posttrain.data.preference import collate_preference, load_preference_examples
from posttrain.data.sampler import EpochSampler
from posttrain.data.types import PreferenceExample, SFTBatch
from posttrain.logging import RunLogger
from posttrain.losses.nll import token_logprobs
from posttrain.losses.preference import PreferenceLossConfig, preference_loss, sequence_logps
from posttrain.models.loading import default_device, load_causal_lm, load_tokenizer
from posttrain.optim import build_optimizer, build_scheduler


@dataclass(frozen=True)
class DPOResult:
    output_dir: Path
    final_dir: Path
    steps: int
    final_loss: float | None
    final_reward_accuracy: float | None
    eval_loss: float | None
    eval_reward_accuracy: float | None


@dataclass(frozen=True)
class CompletionLogps:
    """Per-completion scores of B pairs, each [B].

    chosen, rejected: log-probabilities of the completions (summed over tokens, or their mean).
    chosen_lengths, rejected_lengths: completion token counts.
    chosen_nll: mean per-token NLL of the chosen completion (for ORPO and loss.sft_weight).
    """

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_lengths: torch.Tensor
    rejected_lengths: torch.Tensor
    chosen_nll: torch.Tensor


def completion_logps(model: torch.nn.Module, batch: SFTBatch, average: bool, trainer: TrainerConfig,
                     device: torch.device) -> CompletionLogps:
    """Score a `collate_preference` batch (chosen rows, then rejected rows) with one forward pass."""
    with autocast(trainer, device):
        logits = forward_logits(model, batch)
    token_logps = token_logprobs(logits, batch.input_ids)
    scores = sequence_logps(token_logps, batch.loss_mask, average)
    lengths = batch.loss_mask.sum(-1)
    mean_logps = sequence_logps(token_logps, batch.loss_mask, average=True)
    pairs = batch.input_ids.shape[0] // 2
    return CompletionLogps(scores[:pairs], scores[pairs:], lengths[:pairs], lengths[pairs:], -mean_logps[:pairs])


def load_reference_model(cfg: DPOConfig, device: torch.device) -> torch.nn.Module:
    """The starting model, frozen: eval mode, no gradients."""
    reference = load_causal_lm(cfg.model, device=device)
    reference.eval()
    reference.requires_grad_(False)
    return reference


@torch.no_grad()
def precompute_reference_logps(
    reference: torch.nn.Module, examples: Sequence[PreferenceExample], cfg: DPOConfig, pad_token_id: int,
    device: torch.device,
) -> torch.Tensor:
    """[N, 2] reference log-probabilities (chosen, rejected) of every pair, in batches of trainer.eval_batch_size."""
    rows = []
    for group in chunks(list(examples), cfg.trainer.eval_batch_size):
        batch = batch_to(collate_preference(group, pad_token_id), device)
        scores = completion_logps(reference, batch, cfg.loss.average_logprobs, cfg.trainer, device)
        rows.append(torch.stack([scores.chosen, scores.rejected], dim=1).cpu())
    return torch.cat(rows)


class Reference:
    """Where reference log-probabilities come from: a frozen model, a precomputed table indexed by pair, or
    nowhere (reference-free losses). `logps` returns ([B] chosen, [B] rejected) or (None, None)."""

    def __init__(self, model: torch.nn.Module | None = None, table: torch.Tensor | None = None):
        self.model, self.table = model, table

    @torch.no_grad()
    def logps(self, batch: SFTBatch, indices: Sequence[int], loss: PreferenceLossSection, trainer: TrainerConfig,
              device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.model is not None:
            scores = completion_logps(self.model, batch, loss.average_logprobs, trainer, device)
            return scores.chosen, scores.rejected
        if self.table is not None:
            rows = self.table[list(indices)].to(device)
            return rows[:, 0], rows[:, 1]
        return None, None


def micro_batch_loss(
    policy: torch.nn.Module, batch: SFTBatch, reference_logps: tuple[torch.Tensor | None, torch.Tensor | None],
    cfg: DPOConfig, loss_cfg: PreferenceLossConfig, num_pairs_in_step: float | None, device: torch.device,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The preference loss of one micro-batch of pairs (summed over its pairs / num_pairs_in_step)."""
    policy_logps = completion_logps(policy, batch, cfg.loss.average_logprobs, cfg.trainer, device)
    return preference_loss(
        loss_cfg,
        policy_logps.chosen,
        policy_logps.rejected,
        reference_logps[0],
        reference_logps[1],
        chosen_lengths=policy_logps.chosen_lengths,
        rejected_lengths=policy_logps.rejected_lengths,
        chosen_nll=policy_logps.chosen_nll,
        num_pairs_in_step=num_pairs_in_step,
    )


@torch.no_grad()
def evaluate_preferences(
    policy: torch.nn.Module, examples: Sequence[PreferenceExample], reference: Reference, cfg: DPOConfig,
    loss_cfg: PreferenceLossConfig, pad_token_id: int, device: torch.device,
) -> dict[str, float]:
    """Mean loss and reward accuracy over `examples` (the reference table, if any, indexes these examples)."""
    was_training = policy.training
    policy.eval()
    totals = {"loss": 0.0, "reward_accuracy": 0.0, "margin": 0.0}
    for start in range(0, len(examples), cfg.trainer.eval_batch_size):
        indices = list(range(start, min(start + cfg.trainer.eval_batch_size, len(examples))))
        batch = batch_to(collate_preference([examples[i] for i in indices], pad_token_id), device)
        reference_logps = reference.logps(batch, indices, cfg.loss, cfg.trainer, device)
        _, metrics = micro_batch_loss(policy, batch, reference_logps, cfg, loss_cfg, None, device)
        for key in totals:
            totals[key] += metrics[key] * len(indices)
    policy.train(was_training)
    return {f"eval_{key}": value / len(examples) for key, value in totals.items()}


def accumulate_gradients(
    policy: torch.nn.Module, micro_batches: Sequence[tuple[SFTBatch, list[int]]], reference: Reference,
    cfg: DPOConfig, loss_cfg: PreferenceLossConfig, device: torch.device,
) -> dict[str, float]:
    """Forward and backward every micro-batch of one optimizer step; gradients add up in .grad.

    Each micro-batch's summed per-pair loss is divided by the pair count of the whole step, so the
    accumulated gradient is that of the mean over the step's pairs however they are split. Returns the
    step's metrics: the loss, and the pair-weighted means of the loss function's metrics.
    """
    num_pairs_in_step = sum(len(indices) for _, indices in micro_batches)
    step_metrics: dict[str, float] = {}
    for batch, indices in micro_batches:
        batch = batch_to(batch, device)
        reference_logps = reference.logps(batch, indices, cfg.loss, cfg.trainer, device)
        loss, metrics = micro_batch_loss(policy, batch, reference_logps, cfg, loss_cfg, num_pairs_in_step, device)
        loss.backward()
        metrics["loss"] = loss.item()  # already divided by the step's pairs: these add up to the step's loss
        for key, value in metrics.items():
            weight = 1.0 if key == "loss" else len(indices) / num_pairs_in_step
            step_metrics[key] = step_metrics.get(key, 0.0) + weight * value
    return step_metrics


def train_dpo(cfg: DPOConfig) -> DPOResult:
    output_dir, changed_keys = prepare_output_dir(cfg, cfg.output_dir)
    configure_torch(cfg.trainer)
    seed_everything(cfg.seed)
    device = default_device()
    trainer = cfg.trainer
    loss_cfg = PreferenceLossConfig(**cfg.loss.model_dump(exclude={"average_logprobs"}))

    # Data first: a malformed row should fail before minutes go into loading a large model.
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    train_examples, train_stats = load_preference_examples(cfg.data.train_files, tokenizer, cfg.data)
    eval_examples: list[PreferenceExample] = []
    if cfg.data.eval_files:
        eval_examples, _ = load_preference_examples(cfg.data.eval_files, tokenizer, cfg.data)
        eval_examples = eval_examples[: cfg.data.max_eval_examples]

    resume = latest_checkpoint(output_dir)
    policy = load_causal_lm(cfg.model, path=resume.path if resume else None, device=device)
    policy.train()

    train_reference, eval_reference = Reference(), Reference()
    if not cfg.loss.reference_free:
        reference_model = load_reference_model(cfg, device)
        if cfg.reference == "frozen_copy":
            train_reference = eval_reference = Reference(model=reference_model)
        else:
            pad = tokenizer.pad_token_id
            train_reference = Reference(table=precompute_reference_logps(reference_model, train_examples, cfg, pad, device))
            if eval_examples:
                eval_reference = Reference(table=precompute_reference_logps(reference_model, eval_examples, cfg, pad,
                                                                            device))
            del reference_model

    optimizer = build_optimizer(policy, trainer)
    scheduler = build_scheduler(optimizer, trainer)
    sampler = EpochSampler(len(train_examples), seed=cfg.seed, shuffle=cfg.data.shuffle)
    start_step = resume_training(resume, optimizer, scheduler, sampler)

    pairs_per_step = trainer.micro_batch_size * trainer.gradient_accumulation_steps
    with RunLogger(output_dir, cfg.logging, recipe="dpo", total_steps=trainer.max_steps, start_step=start_step,
                   run_config=cfg.model_dump(mode="json")) as run_log:
        reference_note = "no reference (reference-free loss)" if cfg.loss.reference_free else f"reference {cfg.reference}"
        announce_run(run_log, train_stats.summary(), resume, changed_keys, policy,
                     f"{cfg.loss.type} with {reference_note}, {pairs_per_step} pairs per step "
                     f"({len(train_examples)} in the training set)")

        metrics: dict[str, float] = {}
        eval_metrics: dict[str, float] = {}
        for step in range(start_step + 1, trainer.max_steps + 1):
            started = time.perf_counter()
            micro_batches = []
            for _ in range(trainer.gradient_accumulation_steps):
                indices = sampler.next_indices(trainer.micro_batch_size)
                batch = collate_preference([train_examples[i] for i in indices], tokenizer.pad_token_id)
                micro_batches.append((batch, indices))
            learning_rate = scheduler.get_last_lr()[0]
            step_metrics = accumulate_gradients(policy, micro_batches, train_reference, cfg, loss_cfg, device)
            grad_norm = optimizer_step(policy, optimizer, scheduler, trainer.max_grad_norm)
            elapsed = time.perf_counter() - started

            metrics = {
                **step_metrics,
                "learning_rate": learning_rate,
                "grad_norm": grad_norm,
                "tokens_per_second": sum(batch.num_tokens for batch, _ in micro_batches) / elapsed,
                "step_seconds": elapsed,
                "epoch": sampler.epochs_completed,
            }
            if eval_examples and is_eval_step(step, trainer):
                eval_metrics = evaluate_preferences(policy, eval_examples, eval_reference, cfg, loss_cfg,
                                                    tokenizer.pad_token_id, device)
                metrics.update(eval_metrics)
            log_step(run_log, step, metrics, trainer)
            if is_save_step(step, trainer):
                save_checkpoint(output_dir, step, policy, tokenizer, optimizer, scheduler,
                                {"sampler": sampler.state_dict()}, trainer.keep_last)

        final_dir = export_final(output_dir, policy, tokenizer)
        run_log.message(f"final model: {final_dir}")
    return DPOResult(
        output_dir, final_dir, trainer.max_steps, metrics.get("loss"), metrics.get("reward_accuracy"),
        eval_metrics.get("eval_loss"), eval_metrics.get("eval_reward_accuracy"),
    )
