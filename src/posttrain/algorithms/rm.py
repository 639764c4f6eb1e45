"""Reward-model training: a scalar head on a language-model backbone, Bradley-Terry loss on preference pairs.

The model is AutoModelForSequenceClassification with num_labels=1 loaded from model.name_or_path: from a causal
LM checkpoint its backbone weights load and the score head starts fresh; it reads the hidden state of each row's
last non-pad token (the end of the completion). The loop (algorithms/pairwise.py, shared with DPO): per
micro-batch, chosen and rejected sequences go through the model in ONE forward pass, giving a reward r_c and r_r
per pair; the loss is −log σ(r_c − r_r [− margin]) (+ the optional centering term), normalized by the pair count
of the whole optimizer step. OUTPUT/final/ loads with AutoModelForSequenceClassification and scores text through
posttrain.models.reward.RewardModel; with lora.enabled the adapter (and the trained score head) is also written
alone to OUTPUT/adapter/.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.algorithms.common import autocast
from posttrain.algorithms.pairwise import (
    PairLoss,
    evaluate_pairs,
    start_pair_run,
    train_on_pairs,
)
from posttrain.config.schema import RMConfig, TrainerConfig
from posttrain.data.errors import DataError
from posttrain.data.types import PreferenceExample, SFTBatch
from posttrain.losses.reward_model import bradley_terry_loss
from posttrain.models.loading import load_trainable_model

EVAL_METRICS = ("loss", "accuracy", "margin", "chosen_reward", "rejected_reward")


@dataclass(frozen=True)
class RMResult:
    output_dir: Path
    final_dir: Path
    steps: int
    final_loss: float | None
    final_accuracy: float | None
    eval_loss: float | None
    eval_accuracy: float | None


def sequence_rewards(model: torch.nn.Module, batch: SFTBatch, trainer: TrainerConfig, device: torch.device) -> torch.Tensor:
    """[rows] scalar rewards of a right-padded batch, in float32."""
    with autocast(trainer, device):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                       use_cache=False).logits
    return logits.squeeze(-1).float()


def check_margins(examples: Sequence[PreferenceExample]) -> None:
    """loss.use_margin needs a `margin` on every pair; name the first row without one."""
    for example in examples:
        if example.margin is None:
            raise DataError(example.source, "missing, but loss.use_margin=true needs a margin on every pair", "margin")


def reward_pair_loss(model: torch.nn.Module, examples: Sequence[PreferenceExample], cfg: RMConfig,
                     device: torch.device) -> PairLoss:
    """Bradley-Terry loss of a micro-batch of pairs (indices into `examples`, for their margins)."""

    def pair_loss(batch: SFTBatch, indices: Sequence[int], num_pairs_in_step: float | None):
        rewards = sequence_rewards(model, batch, cfg.trainer, device)
        pairs = len(indices)
        margin = None
        if cfg.loss.use_margin:
            margin = torch.tensor([examples[i].margin for i in indices], dtype=rewards.dtype, device=device)
        return bradley_terry_loss(rewards[:pairs], rewards[pairs:], margin, num_pairs_in_step,
                                  center_rewards_coefficient=cfg.loss.center_rewards_coefficient)

    return pair_loss


def train_rm(cfg: RMConfig) -> RMResult:
    run = start_pair_run(cfg)
    if cfg.loss.use_margin:
        check_margins(run.train_examples)
        check_margins(run.eval_examples)
    model = load_trainable_model(cfg.model, cfg.lora, run.resume.path if run.resume else None, run.device,
                                 task="reward", pad_token_id=run.tokenizer.pad_token_id)

    evaluate = None
    if run.eval_examples:
        eval_loss = reward_pair_loss(model, run.eval_examples, cfg, run.device)

        def evaluate() -> dict[str, float]:
            return evaluate_pairs(model, run.eval_examples, eval_loss, EVAL_METRICS, cfg.trainer.eval_batch_size,
                                  run.tokenizer.pad_token_id, run.device)

    what = "Bradley-Terry reward model" + (" with per-pair margins" if cfg.loss.use_margin else "")
    metrics, eval_metrics, final_dir = train_on_pairs(
        run, cfg, model, "rm", what, reward_pair_loss(model, run.train_examples, cfg, run.device), evaluate,
    )
    return RMResult(
        run.output_dir, final_dir, cfg.trainer.max_steps, metrics.get("loss"), metrics.get("accuracy"),
        eval_metrics.get("eval_loss"), eval_metrics.get("eval_accuracy"),
    )
