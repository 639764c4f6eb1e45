"""Log-probabilities of chosen tokens straight from the last hidden states, without the [N, V] logits tensor.

`chunked_token_logprobs(hidden, weight, targets)` equals
`torch.log_softmax(hidden @ weight.T / temperature, -1).gather(-1, targets)`, but walks the N positions in chunks
of `chunk_size`: each chunk's logits exist only while that chunk is worked on, in the forward pass and again in
the backward pass, which recomputes them instead of keeping them. Peak memory grows with chunk_size · V rather
than N · V: for one 4,096-token row and a 151,936-token vocabulary the full fp32 logits alone are 2.5 GB, and
log_softmax and its gradient each add as much again.

Exact to fp32 rounding against the full computation, values and gradients (tests/test_chunked_logprobs.py); not
bit-identical, since a matrix product over fewer rows may take other kernels. The backward pass is the textbook
one: for position i with target y, d log p_y / d z = onehot(y) − softmax(z), scaled by 1/temperature.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

DEFAULT_CHUNK_SIZE = 1024
"""Positions per chunk: 1,024 × 151,936 fp32 logits are 0.6 GB, small next to a model that has such a vocabulary,
and chunks that size keep the matrix products large enough to run at full speed."""


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                           bias: torch.Tensor | None = None, temperature: float = 1.0,
                           chunk_size: int = DEFAULT_CHUNK_SIZE, return_entropy: bool = False
                           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax((hidden @ weight.T + bias) / temperature)[targets], chunk by chunk.

    hidden: [..., H] the positions whose next token is scored (only those: gather them first, so prompt and
        padding positions never reach the LM head). weight: [V, H] the LM head (tied or not); bias: [V] or None.
    targets: [...] token ids, the same leading shape as hidden. Returns float32 [...] (float64 for float64 inputs).
    return_entropy: also return the entropy of each position's distribution (same shape, no gradient: a metric),
        computed from the same chunk's logits, so it costs a softmax, not another pass through the head.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree on the positions")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [vocabulary, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    # Outside autocast: under bf16 autocast the products below would run in bf16, not in float32.
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        flat, entropy = _ChunkedTokenLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                                    targets.reshape(-1), float(temperature), int(chunk_size),
                                                    bool(return_entropy))
    if return_entropy:
        return flat.reshape(targets.shape), entropy.reshape(targets.shape)
    return flat.reshape(targets.shape)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, return_entropy):
        dtype = _compute_dtype(hidden)
        out = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        entropy = torch.empty(hidden.shape[0] if return_entropy else 0, dtype=dtype, device=hidden.device)
        # One float32 copy of a bf16/fp16 head per call (a no-op for float32), not one per chunk.
        head, head_bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            logits = _chunk_logits(hidden[start : start + chunk_size], head, head_bias, temperature)
            chosen = logits.gather(-1, targets[start : start + chunk_size, None]).squeeze(-1)
            out[start : start + chunk_size] = chosen - torch.logsumexp(logits, dim=-1)
            if return_entropy:
                entropy[start : start + chunk_size] = entropy_of_logits(logits)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_entropy):
        hidden, weight, bias, targets = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        dtype = _compute_dtype(hidden)
        head, head_bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if need_bias else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            stop = start + ctx.chunk_size
            logits = _chunk_logits(hidden[start:stop], head, head_bias, ctx.temperature)
            # d/dz of (z_y - logsumexp z) is onehot(y) - softmax(z); times the incoming gradient and 1/temperature.
            grad_logits = torch.softmax(logits, dim=-1).neg_()
            grad_logits.scatter_add_(-1, targets[start:stop, None], torch.ones_like(grad_logits[:, :1]))
            grad_logits.mul_((grad_out[start:stop].to(dtype) / ctx.temperature)[:, None])
            if need_hidden:
                grad_hidden[start:stop] = (grad_logits @ head).to(hidden.dtype)
            if need_weight:
                grad_weight.addmm_(grad_logits.T, hidden[start:stop].to(dtype))
            if need_bias:
                grad_bias += grad_logits.sum(0)
            del logits, grad_logits
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        if need_bias:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def entropy_of_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dimension of `logits` (−inf logits contribute 0, not nan)."""
    probs = torch.softmax(logits, dim=-1)
    return -torch.special.xlogy(probs, probs).sum(-1)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """float32 for fp32, bf16 and fp16 inputs; float64 stays float64 (for gradcheck)."""
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  temperature: float) -> torch.Tensor:
    dtype = _compute_dtype(hidden)
    logits = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        logits += bias.to(dtype)
    if temperature != 1.0:
        logits /= temperature
    return logits
