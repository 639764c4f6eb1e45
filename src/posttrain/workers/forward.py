"""The one forward pass every worker runs: logits of a padded, packed, shared-prompt or rollout batch, and the
per-token log-probabilities read from them.

`token_logprobs_of` has a single meaning for every batch type: entry [b, t] is log p(token t | the tokens that
precede it in its own sequence), 0 where nothing does. For a shared-prompt batch (one row per preference pair:
prompt, chosen, rejected) that means the first rejected token is scored from the prompt's last position, not
from the chosen completion's last token, so a frozen scorer and the trained policy read pairs identically.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Literal, TypeVar

import torch
import torch.nn.functional as F

from posttrain.config.schema import TrainerConfig
from posttrain.data.types import RolloutBatch, SFTBatch, SharedPromptBatch
from posttrain.losses.chunked import chunked_token_logprobs
from posttrain.losses.nll import token_logprobs
from posttrain.errors import RunError
from posttrain.models.packing import block_causal_mask, custom_mask_problem, shared_prompt_mask

AnyBatch = SFTBatch | SharedPromptBatch | RolloutBatch
Batch = TypeVar("Batch", SFTBatch, SharedPromptBatch, RolloutBatch)
Outputs = Literal["logits", "target_logprobs"]
"""What a worker's forward pass hands a loss: the logits [B, T, V], or target_logprobs [B, T] float32, log p of each
target token (the batch's loss_mask) given the tokens before it and 0 elsewhere, which a chunked LM head computes
without the logits (`target_logprobs`)."""

PLAIN_LM_HEAD_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "phi3", "gpt2"})
"""Architectures whose logits are the LM head's linear map of the last hidden states and nothing more (no soft-capping
as in Gemma, no logit scaling as in Granite or Cohere), so the chunked head computes exactly what they do."""
AUTO_CHUNKED_HEAD_BYTES = 256 * 2**20
"""trainer.lm_head=auto chunks the head where a micro-batch's full float32 logits would reach this size."""


def forward_logits(model: torch.nn.Module, batch: AnyBatch) -> torch.Tensor:
    """Model outputs for `batch`: logits [B, T, V] of a causal LM ([B, 1] of a reward model).

    Packed batches (attention_mask None) get a block-diagonal causal mask built from their position ids;
    flash-attention-2 instead reads the example boundaries from position_ids itself. Shared-prompt batches get
    their tree-shaped mask from their segments (sdpa and eager attention only). Rollout batches are right-padded
    rows with default positions.
    """
    if isinstance(batch, RolloutBatch):
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    implementation = model.config._attn_implementation
    if isinstance(batch, SharedPromptBatch) or batch.attention_mask is None:
        # The recipes refuse these layouts before loading an unverified architecture; this is the last guard.
        problem = custom_mask_problem(model.config, batch.input_ids.shape[1])
        if problem:
            raise RunError(f"packed or shared-prompt rows would not be exact: {problem}")
    if isinstance(batch, SharedPromptBatch):
        attention_mask = shared_prompt_mask(batch.segments, implementation, model.dtype)
    else:
        attention_mask = batch.attention_mask
        if attention_mask is None and implementation != "flash_attention_2":
            attention_mask = block_causal_mask(batch.position_ids, implementation, model.dtype)
    return model(
        input_ids=batch.input_ids,
        attention_mask=attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).logits


def lm_head_problem(model: torch.nn.Module) -> str | None:
    """Why the chunked LM head would not compute exactly what `model`'s forward does, or None."""
    model_type = model.config.model_type
    if model_type not in PLAIN_LM_HEAD_MODEL_TYPES:
        return (f"the chunked LM head is verified for the architectures whose logits are a plain linear map of the "
                f"hidden states ({', '.join(sorted(PLAIN_LM_HEAD_MODEL_TYPES))}), not for model_type {model_type!r}")
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        return f"{type(model).__name__}'s output embedding is no torch.nn.Linear"
    return None


def uses_chunked_head(mode: str, batch: AnyBatch, vocab_size: int, problem: str | None) -> bool:
    """Whether trainer.lm_head=`mode` chunks the LM head for `batch` (a model whose head has `problem`, or None)."""
    if mode == "full" or not isinstance(batch, SFTBatch):
        return False
    if mode == "chunked":
        return True  # the worker refused it at construction when there is a problem
    return problem is None and batch.input_ids.numel() * vocab_size * 4 >= AUTO_CHUNKED_HEAD_BYTES


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def target_logprobs(model: torch.nn.Module, batch: SFTBatch, chunk_size: int) -> torch.Tensor:
    """[B, T] float32 log p(token t | tokens < t) at the batch's targets (loss_mask), 0 elsewhere, with the LM head
    applied only to the positions that predict a target, chunk by chunk (posttrain.losses.chunked): neither the
    [B, T, V] logits nor those of prompt and padding positions ever exist.

    The hidden states come from the model's own forward, its LM head's forward replaced by the identity for that
    pass (so the head multiplies nothing there), so masks and positions are exactly those of `forward_logits`."""
    head = model.get_output_embeddings()
    head.forward = _identity  # an instance attribute: for this pass the head returns its input, computing nothing
    try:
        hidden = forward_logits(model, batch)
    finally:
        del head.forward
    targets = batch.loss_mask[:, 1:].bool()
    scored = chunked_token_logprobs(hidden[:, :-1][targets], head.weight, batch.input_ids[:, 1:][targets],
                                    bias=head.bias, chunk_size=chunk_size)
    shifted = torch.zeros(targets.shape, dtype=scored.dtype, device=scored.device).masked_scatter(targets, scored)
    return F.pad(shifted, (1, 0))


def token_logprobs_of(logits: torch.Tensor, batch: AnyBatch, temperature: float = 1.0) -> torch.Tensor:
    """[B, T] float32 log-probability of each token of `batch` given its own sequence (see the module docstring),
    under `temperature` (logits divided by it; 1 leaves them as they are)."""
    if temperature != 1.0:
        logits = logits.float() / temperature
    logps = token_logprobs(logits, batch.input_ids)
    if isinstance(batch, SharedPromptBatch):
        rows = torch.arange(batch.num_examples, device=logits.device)
        first_rejected = -F.cross_entropy(logits[rows, batch.prompt_ends].float(),
                                          batch.input_ids[rows, batch.rejected_starts], reduction="none")
        logps = logps.index_put((rows, batch.rejected_starts), first_rejected)
    return logps


def batch_to(batch: Batch, device: torch.device) -> Batch:
    """The batch with its tensors (and dicts of tensors) on `device`; the same object on CPU."""
    if device.type == "cpu":
        return batch
    moved = {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if isinstance(value, torch.Tensor):
            moved[field.name] = value.to(device)
        elif isinstance(value, dict):
            moved[field.name] = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in value.items()}
    return dataclasses.replace(batch, **moved)


def autocast(trainer: TrainerConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast around a forward pass when trainer.precision is bf16; nothing otherwise."""
    if trainer.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
