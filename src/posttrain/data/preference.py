"""Preference pairs for offline preference optimization: tokenizing, loading and collating.

A pair is tokenized once into a shared prompt and two completions (`PreferenceExample`). A micro-batch
of B pairs becomes one batch scored in a single forward pass, in either of two layouts:
- `collate_preference`: a padded `SFTBatch` of 2B rows, the chosen sequences first and the rejected ones
  after; the loss mask marks each row's completion tokens;
- `collate_shared_prompt`: a `SharedPromptBatch` of B rows, each the prompt once followed by both
  completions, which a tree-shaped attention mask keeps apart: the prompt's tokens go through the model
  once instead of twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Literal

import torch

from posttrain.config.schema import DataConfig
from posttrain.data.collate import collate_padded
from posttrain.data.dataset import DataStats, check_not_empty, iter_rows, skip_or_raise
from posttrain.data.errors import DataError
from posttrain.data.formats import Messages, PreferenceRow, shared_prefix_length
from posttrain.data.types import (
    CHOSEN,
    PADDING,
    PROMPT,
    REJECTED,
    PreferenceExample,
    SFTBatch,
    SharedPromptBatch,
)

if TYPE_CHECKING:  # annotations only: importing transformers takes seconds
    from transformers import PreTrainedTokenizerBase


def tokenize_preference_row(
    row: PreferenceRow,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    overlong: Literal["truncate", "drop"],
    source: str = "",
) -> PreferenceExample | None:
    """Token ids of one preference row, each sequence (prompt + completion) at most max_length tokens.

    String rows: the prompt as the tokenizer encodes it (with its special tokens), each completion without
    special tokens and followed by EOS. Conversations: rendered with the chat template, the prompt with the
    generation prompt, each completion as what the template adds after it (content and end-of-turn token).
    Overlong pairs are truncated (the completions cut so that every sequence fits; the prompt is kept
    whole) or dropped (None). Raises DataError when the prompt alone leaves no room for a completion token.
    """
    full = _tokenize_pair(row, tokenizer, source)
    return fit_pair(full, max_length, overlong)


def _tokenize_pair(row: PreferenceRow, tokenizer: PreTrainedTokenizerBase, source: str) -> PreferenceExample:
    prompt_ids, (chosen_ids, rejected_ids) = tokenize_completions(row.prompt, [row.chosen, row.rejected], tokenizer,
                                                                   source)
    if not chosen_ids or not rejected_ids:
        raise DataError(source, "a completion tokenizes to no tokens; nothing to compare", "chosen")
    if chosen_ids == rejected_ids:
        raise DataError(source, "tokenizes to the same tokens as chosen; a preference pair needs two different "
                        "completions (identical ones give a constant loss and no gradient)", "rejected")
    return PreferenceExample(tuple(prompt_ids), tuple(chosen_ids), tuple(rejected_ids), source, row.margin)


def rejected_through_first_difference(pair: PreferenceExample) -> PreferenceExample:
    """The pair with its rejected completion cut after the first token where it differs from the chosen one
    (`loss.truncate_rejected`): the tokens both share, then the first wrong one. A rejected completion that is
    the beginning of the chosen one is kept whole."""
    return replace(pair, rejected_ids=pair.rejected_ids[: shared_prefix_length(pair.chosen_ids, pair.rejected_ids) + 1])


def tokenize_completions(
    prompt: str | Messages, completions: Sequence[str | Messages], tokenizer: PreTrainedTokenizerBase, source: str = ""
) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, [ids of each completion]) as preference pairs are tokenized: a string prompt as the tokenizer
    encodes it (with its special tokens), each string completion without special tokens and followed by EOS;
    a conversation through the chat template (see tokenize_preference_row). Reward models score text the same way."""
    if isinstance(prompt, str):
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        completion_ids = [list(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in completions]
        if tokenizer.eos_token_id is not None:
            completion_ids = [ids + [tokenizer.eos_token_id] for ids in completion_ids]
        return prompt_ids, completion_ids
    return _chat_pair(prompt, list(completions), tokenizer, source)


def fit_pair(
    pair: PreferenceExample, max_length: int, overlong: Literal["truncate", "drop"]
) -> PreferenceExample | None:
    """The pair if both sequences fit in max_length tokens; else its completions cut to fit (truncate; the prompt
    is kept whole) or None (drop). DataError when the prompt alone leaves no room for a completion token."""
    if len(pair.prompt_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids)) <= max_length:
        return pair
    if overlong == "drop":
        return None
    room = completion_room(len(pair.prompt_ids), max_length, pair.source)
    return replace(pair, chosen_ids=pair.chosen_ids[:room], rejected_ids=pair.rejected_ids[:room])


def completion_room(prompt_length: int, max_length: int, source: str, key: str = "data.max_length") -> int:
    """How many completion tokens fit after a prompt of prompt_length within max_length; DataError (at source,
    field prompt) when not even one does."""
    room = max_length - prompt_length
    if room < 1:
        raise DataError(source, f"the prompt has {prompt_length} tokens, leaving no completion token within "
                        f"{key}={max_length}", "prompt")
    return room


def _chat_pair(
    prompt: Messages, completions: list[Messages], tokenizer: PreTrainedTokenizerBase, source: str
) -> tuple[list[int], list[list[int]]]:
    if tokenizer.chat_template is None:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template, so conversational preference rows cannot "
            "be rendered; give prompt/chosen/rejected strings instead, or set tokenizer.chat_template"
        )
    prompt_text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
    completion_ids = []
    for completion in completions:
        whole = tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=False)
        if not whole.startswith(prompt_text):
            raise ValueError(
                f"{source}: the chat template of tokenizer {tokenizer.name_or_path!r} does not render the prompt "
                "with the generation prompt as the beginning of the whole conversation, so the completion cannot "
                "be separated; give the data as prompt/chosen/rejected strings"
            )
        # The whitespace a template writes after the end-of-turn token is never generated (as in SFT).
        completion_text = whole[len(prompt_text):].rstrip()
        completion_ids.append(list(tokenizer(completion_text, add_special_tokens=False)["input_ids"]))
    return list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"]), completion_ids


def load_preference_examples(
    sources: Sequence[str], tokenizer: PreTrainedTokenizerBase, cfg: DataConfig
) -> tuple[list[PreferenceExample], DataStats]:
    """Read, validate and tokenize every preference row of sources. Rows of another format, and pairs whose
    prompt leaves no room for a completion, are malformed (raised or skipped per cfg.on_error); overlong pairs
    are truncated or dropped per cfg.overlong. A pair whose completions are the same (as text, as tokens, or once
    truncated) has nothing to compare and is malformed too. All counted in the returned stats."""
    stats = DataStats()
    examples: list[PreferenceExample] = []
    # dataset.py's reading path, so malformed rows are reported and counted exactly as for SFT.
    for location, row in iter_rows(sources, cfg, stats):
        try:
            if not isinstance(row, PreferenceRow):
                raise DataError(location, f"expected a preference row (prompt, chosen, rejected), got {type(row).__name__}")
            full = _tokenize_pair(row, tokenizer, location)
            example = fit_pair(full, cfg.max_length, cfg.overlong)
            if example is not None and example.chosen_ids == example.rejected_ids:
                raise DataError(location, f"is the same as chosen once both are truncated to fit "
                                f"data.max_length={cfg.max_length} (the prompt has {len(example.prompt_ids)} tokens); "
                                "raise data.max_length or set data.overlong=drop", "rejected")
        except DataError as error:
            skip_or_raise(error, cfg.on_error, stats)
            continue
        if example is None:
            stats.dropped_overlong += 1
            continue
        stats.truncated += int(example != full)
        examples.append(example)
        stats.examples += 1
        stats.target_tokens += len(example.chosen_ids) + len(example.rejected_ids)
    check_not_empty(sources, stats)
    return examples, stats


def collate_preference(pairs: Sequence[PreferenceExample], pad_token_id: int) -> SFTBatch:
    """2B right-padded rows: rows [0, B) are prompt + chosen, rows [B, 2B) prompt + rejected of the same pairs.

    loss_mask marks the completion tokens, so `sequence_logps` over it gives each completion's log-probability.
    """
    return collate_padded(
        [pair.sequence("chosen") for pair in pairs] + [pair.sequence("rejected") for pair in pairs], pad_token_id
    )


def collate_shared_prompt(pairs: Sequence[PreferenceExample], pad_token_id: int) -> SharedPromptBatch:
    """B right-padded rows, row i = prompt + chosen + rejected of pair i (see `SharedPromptBatch`)."""
    width = max(len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
    shape = (len(pairs), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    segments = torch.full(shape, PADDING, dtype=torch.long)
    prompt_ends = torch.zeros(len(pairs), dtype=torch.long)
    rejected_starts = torch.zeros(len(pairs), dtype=torch.long)
    for row, pair in enumerate(pairs):
        prompt, chosen, rejected = len(pair.prompt_ids), len(pair.chosen_ids), len(pair.rejected_ids)
        end = prompt + chosen + rejected
        input_ids[row, :end] = torch.tensor(pair.prompt_ids + pair.chosen_ids + pair.rejected_ids)
        position_ids[row, : prompt + chosen] = torch.arange(prompt + chosen)
        position_ids[row, prompt + chosen : end] = torch.arange(prompt, prompt + rejected)
        segments[row, :prompt] = PROMPT
        segments[row, prompt : prompt + chosen] = CHOSEN
        segments[row, prompt + chosen : end] = REJECTED
        prompt_ends[row], rejected_starts[row] = prompt - 1, prompt + chosen
    return SharedPromptBatch(
        input_ids, position_ids, segments, (segments == CHOSEN).float(), (segments == REJECTED).float(), prompt_ends,
        rejected_starts, len(pairs), int((segments != PADDING).sum()),
    )
