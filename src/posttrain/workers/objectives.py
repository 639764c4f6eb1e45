"""Loss descriptions: what a recipe hands a worker's `forward_backward` and `evaluate`.

A description is a frozen dataclass holding only its configuration (which pure function of `posttrain.losses`,
its config, the sampling temperature): it pickles, so the same call crosses a process boundary to a Ray actor or a
subprocess. Everything it reads per example travels in the typed batch (a `RolloutBatch`'s advantages, π_old and
π_ref log-probabilities, a critic's old values and returns; a `PairBatch`'s reference log-probabilities and
margins; a `DistillBatch`'s teacher top-k, a `CrossTokenizerBatch`'s aligned chunks), never in a closure.

Each description says
  - `outputs`: what the worker's forward pass hands it (workers/forward.py's Outputs: logits, target_logprobs,
    target_scores), under `temperature`;
  - `normalizer(micro_batches)`: the step's normalizer (valid tokens, sequences or pairs) over the whole minibatch,
    which the worker computes once before dividing the micro-batches among its ranks;
  - `__call__(outputs, micro_batch, normalizer)`: this micro-batch's share of the step's loss and its metrics
    (each carrying its reduction). `normalizer=None` asks for the micro-batch's own mean (evaluation passes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from posttrain.data.types import CrossTokenizerBatch, DistillBatch, PairBatch, RolloutBatch, SFTBatch, SharedPromptBatch
from posttrain.losses.nll import nll_of_logprobs
from posttrain.config.losses import DistillationLossConfig, PolicyLossConfig, PreferenceLossConfig
from posttrain.losses.cross_tokenizer import cross_tokenizer_loss
from posttrain.losses.distillation import chunked_distillation_loss, distillation_loss
from posttrain.losses.policy_gradient import loss_normalizer, policy_gradient_loss
from posttrain.losses.preference import preference_loss, sequence_logps
from posttrain.losses.reward_model import bradley_terry_loss
from posttrain.losses.value import value_loss, value_loss_normalizer
from posttrain.losses.sampling import sampled_token_logprobs
from posttrain.workers.forward import Outputs, TargetHidden, TargetScores, outputs_of_logits
from posttrain.workers.metrics import Metric, MetricDict


class Objective(Protocol):
    """The protocol every loss description satisfies (see the module docstring)."""

    outputs: Outputs
    temperature: float

    def normalizer(self, micro_batches: Sequence[Any]) -> float: ...

    def __call__(self, outputs: Any, batch: Any, normalizer: float | None) -> tuple[torch.Tensor, MetricDict]: ...


# ---- supervised -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NLLObjective:
    """SFT: the summed target-token NLL of a micro-batch divided by the target count of the whole step.
    Metrics nll_sum and target_tokens (sums), from which evaluation reads the mean NLL per target token."""

    outputs: Outputs = "target_logprobs"
    temperature: float = 1.0

    def normalizer(self, micro_batches: Sequence[SFTBatch]) -> float:
        return sum(batch.num_target_tokens for batch in micro_batches)

    def __call__(self, logprobs: torch.Tensor, batch: SFTBatch, normalizer: float | None
                 ) -> tuple[torch.Tensor, MetricDict]:
        if normalizer is None:  # this batch's own mean NLL per target token (evaluation)
            normalizer = batch.loss_mask.sum().clamp(min=1)
        loss, stats = nll_of_logprobs(logprobs, batch.loss_mask, normalizer)
        return loss, {"nll_sum": Metric.sum(stats["nll_sum"]), "target_tokens": Metric.sum(stats["target_tokens"])}


@dataclass(frozen=True)
class DistillationObjective:
    """Off-policy top-k distillation (losses/distillation.py) of a `DistillBatch`: the student's logits against
    the teacher's top-k travelling in the batch, summed over the micro-batch's targets and divided by the step's
    target count, plus config.nll_weight × the data's NLL. The distillation temperature is config.temperature,
    applied to the logits inside the loss (`temperature` here is the forward pass's, which logits ignore). With a
    chunked LM head (trainer.lm_head) the worker hands the hidden states at the targets and the loss applies the
    head chunk by chunk (chunked_distillation_loss), so the student's [T, V] logits never exist. Metrics are
    per-target-token means (divergence, nll, teacher_topk_mass, student_topk_mass, top1_agreement) and
    target_tokens (a sum)."""

    config: DistillationLossConfig
    outputs: Outputs = "target_hidden"
    temperature: float = 1.0

    def normalizer(self, micro_batches: Sequence[DistillBatch]) -> float:
        return sum(batch.num_target_tokens for batch in micro_batches)

    def __call__(self, outputs: torch.Tensor | TargetHidden, batch: DistillBatch, normalizer: float | None
                 ) -> tuple[torch.Tensor, MetricDict]:
        rows = batch.rows
        if normalizer is None:
            normalizer = max(rows.num_target_tokens, 1)
        if isinstance(outputs, TargetHidden):
            at_rows, at_sources, at_columns = (index.cpu() for index in (outputs.rows, outputs.sources,
                                                                         outputs.columns))
            device = outputs.hidden.device
            loss, sums = chunked_distillation_loss(
                outputs.hidden, outputs.weight, outputs.bias,
                batch.teacher_topk_logprobs[at_rows, at_sources].to(device),
                batch.teacher_topk_ids[at_rows, at_sources].to(device),
                rows.input_ids[at_rows, at_columns].to(device), self.config, normalizer, outputs.chunk_size)
        else:
            device = outputs.device
            loss, sums = distillation_loss(outputs, batch.teacher_topk_logprobs.to(device),
                                           batch.teacher_topk_ids.to(device), rows.input_ids, rows.loss_mask,
                                           self.config, normalizer)
        tokens = sums.pop("target_tokens")
        count = tokens.clamp(min=1)
        return loss, {"target_tokens": Metric.sum(tokens),
                      **{name.removesuffix("_sum"): Metric.mean(value / count, tokens) for name, value in sums.items()}}


@dataclass(frozen=True)
class CrossTokenizerObjective:
    """Distillation from a teacher with another tokenizer (losses/cross_tokenizer.py) of a `CrossTokenizerBatch`:
    per aligned chunk, the top-k divergence through the exact projection (one-token chunks so matched) or the
    divergence of the chunk's likelihood (the others), plus ULD there when config.cross_tokenizer.unmatched=uld,
    each chunk weighted by the batch's chunk_weight, summed over the micro-batch and divided by the step's student
    target count. Metrics: divergence (mean over exact chunks), chunk_divergence, uld and logprob_gap
    (|ℓ_S − ℓ_T|; means over the other chunks), nll (mean per target), exact_chunk_fraction (exact chunks among
    all), target_tokens (a sum), aligned_target_fraction (the student targets the chunks cover, per target; one
    teacher). With teacher_names (several teachers; the batch's chunk_teacher indexes them), also
    <name>/divergence, <name>/chunk_divergence, <name>/logprob_gap, <name>/exact_chunk_fraction over that teacher's
    chunks, and the sums <name>/chunks and <name>/aligned_targets (the student targets its chunks cover)."""

    config: DistillationLossConfig
    outputs: Outputs = "logits"
    temperature: float = 1.0
    teacher_names: tuple[str, ...] = ()

    def normalizer(self, micro_batches: Sequence[CrossTokenizerBatch]) -> float:
        return sum(batch.num_target_tokens for batch in micro_batches)

    def __call__(self, logits: torch.Tensor, batch: CrossTokenizerBatch, normalizer: float | None
                 ) -> tuple[torch.Tensor, MetricDict]:
        rows = batch.rows
        if normalizer is None:
            normalizer = max(rows.num_target_tokens, 1)
        device = logits.device
        weight = None if batch.chunk_weight is None else batch.chunk_weight.to(device)
        loss, sums = cross_tokenizer_loss(
            logits, rows.input_ids, rows.loss_mask, batch.chunk_row.to(device), batch.chunk_start.to(device),
            batch.chunk_end.to(device), batch.chunk_teacher_logprobs.to(device), batch.chunk_exact.to(device),
            batch.teacher_topk_logprobs.to(device), batch.teacher_topk_ids.to(device), self.config, normalizer,
            weight)
        tokens, exact, other = sums["target_tokens"], sums["exact_chunks"], sums["other_chunks"]
        metrics = {
            "target_tokens": Metric.sum(tokens),
            "divergence": Metric.mean(sums["divergence_sum"] / exact.clamp(min=1), exact),
            "chunk_divergence": Metric.mean(sums["chunk_divergence_sum"] / other.clamp(min=1), other),
            "uld": Metric.mean(sums["uld_sum"] / other.clamp(min=1), other),
            "logprob_gap": Metric.mean(sums["logprob_gap_sum"] / other.clamp(min=1), other),
            "nll": Metric.mean(sums["nll_sum"] / tokens.clamp(min=1), tokens),
            "exact_chunk_fraction": Metric.mean(exact / (exact + other).clamp(min=1), exact + other),
        }
        if self.teacher_names:
            metrics |= per_teacher_chunk_metrics(self.teacher_names, batch, sums)
        else:
            covered = (batch.chunk_end - batch.chunk_start).sum().float()
            metrics["aligned_target_fraction"] = Metric.mean(covered / tokens.clamp(min=1), tokens)
        return loss, metrics


def per_teacher_chunk_metrics(names: Sequence[str], batch: CrossTokenizerBatch,
                              sums: dict[str, torch.Tensor]) -> MetricDict:
    """<name>/... metrics of each teacher's chunks (chunk_teacher == its index) from the per-chunk terms."""
    exact = batch.chunk_exact.bool().to(sums["chunk_divergence"].device)
    teacher = batch.chunk_teacher.to(exact.device)
    covered = (batch.chunk_end - batch.chunk_start).to(exact.device).float()
    metrics: MetricDict = {}
    for index, name in enumerate(names):
        mine = teacher == index
        n_exact, n_other = (mine & exact).sum().float(), (mine & ~exact).sum().float()
        metrics |= {
            f"{name}/divergence": Metric.mean(sums["chunk_divergence"][mine & exact].sum() / n_exact.clamp(min=1),
                                              n_exact),
            f"{name}/chunk_divergence": Metric.mean(
                sums["chunk_divergence"][mine & ~exact].sum() / n_other.clamp(min=1), n_other),
            f"{name}/logprob_gap": Metric.mean(sums["chunk_logprob_gap"][mine].sum() / n_other.clamp(min=1), n_other),
            f"{name}/exact_chunk_fraction": Metric.mean(n_exact / (n_exact + n_other).clamp(min=1), n_exact + n_other),
            f"{name}/chunks": Metric.sum(n_exact + n_other),
            f"{name}/aligned_targets": Metric.sum(covered[mine].sum()),
        }
    return metrics


# ---- pairs ------------------------------------------------------------------------------------------------


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


def completion_logps(token_logps: torch.Tensor, batch: SFTBatch | SharedPromptBatch, average: bool) -> CompletionLogps:
    """Per-completion scores of a batch of pairs from its token log-probabilities ([rows, T], as a worker's
    target_logprobs outputs or its `logprobs` give them): a `collate_preference` batch (chosen rows, then rejected
    rows) or a `collate_shared_prompt` one (one row per pair)."""
    if isinstance(batch, SharedPromptBatch):
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


def pair_means(metrics: dict[str, torch.Tensor], num_pairs: int) -> MetricDict:
    """A loss function's per-batch means as metrics weighted by the batch's pair count (its `loss` is left out:
    the worker reports the loss itself)."""
    return {name: Metric.mean(value, num_pairs) for name, value in metrics.items() if name != "loss"}


def _pairs_in(micro_batches: Sequence[PairBatch]) -> int:
    return sum(batch.num_pairs for batch in micro_batches)


def _on(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


@dataclass(frozen=True)
class PreferenceObjective:
    """DPO's family, SimPO and ORPO on a `PairBatch`: the summed per-pair loss over the step's pair count; the
    reference log-probabilities travel in the batch (config.average_logprobs: completion log-probabilities as the
    mean over their tokens instead of the sum)."""

    config: PreferenceLossConfig
    outputs: Outputs = "target_logprobs"
    temperature: float = 1.0

    def normalizer(self, micro_batches: Sequence[PairBatch]) -> float:
        return _pairs_in(micro_batches)

    def __call__(self, target_logps: torch.Tensor, batch: PairBatch, normalizer: float | None
                 ) -> tuple[torch.Tensor, MetricDict]:
        policy = completion_logps(target_logps, batch.rows, self.config.average_logprobs)
        device = target_logps.device
        loss, metrics = preference_loss(
            self.config, policy.chosen, policy.rejected, _on(batch.reference_chosen_logps, device),
            _on(batch.reference_rejected_logps, device), chosen_lengths=policy.chosen_lengths,
            rejected_lengths=policy.rejected_lengths, chosen_nll=policy.chosen_nll, num_pairs_in_step=normalizer,
        )
        return loss, pair_means(metrics, batch.num_pairs)


@dataclass(frozen=True)
class BradleyTerryObjective:
    """A reward model's Bradley-Terry loss on a `PairBatch` of chosen rows then rejected rows; the model's outputs
    are [2B, 1] scores. `use_margin`: subtract the batch's per-pair margins (Llama 2's margin loss)."""

    use_margin: bool = False
    center_rewards_coefficient: float | None = None
    outputs: Outputs = "logits"
    temperature: float = 1.0

    def normalizer(self, micro_batches: Sequence[PairBatch]) -> float:
        return _pairs_in(micro_batches)

    def __call__(self, outputs: torch.Tensor, batch: PairBatch, normalizer: float | None
                 ) -> tuple[torch.Tensor, MetricDict]:
        rewards = outputs.squeeze(-1).float()
        pairs = batch.num_pairs
        margin = None
        if self.use_margin:
            if batch.margins is None:
                raise ValueError("use_margin needs the batch's margins (PairBatch.margins)")
            margin = batch.margins.to(dtype=rewards.dtype, device=rewards.device)
        loss, metrics = bradley_terry_loss(rewards[:pairs], rewards[pairs:], margin, normalizer,
                                           center_rewards_coefficient=self.center_rewards_coefficient)
        return loss, pair_means(metrics, pairs)


# ---- online RL --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyGradientObjective:
    """The clipped policy-gradient loss (losses/policy_gradient.py) of a `RolloutBatch` carrying its advantages
    ([N] or per token [N, T]), π_old (None: on-policy, the training pass itself, detached) and π_ref (None: no KL
    term) log-probabilities. Log-probabilities are taken under the sampling `temperature`. Metrics are
    token-weighted means, except minima and maxima (`*_min`, `*_max`: the ratio, the IS weight).

    With the sampler's `top_k` or `top_p` on, the objective asks for the full logits (no chunked LM head) and also
    reads the sampled tokens' log-probabilities under the truncated, renormalised distribution the generator drew
    from (losses/sampling.py): the generator_logprob_error metrics compare those with the generator's, like with
    like. They are the current weights' (π_old on the first update of a step, the policy being updated after).
    The loss itself and the importance weights still use the full distribution."""

    config: PolicyLossConfig
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    outputs: Outputs = "target_scores"

    def __post_init__(self) -> None:
        if self.top_k > 0 or self.top_p < 1.0:  # the truncated distribution is read from the full logits
            object.__setattr__(self, "outputs", "logits")

    def normalizer(self, micro_batches: Sequence[RolloutBatch]) -> float:
        return sum(loss_normalizer(batch.loss_mask, self.config) for batch in micro_batches)

    def __call__(self, scores: TargetScores, batch: RolloutBatch, normalizer: float | None
                 ) -> tuple[torch.Tensor, MetricDict]:
        if batch.advantages is None:
            raise ValueError("the policy-gradient loss needs RolloutBatch.advantages; set them before training")
        sampler = None
        if self.outputs == "logits" and batch.generator_logprobs is not None:  # top-k/top-p (class docstring)
            sampler = sampled_token_logprobs(scores, batch.input_ids.to(scores.device), self.temperature, self.top_k,
                                             self.top_p)
        if self.outputs == "logits":
            scores = outputs_of_logits(scores, batch, "target_scores", self.temperature)
        logprobs = scores.logprobs
        device = logprobs.device
        mask = batch.loss_mask
        old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs.to(device)
        if normalizer is None:
            normalizer = loss_normalizer(mask, self.config)
        loss, metrics = policy_gradient_loss(
            logprobs, old, batch.advantages.to(device), mask, self.config, normalizer,
            generator_logprobs=batch.generator_logprobs, reference_logprobs=_on(batch.reference_logprobs, device),
            sampler_logprobs=sampler,
        )
        valid = mask.bool()
        metrics["entropy"] = torch.where(valid, scores.entropy, 0.0).sum() / valid.sum().clamp(min=1)
        tokens = mask.sum()
        return loss, {name: Metric.min(value) if name.endswith("_min") else Metric.max(value) if name.endswith("_max")
                      else Metric.mean(value, tokens) for name, value in metrics.items()}


@dataclass(frozen=True)
class ValueObjective:
    """PPO's (clipped) value loss on a `RolloutBatch` carrying the critic's old values and return targets
    ([N, T]); the critic's outputs are its values. Metrics value/<name> as token-weighted means (the loss itself
    is the worker's `loss`)."""

    clip: float | None = None
    outputs: Outputs = "logits"
    temperature: float = 1.0

    def normalizer(self, micro_batches: Sequence[RolloutBatch]) -> float:
        return sum(value_loss_normalizer(batch.loss_mask) for batch in micro_batches)

    def __call__(self, values: torch.Tensor, batch: RolloutBatch, normalizer: float | None
                 ) -> tuple[torch.Tensor, MetricDict]:
        if batch.returns is None:
            raise ValueError("the value loss needs RolloutBatch.returns (and old_values to clip); set them first")
        if normalizer is None:
            normalizer = value_loss_normalizer(batch.loss_mask)
        loss, metrics = value_loss(values, _on(batch.old_values, values.device), batch.returns.to(values.device),
                                   batch.loss_mask, self.clip, normalizer)
        tokens = batch.loss_mask.sum()
        return loss, {f"value/{name.removeprefix('value_')}": Metric.mean(value, tokens)
                      for name, value in metrics.items() if name != "value_loss"}
