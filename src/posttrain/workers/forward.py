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
from typing import TypeVar

import torch
import torch.nn.functional as F

from posttrain.config.schema import TrainerConfig
from posttrain.data.types import RolloutBatch, SFTBatch, SharedPromptBatch
from posttrain.losses.nll import token_logprobs
from posttrain.errors import RunError
from posttrain.models.packing import block_causal_mask, custom_mask_problem, shared_prompt_mask

AnyBatch = SFTBatch | SharedPromptBatch | RolloutBatch
Batch = TypeVar("Batch", SFTBatch, SharedPromptBatch, RolloutBatch)


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
