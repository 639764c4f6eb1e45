"""Supervised fine-tuning: next-token NLL on completion (or whole-text) tokens.

The loop, top to bottom: load config'd data and model, resume from the newest checkpoint if the
output directory has one, then for each optimizer step draw micro_batch_size x
gradient_accumulation_steps examples, normalize the loss by the target-token count of the whole
step, backward each micro-batch, clip, step, log, evaluate, checkpoint. At the end write
OUTPUT/final/ (a Hugging Face model directory). With lora.enabled only LoRA adapters train; checkpoints hold the
adapter, and the end writes it alone to OUTPUT/adapter/ and merged into the base model to OUTPUT/final/.
"""

from __future__ import annotations

import logging
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
    export_model,
    forward_logits,
    is_eval_step,
    is_save_step,
    log_step,
    optimizer_step,
    prepare_output_dir,
    resume_training,
    seed_everything,
)
from posttrain.checkpoint import latest_checkpoint, save_checkpoint
from posttrain.config.schema import SFTConfig, TrainerConfig
from posttrain.data import load_sft_examples
from posttrain.data.collate import collate
from posttrain.data.sampler import EpochSampler
from posttrain.data.types import SFTBatch, TokenizedExample
from posttrain.logging import RunLogger
from posttrain.losses.nll import nll_loss
from posttrain.models.loading import (
    default_device,
    load_tokenizer,
    load_trainable_model,
)
from posttrain.optim import build_optimizer, build_scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTResult:
    output_dir: Path
    final_dir: Path
    steps: int
    final_loss: float | None
    eval_loss: float | None


def accumulate_gradients(
    model: torch.nn.Module, micro_batches: Sequence[SFTBatch], trainer: TrainerConfig, device: torch.device
) -> tuple[float, int]:
    """Forward and backward every micro-batch of one optimizer step; gradients add up in .grad.

    Each micro-batch's summed NLL is divided by the target count of the whole step, so the accumulated
    gradient is that of the mean NLL per target token over the step, however the examples are split
    into micro-batches. Returns (that mean NLL, target tokens in the step).
    """
    step_targets = sum(mb.num_target_tokens for mb in micro_batches)
    if step_targets == 0:
        raise ValueError("an optimizer step drew no target tokens; check data.completion_only_loss and the data")
    step_loss = 0.0
    for micro_batch in micro_batches:
        micro_batch = batch_to(micro_batch, device)
        with autocast(trainer, device):
            logits = forward_logits(model, micro_batch)
        loss, _ = nll_loss(logits, micro_batch.input_ids, micro_batch.loss_mask, step_targets)
        loss.backward()
        step_loss += loss.item()
    return step_loss, step_targets


@torch.no_grad()
def evaluate_loss(
    model: torch.nn.Module, examples: Sequence[TokenizedExample], cfg: SFTConfig, pad_token_id: int, device: torch.device
) -> float:
    """Mean NLL per target token over `examples`."""
    was_training = model.training
    model.eval()
    nll_sum, targets = 0.0, 0.0
    for group in chunks(list(examples), cfg.trainer.eval_batch_size):
        batch = batch_to(collate(group, pad_token_id, cfg.data.packing, cfg.data.max_length), device)
        with autocast(cfg.trainer, device):
            logits = forward_logits(model, batch)
        _, metrics = nll_loss(logits, batch.input_ids, batch.loss_mask, 1.0)
        nll_sum += metrics["nll_sum"]
        targets += metrics["target_tokens"]
    model.train(was_training)
    return nll_sum / max(targets, 1.0)


def train_sft(cfg: SFTConfig) -> SFTResult:
    output_dir, changed_keys = prepare_output_dir(cfg, cfg.output_dir)
    configure_torch(cfg.trainer)
    seed_everything(cfg.seed)
    device = default_device()
    trainer = cfg.trainer

    # Data first: a malformed row should fail before minutes go into loading a large model.
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    train_examples, train_stats = load_sft_examples(cfg.data.train_files, tokenizer, cfg.data)
    eval_examples: list[TokenizedExample] = []
    if cfg.data.eval_files:
        eval_examples, _ = load_sft_examples(cfg.data.eval_files, tokenizer, cfg.data)
        eval_examples = eval_examples[: cfg.data.max_eval_examples]

    resume = latest_checkpoint(output_dir)
    model = load_trainable_model(cfg.model, cfg.lora, resume.path if resume else None, device)
    model.train()
    optimizer = build_optimizer(model, trainer)
    scheduler = build_scheduler(optimizer, trainer)
    sampler = EpochSampler(len(train_examples), seed=cfg.seed, shuffle=cfg.data.shuffle)
    start_step = resume_training(resume, optimizer, scheduler, sampler)

    examples_per_step = trainer.micro_batch_size * trainer.gradient_accumulation_steps
    with RunLogger(output_dir, cfg.logging, recipe="sft", total_steps=trainer.max_steps, start_step=start_step,
                   run_config=cfg.model_dump(mode="json")) as run_log:
        announce_run(run_log, train_stats.summary(), resume, changed_keys, model,
                     f"{examples_per_step} examples per step ({len(train_examples)} in the training set)")

        loss, eval_loss = None, None
        for step in range(start_step + 1, trainer.max_steps + 1):
            started = time.perf_counter()
            micro_batches = [
                collate([train_examples[i] for i in sampler.next_indices(trainer.micro_batch_size)],
                        tokenizer.pad_token_id, cfg.data.packing, cfg.data.max_length)
                for _ in range(trainer.gradient_accumulation_steps)
            ]
            learning_rate = scheduler.get_last_lr()[0]
            loss, target_tokens = accumulate_gradients(model, micro_batches, trainer, device)
            grad_norm = optimizer_step(model, optimizer, scheduler, trainer.max_grad_norm)
            elapsed = time.perf_counter() - started

            metrics = {
                "loss": loss,
                "learning_rate": learning_rate,
                "grad_norm": grad_norm,
                "tokens_per_second": sum(mb.num_tokens for mb in micro_batches) / elapsed,
                "step_seconds": elapsed,
                "target_tokens": target_tokens,
                "epoch": sampler.epochs_completed,
            }
            if eval_examples and is_eval_step(step, trainer):
                eval_loss = evaluate_loss(model, eval_examples, cfg, tokenizer.pad_token_id, device)
                metrics["eval_loss"] = eval_loss
            log_step(run_log, step, metrics, trainer)
            if is_save_step(step, trainer):
                save_checkpoint(output_dir, step, model, tokenizer, optimizer, scheduler,
                                {"sampler": sampler.state_dict()}, trainer.keep_last)

        final_dir = export_model(output_dir, model, tokenizer, run_log)
    return SFTResult(output_dir, final_dir, trainer.max_steps, loss, eval_loss)

