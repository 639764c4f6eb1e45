"""The loop that DPO (algorithms/dpo.py) and reward-model training (algorithms/rm.py) share.

Both train on (prompt, chosen, rejected) pairs: load the pairs, build the policy worker (or resume it), then for
each optimizer step draw micro_batch_size x gradient_accumulation_steps pairs, collate each micro-batch as ONE
batch (2B rows, chosen then rejected; or, for DPO's shared prompt, B rows of prompt + chosen + rejected), take the
recipe's loss normalized by the pair count of the whole step, backward; clip, step, log, evaluate, checkpoint; at
the end export the final model. The recipe supplies only its loss description (workers/objectives.py) and what
each micro-batch of pairs carries for it (`PairInputs`: the reference's log-probabilities, margins).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from posttrain.algorithms.common import (
    NonFiniteGuard,
    announce_run,
    epochs_note,
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
from posttrain.checkpoint import POLICY, Checkpoint, checkpoint_to_resume
from posttrain.config.schema import RecipeConfig
from posttrain.data.dataset import DataStats
from posttrain.distributed.builders import check_split
from posttrain.data.preference import collate_preference, load_preference_examples
from posttrain.data.sampler import EpochSampler
from posttrain.data.types import PairBatch, PreferenceExample, SFTBatch, SharedPromptBatch
from posttrain.models.loading import default_device, load_tokenizer
from posttrain.workers import PolicyWorker, as_floats, reduce_metrics
from posttrain.workers.objectives import Objective

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from posttrain.algorithms.evaluate import TrainingEvaluation

PairRows = SFTBatch | SharedPromptBatch
PairCollate = Callable[[Sequence[PreferenceExample], int], PairRows]
"""(pairs, pad token id) -> one batch of them: collate_preference or collate_shared_prompt."""

PairInputs = Callable[[PairRows, Sequence[int]], PairBatch]
"""(the collated rows of B pairs; the pairs' indices in their example list) -> the PairBatch the loss reads: the rows
with what the loss needs per pair from other workers or the data (reference log-probabilities, margins), fetched
here, before the policy's pass."""


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
    cfg: RecipeConfig
    """The recipe's config, trainer.max_steps derived from trainer.num_epochs when that is set."""


def start_pair_run(cfg: RecipeConfig) -> PairRun:
    """Output directory, torch settings, seed, tokenizer, the pairs (before any model: a malformed row should
    fail before minutes go into loading a large model) and the checkpoint to resume from, if any."""
    configure_torch(cfg.trainer)
    check_split(cfg.trainer)
    output_dir, changed_keys = prepare_output_dir(cfg, cfg.output_dir)
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    train_examples, train_stats = load_preference_examples(cfg.data.train_files, tokenizer, cfg.data)
    eval_examples: list[PreferenceExample] = []
    if cfg.data.eval_files:
        eval_examples, _ = load_preference_examples(cfg.data.eval_files, tokenizer, cfg.data)
        eval_examples = eval_examples[: cfg.data.max_eval_examples]
    return PairRun(output_dir, changed_keys, default_device(), tokenizer, train_examples, train_stats, eval_examples,
                   checkpoint_to_resume(output_dir), with_epochs_as_steps(cfg, len(train_examples)))


def plain_pairs(rows: PairRows, indices: Sequence[int]) -> PairBatch:
    """The PairInputs of a loss that reads nothing but the policy's outputs."""
    return PairBatch(rows)


def evaluate_pairs(policy: PolicyWorker, examples: Sequence[PreferenceExample], loss: Objective,
                   pair_inputs: PairInputs, keys: Sequence[str], batch_size: int, pad_token_id: int,
                   collate: PairCollate = collate_preference) -> dict[str, float]:
    """Pair-weighted means of the metrics `keys` over `examples`, named eval_<key>; the model in eval mode."""
    records = []
    for start in range(0, len(examples), batch_size):
        indices = list(range(start, min(start + batch_size, len(examples))))
        records.append(policy.evaluate(pair_inputs(collate([examples[i] for i in indices], pad_token_id), indices),
                                       loss))
    totals = as_floats(reduce_metrics(records))
    return {f"eval_{key}": totals[key] for key in keys}


def train_on_pairs(run: PairRun, cfg: RecipeConfig, policy: PolicyWorker, recipe: str, what: str,
                   loss: Objective, pair_inputs: PairInputs, evaluate: Callable[[], dict[str, float]] | None,
                   collate: PairCollate = collate_preference,
                   evaluation: TrainingEvaluation | None = None,
                   after_last_step: Callable[[], None] | None = None) -> tuple[dict, dict, Path]:
    """The optimization loop; returns (last step's metrics, last evaluation's metrics, OUTPUT/final).
    `evaluation`: evaluation sets sampled from the policy on their steps (DPO's `evaluation:` section).
    `after_last_step`: called once after the last optimizer step, before that step's evaluation and checkpoint
    (so a run resumed from its last checkpoint neither repeats it nor loses it).
    `loss`: the recipe's loss description, normalized by the pair count of the whole step; `pair_inputs` builds
    each micro-batch's PairBatch (what the loss reads per pair besides the policy's outputs)."""
    trainer = cfg.trainer
    tokenizer = run.tokenizer
    sampler = EpochSampler(len(run.train_examples), seed=cfg.seed, shuffle=cfg.data.shuffle)
    start_step, _ = resume_trainer_state(run.resume, sampler)

    pairs_per_step = trainer.micro_batch_size * trainer.gradient_accumulation_steps
    with run_logger(run.output_dir, cfg.logging, recipe=recipe, total_steps=trainer.max_steps, start_step=start_step,
                   run_config=cfg.model_dump(mode="json")) as run_log:
        announce_run(run_log, run.train_stats.summary(), run.resume, run.changed_keys, policy,
                     f"{what}, {pairs_per_step} pairs per step ({len(run.train_examples)} in the training set"
                     f"{epochs_note(trainer)})")

        metrics: dict[str, float] = {}
        eval_metrics: dict[str, float] = {}
        guard = NonFiniteGuard(trainer, run.output_dir)
        for step in range(start_step + 1, trainer.max_steps + 1):
            started = time.perf_counter()
            micro_batches = []
            for _ in range(trainer.gradient_accumulation_steps):
                indices = sampler.next_indices(trainer.micro_batch_size)
                rows = collate([run.train_examples[i] for i in indices], tokenizer.pad_token_id)
                micro_batches.append(pair_inputs(rows, indices))
            # The policy divides the step's micro-batches among its ranks; the loss is over the step's pairs.
            step_metrics = policy.forward_backward(micro_batches, loss)
            step_metrics.update(policy.optim_step())
            elapsed = time.perf_counter() - started

            metrics = {
                **as_floats(step_metrics),
                "tokens_per_second": sum(batch.num_tokens for batch in micro_batches) / elapsed,
                "step_seconds": elapsed,
                "epoch": sampler.epochs_completed,
            }
            guard.check(step, metrics)
            if step == trainer.max_steps and after_last_step is not None:
                after_last_step()
            if evaluate is not None and is_eval_step(step, trainer):
                eval_metrics = evaluate()
                metrics.update(eval_metrics)
            if evaluation is not None and evaluation.is_due(step):
                metrics.update(evaluation.run_for_policy(step, policy, cfg.model, run_log))
            log_step(run_log, step, metrics, trainer)
            save_if_due(run.output_dir, step, trainer, {POLICY: policy}, sampler, run_log=run_log)

        final_dir = export_policy(run.output_dir, policy, run_log, cfg.hub)
    return metrics, eval_metrics, final_dir
