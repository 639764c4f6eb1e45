"""Row formats: typed, validated views of raw records.

A record (a dict from `loading.iter_records`) is checked against one format and becomes one of the
frozen dataclasses below, or a DataError naming its location and field. Formats follow the layouts
the field uses (TRL's dataset formats): plain text, prompt/completion, messages, preference pairs and
prompts alone. Prompts and completions are strings or, in the conversational form, lists of chat
messages {"role": ..., "content": ...}.

Two layouts common in public datasets are read as one of those: ShareGPT (`conversations`, a list of
{"from": "human" | "gpt" | "system" | ..., "value": ...}) becomes a messages row with the roles renamed, as TRL
converts it; Alpaca (`instruction`, optional `input`, `output`) becomes a prompt/completion row whose prompt is
the instruction, then a blank line and the input when there is one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from posttrain.data.errors import DataError

Message = dict[str, Any]
"""A chat message: "role" (system, user, assistant or tool) and "content" (a string); other keys
(name, tool_call_id, tool_calls) pass through to the chat template."""

Messages = list[Message]

ROLES = ("system", "user", "assistant", "tool")
FORMATS = ("text", "prompt_completion", "messages", "preference", "prompt_only", "sharegpt", "alpaca")

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "chatgpt": "assistant", "system": "system", "tool": "tool", "function_response": "tool",
                  "observation": "tool"}
"""ShareGPT speakers (`from`) and the chat role each becomes."""


@dataclass(frozen=True)
class TextRow:
    """A document trained on as a whole."""

    text: str


@dataclass(frozen=True)
class PromptCompletionRow:
    """A prompt and the completion to learn. Both strings, or both message lists (conversational)."""

    prompt: str | Messages
    completion: str | Messages


@dataclass(frozen=True)
class MessagesRow:
    """A conversation; with completion_only_loss only its assistant messages are targets."""

    messages: Messages


@dataclass(frozen=True)
class PreferenceRow:
    """A prompt with a preferred and a dispreferred completion. All strings, or all message lists.

    For conversations the completions hold only what follows the prompt (usually one assistant message).
    """

    prompt: str | Messages
    chosen: str | Messages
    rejected: str | Messages
    margin: float | None = None
    """How strongly chosen is preferred (an optional numeric `margin` column), for reward-model margins."""


@dataclass(frozen=True)
class PromptOnlyRow:
    """A prompt for online RL; extras holds every other column (answers, test cases) for reward functions."""

    prompt: str | Messages
    extras: dict[str, Any]


Row = TextRow | PromptCompletionRow | MessagesRow | PreferenceRow | PromptOnlyRow

ACCEPTED_LAYOUTS = (
    "messages; prompt+chosen+rejected (preference; chosen+rejected alone for conversations that share "
    "their first messages); prompt+completion; text; prompt (prompt_only); conversations (ShareGPT); "
    "instruction+output (Alpaca)"
)


def detect_format(columns: Iterable[str], location: str = "data") -> str:
    """The format a record's columns fit, checked in order: messages, preference, prompt_completion, text,
    prompt_only, sharegpt, alpaca. Raises DataError (at location) listing the columns found when none fits."""
    names = set(columns)
    if "messages" in names:
        return "messages"
    if {"chosen", "rejected"} <= names:
        return "preference"
    if {"prompt", "completion"} <= names:
        return "prompt_completion"
    if "text" in names:
        return "text"
    if "prompt" in names:
        return "prompt_only"
    if "conversations" in names:
        return "sharegpt"
    if {"instruction", "output"} <= names:
        return "alpaca"
    raise DataError(
        location,
        f"cannot tell the data format from the columns {sorted(names)}; accepted layouts: {ACCEPTED_LAYOUTS}. "
        "Rename the columns, or set data.format.",
    )


def parse_row(fmt: str, row: Mapping[str, Any], location: str) -> Row:
    """Validate a raw record as format `fmt` and return its typed row; DataError names location and field."""
    if fmt not in _PARSERS:
        raise ValueError(f"unknown data format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return _PARSERS[fmt](row, location)


def _parse_text(row: Mapping[str, Any], location: str) -> TextRow:
    return TextRow(text=_string(_field(row, "text", location), "text", location))


def _parse_prompt_completion(row: Mapping[str, Any], location: str) -> PromptCompletionRow:
    prompt = _string_or_messages(_field(row, "prompt", location), "prompt", location)
    completion = _same_kind(_field(row, "completion", location), prompt, "completion", "prompt", location)
    return PromptCompletionRow(prompt=prompt, completion=completion)


def _parse_messages(row: Mapping[str, Any], location: str) -> MessagesRow:
    return MessagesRow(messages=_messages(_field(row, "messages", location), "messages", location))


def _parse_preference(row: Mapping[str, Any], location: str) -> PreferenceRow:
    pair = _parse_pair(row, location)
    margin = row.get("margin")
    if margin is None:
        return pair
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise DataError(location, f"expected a finite number, got {_type_name(margin)} {margin!r}", "margin")
    return replace(pair, margin=float(margin))


def shared_prefix_length(first: Sequence, second: Sequence) -> int:
    """How many leading items (messages, token ids) the two sequences have in common."""
    shared = 0
    while shared < min(len(first), len(second)) and first[shared] == second[shared]:
        shared += 1
    return shared


def _parse_pair(row: Mapping[str, Any], location: str) -> PreferenceRow:
    if "prompt" in row:
        prompt = _string_or_messages(row["prompt"], "prompt", location)
        chosen = _same_kind(_field(row, "chosen", location), prompt, "chosen", "prompt", location)
        rejected = _same_kind(_field(row, "rejected", location), prompt, "rejected", "prompt", location)
        return _checked_pair(PreferenceRow(prompt=prompt, chosen=chosen, rejected=rejected), location, 0)
    chosen = _string_or_messages(_field(row, "chosen", location), "chosen", location)
    rejected = _same_kind(_field(row, "rejected", location), chosen, "rejected", "chosen", location)
    if isinstance(chosen, str):
        raise DataError(
            location,
            "missing; without a prompt column, chosen and rejected must be conversations "
            "(lists of messages) that begin with the same prompt messages",
            "prompt",
        )
    # Implicit prompt: the longest run of leading messages the two conversations share.
    shared = shared_prefix_length(chosen, rejected)
    if shared == 0:
        raise DataError(
            location, "missing, and chosen and rejected share no leading messages to take as the prompt", "prompt"
        )
    if shared == len(chosen) or shared == len(rejected):
        raise DataError(
            location, "one of chosen and rejected is the other or its beginning; nothing is left to compare", "chosen"
        )
    return _checked_pair(PreferenceRow(prompt=chosen[:shared], chosen=chosen[shared:], rejected=rejected[shared:]),
                         location, shared)


def _checked_pair(pair: PreferenceRow, location: str, offset: int) -> PreferenceRow:
    """The pair, if it has something to compare: two different completions, each (in a conversation) beginning
    with the assistant's reply. offset: where the completions start in the row's chosen/rejected lists.

    Identical completions get identical log-probabilities, so the pair's loss is constant (ln 2 for DPO and a
    reward model at a zero margin) and its gradient zero: a file of them trains on nothing, silently. A completion
    that opens with a user or system message is not a reply, and the chat template cannot render it after the
    generation prompt.
    """
    if pair.chosen == pair.rejected:
        raise DataError(location, "is identical to chosen; a preference pair needs two different completions "
                        "(identical ones give a constant loss and no gradient)", "rejected")
    for name, completion in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        if isinstance(completion, list) and completion[0]["role"] != "assistant":
            raise DataError(location, f"expected 'assistant', got {completion[0]['role']!r}: the {name} completion "
                            "must begin with the assistant's reply to the prompt", f"{name}[{offset}].role")
    return pair


def _parse_prompt_only(row: Mapping[str, Any], location: str) -> PromptOnlyRow:
    prompt = _string_or_messages(_field(row, "prompt", location), "prompt", location)
    return PromptOnlyRow(prompt=prompt, extras={key: value for key, value in row.items() if key != "prompt"})


def _parse_sharegpt(row: Mapping[str, Any], location: str) -> MessagesRow:
    turns = _field(row, "conversations", location)
    if not isinstance(turns, (list, tuple)):
        raise DataError(location, f"expected a list of turns, got {_type_name(turns)}", "conversations")
    messages = []
    for index, turn in enumerate(turns):
        where = f"conversations[{index}]"
        if isinstance(turn, Mapping) and "role" in turn:  # already chat messages under another column name
            messages.append(turn)
            continue
        if not isinstance(turn, Mapping):
            raise DataError(location, f'expected a turn {{"from": ..., "value": ...}}, got {_type_name(turn)}', where)
        speaker = _string(_field(turn, "from", location), f"{where}.from", location)
        if speaker not in SHAREGPT_ROLES:
            raise DataError(location, f"unknown speaker {speaker!r}; expected one of {', '.join(SHAREGPT_ROLES)}",
                            f"{where}.from")
        if "value" not in turn:
            raise DataError(location, "missing", f"{where}.value")
        extra = {key: value for key, value in turn.items() if key not in ("from", "value")}
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn["value"], **extra})
    return MessagesRow(messages=_messages(messages, "conversations", location))


def _parse_alpaca(row: Mapping[str, Any], location: str) -> PromptCompletionRow:
    instruction = _string(_field(row, "instruction", location), "instruction", location)
    extra = row.get("input") or ""
    extra = _string(extra, "input", location)
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    return PromptCompletionRow(prompt=prompt, completion=_string(_field(row, "output", location), "output", location))


_PARSERS: dict[str, Callable[[Mapping[str, Any], str], Row]] = {
    "text": _parse_text,
    "prompt_completion": _parse_prompt_completion,
    "messages": _parse_messages,
    "preference": _parse_preference,
    "prompt_only": _parse_prompt_only,
    "sharegpt": _parse_sharegpt,
    "alpaca": _parse_alpaca,
}


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _field(row: Mapping[str, Any], name: str, location: str) -> Any:
    if name not in row:
        raise DataError(location, f"missing (columns found: {', '.join(sorted(row)) or 'none'})", name)
    return row[name]


MAX_FIELD_CHARS = 1_000_000
"""The longest text one field may hold, checked before anything is tokenized: a 20 MB line took 95 s and 4 GB of
tokenization before its length in tokens was found to be too long. A million characters is far more tokens than
any data.max_length a model has."""


def _string(value: Any, field: str, location: str) -> str:
    if not isinstance(value, str):
        raise DataError(location, f"expected a string, got {_type_name(value)}", field)
    if len(value) > MAX_FIELD_CHARS:
        raise DataError(location, f"{len(value):,} characters, more than the {MAX_FIELD_CHARS:,} a field may hold "
                        "(MAX_FIELD_CHARS; checked before tokenizing)", field)
    return value


def _string_or_messages(value: Any, field: str, location: str) -> str | Messages:
    if isinstance(value, str):
        return _string(value, field, location)
    if isinstance(value, (list, tuple)):
        return _messages(value, field, location)
    raise DataError(location, f"expected a string or a list of messages, got {_type_name(value)}", field)


def _messages(value: Any, field: str, location: str) -> Messages:
    if not isinstance(value, (list, tuple)):
        raise DataError(location, f"expected a list of messages, got {_type_name(value)}", field)
    if not value:
        raise DataError(location, "expected at least one message, got an empty list", field)
    messages: Messages = []
    for index, message in enumerate(value):
        where = f"{field}[{index}]"
        if not isinstance(message, Mapping):
            raise DataError(
                location, f'expected a message {{"role": ..., "content": ...}}, got {_type_name(message)}', where
            )
        for key in ("role", "content"):
            if key not in message:
                raise DataError(location, "missing", f"{where}.{key}")
            _string(message[key], f"{where}.{key}", location)
        if message["role"] not in ROLES:
            raise DataError(location, f"expected one of {', '.join(ROLES)}, got {message['role']!r}", f"{where}.role")
        messages.append(dict(message))
    return messages


def _same_kind(value: Any, like: str | Messages, field: str, like_field: str, location: str) -> str | Messages:
    """Validate value as a string when `like` is one, else as a list of messages."""
    if isinstance(value, (str, list, tuple)) and isinstance(value, str) != isinstance(like, str):
        kind = "a string" if isinstance(like, str) else "a list of messages"
        raise DataError(
            location,
            f"expected {kind} like {like_field}, got {_type_name(value)}; "
            f"give {like_field} and {field} both as strings or both as lists of messages",
            field,
        )
    return _string(value, field, location) if isinstance(like, str) else _messages(value, field, location)
