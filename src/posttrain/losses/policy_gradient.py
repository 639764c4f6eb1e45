"""Policy-gradient losses for online RL (PPO, GRPO, DAPO, Dr. GRPO, GSPO, CISPO, REINFORCE/RLOO), the KL
estimators of the reference penalty.

One function, `policy_gradient_loss`, computes a per-token loss from the knobs of `PolicyLossConfig`; each knob
changes one term: the ratio (token, sequence or none), the surrogate (PPO clip or CISPO), the correction between
the generator's and the trainer's log-probabilities, the KL penalty, and the aggregation over tokens.

Notation, per completion token t of sequence i: logπ = log π_θ(y_t) under the current policy (with gradient),
logπ_old = the same under the policy that sampled, as the trainer recomputes it before the update, logπ_gen =
what the generator (vLLM, ...) reported while sampling, logπ_ref = the frozen reference model's.
r = exp(logπ − logπ_old) is the policy ratio, w = exp(logπ_old − logπ_gen) the trainer/generator mismatch
weight, A the advantage and sg(·) stop-gradient.

Normalization (ARCHITECTURE.md, "Loss normalization"): the loss of a micro-batch is a sum over its tokens (or
sequences) divided by `normalizer`, the count over the whole optimizer step (all micro-batches and ranks) that
`loss_normalizer` contributes to. Summing the micro-batch losses of a step then gives the full-batch loss, whatever
the split. Note that "token-mean" and "seq-mean-token-sum" sum the same per-token terms and differ only in their
normalizer (tokens vs sequences).

Departures from the papers and choices the papers leave open:
- GSPO (Zheng et al. 2025, eq. 7) uses s_i = exp(mean_t(logπ − sg(logπ_old))) over the sequence's valid tokens,
  broadcast to its tokens, so every token of a sequence gets the same gradient s_i·A/|y_i|·∇logπ_t. The paper
  averages min(s_i·A_i, clip(s_i)·A_i) over sequences, which is "seq-mean-token-mean" here; "token-mean" would
  weight each sequence by its length (PITFALLS, TRL #6042) and is rejected by the config.
- CISPO (MiniMax-M1, MiniMax 2025) clips the IS weight only from above in practice (a very large ε_low); here both
  bounds apply, and ratio_clip_low >= 1 removes the lower one (r > 0 always). The loss value −sg(clip(r))·A·logπ,
  like REINFORCE's −A·logπ, is a surrogate whose gradient is the estimator; its value is not an objective.
- For CISPO the clip fractions count tokens whose IS weight is clipped, whatever the sign of A (each such token
  still has a gradient, only a smaller weight); for PPO they count tokens where the clip binds (zero gradient).
- The generator/trainer correction (TIS, IcePop, seq-mask-tis, seq-tis) multiplies the policy-gradient term only.
  The KL penalty is a regularizer evaluated on the same tokens and is not reweighted or masked, so a masked token
  is still pulled toward the reference.
- seq-tis weighs a whole sequence by the product of its token weights, the sequence-level likelihood ratio of
  Truncated IS at sequence level (verl's rollout_corr "sequence" mode), truncated from above at is_threshold_high
  (and optionally from below at tis_lower_bound).
- CISPO with GSPO's sequence ratio is rejected: CISPO's point is a per-token clipped weight that keeps every
  token's gradient, and no paper defines the sequence-ratio variant.
- The KL penalty is added to the loss per token (GRPO, Shao et al. 2024, eq. 3, with k3), not folded into the
  reward; a reward-side KL goes through `posttrain.advantages.reinforce_plus_plus_advantages`.
- `kl_clamp` clamps the log-ratio before exponentiating, which also zeroes the KL gradient of clamped tokens;
  `kl_output_clamp` (off by default) clamps the estimate itself, as verl clamps its k3 to ±10.
- With ratio_level "none" (REINFORCE, RLOO) there is no clipping; the ratio metrics still report the token
  ratio exp(logπ − logπ_old), as a measure of how far off-policy the batch is.

KL estimators (Schulman 2020, "Approximating KL Divergence"), with d = logπ_ref − logπ, for tokens sampled from
π and differentiated only through logπ (the sample held fixed, as a loss term is):
- k1 = −d. E_π[k1] = KL(π‖π_ref): unbiased value. Its gradient ∇logπ has expectation E_π[∇logπ] = 0, so as a
  loss term it adds noise and no pull toward the reference: a biased gradient.
- k2 = d²/2. Biased value (it matches KL only to second order in d). Its gradient −d·∇logπ has expectation
  E_π[(logπ − logπ_ref)∇logπ] = ∇KL(π‖π_ref): in expectation, exactly the gradient of the reverse KL.
- k3 = exp(d) − 1 − d ≥ 0. E_π[k3] = KL(π‖π_ref): unbiased value. Its gradient (1 − π_ref/π)∇logπ has
  expectation −E_{π_ref}[∇logπ] = ∇KL(π_ref‖π), the gradient of the forward KL: biased for the reverse KL whose
  value it estimates (the two agree to first order when π is close to π_ref).
These hold for on-policy samples; tokens from π_old ≠ π add the usual off-policy bias to all three.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from posttrain.config.losses import KLEstimator, PolicyLossConfig  # the recipe's loss section is the loss's config


# ---- KL estimators ------------------------------------------------------------------------------------------

_KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda d: -d,
    "k2": lambda d: 0.5 * d.square(),
    "k3": lambda d: torch.expm1(d) - d,
}


def kl_estimate(
    logprobs: Tensor,
    reference_logprobs: Tensor,
    estimator: KLEstimator = "k3",
    clamp: float | None = 10.0,
    output_clamp: float | None = None,
) -> Tensor:
    """Per-token estimate of KL(π‖π_ref) from the sampled tokens' log-probabilities (Schulman 2020).

    logprobs, reference_logprobs: [B, T] (any matching shape) log π(y_t) and log π_ref(y_t).
    estimator: k1 = −d, k2 = d²/2 or k3 = exp(d) − 1 − d, with d = logπ_ref − logπ clamped to [−clamp, clamp]
        (no clamp when None). See the module docstring for which are unbiased in value and in gradient.
    output_clamp: the estimate is then clamped to [−output_clamp, output_clamp] (None: not clamped), as verl
        bounds its low-variance KL; a clamped token has no KL gradient.
    Returns the estimate per token, same shape, differentiable through both inputs.
    """
    d = reference_logprobs - logprobs
    if clamp is not None:
        d = d.clamp(-clamp, clamp)
    estimate = _KL_ESTIMATORS[estimator](d)
    if output_clamp is not None:
        estimate = estimate.clamp(-output_clamp, output_clamp)
    return estimate


# ---- generator/trainer mismatch correction ------------------------------------------------------------------


class ImportanceWeights(NamedTuple):
    """Detached per-token weights of the policy-gradient term, which tokens they drop and which they truncate,
    each [B, T]."""

    weights: Tensor
    masked: Tensor
    """bool, True where the correction set the weight to 0."""
    truncated: Tensor
    """bool, True where truncation moved the weight to a bound (tis, seq-tis, and seq-mask-tis's kept tokens)."""


def _no_correction(log_w: Tensor, valid: Tensor, cfg: PolicyLossConfig) -> ImportanceWeights:
    never = torch.zeros_like(valid)
    return ImportanceWeights(torch.ones_like(log_w), never, never)


def _tis(log_w: Tensor, valid: Tensor, cfg: PolicyLossConfig) -> ImportanceWeights:
    """Truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"):
    min(w, high) per token, and max(·, tis_lower_bound) when that is set; no token is dropped."""
    w = log_w.exp()
    truncated = _outside(w, cfg.tis_lower_bound, cfg.is_threshold_high)
    return ImportanceWeights(w.clamp(min=cfg.tis_lower_bound, max=cfg.is_threshold_high), torch.zeros_like(valid),
                             truncated)


def _seq_tis(log_w: Tensor, valid: Tensor, cfg: PolicyLossConfig) -> ImportanceWeights:
    """Sequence-level truncated IS: one weight per sequence, the product of its valid tokens' weights, computed
    in log space as exp(Σ_t log w_t), truncated to [tis_lower_bound, high] and applied to every token of the
    sequence. Unlike the geometric mean of seq-mask-tis, the product is the exact sequence likelihood ratio
    π_old(y)/π_gen(y), so it drifts far from 1 on long sequences; the truncation bounds its variance."""
    sequence_w = log_w.sum(-1, keepdim=True).exp()  # log_w is 0 off the valid tokens; inf beyond float range
    truncated = _outside(sequence_w, cfg.tis_lower_bound, cfg.is_threshold_high)
    weights = sequence_w.clamp(min=cfg.tis_lower_bound, max=cfg.is_threshold_high)
    return ImportanceWeights(weights.expand_as(log_w), torch.zeros_like(valid), truncated.expand_as(log_w))


def _outside(w: Tensor, low: float | None, high: float) -> Tensor:
    """bool, True where w lies above high or below low (no lower bound when low is None)."""
    return (w > high) if low is None else (w > high) | (w < low)


def _icepop(log_w: Tensor, valid: Tensor, cfg: PolicyLossConfig) -> ImportanceWeights:
    """IcePop (Ling Team 2025, Ring-1T, "Every Step Evolves"): M(w) = w if low <= w <= high else 0 per token.

    A token whose mismatch lies outside the band is dropped; inside it keeps the full, untruncated weight w.
    """
    w = log_w.exp()
    outside = (w < cfg.is_threshold_low) | (w > cfg.is_threshold_high)
    return ImportanceWeights(torch.where(outside, 0.0, w), outside, torch.zeros_like(valid))


def _seq_mask_tis(log_w: Tensor, valid: Tensor, cfg: PolicyLossConfig) -> ImportanceWeights:
    """Sequence mask + token TIS: drop whole sequences whose GEOMETRIC-MEAN weight exp(mean_t log w) over their
    valid tokens lies outside [low, high]; the kept sequences' tokens get min(w, high).

    The geometric mean (not the product exp(Σ_t log w)) keeps the band meaningful at any length: a product of
    thousands of per-token weights near 1 leaves any fixed band almost surely.
    """
    sequence_w = _sequence_mean(log_w, valid).exp()
    outside = (sequence_w < cfg.is_threshold_low) | (sequence_w > cfg.is_threshold_high)
    weights = torch.where(outside, 0.0, log_w.exp().clamp(max=cfg.is_threshold_high))
    truncated = ~outside & (log_w.exp() > cfg.is_threshold_high)
    return ImportanceWeights(weights, outside.expand_as(log_w), truncated)


_CORRECTIONS: dict[str, Callable[[Tensor, Tensor, PolicyLossConfig], ImportanceWeights]] = {
    "none": _no_correction,
    "tis": _tis,
    "icepop": _icepop,
    "seq-mask-tis": _seq_mask_tis,
    "seq-tis": _seq_tis,
}


def importance_weights(
    old_logprobs: Tensor, generator_logprobs: Tensor, mask: Tensor, cfg: PolicyLossConfig
) -> ImportanceWeights:
    """Detached weights of the policy-gradient term correcting for sampling from the generator, not π_old.

    old_logprobs, generator_logprobs, mask: [B, T]. w = exp(logπ_old − logπ_gen) per token; low/high are
    cfg.is_threshold_low/high, bounds inclusive:
    - tis: weight min(w, high), and max(·, cfg.tis_lower_bound) when set.
    - icepop: weight w where low <= w <= high, else 0 (token masked).
    - seq-mask-tis: a sequence whose geometric-mean weight exp(mean over its valid tokens of log w) is outside
      [low, high] is masked entirely (weight 0); tokens of the other sequences get min(w, high).
    - seq-tis: every token of a sequence gets the sequence's product weight exp(Σ over its valid tokens of
      log w), truncated like tis: min(·, high), and max(·, cfg.tis_lower_bound) when set.
    - none: weight 1.
    Masked positions of `mask` get weight 1 and are never reported as dropped or truncated; they carry no loss.
    """
    valid = mask.bool()
    with torch.no_grad():
        log_w = torch.where(valid, old_logprobs - generator_logprobs, 0.0)
        weights, masked, truncated = _CORRECTIONS[cfg.importance_correction](log_w, valid, cfg)
        return ImportanceWeights(torch.where(valid, weights, 1.0), masked & valid, truncated & valid)


# ---- policy terms -------------------------------------------------------------------------------------------


class _PolicyTerms(NamedTuple):
    """Per-token policy-gradient loss [B, T] and where each clip binds (bool [B, T])."""

    loss: Tensor
    clipped_low: Tensor
    clipped_high: Tensor
    dual_clipped: Tensor


def _ppo(ratio: Tensor, logprobs: Tensor, advantages: Tensor, cfg: PolicyLossConfig) -> _PolicyTerms:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) with decoupled bounds (DAPO, Yu et al. 2025) and
    the dual clip max(·, c·A) for A < 0 (Ye et al. 2020), negated into a loss."""
    low, high = 1 - cfg.ratio_clip_low, 1 + cfg.ratio_clip_high
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    negative = advantages < 0
    if cfg.ratio_clip_c is None:
        dual_clipped = torch.zeros_like(negative)
    else:
        # For A < 0, min(r·A, clip(r)·A) = A·max(r, clip(r)) falls without bound as r grows; c·A floors it.
        surrogate = torch.where(negative, torch.maximum(surrogate, cfg.ratio_clip_c * advantages), surrogate)
        dual_clipped = negative & (ratio > cfg.ratio_clip_c)
    return _PolicyTerms(-surrogate, negative & (ratio < low), (advantages > 0) & (ratio > high), dual_clipped)


def _cispo(ratio: Tensor, logprobs: Tensor, advantages: Tensor, cfg: PolicyLossConfig) -> _PolicyTerms:
    """CISPO (MiniMax-M1, MiniMax 2025): −sg(clip(r, 1 − low, 1 + high))·A·logπ.

    Gradient −clip(r)·A·∇logπ on every token: clipping bounds the IS weight instead of dropping the token.
    """
    low, high = 1 - cfg.ratio_clip_low, 1 + cfg.ratio_clip_high
    weight = ratio.clamp(low, high).detach()
    no_dual = torch.zeros_like(advantages, dtype=torch.bool)
    return _PolicyTerms(-weight * advantages * logprobs, ratio < low, ratio > high, no_dual)


def _reinforce(ratio: Tensor, logprobs: Tensor, advantages: Tensor, cfg: PolicyLossConfig) -> _PolicyTerms:
    """REINFORCE (Williams 1992) / RLOO (Ahmadian et al. 2024): −A·logπ, gradient −A·∇logπ."""
    never = torch.zeros_like(advantages, dtype=torch.bool)
    return _PolicyTerms(-advantages * logprobs, never, never, never)


def _policy_term(cfg: PolicyLossConfig) -> Callable[[Tensor, Tensor, Tensor, PolicyLossConfig], _PolicyTerms]:
    return _reinforce if cfg.ratio_level == "none" else {"ppo": _ppo, "cispo": _cispo}[cfg.clip_mode]


def _sequence_mean(values: Tensor, valid: Tensor) -> Tensor:
    """[B, 1] mean of `values` over each row's valid positions (0 for a row with none)."""
    count = valid.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(valid, values, 0.0).sum(-1, keepdim=True) / count


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor, valid: Tensor, cfg: PolicyLossConfig) -> Tensor:
    """[B, T] log of the ratio each token uses: per token, or GSPO's per-sequence mean broadcast to its tokens."""
    token_log_ratio = logprobs - old_logprobs.detach()
    if cfg.ratio_level == "sequence":
        # GSPO eq. 7: log s_i = (1/|y_i|) Σ_t (logπ − sg(logπ_old)); the gradient reaches every token of the
        # sequence through the mean.
        return _sequence_mean(token_log_ratio, valid).expand_as(token_log_ratio)
    return token_log_ratio


# ---- aggregation --------------------------------------------------------------------------------------------

_SEQUENCE_TERMS: dict[str, Callable[[Tensor, Tensor, PolicyLossConfig], Tensor]] = {
    # (sum of the sequence's per-token losses [B], its valid-token count [B], cfg) -> its term of the numerator
    "token-mean": lambda total, count, cfg: total,
    "seq-mean-token-mean": lambda total, count, cfg: total / count.clamp(min=1),
    "seq-mean-token-sum": lambda total, count, cfg: total,
    "seq-mean-token-sum-norm": lambda total, count, cfg: total / cfg.aggregation_constant,  # Dr. GRPO
}


def loss_normalizer(mask: Tensor, cfg: PolicyLossConfig) -> float:
    """This micro-batch's contribution to `normalizer`; sum it over every micro-batch (and rank) of the step.

    mask: [B, T]. Returns the valid-token count for "token-mean", else the number of sequences with at least one
    valid token (the seq-mean-* modes average over those).
    """
    valid = mask.bool()
    if cfg.aggregation == "token-mean":
        return float(valid.sum())
    return float(valid.any(-1).sum())


# ---- the loss -----------------------------------------------------------------------------------------------


def policy_gradient_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    normalizer: float,
    generator_logprobs: Tensor | None = None,
    reference_logprobs: Tensor | None = None,
    sampler_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy-gradient loss of one micro-batch of B sequences, normalized over the whole optimizer step.

    logprobs: [B, T] log π_θ of the sampled tokens under the current policy (requires grad).
    old_logprobs: [B, T] log π_old, the sampling policy as the trainer recomputed it before the update (no grad).
    advantages: [B] per sequence or [B, T] per token.
    mask: [B, T], 1 (or True) on completion tokens that get loss; 0 on padding, prompt and filtered samples.
        Values at masked positions are never used (they may be anything, nan included).
    normalizer: the step-wide count, the sum of `loss_normalizer` over every micro-batch and rank of the step.
    generator_logprobs: [B, T] log π_gen reported by the sampler; required unless cfg.importance_correction is
        "none" (then it only feeds the `generator_logprob_error` metric).
    reference_logprobs: [B, T] log π_ref; required when cfg.reference_kl_penalty > 0 (else only the `kl` metric).
    sampler_logprobs: [B, T] the trainer's log-probabilities of the sampled tokens under the distribution the
        generator sampled from (top-k/top-p truncated and renormalised: losses/sampling.py), for the mismatch
        metrics only; None: they compare old_logprobs (right when the generator samples the full distribution).

    Per token, ℓ_t = c_t·policy_term_t + β·kl_t with c_t the detached mismatch weight (`importance_weights`) and
    policy_term_t from cfg.ratio_level and cfg.clip_mode (module docstring). Then
    loss = Σ_i term_i / normalizer, term_i = Σ_t ℓ_t for token-mean and seq-mean-token-sum, the mean over the
    sequence's valid tokens for seq-mean-token-mean, Σ_t ℓ_t / aggregation_constant for seq-mean-token-sum-norm.

    Returns (loss, metrics): detached 0-dim tensors, means over this micro-batch's valid tokens (0 when there are
    none; ratio_min/max 1): clip_fraction_low (A < 0, r < 1 − low), clip_fraction_high (A > 0, r > 1 + high),
    dual_clip_fraction (A < 0, r > c), ratio_mean, ratio_min, ratio_max; kl (the estimator's mean) when
    reference_logprobs is given; generator_logprob_error (mean |logπ_old − logπ_gen|, or |log q − logπ_gen| with
    sampler_logprobs q), generator_logprob_error_max
    (its largest, 0 with no valid token) and generator_logprob_error_fraction (the share of tokens past
    cfg.logprob_mismatch_threshold) when generator_logprobs is given; and when the correction is on (importance_correction not "none"), of the applied weights c_t:
    is_weight_mean, is_masked_fraction (c_t set to 0), is_truncated_fraction (c_t moved to a truncation bound),
    is_effective_sample_size (Σc)²/(n·Σc²) over the n valid tokens (1 with no valid token, 0 when every c_t is
    0), and of the raw token weights w = exp(logπ_old − logπ_gen): is_raw_weight_min, is_raw_weight_max (1 with
    no valid token). Each is of this micro-batch: a minimum, maximum or effective sample size over a whole step
    needs the reduction that fits it, not a token-weighted mean.
    """
    valid = _check_inputs(cfg, logprobs, old_logprobs, advantages, mask, normalizer, generator_logprobs,
                          reference_logprobs, sampler_logprobs)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    # Masked positions are zeroed before any exp: a nan or inf there would otherwise reach the gradient as 0·inf.
    logprobs = torch.where(valid, logprobs.to(dtype), 0.0)
    old_logprobs = torch.where(valid, old_logprobs.detach().to(dtype), 0.0)
    advantages = advantages.detach().to(dtype)
    advantages = torch.where(valid, advantages[:, None] if advantages.dim() == 1 else advantages, 0.0)

    ratio = _log_ratio(logprobs, old_logprobs, valid, cfg).exp()
    terms = _policy_term(cfg)(ratio, logprobs, advantages, cfg)
    per_token = terms.loss
    metrics: dict[str, Tensor] = {}

    if generator_logprobs is not None:
        generator_logprobs = torch.where(valid, generator_logprobs.detach().to(dtype), 0.0)
        correction = importance_weights(old_logprobs, generator_logprobs, valid, cfg)
        per_token = correction.weights * per_token
        with torch.no_grad():
            trainer_view = old_logprobs
            if sampler_logprobs is not None:
                # A token the trainer's truncation leaves out (its rounding moved a top-p or top-k boundary: −inf)
                # is read under the full distribution: a finite mismatch, counted past the threshold when large.
                sampler_logprobs = sampler_logprobs.detach().to(dtype)
                trainer_view = torch.where(valid & torch.isfinite(sampler_logprobs), sampler_logprobs, old_logprobs)
            mismatch = (trainer_view - generator_logprobs).abs()
            metrics["generator_logprob_error"] = _masked_mean(mismatch, valid)
            metrics["generator_logprob_error_max"] = _masked_extreme(mismatch, valid, "max", empty=0.0)
            metrics["generator_logprob_error_fraction"] = _masked_mean(mismatch > cfg.logprob_mismatch_threshold,
                                                                       valid)
            if cfg.importance_correction != "none":
                metrics.update(_importance_metrics(correction, old_logprobs - generator_logprobs, valid))

    if reference_logprobs is not None:
        reference_logprobs = torch.where(valid, reference_logprobs.detach().to(dtype), 0.0)
        kl = kl_estimate(logprobs, reference_logprobs, cfg.kl_estimator, cfg.kl_clamp, cfg.kl_output_clamp)
        if cfg.reference_kl_penalty > 0:
            per_token = per_token + cfg.reference_kl_penalty * kl
        metrics["kl"] = _masked_mean(kl.detach(), valid)

    per_token = torch.where(valid, per_token, 0.0)
    sequence_terms = _SEQUENCE_TERMS[cfg.aggregation](per_token.sum(-1), valid.sum(-1), cfg)
    loss = sequence_terms.sum() / normalizer

    with torch.no_grad():
        ratio = ratio.detach()
        metrics.update(
            clip_fraction_low=_masked_mean(terms.clipped_low, valid),
            clip_fraction_high=_masked_mean(terms.clipped_high, valid),
            dual_clip_fraction=_masked_mean(terms.dual_clipped, valid),
            ratio_mean=_masked_mean(ratio, valid),
            ratio_min=_masked_extreme(ratio, valid, "min"),
            ratio_max=_masked_extreme(ratio, valid, "max"),
        )
    return loss, metrics


def _importance_metrics(correction: ImportanceWeights, log_w: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """Statistics of the applied weights over this micro-batch's valid tokens (see `policy_gradient_loss`)."""
    weights = torch.where(valid, correction.weights.double(), 0.0)  # float64 sums: (Σc)² ≤ n·Σc² holds to rounding
    count, total, squares = valid.sum(), weights.sum(), weights.square().sum()
    # (Σw)² / (n·Σw²); 0 when every weight is 0, 1 without valid tokens (no branch on a device value: no sync)
    effective = torch.where(squares > 0, total.square() / (count * squares).clamp(min=1e-300), 0.0)
    effective = torch.where(count == 0, 1.0, effective).to(correction.weights.dtype)
    return {
        "is_weight_mean": _masked_mean(correction.weights, valid),
        "is_masked_fraction": _masked_mean(correction.masked, valid),
        "is_truncated_fraction": _masked_mean(correction.truncated, valid),
        "is_effective_sample_size": effective,
        # exp is increasing: the extreme of the raw weights is exp of the extreme log-weight
        "is_raw_weight_min": _masked_extreme(log_w, valid, "min", empty=0.0).exp(),
        "is_raw_weight_max": _masked_extreme(log_w, valid, "max", empty=0.0).exp(),
    }


def _masked_extreme(values: Tensor, valid: Tensor, which: str, empty: float = 1.0) -> Tensor:
    """0-dim min or max of `values` over `valid` positions, `empty` when there are none. Masked with ±inf rather
    than indexed, so the device is never asked how many there are (no sync)."""
    fill = float("inf") if which == "min" else float("-inf")
    extreme = torch.where(valid, values, fill)
    extreme = extreme.amin() if which == "min" else extreme.amax()
    return torch.where(valid.any(), extreme, empty)


def _masked_mean(values: Tensor, valid: Tensor) -> Tensor:
    """0-dim mean of `values` over `valid` positions, 0 when there are none."""
    values = values.to(torch.promote_types(values.dtype, torch.float32))
    return torch.where(valid, values, 0.0).sum() / valid.sum().clamp(min=1)


def _check_inputs(
    cfg: PolicyLossConfig,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    normalizer: float,
    generator_logprobs: Tensor | None,
    reference_logprobs: Tensor | None,
    sampler_logprobs: Tensor | None = None,
) -> Tensor:
    """Raise ValueError naming the argument for a missing or misshapen input; return the mask as bool [B, T]."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    given = {
        "old_logprobs": old_logprobs,
        "mask": mask,
        "generator_logprobs": generator_logprobs,
        "reference_logprobs": reference_logprobs,
        "sampler_logprobs": sampler_logprobs,
    }
    for name, tensor in given.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs {tuple(logprobs.shape)}")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages must be [B] or [B, T] = {tuple(logprobs.shape)}, got shape {tuple(advantages.shape)}"
        )
    if cfg.importance_correction != "none" and generator_logprobs is None:
        raise ValueError(f"importance_correction={cfg.importance_correction!r} needs generator_logprobs")
    if cfg.reference_kl_penalty > 0 and reference_logprobs is None:
        raise ValueError(f"reference_kl_penalty={cfg.reference_kl_penalty} needs reference_logprobs")
    if cfg.aggregation == "seq-mean-token-sum-norm" and cfg.aggregation_constant is None:
        raise ValueError("aggregation='seq-mean-token-sum-norm' needs aggregation_constant (e.g. the max length; "
                         "PolicyLossConfig.resolved fills in the rollout's)")
    if not normalizer > 0:
        raise ValueError(f"normalizer must be positive (the step's count from loss_normalizer), got {normalizer}")
    return mask.bool()
