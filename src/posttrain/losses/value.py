"""The critic's loss for PPO with a value model, and the explained variance of its predictions.

`value_loss` regresses the critic's per-token values V on the returns R (`posttrain.advantages.gae_advantages`),
with PPO's optional clipping of the new value around the one that computed the advantages (Schulman et al. 2017's
reference implementation, openai/baselines ppo2, `cliprange_value` in TRL): per valid token

    ℓ_t = ½·max((V − R)², (clip(V, V_old − ε, V_old + ε) − R)²)

Normalization follows ARCHITECTURE.md ("Loss normalization"): the micro-batch's loss is Σ_t ℓ_t over its valid
tokens divided by `normalizer`, the valid-token count of the whole optimizer step (`value_loss_normalizer` summed
over every micro-batch and rank), so the split into micro-batches never changes the update.

Choices left open elsewhere:
- The clip is in value units (ε added to and subtracted from V_old), not relative, as in ppo2 and TRL.
- The max keeps whichever error is larger, so clipping never lowers the loss; a token whose clipped term is
  strictly the larger gets no gradient (the clipped value is constant in V there) and counts in the clip fraction.
"""

from __future__ import annotations

import torch
from torch import Tensor


def value_loss_normalizer(mask: Tensor) -> float:
    """This micro-batch's contribution to `value_loss`'s normalizer: its valid-token count. mask: [B, T]."""
    return float(mask.bool().sum())


def value_loss(
    values: Tensor,
    old_values: Tensor | None,
    returns: Tensor,
    mask: Tensor,
    clip: float | None,
    normalizer: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The (clipped) value loss of one micro-batch, normalized over the whole optimizer step.

    values: [B, T] the critic's current predictions (requires grad).
    old_values: [B, T] the predictions that computed the advantages (detached); required when clip is set.
    returns: [B, T] regression targets (detached). mask: [B, T], 1 on the tokens with a target.
        Values at masked positions are never used (they may be anything, nan included).
    clip: ε of the value clip, > 0; None: no clipping, ℓ_t = ½(V − R)².
    normalizer: the step-wide valid-token count, the sum of `value_loss_normalizer` over the step.

    Returns (loss, metrics); metrics are detached 0-dim tensors over this micro-batch's valid tokens (0 when there
    are none), to be averaged weighted by its token count: value_loss (mean ℓ_t), value_clip_fraction (tokens
    whose clipped term is strictly the larger), value_mean (mean V).
    """
    if values.dim() != 2:
        raise ValueError(f"values must be [B, T], got shape {tuple(values.shape)}")
    given = {"old_values": old_values, "returns": returns, "mask": mask}
    for name, tensor in given.items():
        if tensor is not None and tensor.shape != values.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, values {tuple(values.shape)}")
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be positive or None, got {clip}")
    if clip is not None and old_values is None:
        raise ValueError(f"clip={clip} needs old_values (the predictions that computed the advantages)")
    if not normalizer > 0:
        raise ValueError(f"normalizer must be positive (the step's valid-token count), got {normalizer}")

    valid = mask.bool()
    dtype = torch.promote_types(values.dtype, torch.float32)
    # Masked positions are zeroed first: a nan there would otherwise reach the gradient as 0·nan.
    values = torch.where(valid, values.to(dtype), 0.0)
    returns = torch.where(valid, returns.detach().to(dtype), 0.0)
    unclipped = (values - returns).square()
    if clip is None:
        per_token = unclipped
        clipped_larger = torch.zeros_like(valid)
    else:
        old_values = torch.where(valid, old_values.detach().to(dtype), 0.0)
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (clipped_values - returns).square()
        per_token = torch.maximum(unclipped, clipped)
        # Inside the clip range old + (V − old) equals V only up to rounding, which must not count as clipping.
        clipped_larger = (clipped > unclipped) & ((values - old_values).abs() > clip)
    per_token = 0.5 * torch.where(valid, per_token, 0.0)
    loss = per_token.sum() / normalizer

    with torch.no_grad():
        metrics = {
            "value_loss": _masked_mean(per_token.detach(), valid),
            "value_clip_fraction": _masked_mean(clipped_larger, valid),
            "value_mean": _masked_mean(values.detach(), valid),
        }
    return loss, metrics


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 − Var[R − V] / Var[R] over the valid tokens: 1 for a perfect critic, 0 for one no better than the mean
    return, negative for a worse one.

    values, returns, mask: [B, T] (any matching shape). Both variances are the population ones (divisor n; the
    divisor cancels in the ratio). Returns a 0-dim float32 tensor. Degenerate case: where Var[R] = 0 (every return
    equal, or fewer than two valid tokens) nothing varies to be explained and the ratio is undefined; the result is
    nan, as in cleanrl and Stable-Baselines3, rather than a number that would read as a verdict on the critic.
    """
    if values.shape != returns.shape or values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)}, returns {tuple(returns.shape)} and mask "
                         f"{tuple(mask.shape)} must have the same shape")
    valid = mask.bool()
    with torch.no_grad():
        target = returns.detach().double()[valid]
        error = target - values.detach().double()[valid]
        if target.numel() < 2:
            return torch.tensor(float("nan"))
        target_variance = target.var(unbiased=False)
        if target_variance == 0:
            return torch.tensor(float("nan"))
        return (1 - error.var(unbiased=False) / target_variance).float()


def _masked_mean(values: Tensor, valid: Tensor) -> Tensor:
    """0-dim mean of `values` over `valid` positions, 0 when there are none."""
    values = values.to(torch.promote_types(values.dtype, torch.float32))
    return torch.where(valid, values, 0.0).sum() / valid.sum().clamp(min=1)
