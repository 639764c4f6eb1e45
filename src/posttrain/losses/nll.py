"""Next-token negative log-likelihood, normalized by the target-token count of the whole optimizer step."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each token given the ones before it.

    logits: [B, T, V] model outputs (position t predicts token t + 1).
    input_ids: [B, T].
    Returns [B, T] float32 where entry t is log p(input_ids[t] | input_ids[<t]); entry 0 is 0.
    Computed as -cross_entropy, which never materializes a float32 copy of the full log-softmax.
    """
    shifted = -F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten(), reduction="none"
    ).view(input_ids.shape[0], -1)
    return F.pad(shifted, (1, 0))


def nll_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, num_target_tokens_in_step: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of target-token NLL in this micro-batch divided by the target count of the whole step.

    logits: [B, T, V]; input_ids: [B, T]; loss_mask: [B, T], 1 where input_ids[b, t] is a target.
    num_target_tokens_in_step: targets summed over every micro-batch (and data-parallel rank) of the
        optimizer step. Summing this function's losses over the step's micro-batches then gives the
        mean NLL per target token of the whole step, whatever the micro-batch split (the contract in
        ARCHITECTURE.md; averaging per micro-batch would weight short and long examples differently).
    Returns (loss, {"nll_sum": summed NLL, "target_tokens": targets in this micro-batch}), 0-dim tensors.
    """
    return nll_of_logprobs(token_logprobs(logits, input_ids), loss_mask, num_target_tokens_in_step)


def nll_of_logprobs(
    logprobs: torch.Tensor, loss_mask: torch.Tensor, num_target_tokens_in_step: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`nll_loss` from the token log-probabilities [B, T] (entry t: log p(token t | tokens < t)) instead of the
    logits: what the chunked LM head gives (posttrain.losses.chunked), where the logits never exist."""
    nll = -logprobs * loss_mask
    nll_sum = nll.sum()
    return nll_sum / num_target_tokens_in_step, {
        "nll_sum": nll_sum.detach(),
        "target_tokens": loss_mask.sum(),
    }
