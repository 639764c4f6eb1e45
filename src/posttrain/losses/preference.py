"""Offline preference-optimization losses on per-sequence log-probabilities of (chosen, rejected) pairs.

Every variant is one small function of the same inputs, listed in `_VARIANTS`; `preference_loss` checks
the inputs, adds the optional SFT term, reduces over pairs and reports the same metrics for all.

Notation: π_c, π_r are the policy's log-probabilities of the chosen and rejected completions, ref_c, ref_r
the reference model's, |y_w|, |y_l| the completions' token counts, and h = (π_c − ref_c) − (π_r − ref_r).

Whether π are sums or per-token means over the completion is the caller's choice (`sequence_logps`), with
one exception: SimPO and ORPO length-normalize themselves, as their papers define them, so they need
SUMMED log-probabilities and both lengths.

Departures from the papers and from TRL:
- R-DPO puts +α·(|y_w| − |y_l|) inside the sigmoid. This is what Park et al. derive from the
  length-penalized objective max E[r − α|y|] − β·KL: the implied reward is β·log(π/π_ref) + α|y| + const.
  A longer chosen completion therefore already "explains" part of the preference and the pair pushes the
  policy less, which is the regularization. Written with a minus sign, a positive α would instead give
  more weight to pairs whose chosen completion is the longer one.
- `simpo_gamma` is the paper's target margin γ itself (Meng et al. eq. 6; TRL's `simpo_gamma` means the
  same, since it computes β·(Δ − γ/β)). The SimPO repository's `gamma_beta_ratio` is γ/β instead.
- ORPO's reward metrics are β × the per-token mean log-probability (as TRL reports them), so that
  `reward_accuracy` is exactly the fraction of pairs with a positive log odds ratio.
- The log odds of ORPO clamp the mean log-probability just below 0, where log(1 − p) is −inf.
- Reductions are over pairs: sum / `num_pairs_in_step` when given (the step-wide normalization of the
  project, so micro-batch splits do not change the update), else the mean over this batch.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from posttrain.config.losses import PreferenceLossConfig, PreferenceLossType  # the loss section is the loss config

def sequence_logps(token_logps: torch.Tensor, mask: torch.Tensor, average: bool) -> torch.Tensor:
    """Log-probability of each completion from its tokens'.

    token_logps: [B, T], e.g. from `posttrain.losses.nll.token_logprobs`.
    mask: [B, T], 1 on completion tokens; every row needs at least one (an average over none is nan).
    Returns [B]: the sum over masked tokens, or their mean when `average`.
    """
    if token_logps.shape != mask.shape:
        raise ValueError(f"token_logps {tuple(token_logps.shape)} and mask {tuple(mask.shape)} differ in shape")
    mask = mask.to(token_logps.dtype)
    summed = (token_logps * mask).sum(-1)
    return summed / mask.sum(-1) if average else summed


def reduce_over_step(per_pair_losses: torch.Tensor, num_pairs_in_step: float | None) -> torch.Tensor:
    """Sum of [B] per-pair losses / `num_pairs_in_step` (pairs in the whole optimizer step), else their mean.

    With the step-wide count, summing this over the step's micro-batches gives the mean over the step's
    pairs whatever the micro-batch split.
    """
    if num_pairs_in_step is None:
        return per_pair_losses.mean()
    if num_pairs_in_step <= 0:
        raise ValueError(f"num_pairs_in_step must be positive, got {num_pairs_in_step}")
    return per_pair_losses.sum() / num_pairs_in_step


class _Pairs(NamedTuple):
    """The checked inputs, each [B]; lengths are float. Optional fields are None when not given."""

    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    reference_chosen: torch.Tensor | None
    reference_rejected: torch.Tensor | None
    chosen_lengths: torch.Tensor | None
    rejected_lengths: torch.Tensor | None
    chosen_nll: torch.Tensor | None
    """Mean per-token NLL of the chosen completion: as given, else −π_c/|y_w| (π_c summed)."""


class _Terms(NamedTuple):
    """What a variant returns: per-pair losses and the implicit rewards the metrics report, each [B]."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    extras: dict[str, torch.Tensor]
    """Variant-specific [B] quantities, reported as batch means."""


def _reference_rewards(cfg: PreferenceLossConfig, p: _Pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's implicit rewards β·(π_c − ref_c) and β·(π_r − ref_r), each [B]."""
    return cfg.beta * (p.policy_chosen - p.reference_chosen), cfg.beta * (p.policy_rejected - p.reference_rejected)


def _dpo(cfg: PreferenceLossConfig, p: _Pairs) -> _Terms:
    """DPO (Rafailov et al. 2023, eq. 7): −log σ(β·h)."""
    chosen, rejected = _reference_rewards(cfg, p)
    return _Terms(-F.logsigmoid(chosen - rejected), chosen, rejected, {})


def _cdpo(cfg: PreferenceLossConfig, p: _Pairs) -> _Terms:
    """Conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences & relationship to IPO").

    −(1 − ε)·log σ(β·h) − ε·log σ(−β·h): DPO's loss when each label is flipped with probability ε.
    """
    chosen, rejected = _reference_rewards(cfg, p)
    logits = chosen - rejected
    eps = cfg.label_smoothing
    return _Terms(-(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits), chosen, rejected, {})


def _dpop(cfg: PreferenceLossConfig, p: _Pairs) -> _Terms:
    """DPO-Positive (Pal et al. 2024, "Smaug", eq. 3): −log σ(β·[h − λ·max(0, ref_c − π_c)]).

    The penalty is zero while the policy keeps the chosen completion at least as likely as the reference
    does, where DPOP equals DPO.
    """
    chosen, rejected = _reference_rewards(cfg, p)
    penalty = (p.reference_chosen - p.policy_chosen).clamp(min=0)
    losses = -F.logsigmoid(chosen - rejected - cfg.beta * cfg.dpop_lambda * penalty)
    return _Terms(losses, chosen, rejected, {"dpop_penalty": penalty})


def _rdpo(cfg: PreferenceLossConfig, p: _Pairs) -> _Terms:
    """Length-regularized DPO (Park et al. 2024, "Disentangling Length from Quality in DPO").

    −log σ(β·h + α·(|y_w| − |y_l|)): the length offset sits inside the sigmoid, outside β (see the module
    docstring for the sign).
    """
    chosen, rejected = _reference_rewards(cfg, p)
    length_offset = cfg.rdpo_alpha * (p.chosen_lengths - p.rejected_lengths)
    losses = -F.logsigmoid(chosen - rejected + length_offset)
    return _Terms(losses, chosen, rejected, {"length_offset": length_offset})


def _ipo(cfg: PreferenceLossConfig, p: _Pairs) -> _Terms:
    """IPO (Azar et al. 2023, eq. 17, the sampled loss, with τ = β): (h − 1/(2β))².

    A squared loss with its minimum at h = 1/(2β), so unlike DPO it stops pushing once the margin is met.
    TRL length-averages the log-probabilities for IPO; here that is the caller's `average` choice.
    """
    chosen, rejected = _reference_rewards(cfg, p)
    h = (p.policy_chosen - p.reference_chosen) - (p.policy_rejected - p.reference_rejected)
    return _Terms((h - 1 / (2 * cfg.beta)) ** 2, chosen, rejected, {})


def _simpo(cfg: PreferenceLossConfig, p: _Pairs) -> _Terms:
    """SimPO (Meng et al. 2024, eq. 6): −log σ(β·π_c/|y_w| − β·π_r/|y_l| − γ), reference-free.

    π are SUMMED log-probabilities; the rewards β·π/|y| are the length-normalized ones of the paper.
    """
    chosen = cfg.beta * p.policy_chosen / p.chosen_lengths
    rejected = cfg.beta * p.policy_rejected / p.rejected_lengths
    return _Terms(-F.logsigmoid(chosen - rejected - cfg.simpo_gamma), chosen, rejected, {})


def _log_odds(mean_logps: torch.Tensor) -> torch.Tensor:
    """log(p / (1 − p)) from log p ≤ 0: log p − log(1 − exp(log p)), stable on both sides of −ln 2."""
    x = mean_logps.clamp(max=-torch.finfo(mean_logps.dtype).eps)
    log1mexp = torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))
    return x - log1mexp


def _orpo(cfg: PreferenceLossConfig, p: _Pairs) -> _Terms:
    """ORPO (Hong et al. 2024, L_SFT + λ·L_OR, L_OR in eq. 7): NLL(chosen) − λ·log σ(log odds_c − log odds_r).

    odds = p / (1 − p) with log p the per-token MEAN log-probability π/|y| (eq. 4), so π are summed.
    NLL is the chosen completion's mean per-token NLL, averaged over pairs like the odds-ratio term (TRL
    averages it over all chosen tokens of the batch instead). Reference-free.
    """
    mean_chosen = p.policy_chosen / p.chosen_lengths
    mean_rejected = p.policy_rejected / p.rejected_lengths
    log_odds_ratio = _log_odds(mean_chosen) - _log_odds(mean_rejected)
    losses = p.chosen_nll - cfg.orpo_lambda * F.logsigmoid(log_odds_ratio)
    extras = {"log_odds_ratio": log_odds_ratio, "nll": p.chosen_nll}
    return _Terms(losses, cfg.beta * mean_chosen, cfg.beta * mean_rejected, extras)


class _Variant(NamedTuple):
    terms: Callable[[PreferenceLossConfig, _Pairs], _Terms]
    needs_reference: bool
    needs_lengths: bool
    """Both chosen_lengths and rejected_lengths."""


_VARIANTS: dict[str, _Variant] = {
    "dpo": _Variant(_dpo, needs_reference=True, needs_lengths=False),
    "ipo": _Variant(_ipo, needs_reference=True, needs_lengths=False),
    "cdpo": _Variant(_cdpo, needs_reference=True, needs_lengths=False),
    "dpop": _Variant(_dpop, needs_reference=True, needs_lengths=False),
    "rdpo": _Variant(_rdpo, needs_reference=True, needs_lengths=True),
    "simpo": _Variant(_simpo, needs_reference=False, needs_lengths=True),
    "orpo": _Variant(_orpo, needs_reference=False, needs_lengths=True),
}


def preference_loss(
    cfg: PreferenceLossConfig,
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor | None = None,
    reference_rejected_logps: torch.Tensor | None = None,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    chosen_nll: torch.Tensor | None = None,
    num_pairs_in_step: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The preference loss `cfg.type` over a batch of B (chosen, rejected) pairs.

    policy_chosen_logps, policy_rejected_logps: [B] log π(y_w|x), log π(y_l|x), summed or averaged over
        completion tokens as the caller chose; SimPO and ORPO need them summed.
    reference_chosen_logps, reference_rejected_logps: [B] the same under the reference model; required by
        dpo, ipo, cdpo, dpop, rdpo; ignored by simpo and orpo.
    chosen_lengths, rejected_lengths: [B] completion token counts; required by rdpo, simpo, orpo.
    chosen_nll: [B] mean per-token NLL of the chosen completion, for ORPO and `cfg.sft_weight`. When None it
        is −policy_chosen_logps / chosen_lengths, right only for summed log-probabilities: pass it when the
        log-probabilities are averaged.
    num_pairs_in_step: pairs in the whole optimizer step (all micro-batches and ranks); the loss is then the
        sum over this batch's pairs divided by it. None: the mean over this batch.
    Returns (loss, metrics). Metrics are batch means, as detached 0-dim tensors (read back once per step, not
    here): `reward_accuracy` (fraction of pairs with chosen_reward > rejected_reward, ties count as wrong),
    `chosen_reward`, `rejected_reward`, `margin`
    (their difference) and `loss`, plus each variant's extras and `sft_nll` when sft_weight > 0. The rewards
    are β·(π − ref) for reference-based losses, β·π/|y| for SimPO and ORPO (β × the mean token log-prob).
    """
    variant = _VARIANTS[cfg.type]
    pairs = _check_inputs(
        cfg.type,
        variant,
        cfg.sft_weight > 0,
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
        chosen_lengths,
        rejected_lengths,
        chosen_nll,
    )
    terms = variant.terms(cfg, pairs)
    losses, extras = terms.losses, dict(terms.extras)
    if cfg.sft_weight > 0:
        # The pairwise losses leave the absolute likelihood of the chosen completion free to fall; this
        # anchors it (as in RPO, Pang et al. 2024, and ORPO's own NLL term).
        losses = losses + cfg.sft_weight * pairs.chosen_nll
        extras["sft_nll"] = pairs.chosen_nll
    loss = reduce_over_step(losses, num_pairs_in_step)
    with torch.no_grad():
        chosen, rejected = terms.chosen_rewards, terms.rejected_rewards
        metrics = {
            "loss": loss.detach(),
            "reward_accuracy": (chosen > rejected).float().mean(),
            "chosen_reward": chosen.mean(),
            "rejected_reward": rejected.mean(),
            "margin": (chosen - rejected).mean(),
        }
        metrics.update({name: value.detach().mean() for name, value in extras.items()})
    return loss, metrics


def _check_inputs(
    loss_type: str,
    variant: _Variant,
    needs_nll: bool,
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor | None,
    reference_rejected_logps: torch.Tensor | None,
    chosen_lengths: torch.Tensor | None,
    rejected_lengths: torch.Tensor | None,
    chosen_nll: torch.Tensor | None,
) -> _Pairs:
    """Raise ValueError naming the loss and the argument for a missing or misshapen input; else pack them."""
    if policy_chosen_logps.dim() != 1:
        raise ValueError(f"{loss_type}: policy_chosen_logps must be [B], got shape {tuple(policy_chosen_logps.shape)}")
    given = {
        "policy_rejected_logps": policy_rejected_logps,
        "reference_chosen_logps": reference_chosen_logps,
        "reference_rejected_logps": reference_rejected_logps,
        "chosen_lengths": chosen_lengths,
        "rejected_lengths": rejected_lengths,
        "chosen_nll": chosen_nll,
    }
    for name, tensor in given.items():
        if tensor is not None and tensor.shape != policy_chosen_logps.shape:
            raise ValueError(
                f"{loss_type}: {name} has shape {tuple(tensor.shape)}, "
                f"policy_chosen_logps {tuple(policy_chosen_logps.shape)}"
            )
    if variant.needs_reference and (reference_chosen_logps is None or reference_rejected_logps is None):
        raise ValueError(
            f"{loss_type!r} is a reference-based loss: pass reference_chosen_logps and reference_rejected_logps"
        )
    if variant.needs_lengths and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError(f"{loss_type!r} needs chosen_lengths and rejected_lengths (completion token counts)")
    dtype = policy_chosen_logps.dtype
    chosen_lengths = None if chosen_lengths is None else chosen_lengths.to(dtype)
    rejected_lengths = None if rejected_lengths is None else rejected_lengths.to(dtype)
    if chosen_nll is None and chosen_lengths is not None:
        chosen_nll = -policy_chosen_logps / chosen_lengths
    if needs_nll and chosen_nll is None:
        raise ValueError(f"{loss_type}: sft_weight > 0 needs chosen_nll, or chosen_lengths with summed logps")
    return _Pairs(
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
        chosen_lengths,
        rejected_lengths,
        chosen_nll,
    )
