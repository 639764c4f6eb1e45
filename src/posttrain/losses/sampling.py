"""The distribution a sampler draws from when top-k or top-p is on, as the trainer reads it from its own logits.

A sampler with top-k/top-p keeps a subset of the vocabulary and renormalises over it, and reports the
log-probabilities of that truncated distribution. The trainer's log-softmax is of the full one: with truncation the
two differ by log Σ_kept p (about −log top_p for nucleus sampling), whatever the weights. Comparing them, as a
trainer–generator mismatch metric does, then measures the truncation, not the mismatch (TRL #6789).
`sampled_token_logprobs` applies to the trainer's logits the same truncation the transformers generator applies
(generation/transformers_backend.py, `sample_next_token`): logits / temperature; top-k keeps the logits at least as
large as the k-th largest (ties kept); top-p drops a token when the tokens ranked above it already reach top_p (the
top token always stays); then log-softmax over what is kept. vLLM's sampler applies the same rules.
"""

from __future__ import annotations

import torch
from torch import Tensor


def truncated_logprobs(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """[..., V] float32 log-probabilities of the sampling distribution of logits [..., V]: divided by `temperature`,
    top-k (0: off) and top-p (1: off) applied, renormalised over the kept tokens; −inf outside them."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        sorted_probs = sorted_logits.softmax(-1)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return logits.log_softmax(-1)


@torch.no_grad()
def sampled_token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float, top_k: int, top_p: float,
                           chunk_positions: int = 1024) -> Tensor:
    """[B, T] float32: entry t is log q(input_ids[t] | input_ids[<t]) under the truncated sampling distribution q
    of logits [B, T, V] (position t predicts token t + 1, as in `nll.token_logprobs`); entry 0 is 0; −inf for a
    token outside the kept set. No graph (a metric). Positions are worked on `chunk_positions` at a time: the sort
    of top-p holds a few [chunk, V] tensors, not [B·T, V] ones."""
    rows, length = input_ids.shape
    flat_logits = logits[:, :-1].reshape(rows * (length - 1), -1)
    targets = input_ids[:, 1:].reshape(-1)
    values = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, targets.numel(), chunk_positions):
        stop = start + chunk_positions
        chunk = truncated_logprobs(flat_logits[start:stop], temperature, top_k, top_p)
        values[start:stop] = chunk.gather(-1, targets[start:stop, None]).squeeze(-1)
    return torch.nn.functional.pad(values.view(rows, length - 1), (1, 0))
