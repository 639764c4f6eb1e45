"""Judged tasks in the row schemas of Humanity's Last Exam (HLE) and GDPval, read from .jsonl or .parquet files.

HLE row (the fields of the public release, `cais/hle`; others are kept but unused):

- id: unique id.
- question: the question's text (for multipleChoice the answer choices are part of it).
- answer: the reference answer (for multipleChoice the letter of the right choice).
- answer_type: "exactMatch" or "multipleChoice".
- image (optional): the question's image (a data URI in the release); empty or null for a text-only question.
  posttrain's rollouts carry text only: rows with an image need a vision-language model and are skipped and
  counted (`HleTaskSet.skipped_image_rows`), never sent to a text model without their image.
- rationale, category (optional): kept in the task (the judge does not read them).

GDPval row (the fields of the public gold subset, `openai/gdpval`):

- task_id: unique id.
- prompt: the task's instructions.
- reference_files (optional): the files the task refers to, as paths relative to the task file (the release
  names them `reference_files/<hash>/<name>`, beside its parquet file once downloaded). No network: a URL is
  refused with a message; download the files yourself and keep the relative paths.
- rubric_json: the grading rubric, a list of items (or a string holding that JSON list, as the release stores it);
  each item has `criterion` (text) and `score` (the points it is worth; `points` is read too) and optionally
  `rubric_item_id`. `rubric_pretty` (the same rubric as prose) is kept for reading, never parsed.
- sector, occupation (optional): kept in the task.

Both sets are gated and not redistributable: posttrain bundles only small synthetic samples in these schemas
(`bundled_hle_tasks`, `bundled_gdpval_tasks`) and reads your own downloaded copies the same way. Every error names
the file, the line (or parquet row) and the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.errors import RunError

SAMPLES_DIR = Path(__file__).parent / "samples"
ANSWER_TYPES = ("exactMatch", "multipleChoice")
MAX_REFERENCE_CHARS = 20_000
"""Characters of one text reference file shown in a GDPval prompt; the rest is cut, saying how much."""


class JudgedTaskError(RunError, ValueError):
    """A task file that cannot be read: the message names the file, the line (or row) and the field."""


@dataclass(frozen=True)
class HleTask:
    """One HLE question (see the module docstring)."""

    id: str
    question: str
    answer: str
    answer_type: str
    """exactMatch or multipleChoice."""
    rationale: str | None = None
    category: str | None = None


@dataclass(frozen=True)
class HleTaskSet:
    """The text-only questions of an HLE file, and how many rows were skipped for their image."""

    tasks: dict[str, HleTask]
    skipped_image_rows: int
    """Rows with an image: they need a vision-language model, which text rollouts cannot feed."""


@dataclass(frozen=True)
class RubricItem:
    """One GDPval rubric criterion."""

    criterion: str
    points: float
    """What the item is worth; the judge awards 0 to points."""
    item_id: str | None = None


@dataclass(frozen=True)
class GdpvalTask:
    """One GDPval task (see the module docstring)."""

    task_id: str
    prompt: str
    reference_files: tuple[Path, ...]
    """Local files, resolved against the task file's folder."""
    rubric: tuple[RubricItem, ...]
    sector: str | None = None
    occupation: str | None = None

    @property
    def max_points(self) -> float:
        """The rubric's total: what a perfect deliverable scores."""
        return sum(item.points for item in self.rubric)


# ---- reading rows ----------------------------------------------------------------------------------------------

def iter_rows(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, row) for every row of a .jsonl or .parquet file; location reads "file:line" or "file row N"."""
    path = Path(path)
    if not path.is_file():
        raise JudgedTaskError(f"{path}: no such task file")
    if path.suffix == ".parquet":
        import pyarrow.parquet  # lazily: only for the real sets' parquet releases

        for number, row in enumerate(pyarrow.parquet.read_table(path).to_pylist(), start=1):
            yield f"{path} row {number}", row
        return
    if path.suffix != ".jsonl":
        raise JudgedTaskError(f"{path}: task files are .jsonl (one JSON object per line) or .parquet")
    with path.open(encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise JudgedTaskError(f"{path}:{number}: not JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise JudgedTaskError(f"{path}:{number}: a row must be a JSON object, got {type(row).__name__}")
            yield f"{path}:{number}", row


def _text(row: dict[str, Any], field: str, location: str, optional: bool = False) -> str | None:
    value = row.get(field)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value.strip():
        got = "nothing" if value is None else repr(value)[:60]
        raise JudgedTaskError(f"{location}: field {field!r} must be a non-empty string, got {got}")
    return value


def _unique(seen: dict[str, str], key: str, location: str, field: str) -> None:
    if key in seen:
        raise JudgedTaskError(f"{location}: field {field!r}: {key!r} is already the id of {seen[key]}")
    seen[key] = location


# ---- HLE ------------------------------------------------------------------------------------------------------

def load_hle_tasks(path: str | Path) -> HleTaskSet:
    """The HLE questions of `path` (.jsonl or .parquet) by id; rows with an image are skipped and counted."""
    tasks: dict[str, HleTask] = {}
    seen: dict[str, str] = {}
    skipped = 0
    for location, row in iter_rows(path):
        task_id = row.get("id")
        if isinstance(task_id, int) and not isinstance(task_id, bool):
            task_id = str(task_id)
            row = {**row, "id": task_id}
        task_id = _text(row, "id", location)
        _unique(seen, task_id, location, "id")
        answer_type = row.get("answer_type")
        if answer_type not in ANSWER_TYPES:
            raise JudgedTaskError(f"{location}: field 'answer_type' must be one of {', '.join(ANSWER_TYPES)}, got "
                                  f"{answer_type!r}")
        image = row.get("image")
        if image is not None and not isinstance(image, str):
            raise JudgedTaskError(f"{location}: field 'image' must be a string (a data URI or a path) or empty, got "
                                  f"{type(image).__name__}")
        question, answer = _text(row, "question", location), _text(row, "answer", location)
        if image:
            skipped += 1
            continue
        tasks[task_id] = HleTask(task_id, question, answer, answer_type, _text(row, "rationale", location, True),
                                 _text(row, "category", location, True))
    return HleTaskSet(tasks, skipped)


HLE_FORMAT = {
    "exactMatch": ("Answer in this format:\nExplanation: {why your answer is right}\n"
                   "Exact Answer: {your final answer, short}\n"
                   "Confidence: {how sure you are that the answer is right, from 0% to 100%}"),
    "multipleChoice": ("Answer in this format:\nExplanation: {why your choice is right}\n"
                       "Answer: {the letter of your choice}\n"
                       "Confidence: {how sure you are that the answer is right, from 0% to 100%}"),
}
"""The response format a question's prompt asks for, per answer type (HLE's format: an explanation, the answer,
a confidence in percent)."""


def hle_prompt(task: HleTask) -> str:
    """The question followed by the response format its answer type asks for."""
    return f"{task.question}\n\n{HLE_FORMAT[task.answer_type]}"


def hle_prompt_rows(tasks: HleTaskSet) -> list[dict[str, str]]:
    """Data rows for training or evaluation on `tasks`: {"prompt", "id"}."""
    return [{"prompt": hle_prompt(task), "id": task.id} for task in tasks.tasks.values()]


def bundled_hle_tasks() -> Path:
    """The bundled synthetic HLE-format sample (text questions plus one image row, which a text model skips)."""
    return SAMPLES_DIR / "hle.jsonl"


# ---- GDPval ---------------------------------------------------------------------------------------------------

def load_gdpval_tasks(path: str | Path) -> dict[str, GdpvalTask]:
    """The GDPval tasks of `path` (.jsonl or .parquet) by task_id; reference files must exist beside it."""
    root = Path(path).parent
    tasks: dict[str, GdpvalTask] = {}
    seen: dict[str, str] = {}
    for location, row in iter_rows(path):
        task_id = _text(row, "task_id", location)
        _unique(seen, task_id, location, "task_id")
        tasks[task_id] = GdpvalTask(task_id, _text(row, "prompt", location),
                                    _reference_files(row.get("reference_files"), root, location),
                                    _rubric(row, location), _text(row, "sector", location, True),
                                    _text(row, "occupation", location, True))
    return tasks


def _reference_files(value: Any, root: Path, location: str) -> tuple[Path, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise JudgedTaskError(f"{location}: field 'reference_files' must be a list of file paths, got "
                              f"{repr(value)[:80]}")
    files = []
    for item in value:
        if "://" in item:
            raise JudgedTaskError(f"{location}: field 'reference_files': {item!r} is a URL; nothing is downloaded, "
                                  "so download the file and name it by its path relative to the task file")
        file = root / item
        if not file.is_file():
            raise JudgedTaskError(f"{location}: field 'reference_files': {item!r} is not a file (looked for {file})")
        files.append(file)
    return tuple(files)


def _rubric(row: dict[str, Any], location: str) -> tuple[RubricItem, ...]:
    value = row.get("rubric_json")
    if value is None:
        extra = " (rubric_pretty is prose and is not parsed)" if "rubric_pretty" in row else ""
        raise JudgedTaskError(f"{location}: field 'rubric_json' is missing{extra}: give the rubric as a list of "
                              "{criterion, score} items")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise JudgedTaskError(f"{location}: field 'rubric_json' is a string but not JSON ({error.msg})") from None
    if not isinstance(value, list) or not value:
        raise JudgedTaskError(f"{location}: field 'rubric_json' must be a non-empty list of items, got "
                              f"{repr(value)[:80]}")
    items = []
    for index, item in enumerate(value):
        where = f"{location}: field 'rubric_json' item {index}"
        if not isinstance(item, dict):
            raise JudgedTaskError(f"{where} must be an object with criterion and score, got {repr(item)[:60]}")
        criterion = item.get("criterion")
        if not isinstance(criterion, str) or not criterion.strip():
            raise JudgedTaskError(f"{where}: 'criterion' must be non-empty text, got {repr(criterion)[:60]}")
        points = item.get("score", item.get("points"))
        if isinstance(points, bool) or not isinstance(points, (int, float)) or not math.isfinite(points) \
                or points <= 0:
            raise JudgedTaskError(f"{where}: 'score' (the item's points) must be a positive number, got {points!r}")
        item_id = item.get("rubric_item_id")
        items.append(RubricItem(criterion, float(points), None if item_id is None else str(item_id)))
    return tuple(items)


def gdpval_prompt(task: GdpvalTask, max_reference_chars: int = MAX_REFERENCE_CHARS) -> str:
    """The task's prompt followed by its reference files: a UTF-8 text file's content (cut past
    `max_reference_chars`), any other file by name and size only (a text model cannot read a spreadsheet)."""
    parts = [task.prompt]
    for file in task.reference_files:
        data = file.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            parts.append(f"Reference file {file.name}: binary, {len(data)} bytes, not shown.")
            continue
        cut = len(text) - max_reference_chars
        shown = text if cut <= 0 else text[:max_reference_chars] + f"\n[... {cut} more characters cut]"
        parts.append(f"Reference file {file.name}:\n{shown}")
    return "\n\n".join(parts)


def gdpval_prompt_rows(tasks: dict[str, GdpvalTask],
                       max_reference_chars: int = MAX_REFERENCE_CHARS) -> list[dict[str, str]]:
    """Data rows for training or evaluation on `tasks`: {"prompt", "task_id"}."""
    return [{"prompt": gdpval_prompt(task, max_reference_chars), "task_id": task.task_id}
            for task in tasks.values()]


def bundled_gdpval_tasks() -> Path:
    """The bundled synthetic GDPval-format sample (with its reference files under samples/reference_files/)."""
    return SAMPLES_DIR / "gdpval.jsonl"
