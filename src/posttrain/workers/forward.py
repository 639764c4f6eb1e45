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
from torch.distributed.fsdp import FSDPModule
import torch.nn.functional as F

from posttrain.config.schema import TrainerConfig
from posttrain.data.types import RolloutBatch, SFTBatch, SharedPromptBatch
from posttrain.losses.chunked import chunked_token_logprobs, entropy_of_logits
from posttrain.losses.nll import token_logprobs
from posttrain.errors import RunError
from posttrain.models.packing import block_causal_mask, custom_mask_problem, shared_prompt_mask

AnyBatch = SFTBatch | SharedPromptBatch | RolloutBatch
Batch = TypeVar("Batch", SFTBatch, SharedPromptBatch, RolloutBatch)
Outputs = Literal["logits", "target_logprobs", "target_scores", "target_hidden"]
"""What a worker's forward pass hands a loss: the logits [B, T, V]; target_logprobs [B, T] float32, log p of each
target token (the batch's loss_mask; a shared-prompt row's chosen and rejected tokens) given the tokens before it
in its own sequence; or TargetScores (those log-probabilities and the entropies of the same distributions). The
last two are what a chunked LM head computes without the logits (`chunked_head_outputs`); from full logits they
hold every position, from the chunked head 0 off the targets, so a loss reads them at its targets only.
target_hidden: with a chunked head, TargetHidden (the hidden states at the targets and the head, for a loss that
applies the head itself chunk by chunk, as distillation does); with a full head, the logits."""

PLAIN_LM_HEAD_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "phi3", "gpt2"})
"""Architectures whose logits are the LM head's linear map of the last hidden states and nothing more (no soft-capping
as in Gemma, no logit scaling as in Granite or Cohere), so the chunked head computes exactly what they do."""
AUTO_CHUNKED_HEAD_BYTES = 256 * 2**20
"""trainer.lm_head=auto chunks the head where a micro-batch's full float32 logits would reach this size."""


def forward_logits(model: torch.nn.Module, batch: AnyBatch) -> torch.Tensor:
    """Model outputs for `batch`: logits [B, T, V] of a causal LM ([B, 1] of a reward model).

    Packed batches (attention_mask None) get a block-diagonal causal mask built from their position ids;
    flash-attention-2 instead reads the example boundaries from position_ids itself (`call_with_positions`). Shared-prompt batches get
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
    return call_with_positions(model, batch.input_ids, batch.position_ids, attention_mask)


def call_with_positions(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                        attention_mask: torch.Tensor | None) -> torch.Tensor:
    """model(...).logits of rows with explicit position ids. Packed rows under flash-attention-2 (no mask: it reads
    the example boundaries from the position ids) are laid end to end into one row for the call and the outputs
    cut back into rows, because transformers (5.2x, `_is_packed_sequence`) reads the boundaries only when the
    batch has a single row; with several it would let each row's examples attend to each other."""
    rows, width = input_ids.shape
    if attention_mask is None and model.config._attn_implementation == "flash_attention_2" and rows > 1:
        out = model(input_ids=input_ids.reshape(1, -1), position_ids=position_ids.reshape(1, -1),
                    use_cache=False).logits
        return out.reshape(rows, width, *out.shape[2:]) if out.dim() == 3 else out
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 use_cache=False).logits


def lm_head_problem(model: torch.nn.Module) -> str | None:
    """Why the chunked LM head would not compute exactly what `model`'s forward does, or None."""
    if any(isinstance(m, FSDPModule) for m in model.modules()):  # the root, or a LoRA base inside a sharded one
        return "the LM head of an FSDP2-sharded model is sharded over the ranks; the chunked head runs in one process"
    model_type = model.config.model_type
    if model_type not in PLAIN_LM_HEAD_MODEL_TYPES:
        return (f"the chunked LM head is verified for the architectures whose logits are a plain linear map of the "
                f"hidden states ({', '.join(sorted(PLAIN_LM_HEAD_MODEL_TYPES))}), not for model_type {model_type!r}")
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        return f"{type(model).__name__}'s output embedding is no torch.nn.Linear"
    return None


def uses_chunked_head(mode: str, batch: AnyBatch, vocab_size: int, problem: str | None,
                      rows: int | None = None) -> bool:
    """Whether trainer.lm_head=`mode` chunks the LM head for `batch` (a model whose head has `problem`, or None).
    `rows`: decide as for a batch of that many rows of this length (a rollout batch's passes, old-policy, reference
    and training alike, are cut to trainer.micro_batch_size rows of the same length, so all of them take the same
    path); the batch's own row count otherwise."""
    if mode == "full":
        return False
    if mode == "chunked":
        return True  # the worker refused it at construction when there is a problem
    rows = batch.input_ids.shape[0] if rows is None else rows
    return problem is None and rows * batch.input_ids.shape[1] * vocab_size * 4 >= AUTO_CHUNKED_HEAD_BYTES


@dataclasses.dataclass(frozen=True)
class TargetScores:
    """What outputs="target_scores" hands a loss (the RL policy losses): at each target token t (the batch's
    loss_mask), `logprobs` [B, T] float32 log p(token t | tokens < t) with its graph, and `entropy` [B, T] float32
    the entropy of that same distribution (the one token t was drawn from), without a graph: a metric. Both are
    under the worker call's temperature and 0 off the targets."""

    logprobs: torch.Tensor
    entropy: torch.Tensor


@dataclasses.dataclass(frozen=True)
class TargetHidden:
    """What outputs="target_hidden" hands a loss when the LM head is chunked: `hidden` [n, H] the last hidden
    states at the n positions that predict a target (`target_positions` order: row by row), with their graph;
    `weight` [V, H] and `bias` [V] or None, the LM head; `rows`, `sources`, `columns` [n] where each sits (the
    target is input_ids[rows, columns], predicted from position sources of the same row); `chunk_size` the
    positions per chunk the loss may apply the head to at once (trainer.lm_head_chunk_size)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    rows: torch.Tensor
    sources: torch.Tensor
    columns: torch.Tensor
    chunk_size: int


def target_mask(batch: AnyBatch) -> torch.Tensor:
    """[B, T] bool, the batch's target tokens: the loss_mask's (a shared-prompt row's chosen and rejected tokens),
    never position 0 (no token precedes it)."""
    if isinstance(batch, SharedPromptBatch):
        targets = (batch.chosen_mask + batch.rejected_mask) > 0
    else:
        targets = batch.loss_mask > 0
    targets[:, 0] = False
    return targets


def target_positions(batch: AnyBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, sources, columns) of every target token of `batch`, row-major: token [row, column] is predicted by
    the hidden state at [row, source]. Targets are the loss_mask's tokens (a shared-prompt row's chosen and
    rejected tokens); the source is the position before, except for a shared-prompt row's first rejected token,
    which is predicted from the prompt's last position (see the module docstring). Position 0 is never a target."""
    rows, columns = target_mask(batch).nonzero(as_tuple=True)
    sources = columns - 1
    if isinstance(batch, SharedPromptBatch):
        first_rejected = columns == batch.rejected_starts[rows]
        sources = torch.where(first_rejected, batch.prompt_ends[rows], sources)
    return rows, sources, columns


def identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def chunked_head_outputs(model: torch.nn.Module, batch: AnyBatch, kind: Outputs, chunk_size: int,
                         temperature: float = 1.0) -> torch.Tensor | TargetScores:
    """`kind` ("target_logprobs" or "target_scores") for `batch` with the LM head applied only to the positions
    that predict a target, chunk by chunk (posttrain.losses.chunked): neither the [B, T, V] logits nor those of
    prompt and padding positions ever exist.

    The hidden states come from the model's own forward, its LM head's forward replaced by the identity for that
    pass (so the head multiplies nothing there), so masks and positions are exactly those of `forward_logits`."""
    hidden, (rows, sources, columns) = target_hidden(model, batch)
    head = model.get_output_embeddings()
    scored = chunked_token_logprobs(hidden, head.weight, batch.input_ids[rows, columns],
                                    bias=head.bias, temperature=temperature, chunk_size=chunk_size,
                                    return_entropy=kind == "target_scores")
    def placed(values: torch.Tensor) -> torch.Tensor:  # [n] at the targets -> [B, T], 0 elsewhere
        return values.new_zeros(batch.input_ids.shape).index_put((rows, columns), values)

    if kind == "target_logprobs":
        return placed(scored)
    return TargetScores(*(placed(values) for values in scored))


def target_hidden(model: torch.nn.Module, batch: AnyBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """([n, H] the last hidden states at the positions that predict the batch's n targets, `target_positions`),
    from one forward pass whose LM head computes nothing."""
    head = model.get_output_embeddings()
    head.forward = identity  # an instance attribute: for this pass the head returns its input, computing nothing
    try:
        hidden = forward_logits(model, batch)
    finally:
        del head.forward
    positions = target_positions(batch)
    rows, sources, _ = positions
    return hidden[rows, sources], positions


@torch.no_grad()
def topk_at_targets(hidden: torch.Tensor, head: torch.nn.Module, positions: tuple[torch.Tensor, ...],
                    shape: torch.Size, k: int, chunk_size: int, temperature: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T, k] log-probabilities, [B, T, k] ids) of the k likeliest tokens at each position that predicts a
    target (the position before it, as in `topk_logprobs`), 0 elsewhere, from the hidden states there ([n, H],
    `target_hidden`): the LM head on chunk_size positions at a time, never on the others."""
    rows, sources, _ = positions
    values = torch.zeros((*shape, k), dtype=torch.float32, device=hidden.device)
    ids = torch.zeros((*shape, k), dtype=torch.long, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        logits = F.linear(hidden[start : start + chunk_size], head.weight, head.bias).float() / temperature
        top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        at = (rows[start : start + chunk_size], sources[start : start + chunk_size])
        values.index_put_(at, top.values)
        ids.index_put_(at, top.indices)
    return values, ids


def outputs_of_logits(logits: torch.Tensor, batch: AnyBatch, kind: Outputs,
                      temperature: float = 1.0) -> torch.Tensor | TargetScores:
    """`kind` from the full logits [B, T, V]: the logits themselves, the log-probabilities of `token_logprobs_of`
    (every position, a superset of the targets'), or TargetScores."""
    if kind == "logits":
        return logits
    logprobs = token_logprobs_of(logits, batch, temperature)
    if kind == "target_logprobs":
        return logprobs
    return TargetScores(logprobs, target_entropy(logits.detach(), batch, temperature))


def target_entropy(logits: torch.Tensor, batch: AnyBatch, temperature: float = 1.0,
                   chunk_tokens: int = 4096) -> torch.Tensor:
    """[B, T] float32 entropy of the distribution each target token was drawn from (logits [B, T, V] divided by
    `temperature`), 0 off the targets; float32 copies of at most `chunk_tokens` positions' logits at a time. Logits
    of −inf (forbidden tokens) contribute 0, not nan. Every position is computed and the targets are selected by
    masking, not indexing, so the device is never asked where they are (no sync)."""
    rows, length = batch.input_ids.shape
    entropy = torch.zeros((rows, length), dtype=torch.float32, device=logits.device)
    row_step = max(1, chunk_tokens // max(length - 1, 1))
    column_step = length - 1 if row_step > 1 else chunk_tokens  # rows longer than a chunk go in pieces
    with torch.no_grad():
        for row in range(0, rows, row_step):
            for column in range(0, length - 1, column_step):
                chunk = logits[row : row + row_step, column : min(column + column_step, length - 1)].float()
                if temperature != 1.0:
                    chunk = chunk / temperature
                entropy[row : row + row_step, column + 1 : column + 1 + chunk.shape[1]] = entropy_of_logits(chunk)
                del chunk
        if isinstance(batch, SharedPromptBatch):  # the first rejected token is drawn from the prompt's last position
            index = torch.arange(rows, device=logits.device)
            entropy = entropy.index_put((index, batch.rejected_starts), entropy[index, batch.prompt_ends + 1])
    return torch.where(target_mask(batch), entropy, 0.0)


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
            moved[field.name] = to_device(value, device)
        elif isinstance(value, dict):
            moved[field.name] = {k: to_device(v, device) if isinstance(v, torch.Tensor) else v
                                 for k, v in value.items()}
        elif dataclasses.is_dataclass(value):  # the rows of a PairBatch or DistillBatch
            moved[field.name] = batch_to(value, device)
    return dataclasses.replace(batch, **moved)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to a CUDA device from pinned memory without waiting for the copy (the next kernel on
    the stream waits for it); anything else moved as usual."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def autocast(trainer: TrainerConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast around a forward pass when trainer.precision is bf16; nothing otherwise."""
    if trainer.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
