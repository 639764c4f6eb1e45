"""trainer.packing: the decoder runs on a padded micro-batch's rows packed end to end, and its outputs are read back
in the padded layout, so no loss, metric or caller sees a difference.

A padded batch (an `SFTBatch` with an attention mask, a `SharedPromptBatch`, a `RolloutBatch`) wastes the padding
of its shorter rows: every layer computes it, and for variable-length data it can be most of the batch. Packing
puts several rows side by side into one of the same width (first-fit decreasing, never wider than the batch's
widest row, so no packed row costs more attention than a padded one), gives each its own position ids, and masks
attention so that a token sees only earlier tokens of its own row (for a shared-prompt row, the tree of
`models.packing.shared_prompt_mask` inside its block). Each output is then read where its token landed:

- log-probabilities and entropies of the target tokens (the chunked LM head on the packed hidden states, or the
  model's own logits gathered at the positions that predict a target), placed at their padded [B, T] positions;
- a sequence classifier's score (reward models) at each row's last non-pad token, as the model pools it;
- a critic's per-token values, and full logits, gathered back to [B, T, ...].

Exact to float rounding for the architectures whose custom masks are verified (models/packing.py); refused for
others. The packing itself is decided on the host from the rows' lengths.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from posttrain.data.collate import pack_rows
from posttrain.data.types import PADDING, PROMPT, RolloutBatch, SharedPromptBatch
from posttrain.errors import RunError
from posttrain.losses.chunked import chunked_token_logprobs, entropy_of_logits
from posttrain.models.packing import attention_form, custom_mask_problem
from posttrain.models.value_head import head_outputs_during
from posttrain.workers.forward import (
    AnyBatch,
    TargetScores,
    to_device,
    call_with_positions,
    identity,
    target_positions,
)

ENTROPY_CHUNK_ROWS = 4096
"""Target positions whose float32 logits the full-head path turns into entropies at a time."""


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """A padded [B, T] batch's real tokens in R <= B rows of width L <= T.

    input_ids, position_ids: [R, L]; each padded row's tokens are contiguous, with its own position ids.
    blocks: [R, L] long, the padded row each token came from (-1 on a packed row's empty tail).
    segments: [R, L] long, a shared-prompt batch's segment labels (PADDING on the tail); None for other batches.
    index: [B, T] long, where each padded token landed in the flattened [R * L] packed tokens (0 for padding,
        which is never read).
    lengths: [B] long, real tokens of each padded row.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    blocks: torch.Tensor
    segments: torch.Tensor | None
    index: torch.Tensor
    lengths: torch.Tensor

    def attention_mask(self, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor | None:
        """[R, 1, L, L]: token q sees token k <= q of its own block (within a shared-prompt block, the prompt and
        its own completion only). None for flash-attention-2, which finds the blocks from the position ids."""
        if attn_implementation == "flash_attention_2":
            return None
        width = self.input_ids.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=self.input_ids.device).tril()
        allowed = (self.blocks[:, :, None] == self.blocks[:, None, :]) & causal
        if self.segments is not None:
            allowed &= (self.segments[:, :, None] == self.segments[:, None, :]) | (self.segments[:, None, :] == PROMPT)
        return attention_form(allowed[:, None], attn_implementation, dtype)

    def gather(self, packed: torch.Tensor) -> torch.Tensor:
        """[R, L, ...] values of the packed tokens -> [B, T, ...] at the padded positions (padding: some packed
        token's value, never meant to be read)."""
        return packed.flatten(0, 1)[self.index]


def real_tokens(batch: AnyBatch) -> torch.Tensor:
    """[B, T] bool, the batch's real (non-padding) tokens."""
    if isinstance(batch, SharedPromptBatch):
        return batch.segments != PADDING
    if batch.attention_mask is None:
        raise ValueError("this batch is packed already (attention_mask None); trainer.packing packs padded batches")
    return batch.attention_mask > 0


def pack_batch(batch: AnyBatch) -> PackedRows:
    """The packed layout of a right-padded batch: its rows first-fit decreasing into rows no wider than its widest
    (`data.collate.pack_rows`), tokens in order within each. The layout is worked out on the host from the rows'
    real tokens (for a batch on a GPU, the one read-back of this function) and copied to the batch's device."""
    real = real_tokens(batch).cpu()
    rows, length = real.shape
    lengths = real.sum(-1)
    if not torch.equal(real, torch.arange(length)[None, :] < lengths[:, None]):
        raise ValueError("trainer.packing packs right-padded rows (real tokens first, then padding); this batch has "
                         "padding between real tokens")
    host_lengths = lengths.tolist()
    groups = pack_rows(host_lengths, max(host_lengths))
    width = max(sum(host_lengths[i] for i in group) for group in groups)
    flat_index = torch.zeros(rows, length, dtype=torch.long)
    blocks = torch.full((len(groups), width), -1, dtype=torch.long)
    for packed_row, group in enumerate(groups):
        start = 0
        for row in group:
            n = host_lengths[row]
            flat_index[row, :n] = torch.arange(packed_row * width + start, packed_row * width + start + n)
            blocks[packed_row, start : start + n] = row
            start += n
    tail = blocks < 0  # a packed row's empty end: positions 0, 1, ... of its own
    tail_positions = torch.cumsum(tail, -1) - 1
    sources, (target_rows, target_columns) = flat_index[real], real.nonzero(as_tuple=True)
    device = batch.input_ids.device
    sources, target_rows, target_columns, flat_index, blocks, tail, tail_positions, lengths = (
        to_device(t, device) for t in (sources, target_rows, target_columns, flat_index, blocks, tail,
                                        tail_positions, lengths))

    def scattered(values: torch.Tensor, fill: int) -> torch.Tensor:
        packed = torch.full((len(groups) * width,), fill, dtype=values.dtype, device=device)
        return packed.index_put((sources,), values[target_rows, target_columns]).view(len(groups), width)

    if isinstance(batch, RolloutBatch):  # right-padded rows with default positions
        position_ids = torch.arange(length, device=device).expand(rows, length)
    else:
        position_ids = batch.position_ids
    packed_positions = torch.where(tail, tail_positions, scattered(position_ids, 0))
    segments = scattered(batch.segments, PADDING) if isinstance(batch, SharedPromptBatch) else None
    return PackedRows(scattered(batch.input_ids, 0), packed_positions, blocks, segments, flat_index, lengths)


def packing_problem(model: torch.nn.Module, width: int) -> str | None:
    """Why packed rows of `width` tokens would not be exact for `model`, or None."""
    return custom_mask_problem(model.config, width)


def run_packed(model: torch.nn.Module, packed: PackedRows, head_identity: bool = False) -> torch.Tensor:
    """The model's outputs on the packed rows: logits [R, L, V] (or a classifier's per-position scores, see
    `packed_outputs`); with `head_identity`, the last hidden states [R, L, H] (the LM head computes nothing)."""
    problem = packing_problem(model, packed.input_ids.shape[1])
    if problem:
        raise RunError(f"trainer.packing=true would not be exact: {problem}; set trainer.packing=false")
    mask = packed.attention_mask(model.config._attn_implementation, model.dtype)
    head = model.get_output_embeddings() if head_identity else None
    if head is not None:
        head.forward = identity
    try:
        return call_with_positions(model, packed.input_ids, packed.position_ids, mask)
    finally:
        if head is not None:
            del head.forward


def packed_target_outputs(model: torch.nn.Module, batch: AnyBatch, kind: str, chunked: bool, chunk_size: int,
                          temperature: float = 1.0):
    """`kind` ("target_logprobs" or "target_scores", see workers/forward.py) of `batch` from one packed pass:
    each target's log-probability (and entropy) from the packed position that predicts it, placed at its padded
    [B, T] position, 0 elsewhere. `chunked`: the LM head on those positions only (posttrain.losses.chunked);
    else the model's own logits, gathered there."""
    rows, sources, columns = target_positions(batch)
    tokens = batch.input_ids[rows, columns]
    want_entropy = kind == "target_scores"
    if chunked:
        head = model.get_output_embeddings()
        hidden, _ = packed_target_hidden(model, batch)
        scored = chunked_token_logprobs(hidden, head.weight, tokens, bias=head.bias, temperature=temperature,
                                        chunk_size=chunk_size, return_entropy=want_entropy)
    else:
        packed = pack_batch(batch)
        logits = run_packed(model, packed).flatten(0, 1)[packed.index[rows, sources]].float()
        if temperature != 1.0:
            logits = logits / temperature
        logprobs = -F.cross_entropy(logits, tokens, reduction="none")
        scored = (logprobs, _entropy(logits.detach())) if want_entropy else logprobs

    def placed(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(batch.input_ids.shape).index_put((rows, columns), values)

    if kind == "target_logprobs":
        return placed(scored)
    return TargetScores(*(placed(values) for values in scored))


def packed_target_hidden(model: torch.nn.Module, batch: AnyBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """`forward.target_hidden` from one packed pass: the last hidden states [n, H] at the positions that predict
    the batch's targets, and those positions (`target_positions`, padded coordinates)."""
    packed = pack_batch(batch)
    positions = target_positions(batch)
    rows, sources, _ = positions
    return run_packed(model, packed, head_identity=True).flatten(0, 1)[packed.index[rows, sources]], positions


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """[n] entropy of each row of float32 logits [n, V] (−inf logits contribute 0), ENTROPY_CHUNK_ROWS at a time."""
    with torch.no_grad():
        pieces = []
        for chunk in logits.split(ENTROPY_CHUNK_ROWS):
            pieces.append(entropy_of_logits(chunk))
        return torch.cat(pieces) if pieces else logits.new_zeros(0)


def packed_logits(model: torch.nn.Module, batch: AnyBatch) -> torch.Tensor:
    """What `forward_logits` returns for `batch`, from one packed pass: a causal LM's logits [B, T, V] (padding
    positions hold values never meant to be read), or a sequence classifier's scores [B, num_labels] read at each
    row's last non-pad token as the classifier pools them."""
    packed = pack_batch(batch)
    if not is_sequence_classifier(model):
        return packed.gather(run_packed(model, packed))
    scores = packed_token_scores(model, packed)
    return scores.flatten(0, 1)[packed.index[torch.arange(len(packed.lengths)), pooled_positions(model, batch,
                                                                                                  packed.lengths)]]


def is_sequence_classifier(model: torch.nn.Module) -> bool:
    """Whether `model` is a scalar-head model (a transformers sequence classifier or posttrain's scalar head)."""
    return hasattr(model, "score") and not hasattr(model, "lm_head")


def packed_token_scores(model: torch.nn.Module, packed: PackedRows) -> torch.Tensor:
    """[R, L, num_labels] a sequence classifier's head at every packed position (its own pooling, which looks for
    each row's last non-pad token, does not apply to packed rows and is discarded)."""
    scores = head_outputs_during(model, lambda: run_packed(model, packed))
    return scores.reshape(*packed.input_ids.shape, -1)  # flash-attention-2 ran the rows as one


def pooled_positions(model: torch.nn.Module, batch: AnyBatch, lengths: torch.Tensor) -> torch.Tensor:
    """[B] the position a sequence classifier reads each padded row's score at: the rightmost token that is not
    the pad token (transformers' rule; a real token equal to the pad id is skipped, as it is there), or the last
    real token when the model has no pad token."""
    pad = model.config.get_text_config().pad_token_id
    if pad is None:
        return lengths - 1
    positions = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)
    return (positions * (batch.input_ids != pad)).argmax(-1)
