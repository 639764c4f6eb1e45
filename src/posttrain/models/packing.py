"""Attention masks for packed rows (several examples in one row, none attending to another)."""

from __future__ import annotations

import torch


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] index of the example each token belongs to: a new one starts wherever positions do not go up by 1."""
    previous = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=previous, dim=-1) != 1).cumsum(-1)


def block_causal_mask(position_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, T, T] mask letting token q attend to token k only if k <= q within the same example.

    Built explicitly rather than left to transformers' detection of packed position ids, whose result
    (transformers 5.2x) still let later examples in a row attend to earlier ones. sdpa takes a boolean
    mask (True = attend); eager attention adds the mask to the scores, so it gets 0 / dtype-min.
    """
    segments = segment_ids(position_ids)
    width = position_ids.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=position_ids.device).tril()
    allowed = ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]
    if attn_implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device).masked_fill(~allowed, torch.finfo(dtype).min)
