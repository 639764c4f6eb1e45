"""Reward-model training: a scalar head on a language-model backbone, Bradley-Terry loss on preference pairs.

The model is AutoModelForSequenceClassification with num_labels=1 loaded from model.name_or_path (for an
architecture transformers has no sequence classifier for, such as Granite, the same scalar head over its base
model: posttrain.models.value_head). From a causal LM checkpoint its backbone weights load and the score head
starts fresh; it reads the hidden state of each row's last non-pad token (the end of the completion). The loop
(algorithms/pairwise.py, shared with DPO): per micro-batch, chosen and rejected sequences go through the model in
ONE forward pass, giving a reward r_c and r_r per pair; the loss is −log σ(r_c − r_r [− margin]) (+ the optional
centering term), normalized by the pair count of the whole optimizer step. OUTPUT/final/ loads with
AutoModelForSequenceClassification (where transformers has the class) and scores text through
posttrain.workers.reward_model.RewardModel (any architecture); with lora.enabled the adapter (and the trained score
head) is also written alone to OUTPUT/adapter/.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.algorithms.pairwise import (
    PairInputs,
    PairRows,
    evaluate_pairs,
    plain_pairs,
    start_pair_run,
    train_on_pairs,
)
from posttrain.checkpoint import POLICY
from posttrain.config.schema import RMConfig
from posttrain.data.errors import DataError
from posttrain.data.sampler import check_step_fits
from posttrain.data.types import PairBatch, PreferenceExample
from posttrain.workers.objectives import BradleyTerryObjective
from posttrain.rundir import one_run_per_output_dir
from posttrain.distributed.builders import build_policy

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


def check_margins(examples: Sequence[PreferenceExample]) -> None:
    """loss.use_margin needs a `margin` on every pair; name the first row without one."""
    for example in examples:
        if example.margin is None:
            raise DataError(example.source, "missing, but loss.use_margin=true needs a margin on every pair", "margin")


def margin_inputs(examples: Sequence[PreferenceExample]) -> PairInputs:
    """The PairInputs of a margin loss: each micro-batch's rows with their pairs' margins (indices into
    `examples`)."""

    def inputs(rows: PairRows, indices: Sequence[int]) -> PairBatch:
        return PairBatch(rows, margins=torch.tensor([examples[i].margin for i in indices], dtype=torch.float32))

    return inputs


@one_run_per_output_dir
def train_rm(cfg: RMConfig) -> RMResult:
    run = start_pair_run(cfg)
    cfg = run.cfg
    if cfg.loss.use_margin:
        check_margins(run.train_examples)
        check_margins(run.eval_examples)
    check_step_fits(cfg.trainer, len(run.train_examples), "training pairs")
    policy = build_policy(cfg.model, cfg.lora, cfg.trainer, run.tokenizer, run.device, task="reward",
                          resume_dir=run.resume.worker_dir(POLICY) if run.resume else None)

    # Bradley-Terry on the model's [2B, 1] scores, chosen rows then rejected rows.
    loss = BradleyTerryObjective(cfg.loss.use_margin, cfg.loss.center_rewards_coefficient)

    def pair_inputs(examples: Sequence[PreferenceExample]) -> PairInputs:
        return margin_inputs(examples) if cfg.loss.use_margin else plain_pairs

    evaluate = None
    if run.eval_examples:
        def evaluate() -> dict[str, float]:
            return evaluate_pairs(policy, run.eval_examples, loss, pair_inputs(run.eval_examples), EVAL_METRICS,
                                  cfg.trainer.eval_batch_size, run.tokenizer.pad_token_id)

    what = "Bradley-Terry reward model" + (" with per-pair margins" if cfg.loss.use_margin else "")
    metrics, eval_metrics, final_dir = train_on_pairs(
        run, cfg, policy, "rm", what, loss, pair_inputs(run.train_examples), evaluate,
    )
    return RMResult(
        run.output_dir, final_dir, cfg.trainer.max_steps, metrics.get("loss"), metrics.get("accuracy"),
        eval_metrics.get("eval_loss"), eval_metrics.get("eval_accuracy"),
    )
