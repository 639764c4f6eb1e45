"""Offline preference optimization (DPO and its family) against a frozen reference model.

The loop (algorithms/pairwise.py, shared with reward-model training): load the preference pairs and the policy
(with LoRA adapters if lora.enabled), resume from the newest checkpoint if the output directory has one, set up
the reference, then for each optimizer step draw micro_batch_size x gradient_accumulation_steps pairs; per
micro-batch run chosen and rejected sequences through the policy in ONE forward pass (by default one row per pair
holding the prompt once: data.preference.collate_shared_prompt), reduce token
log-probabilities to one per completion, take the preference loss normalized by the pair count of the whole
step, backward; clip, step, log, evaluate, checkpoint. At the end write OUTPUT/final/ (a Hugging Face model
directory; with LoRA also OUTPUT/adapter/).

The reference: a frozen copy of the starting model; or, with LoRA, the policy itself with its adapters switched
off (no second copy); or either one's log-probabilities of every pair computed once up front; none for the
reference-free simpo and orpo. It is always the starting model (model.name_or_path), also when resuming: a
checkpoint holds only the policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from posttrain.algorithms.common import autocast, batch_to, chunks, forward_logits
from posttrain.algorithms.pairwise import (
    PairBatch,
    PairCollate,
    PairLoss,
    PairRun,
    evaluate_pairs,
    start_pair_run,
    train_on_pairs,
)
from posttrain.config.schema import DPOConfig, PreferenceLossSection, TrainerConfig
from posttrain.data.preference import collate_preference, collate_shared_prompt
from posttrain.data.types import PreferenceExample, SharedPromptBatch
from posttrain.losses.nll import token_logprobs
from posttrain.losses.preference import (
    PreferenceLossConfig,
    preference_loss,
    sequence_logps,
)
from posttrain.models.loading import load_causal_lm, load_trainable_model
from posttrain.models.lora import adapters_disabled, is_lora_model

EVAL_METRICS = ("loss", "reward_accuracy", "margin", "chosen_reward", "rejected_reward")


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


def completion_logps(model: torch.nn.Module, batch: PairBatch, average: bool, trainer: TrainerConfig,
                     device: torch.device) -> CompletionLogps:
    """Score a batch of pairs with one forward pass: a `collate_preference` batch (chosen rows, then rejected
    rows) or a `collate_shared_prompt` one (one row per pair)."""
    with autocast(trainer, device):
        logits = forward_logits(model, batch)
    token_logps = token_logprobs(logits, batch.input_ids)
    if isinstance(batch, SharedPromptBatch):
        # Entry t holds log p(token t | logits at t - 1); the first rejected token instead follows the prompt.
        rows = torch.arange(batch.num_examples, device=logits.device)
        first_rejected = -F.cross_entropy(logits[rows, batch.prompt_ends].float(),
                                          batch.input_ids[rows, batch.rejected_starts], reduction="none")
        token_logps = token_logps.index_put((rows, batch.rejected_starts), first_rejected)
        chosen_logps = rejected_logps = token_logps
        chosen_mask, rejected_mask = batch.chosen_mask, batch.rejected_mask
    else:
        pairs = batch.input_ids.shape[0] // 2
        chosen_logps, rejected_logps = token_logps[:pairs], token_logps[pairs:]
        chosen_mask, rejected_mask = batch.loss_mask[:pairs], batch.loss_mask[pairs:]
    return CompletionLogps(
        sequence_logps(chosen_logps, chosen_mask, average), sequence_logps(rejected_logps, rejected_mask, average),
        chosen_mask.sum(-1), rejected_mask.sum(-1), -sequence_logps(chosen_logps, chosen_mask, average=True),
    )


def pair_collate(cfg: DPOConfig) -> PairCollate:
    """How pairs become batches: one shared-prompt row per pair, or two rows (cfg.share_prompt)."""
    return collate_shared_prompt if cfg.shares_prompt else collate_preference


def load_reference_model(cfg: DPOConfig, device: torch.device) -> torch.nn.Module:
    """The starting model, frozen: eval mode, no gradients."""
    reference = load_causal_lm(cfg.model, device=device)
    reference.eval()
    reference.requires_grad_(False)
    return reference


@torch.no_grad()
def precompute_reference_logps(
    reference: torch.nn.Module, examples: Sequence[PreferenceExample], cfg: DPOConfig, pad_token_id: int,
    device: torch.device, adapters_off: bool = False,
) -> torch.Tensor:
    """[N, 2] reference log-probabilities (chosen, rejected) of every pair, in batches of trainer.eval_batch_size
    (with `adapters_off`, of the LoRA model `reference` with its adapters switched off)."""
    rows = []
    for group in chunks(list(examples), cfg.trainer.eval_batch_size):
        batch = batch_to(pair_collate(cfg)(group, pad_token_id), device)
        scores = reference_scores(reference, batch, cfg.loss.average_logprobs, cfg.trainer, device, adapters_off)
        rows.append(torch.stack([scores.chosen, scores.rejected], dim=1).cpu())
    return torch.cat(rows)


class Reference:
    """Where reference log-probabilities come from: a frozen model (with `adapters_off`, the LoRA policy itself with
    its adapters switched off), a precomputed table indexed by pair, or nowhere (reference-free losses).
    `logps` returns ([B] chosen, [B] rejected) or (None, None)."""

    def __init__(self, model: torch.nn.Module | None = None, table: torch.Tensor | None = None,
                 adapters_off: bool = False):
        self.model, self.table, self.adapters_off = model, table, adapters_off

    @torch.no_grad()
    def logps(self, batch: PairBatch, indices: Sequence[int], loss: PreferenceLossSection, trainer: TrainerConfig,
              device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.model is not None:
            scores = reference_scores(self.model, batch, loss.average_logprobs, trainer, device, self.adapters_off)
            return scores.chosen, scores.rejected
        if self.table is not None:
            rows = self.table[list(indices)].to(device)
            return rows[:, 0], rows[:, 1]
        return None, None


def reference_scores(model: torch.nn.Module, batch: PairBatch, average: bool, trainer: TrainerConfig,
                     device: torch.device, adapters_off: bool) -> CompletionLogps:
    """`completion_logps` of the reference: `model` in eval mode, as its frozen base if `adapters_off`."""
    was_training = model.training
    model.eval()
    with adapters_disabled(model) if adapters_off else contextlib.nullcontext():
        scores = completion_logps(model, batch, average, trainer, device)
    model.train(was_training)
    return scores


def preference_pair_loss(policy: torch.nn.Module, reference: Reference, cfg: DPOConfig,
                         loss_cfg: PreferenceLossConfig, device: torch.device) -> PairLoss:
    """The preference loss of a micro-batch of pairs (summed over its pairs / the step's pair count)."""

    def pair_loss(batch: PairBatch, indices: Sequence[int], num_pairs_in_step: float | None):
        reference_logps = reference.logps(batch, indices, cfg.loss, cfg.trainer, device)
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

    return pair_loss


def build_references(cfg: DPOConfig, run: PairRun, policy: torch.nn.Module) -> tuple[Reference, Reference]:
    """The (training, evaluation) references. Reference-free losses: none. LoRA: the policy with adapters off
    (scored every batch, or once up front for `precomputed`). Otherwise a frozen copy of the starting model, kept
    (frozen_copy) or used once to fill the tables and freed (precomputed)."""
    if cfg.loss.reference_free:
        return Reference(), Reference()
    lora = is_lora_model(policy)
    if cfg.reference == "frozen_copy":
        reference = Reference(model=policy, adapters_off=True) if lora else Reference(model=load_reference_model(cfg, run.device))
        return reference, reference
    model = policy if lora else load_reference_model(cfg, run.device)

    def table(examples: Sequence[PreferenceExample]) -> Reference:
        return Reference(table=precompute_reference_logps(model, examples, cfg, run.tokenizer.pad_token_id,
                                                          run.device, adapters_off=lora))

    return table(run.train_examples), table(run.eval_examples) if run.eval_examples else Reference()


def train_dpo(cfg: DPOConfig) -> DPOResult:
    run = start_pair_run(cfg)
    loss_cfg = PreferenceLossConfig(**cfg.loss.model_dump(exclude={"average_logprobs"}))
    policy = load_trainable_model(cfg.model, cfg.lora, run.resume.path if run.resume else None, run.device)
    train_reference, eval_reference = build_references(cfg, run, policy)

    evaluate = None
    if run.eval_examples:
        eval_loss = preference_pair_loss(policy, eval_reference, cfg, loss_cfg, run.device)

        def evaluate() -> dict[str, float]:
            return evaluate_pairs(policy, run.eval_examples, eval_loss, EVAL_METRICS, cfg.trainer.eval_batch_size,
                                  run.tokenizer.pad_token_id, run.device, pair_collate(cfg))

    if cfg.loss.reference_free:
        reference_note = "no reference (reference-free loss)"
    elif is_lora_model(policy):
        reference_note = f"reference {cfg.reference}: the base model with the LoRA adapters off"
    else:
        reference_note = f"reference {cfg.reference}"
    layout = "one shared-prompt row per pair" if cfg.shares_prompt else "chosen and rejected rows"
    metrics, eval_metrics, final_dir = train_on_pairs(
        run, cfg, policy, "dpo", f"{cfg.loss.type} with {reference_note}, {layout}",
        preference_pair_loss(policy, train_reference, cfg, loss_cfg, run.device), evaluate, pair_collate(cfg),
    )
    return DPOResult(
        run.output_dir, final_dir, cfg.trainer.max_steps, metrics.get("loss"), metrics.get("reward_accuracy"),
        eval_metrics.get("eval_loss"), eval_metrics.get("eval_reward_accuracy"),
    )
