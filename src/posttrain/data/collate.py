"""Batching tokenized examples: padded rows, or packed rows with no attention across examples."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.data.types import SFTBatch, TokenizedExample


def collate_padded(examples: Sequence[TokenizedExample], pad_token_id: int) -> SFTBatch:
    """One example per row, right-padded to the longest."""
    width = max(len(e) for e in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.float32)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        loss_mask[row, :n] = torch.tensor(example.loss_mask, dtype=torch.float32)
        attention_mask[row, :n] = 1
    position_ids = torch.arange(width).expand(len(examples), width).contiguous()
    return SFTBatch(input_ids, loss_mask, position_ids, attention_mask, len(examples), int(attention_mask.sum()))


def pack_rows(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """First-fit-decreasing assignment of examples (by length) to rows of at most max_length tokens.

    Returns the example indices of each row. Deterministic: ties keep input order.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > max_length:
            raise ValueError(f"example of {lengths[i]} tokens exceeds the packing length {max_length}")
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max_length - lengths[i])
    return rows


def collate_packed(examples: Sequence[TokenizedExample], pad_token_id: int, max_length: int) -> SFTBatch:
    """Several examples per row, each with its own position ids starting at 0.

    attention_mask is None: the forward pass builds a block-diagonal causal mask from the position-id
    resets (posttrain.models.packing), so a token attends only to earlier tokens of its own example. The first token of every example
    is never a target (its loss_mask is 0 by construction), so nothing is predicted across a boundary.
    The padded tail of a row is its own segment (positions 0, 1, ...) and carries no loss.
    """
    rows = pack_rows([len(e) for e in examples], max_length)
    width = max(sum(len(examples[i]) for i in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    num_tokens = 0
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            example = examples[i]
            n = len(example)
            input_ids[r, start : start + n] = torch.tensor(example.input_ids)
            loss_mask[r, start : start + n] = torch.tensor(example.loss_mask, dtype=torch.float32)
            position_ids[r, start : start + n] = torch.arange(n)
            start += n
        position_ids[r, start:] = torch.arange(width - start)
        num_tokens += start
    return SFTBatch(input_ids, loss_mask, position_ids, None, len(examples), num_tokens)


def collate(examples: Sequence[TokenizedExample], pad_token_id: int, packing: bool, max_length: int) -> SFTBatch:
    if packing:
        return collate_packed(examples, pad_token_id, max_length)
    return collate_padded(examples, pad_token_id)
