"""Offline preference optimization (DPO and its family) against a frozen reference model.

The loop (algorithms/pairwise.py, shared with reward-model training): load the preference pairs and the policy
(with LoRA adapters if lora.enabled), resume from the newest checkpoint if the output directory has one, set up
the reference, then for each optimizer step draw micro_batch_size x gradient_accumulation_steps pairs; per
micro-batch run chosen and rejected sequences through the policy in ONE forward pass (by default one row per pair
holding the prompt once: data.preference.collate_shared_prompt), reduce token
log-probabilities to one per completion, take the preference loss normalized by the pair count of the whole
step, backward; clip, step, log, evaluate, checkpoint. With final_interpolation other than 1, the weights become
start + final_interpolation·(trained − start) right after the last step, before its evaluation and checkpoint.
At the end write OUTPUT/final/ (a Hugging Face model directory; with LoRA also OUTPUT/adapter/).

The reference: a frozen copy of the starting model; or, with LoRA, the policy itself with its adapters switched
off (no second copy); or either one's log-probabilities of every pair computed once up front; none for the
reference-free simpo and orpo. It is always the starting model (model.name_or_path), also when resuming: a
checkpoint holds only the policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml

from posttrain.algorithms.common import CONFIG_FILE, chunks
from posttrain.algorithms.evaluate import TrainingEvaluation
from posttrain.algorithms.pairwise import (
    PairCollate,
    PairInputs,
    PairRows,
    PairRun,
    evaluate_pairs,
    start_pair_run,
    train_on_pairs,
)
from posttrain.checkpoint import POLICY, latest_checkpoint
from posttrain.config.schema import DPOConfig, ModelConfig
from posttrain.data.preference import collate_preference, collate_shared_prompt, rejected_through_first_difference
from posttrain.data.sampler import check_step_fits
from posttrain.data.types import PairBatch, PreferenceExample
from posttrain.losses.preference import PreferenceLossConfig
from posttrain.workers import PolicyWorker, ScoringWorker
from posttrain.rundir import one_run_per_output_dir
from posttrain.distributed.builders import build_policy, build_scorer
from posttrain.errors import RunError
from posttrain.models.loading import custom_mask_problem_of
from posttrain.workers.objectives import PreferenceObjective, completion_logps

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


def pair_collate(cfg: DPOConfig) -> PairCollate:
    """How pairs become batches: one shared-prompt row per pair, or two rows (cfg.share_prompt)."""
    return collate_shared_prompt if cfg.shares_prompt else collate_preference


def resolve_share_prompt(cfg: DPOConfig) -> DPOConfig:
    """`cfg`, with share_prompt off when it was left to its default and the architecture's masks are not verified
    exact (models/packing.py); an explicit share_prompt=true on such an architecture is an error."""
    if not cfg.shares_prompt:
        return cfg
    problem = custom_mask_problem_of(cfg.model, cfg.data.max_length)
    if problem is None:
        return cfg
    if cfg.share_prompt:
        raise RunError(f"share_prompt=true would not be exact: {problem}; set share_prompt=false")
    return cfg.model_copy(update={"share_prompt": False})


def load_reference_model(cfg: DPOConfig, device: torch.device) -> ScoringWorker:
    """The starting model, frozen: eval mode, no gradients."""
    return build_scorer(cfg.model, cfg.trainer, device, role="reference")


def precompute_reference_logps(reference: ScoringWorker, examples: Sequence[PreferenceExample], cfg: DPOConfig,
                               pad_token_id: int) -> torch.Tensor:
    """[N, 2] reference log-probabilities (chosen, rejected) of every pair, in batches of trainer.eval_batch_size."""
    rows = []
    for group in chunks(list(examples), cfg.trainer.eval_batch_size):
        batch = pair_collate(cfg)(group, pad_token_id)
        scores = completion_logps(reference.logprobs(batch), batch, cfg.loss.average_logprobs)
        rows.append(torch.stack([scores.chosen, scores.rejected], dim=1))
    return torch.cat(rows)


class Reference:
    """Where reference log-probabilities come from: a frozen scoring worker (with LoRA, the policy's base), a
    precomputed table indexed by pair, or nowhere (reference-free losses). `logps` returns ([B] chosen, [B]
    rejected) on the CPU, or (None, None)."""

    def __init__(self, scorer: ScoringWorker | None = None, table: torch.Tensor | None = None):
        self.scorer, self.table = scorer, table

    def logps(self, batch: PairRows, indices: Sequence[int], average: bool
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.scorer is not None:
            scores = completion_logps(self.scorer.logprobs(batch), batch, average)
            return scores.chosen, scores.rejected
        if self.table is not None:
            rows = self.table[list(indices)]
            return rows[:, 0], rows[:, 1]
        return None, None


def reference_inputs(reference: Reference, average_logprobs: bool) -> PairInputs:
    """The PairInputs of a preference loss: each micro-batch's rows with their reference log-probabilities."""

    def inputs(rows: PairRows, indices: Sequence[int]) -> PairBatch:
        chosen, rejected = reference.logps(rows, indices, average_logprobs)
        return PairBatch(rows, chosen, rejected)

    return inputs


def build_references(cfg: DPOConfig, run: PairRun, policy: PolicyWorker) -> tuple[Reference, Reference]:
    """The (training, evaluation) references. Reference-free losses: none. LoRA: the policy with adapters off
    (scored every batch, or once up front for `precomputed`). Otherwise a frozen copy of the starting model, kept
    (frozen_copy) or used once to fill the tables and freed (precomputed)."""
    if cfg.loss.reference_free:
        return Reference(), Reference()
    scorer = policy.base_model_scorer() or load_reference_model(cfg, run.device)
    if cfg.reference == "frozen_copy":
        return Reference(scorer), Reference(scorer)

    def table(examples: Sequence[PreferenceExample]) -> Reference:
        return Reference(table=precompute_reference_logps(scorer, examples, cfg, run.tokenizer.pad_token_id))

    return table(run.train_examples), table(run.eval_examples) if run.eval_examples else Reference()


def refuse_reinterpolating(cfg: DPOConfig) -> None:
    """A finished run's last checkpoint already holds its interpolated weights: re-running it with another
    final_interpolation would resume there, train nothing and apply nothing. Refused before any file changes."""
    output_dir = Path(cfg.output_dir)
    previous = output_dir / CONFIG_FILE
    if not previous.is_file():
        return
    before = (yaml.safe_load(previous.read_text()) or {}).get("final_interpolation", 1.0)
    last = latest_checkpoint(output_dir)
    if before != cfg.final_interpolation and last is not None and last.step >= cfg.trainer.max_steps:
        raise RunError(f"{output_dir} finished with final_interpolation {before:g}, and its last checkpoint holds those "
                       f"weights; {cfg.final_interpolation:g} cannot be applied to them. Train into a new output_dir "
                       f"(or run with final_interpolation={before:g} to export it again)")


@one_run_per_output_dir
def train_dpo(cfg: DPOConfig) -> DPOResult:
    refuse_reinterpolating(cfg)
    run = start_pair_run(cfg)
    cfg = run.cfg
    if cfg.loss.truncate_rejected:
        run = replace(run, train_examples=[rejected_through_first_difference(pair) for pair in run.train_examples])
    # After start_pair_run: rank 0 has built an embedded model there before any rank reads its config.
    cfg = resolve_share_prompt(cfg)
    check_step_fits(cfg.trainer, len(run.train_examples), "training pairs")
    loss = PreferenceObjective(cfg.loss)
    # Evaluation sets' prompts and environments before the model: their errors, too, come before minutes of loading.
    evaluation = TrainingEvaluation(cfg.evaluation, run.tokenizer, cfg.trainer.max_steps, cfg.trainer.eval_batch_size)
    with contextlib.closing(evaluation):
        policy = build_policy(cfg.model, cfg.lora, cfg.trainer, run.tokenizer, run.device,
                              resume_dir=run.resume.worker_dir(POLICY) if run.resume else None)
        if cfg.final_interpolation != 1.0 and (problem := policy.interpolation_problem()):
            raise RunError(f"final_interpolation={cfg.final_interpolation:g}: {problem}")
        train_reference, eval_reference = build_references(cfg, run, policy)

        evaluate = None
        if run.eval_examples:
            def evaluate() -> dict[str, float]:
                return evaluate_pairs(policy, run.eval_examples, loss,
                                      reference_inputs(eval_reference, cfg.loss.average_logprobs), EVAL_METRICS,
                                      cfg.trainer.eval_batch_size, run.tokenizer.pad_token_id, pair_collate(cfg))

        if cfg.loss.reference_free:
            reference_note = "no reference (reference-free loss)"
        elif policy.base_model_scorer() is not None:
            reference_note = f"reference {cfg.reference}: the base model with the LoRA adapters off"
        else:
            reference_note = f"reference {cfg.reference}"
        layout = "one shared-prompt row per pair" if cfg.shares_prompt else "chosen and rejected rows"
        if cfg.loss.truncate_rejected:
            layout += ", training rejected completions cut after their first wrong token"
        after_last_step = None
        if cfg.final_interpolation != 1.0:
            layout += f", final weights start + {cfg.final_interpolation:g}·(trained − start)"

            def after_last_step() -> None:
                policy.interpolate_toward_start(cfg.final_interpolation, cfg.model)
        metrics, eval_metrics, final_dir = train_on_pairs(
            run, cfg, policy, "dpo", f"{cfg.loss.type} with {reference_note}, {layout}",
            loss, reference_inputs(train_reference, cfg.loss.average_logprobs), evaluate, pair_collate(cfg),
            evaluation, after_last_step=after_last_step,
        )
    return DPOResult(
        run.output_dir, final_dir, cfg.trainer.max_steps, metrics.get("loss"), metrics.get("reward_accuracy"),
        eval_metrics.get("eval_loss"), eval_metrics.get("eval_reward_accuracy"),
    )
