"""Multiple-choice rows: a question, its choices and the index of the right one.

`parse_multiple_choice_row` accepts the shapes the common benchmark datasets come in, after data.column_map:

    question   the `prompt` column, else `question` (MMLU, ARC, OpenBookQA's question_stem renamed); a string, or a
               list of chat messages
    choices    `choices`: a list of strings (MMLU), or an object {"text": [...], "label": [...]} (ARC,
               OpenBookQA), whose labels the answer may name
    answer     `answer`, else `answerKey`, else `label`, else `gold`:
               an integer          the 0-based index of the right choice (MMLU's answer, HellaSwag's label)
               a string of digits  the same index, when the choices have no labels naming it otherwise
               one of the labels   (ARC's answerKey "B" or "2")
               a letter A-Z        the index in the alphabet (A is the first choice)
               a choice's text     that choice ("46" among ["45", "46", "47"])

A string that two of these rules read as different choices (the answer "1" among the choices ["1", "2", "3"]: the
index 1 or the text of the choice at index 0) is refused, naming the row, rather than guessed. Every other column is kept in `extras` for prompt.template.
"""

from __future__ import annotations

import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.data.dataset import DataStats, check_not_empty, skip_or_raise
from posttrain.data.errors import DataError
from posttrain.data.formats import Messages, _string_or_messages, _type_name
from posttrain.data.loading import iter_records

PROMPT_COLUMNS = ("prompt", "question")
ANSWER_COLUMNS = ("answer", "answerKey", "label", "gold")
LETTERS = string.ascii_uppercase


@dataclass(frozen=True)
class MultipleChoiceRow:
    """One multiple-choice question."""

    prompt: str | Messages
    """The question the choices continue (a string, or chat messages for the chat template)."""
    choices: tuple[str, ...]
    """The candidate continuations, in the row's order (at least two, none empty)."""
    answer: int
    """0-based index of the right choice."""
    location: str = ""
    """Where the row came from ("file.jsonl:12"), for error messages."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Every other column (for prompt.template)."""


def parse_multiple_choice_row(record: Mapping[str, Any], location: str) -> MultipleChoiceRow:
    """The record as a MultipleChoiceRow (the shapes of the module docstring); DataError naming location and field."""
    prompt_column = next((c for c in PROMPT_COLUMNS if c in record), None)
    if prompt_column is None:
        raise DataError(location, f"missing: a multiple-choice row needs its question in a 'prompt' or 'question' "
                        f"column (columns found: {', '.join(sorted(record)) or 'none'}; data.column_map can rename "
                        "one)", "prompt")
    prompt = _string_or_messages(record[prompt_column], prompt_column, location)
    if "choices" not in record:
        raise DataError(location, f"missing: a multiple-choice row needs a 'choices' column, a list of strings "
                        f"(columns found: {', '.join(sorted(record))}; data.column_map can rename one)", "choices")
    choices, labels = _choices(record["choices"], location)
    answer_column = next((c for c in ANSWER_COLUMNS if c in record), None)
    if answer_column is None:
        raise DataError(location, f"missing: a multiple-choice row needs the right choice in an 'answer' column (or "
                        f"answerKey, label, gold; columns found: {', '.join(sorted(record))})", "answer")
    answer = _answer_index(record[answer_column], choices, labels, answer_column, location)
    used = {prompt_column, "choices", answer_column}
    extras = {key: value for key, value in record.items() if key not in used}
    return MultipleChoiceRow(prompt, tuple(choices), answer, location, extras)


def _choices(value: Any, location: str) -> tuple[list[str], list[str] | None]:
    """The choice texts and, for the {"text": [...], "label": [...]} shape, their labels."""
    labels = None
    where = "choices"
    if isinstance(value, Mapping):
        if "text" not in value:
            raise DataError(location, f"expected a list of strings or an object with 'text' (and 'label') lists, got "
                            f"an object with keys {sorted(value)}", "choices")
        if "label" in value:
            labels = value["label"]
            if not isinstance(labels, list) or not all(isinstance(label, str) for label in labels):
                raise DataError(location, f"expected a list of strings, got {labels!r}", "choices.label")
        value, where = value["text"], "choices.text"
    if not isinstance(value, list) or len(value) < 2:
        shown = f"{_type_name(value)} {value!r}" if not isinstance(value, list) else f"{len(value)} choice(s)"
        raise DataError(location, f"expected a list of at least two strings, got {shown}", where)
    for index, choice in enumerate(value):
        if not isinstance(choice, str) or not choice:
            raise DataError(location, f"expected a non-empty string, got {_type_name(choice)} {choice!r}",
                            f"{where}[{index}]")
    if labels is not None and len(labels) != len(value):
        raise DataError(location, f"{len(labels)} labels for {len(value)} choices", "choices.label")
    return list(value), labels


def _answer_index(value: Any, choices: Sequence[str], labels: Sequence[str] | None, column: str,
                  location: str) -> int:
    """The 0-based index `value` names (module docstring); DataError when it names none, or two different ones."""
    count = len(choices)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise DataError(location, f"expected the right choice's index (an integer), letter, label or text, got "
                        f"{_type_name(value)} {value!r}", column)
    if isinstance(value, int):
        if not 0 <= value < count:
            raise DataError(location, f"index {value} is out of range for {count} choices (0-based: 0 to "
                            f"{count - 1})", column)
        return value
    if labels is not None:
        if value not in labels:
            raise DataError(location, f"{value!r} is none of the choices' labels {list(labels)}", column)
        return labels.index(value)
    readings = {}
    if value.isdigit() and int(value) < count:
        readings["the index"] = int(value)
    if len(value) == 1 and value in LETTERS[:count]:
        readings["the letter"] = LETTERS.index(value)
    if value in choices:
        readings["the text of a choice"] = choices.index(value)
    if not readings:
        raise DataError(location, f"{value!r} names none of the {count} choices: give the 0-based index, a letter "
                        f"(A-{LETTERS[count - 1]}) or a choice's text ({list(choices)})", column)
    if len(set(readings.values())) > 1:
        read = ", ".join(f"{how} {index}" for how, index in readings.items())
        raise DataError(location, f"{value!r} is ambiguous among the choices {list(choices)}: it reads as {read}; "
                        "give the answer as an integer index", column)
    return next(iter(readings.values()))


def iter_multiple_choice_rows(sources: Sequence[str], column_map: Mapping[str, str], on_error: str,
                              stats: DataStats) -> Iterator[MultipleChoiceRow]:
    """Every usable row of `sources` (columns renamed by column_map); a malformed one raises its DataError, or with
    on_error="skip" is counted in stats and dropped."""

    def unreadable(error: DataError) -> None:
        stats.rows_read += 1
        skip_or_raise(error, on_error, stats)

    for source in sources:
        for location, record in iter_records(source, on_bad_record=unreadable):
            stats.rows_read += 1
            if column_map:
                record = {column_map.get(key, key): value for key, value in record.items()}
            try:
                yield parse_multiple_choice_row(record, location)
            except DataError as error:
                skip_or_raise(error, on_error, stats)


def load_multiple_choice_rows(sources: Sequence[str], column_map: Mapping[str, str], on_error: str = "raise",
                              limit: int | None = None) -> tuple[list[MultipleChoiceRow], DataStats]:
    """The first `limit` (None: all) usable rows of `sources` and what reading them counted; DataError when none
    is usable."""
    stats = DataStats()
    rows = []
    for row in iter_multiple_choice_rows(sources, column_map, on_error, stats):
        rows.append(row)
        if limit is not None and len(rows) == limit:
            break
    stats.examples = len(rows)
    check_not_empty(sources, stats)
    return rows, stats
