"""Supervised fine-tuning: next-token NLL on completion (or whole-text) tokens.

The loop, top to bottom: load config'd data and model, resume from the newest checkpoint if the
output directory has one, then for each optimizer step draw micro_batch_size x
gradient_accumulation_steps examples, normalize the loss by the target-token count of the whole
step, backward each micro-batch, clip, step, log, evaluate, checkpoint. At the end write
OUTPUT/final/ (a Hugging Face model directory). With lora.enabled only LoRA adapters train; checkpoints hold the
adapter, and the end writes it alone to OUTPUT/adapter/ and merged into the base model to OUTPUT/final/.
Evaluation sets (the `evaluation:` section) sample from the policy on their steps and log eval/<name>/<metric>
(algorithms/evaluate.py); without them nothing of the loop changes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.algorithms.common import (
    NonFiniteGuard,
    announce_run,
    epochs_note,
    chunks,
    configure_torch,
    export_policy,
    with_epochs_as_steps,
    is_eval_step,
    log_step,
    prepare_output_dir,
    resume_trainer_state,
    run_logger,
    save_if_due,
    seed_everything,
)
from posttrain.algorithms.evaluate import TrainingEvaluation
from posttrain.checkpoint import POLICY, checkpoint_to_resume
from posttrain.config.schema import SFTConfig
from posttrain.data import load_sft_examples
from posttrain.data.collate import collate
from posttrain.data.sampler import EpochSampler, check_step_fits
from posttrain.data.types import SFTBatch, TokenizedExample
from posttrain.errors import RunError
from posttrain.models.loading import custom_mask_problem_of, default_device, load_tokenizer
from posttrain.workers import PolicyWorker, as_floats, reduce_metrics
from posttrain.workers.objectives import NLLObjective
from posttrain.distributed.builders import build_policy, check_split
from posttrain.rundir import one_run_per_output_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTResult:
    output_dir: Path
    final_dir: Path
    steps: int
    final_loss: float | None
    eval_loss: float | None


def accumulate_gradients(policy: PolicyWorker, micro_batches: Sequence[SFTBatch]) -> tuple[float, int]:
    """Forward and backward one optimizer step's micro-batches (the policy divides them among its ranks);
    gradients add up until the optimizer step.

    Each micro-batch's summed NLL is divided by the target count of the whole step, so the accumulated
    gradient is that of the mean NLL per target token over the step, however the examples are split
    into micro-batches. Returns (that mean NLL, target tokens in the step).
    """
    step_targets = sum(mb.num_target_tokens for mb in micro_batches)
    if step_targets == 0:
        raise ValueError("an optimizer step drew no target tokens; check data.completion_only_loss and the data")
    return policy.forward_backward(list(micro_batches), NLLObjective())["loss"].value, step_targets


def evaluate_loss(policy: PolicyWorker, examples: Sequence[TokenizedExample], cfg: SFTConfig, pad_token_id: int) -> float:
    """Mean NLL per target token over `examples`."""
    totals = reduce_metrics(
        policy.evaluate(collate(group, pad_token_id, cfg.data.packing, cfg.data.max_length), NLLObjective())
        for group in chunks(list(examples), cfg.trainer.eval_batch_size)
    )
    return totals["nll_sum"].value / max(totals["target_tokens"].value, 1.0)


@one_run_per_output_dir
def train_sft(cfg: SFTConfig) -> SFTResult:
    configure_torch(cfg.trainer)
    output_dir, changed_keys = prepare_output_dir(cfg, cfg.output_dir)
    seed_everything(cfg.seed)
    device = default_device()
    trainer = cfg.trainer

    if cfg.data.packing:
        problem = custom_mask_problem_of(cfg.model, cfg.data.max_length)
        if problem:
            raise RunError(f"data.packing=true would not be exact: {problem}; set data.packing=false")
    # Data first: a malformed row should fail before minutes go into loading a large model.
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    train_examples, train_stats = load_sft_examples(cfg.data.train_files, tokenizer, cfg.data)
    cfg = with_epochs_as_steps(cfg, len(train_examples))
    trainer = cfg.trainer
    eval_examples: list[TokenizedExample] = []
    if cfg.data.eval_files:
        eval_examples, _ = load_sft_examples(cfg.data.eval_files, tokenizer, cfg.data)
        eval_examples = eval_examples[: cfg.data.max_eval_examples]
    check_step_fits(trainer, len(train_examples))
    evaluation = TrainingEvaluation(cfg.evaluation, tokenizer, trainer.max_steps, trainer.eval_batch_size)

    check_split(trainer)
    resume = checkpoint_to_resume(output_dir)
    policy = build_policy(cfg.model, cfg.lora, trainer, tokenizer, device,
                          resume_dir=resume.worker_dir(POLICY) if resume else None)
    sampler = EpochSampler(len(train_examples), seed=cfg.seed, shuffle=cfg.data.shuffle)
    start_step, _ = resume_trainer_state(resume, sampler)

    examples_per_step = trainer.micro_batch_size * trainer.gradient_accumulation_steps
    with run_logger(output_dir, cfg.logging, recipe="sft", total_steps=trainer.max_steps, start_step=start_step,
                   run_config=cfg.model_dump(mode="json")) as run_log, contextlib.closing(evaluation):
        announce_run(run_log, train_stats.summary(), resume, changed_keys, policy,
                     f"{examples_per_step} examples per step ({len(train_examples)} in the training set"
                     f"{epochs_note(trainer)})")

        loss, eval_loss = None, None
        guard = NonFiniteGuard(trainer, output_dir)
        for step in range(start_step + 1, trainer.max_steps + 1):
            started = time.perf_counter()
            micro_batches = [
                collate([train_examples[i] for i in sampler.next_indices(trainer.micro_batch_size)],
                        tokenizer.pad_token_id, cfg.data.packing, cfg.data.max_length)
                for _ in range(trainer.gradient_accumulation_steps)
            ]
            loss, target_tokens = accumulate_gradients(policy, micro_batches)
            update = as_floats(policy.optim_step())
            elapsed = time.perf_counter() - started

            metrics = {
                "loss": loss,
                "learning_rate": update["learning_rate"],
                "grad_norm": update["grad_norm"],
                "tokens_per_second": sum(mb.num_tokens for mb in micro_batches) / elapsed,
                "step_seconds": elapsed,
                "target_tokens": target_tokens,
                "epoch": sampler.epochs_completed,
                **{k: v for k, v in update.items() if k not in ("learning_rate", "grad_norm")},
            }
            guard.check(step, metrics)
            if eval_examples and is_eval_step(step, trainer):
                eval_loss = evaluate_loss(policy, eval_examples, cfg, tokenizer.pad_token_id)
                metrics["eval_loss"] = eval_loss
            if evaluation.is_due(step):
                metrics.update(evaluation.run_for_policy(step, policy, cfg.model, run_log))
            log_step(run_log, step, metrics, trainer)
            save_if_due(output_dir, step, trainer, {POLICY: policy}, sampler, run_log=run_log)

        final_dir = export_policy(output_dir, policy, run_log, cfg.hub)
    return SFTResult(output_dir, final_dir, trainer.max_steps, loss, eval_loss)
