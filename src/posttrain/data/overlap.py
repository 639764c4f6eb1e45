"""Held-out means held out: rows of the evaluation data whose prompt (or whole example) also appears in the
training data.

Two rows match when their prompts are equal after normalisation: Unicode NFKC, case folded, runs of whitespace
made one space, the ends stripped; a conversation is compared as its messages' roles and normalised contents up to
its last assistant message. The whole example (prompt with completion, chosen and rejected, the full conversation,
a text row) is compared the same way, so that a row repeated outright is told apart from a prompt answered
differently. Rows are read as they are (column_map applied, nothing tokenized); what cannot be read here is left
to the loaders, which report it.

A recipe with both training and evaluation data counts the shared prompts of each evaluation source (data.eval_files,
each `evaluation:` set), says so in one line, and refuses to run when the fraction of an evaluation source's rows
that share a prompt with the training data is above data.max_overlap_fraction (default 0: none may), naming both
sources and an example row: numbers measured on training rows are not held-out numbers.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from posttrain.data.errors import DataError
from posttrain.data.loading import iter_records

_SPACES = re.compile(r"\s+")
PROMPT_COLUMNS = ("prompt",)
RESPONSE_COLUMNS = ("completion", "chosen", "rejected", "response", "answer")


def normalize(text: str) -> str:
    return _SPACES.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def _normalized(value: Any) -> str:
    """A column's value as comparable text: a string normalised, a message list as role: content lines."""
    if isinstance(value, str):
        return normalize(value)
    if isinstance(value, list):
        return "\n".join(f"{m.get('role')}: {_normalized(m.get('content'))}" if isinstance(m, Mapping)
                         else _normalized(m) for m in value)
    return normalize(str(value))


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def row_keys(record: Mapping[str, Any], column_map: Mapping[str, str]) -> tuple[bytes | None, bytes]:
    """(prompt key or None when the row has no prompt, whole-example key) of one raw record."""
    row = {column_map.get(name, name): value for name, value in record.items()}
    prompt = next((row[name] for name in PROMPT_COLUMNS if name in row), None)
    if prompt is None and isinstance(row.get("messages"), list):
        messages = row["messages"]
        last = max((i for i, m in enumerate(messages) if isinstance(m, Mapping) and m.get("role") == "assistant"),
                   default=len(messages))
        prompt = messages[:last]
    prompt_text = None if prompt is None else _normalized(prompt)
    whole = "\x00".join(_normalized(row[name]) for name in ("messages", "text", *RESPONSE_COLUMNS) if name in row)
    return (None if prompt_text is None else _digest(prompt_text)), _digest(f"{prompt_text}\x01{whole}")


@dataclass(frozen=True)
class Overlap:
    """What one evaluation source shares with the training data."""

    source: str
    """The evaluation source's name as the config gives it ("data.eval_files" or "evaluation set 'add'")."""
    rows: int
    shared_prompts: int
    """Rows whose prompt (or, for rows without one, whole example) is also a training row's."""
    shared_examples: int
    """Rows that equal a training row outright."""
    example: str | None
    """The location of the first shared row ("eval.jsonl:3") and of its training twin, for the message."""

    @property
    def fraction(self) -> float:
        return self.shared_prompts / self.rows if self.rows else 0.0

    def describe(self) -> str:
        return (f"{self.shared_prompts} of {self.rows} rows of {self.source} share a prompt with the training data "
                f"({self.shared_examples} the whole example)")


def _read(files: Iterable[str], column_map: Mapping[str, str]) -> Iterable[tuple[str, bytes | None, bytes]]:
    for source in files:
        for location, record in iter_records(source, on_bad_record=lambda error: None):
            prompt, whole = row_keys(record, column_map)
            yield location, prompt, whole


def training_index(files: Iterable[str], column_map: Mapping[str, str]) -> tuple[dict[bytes, str], set[bytes]]:
    """The training rows' prompt keys (to the first location of each) and whole-example keys."""
    prompts: dict[bytes, str] = {}
    examples: set[bytes] = set()
    for location, prompt, whole in _read(files, column_map):
        prompts.setdefault(prompt if prompt is not None else whole, location)
        examples.add(whole)
    return prompts, examples


def measure_overlap(index: tuple[dict[bytes, str], set[bytes]], source: str, files: Iterable[str],
                    column_map: Mapping[str, str]) -> Overlap:
    prompts, examples = index
    rows = shared = same = 0
    example = None
    for location, prompt, whole in _read(files, column_map):
        rows += 1
        twin = prompts.get(prompt if prompt is not None else whole)
        if twin is not None:
            shared += 1
            example = example or f"{location} (the same as training row {twin})"
        same += whole in examples
    return Overlap(source, rows, shared, same, example)


def check_held_out(train_files: list[str], train_column_map: Mapping[str, str],
                   evaluation_sources: list[tuple[str, list[str], Mapping[str, str]]], max_fraction: float) -> list[str]:
    """Compare every evaluation source (name, files, column_map) with the training files; return one line per
    source for the run's log. DataError when a source shares more than `max_fraction` of its rows' prompts."""
    sources = [(name, files, columns) for name, files, columns in evaluation_sources if files]
    if not sources or not train_files:
        return []
    index = training_index(train_files, train_column_map)
    lines = []
    for name, files, columns in sources:
        overlap = measure_overlap(index, name, files, columns)
        if overlap.fraction > max_fraction:
            raise DataError(", ".join(files), f"{overlap.describe()} ({', '.join(train_files)}), more than "
                            f"data.max_overlap_fraction={max_fraction:g}; for example {overlap.example}. Scores on "
                            "rows the model trained on are not held-out scores: use other evaluation data, remove "
                            "the shared rows, or raise data.max_overlap_fraction")
        lines.append(f"held-out check: {overlap.describe()}")
    return lines
