"""Attention masks for packed rows (several examples in one row, none attending to another)."""

from __future__ import annotations

import torch

from posttrain.data.types import PROMPT


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
    return attention_form(allowed, attn_implementation, dtype)


def attention_form(allowed: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    if attn_implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def shared_prompt_mask(segments: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, T, T] mask for rows holding a prompt once and then two completions of it.

    Token q attends to token k <= q when k is in the prompt or in q's own segment: the chosen and the rejected
    completion each see the prompt and themselves, never each other (padding, never read, sees the prompt and
    padding). Every token may attend to itself, so no softmax is empty. Booleans for sdpa, 0 / dtype-min for eager.
    """
    width = segments.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    allowed = ((same | (segments[:, None, :] == PROMPT)) & causal)[:, None]
    return attention_form(allowed, attn_implementation, dtype)


# ---- which architectures take these masks exactly -------------------------------------------------------------

VERIFIED_MASK_MODEL_TYPES = frozenset({
    "gemma3_text", "gpt2", "granite", "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen2_moe", "qwen3",
})
"""Architectures (config.model_type) whose packed rows and shared-prompt rows are checked, in
tests/test_architecture_masks.py with a tiny random model of each, to give the log-probabilities of separate padded
rows to float rounding, with sdpa and with eager attention. Others may apply position ids or masks their own way
(ALiBi, learned position offsets, their own mask code: Bloom fails on a custom mask), so packing and shared-prompt
rows are refused for them rather than silently different."""


def custom_mask_problem(model_config, max_length: int) -> str | None:
    """Why packed or shared-prompt rows of up to `max_length` tokens would not be exact for the model with this
    transformers config, or None when they are."""
    if problem := unverified_architecture(model_config):
        return problem
    model_type = model_config.model_type
    window = getattr(model_config, "sliding_window", None)
    uses_window = window is not None and getattr(model_config, "use_sliding_window", True) is not False
    if uses_window and window < max_length:
        return (f"{model_type} attends within a sliding window of {window} tokens, shorter than data.max_length="
                f"{max_length}; a custom mask would replace the window")
    return None


def unverified_architecture(model_config) -> str | None:
    """Why this architecture's custom masks are not trusted (not among VERIFIED_MASK_MODEL_TYPES), or None."""
    model_type = getattr(model_config, "model_type", None)
    if model_type not in VERIFIED_MASK_MODEL_TYPES:
        return (f"architecture {model_type!r} is not among those whose custom attention masks are verified exact "
                f"({', '.join(sorted(VERIFIED_MASK_MODEL_TYPES))})")
    return None
