"""OUTPUT/metrics.jsonl: one JSON object per logged step, always with ``step``.

The file is the run's source of truth for metrics (plots, reports and tests read it), so it is
written to survive a crash: each record is one ``write`` of a whole line followed by a flush,
so ``kill -9`` loses at most the line being written. ``read_metrics`` tolerates exactly that
damage (an unterminated last line), and ``truncate_metrics`` removes the records of steps that a
resumed run is about to redo.

Values are written as plain JSON numbers. Non-finite floats follow Python's ``json`` (``NaN``,
``Infinity``): a diverged loss must stay visible in the file rather than turn into ``null``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any


def _plain_number(key: str, value: Any) -> int | float:
    """int stays int (a bool becomes 0/1); floats, numpy scalars and one-element tensors become a float."""
    if isinstance(value, int):
        return int(value)
    # float() accepts numpy scalars and one-element torch tensors; anything else (a string,
    # a list) raises here, naming the metric, rather than corrupting the file.
    try:
        return float(value)
    except (TypeError, ValueError) as error:
        raise TypeError(f"metric {key!r} is not a number: {value!r}") from error


class MetricsFile:
    """Append-only writer of ``{"step": N, ...}`` lines.

    To continue a file left by an interrupted run, call ``truncate_metrics`` first: it drops the
    records of steps that will be redone and any unterminated last line.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._file is None:
            raise ValueError(f"{self.path} is closed")
        if "step" in metrics:
            raise ValueError("'step' is reserved in metrics.jsonl; pass it as the step argument")
        record = {"step": int(step)} | {key: _plain_number(key, value) for key, value in metrics.items()}
        # One write call per whole line, then flush: a killed process leaves at most a partial last line.
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _parse_lines(path: Path) -> list[tuple[dict[str, Any], str]]:
    """(record, original line) pairs; skips blank lines and an unterminated, unparsable last line."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    # A file written by MetricsFile ends with "\n", so the last element is "". Anything else there
    # is a line whose writer was killed mid-write.
    unterminated = lines.pop()
    parsed: list[tuple[dict[str, Any], str]] = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{line_number}: not a JSON object ({error.msg})") from error
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}:{line_number}: expected a JSON object with a 'step' key")
        if not isinstance(record["step"], int) or isinstance(record["step"], bool):
            raise ValueError(f"{path}:{line_number}: 'step' must be a whole number, got {record['step']!r}")
        parsed.append((record, line))
    if unterminated.strip():
        try:
            record = json.loads(unterminated)
        except json.JSONDecodeError:
            record = None  # truncated by a kill: the step is redone (or lost) by design
        if isinstance(record, dict) and "step" in record:
            parsed.append((record, unterminated))
    return parsed


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl, in file order. A truncated last line is ignored."""
    return [record for record, _ in _parse_lines(Path(path))]


def truncate_metrics(path: str | os.PathLike[str], last_step: int) -> int:
    """Keep only records with ``step <= last_step``, rewriting the file atomically.

    Used on resume from the checkpoint of ``last_step``: the steps after it are redone and
    would otherwise appear twice. Kept lines are copied verbatim. Returns the number of records
    dropped (an unterminated last line is dropped and not counted if it was unreadable).
    """
    path = Path(path)
    parsed = _parse_lines(path)
    kept = [line for record, line in parsed if record["step"] <= last_step]
    tmp_path = path.with_name(path.name + ".tmp")
    with tmp_path.open("w", encoding="utf-8") as tmp:
        tmp.writelines(line + "\n" for line in kept)
        tmp.flush()
        # fsync before the rename so a crash cannot leave an empty file in place of the old one.
        os.fsync(tmp.fileno())
    os.replace(tmp_path, path)
    return len(parsed) - len(kept)
