"""Reading raw records from local files (.jsonl, .json, .parquet, .csv) and `datasets` hub names.

Every record comes with its location ("data/train.jsonl:12", "file.csv row 5", "hub:name[split] row 5"),
so that later validation errors can point at it. Row, item and line numbers are 1-based; CSV rows are
counted from the first data row (the header is not a row).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from posttrain.data.embedded import is_embedded_dataset, iter_embedded
from posttrain.data.errors import DataError

BadRecordHandler = Callable[[DataError], None]
"""Called with the error of a record that cannot be read (bad JSON line, non-object item); may raise it."""

LOCAL_EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")


def iter_records(source: str, on_bad_record: BadRecordHandler | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (location, record) for every record of a local file or a `datasets` hub dataset.

    source: a path ending in .jsonl, .json, .parquet or .csv, or a hub name "name" / "name:split"
        (split defaults to "train"), or an embedded dataset such as "posttrain/arithmetic" (see
        posttrain.data.embedded). Anything that is neither an existing path nor has one of these
        extensions is taken as a hub name.
    on_bad_record: what to do with a record that cannot be read (a JSONL line that is not valid JSON
        or not an object, a CSV row with the wrong number of fields). None raises its DataError; a handler
        may count it and return, and iteration goes on. Problems with the whole source (missing file,
        unreadable file, unloadable dataset) always raise.
    """
    path = Path(source)
    suffix = path.suffix.lower()
    handle = on_bad_record if on_bad_record is not None else _raise
    if path.is_dir():
        raise DataError(source, f"is a directory; give the data files in it ({', '.join(LOCAL_EXTENSIONS)})")
    if path.is_file():
        if suffix == ".jsonl":
            yield from _iter_jsonl(source, handle)
        elif suffix == ".json":
            yield from _iter_json(source, handle)
        elif suffix == ".csv":
            yield from _iter_csv(source, handle)
        elif suffix == ".parquet":
            yield from _iter_parquet(source)
        else:
            raise DataError(source, f"unsupported file type {suffix!r}; use one of {', '.join(LOCAL_EXTENSIONS)}")
    elif suffix in LOCAL_EXTENSIONS:
        raise DataError(source, "file not found")
    elif is_embedded_dataset(source):
        yield from iter_embedded(source)
    else:
        yield from _iter_hub(source)


def _raise(error: DataError) -> None:
    raise error


def _json_type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _iter_jsonl(source: str, handle: BadRecordHandler) -> Iterator[tuple[str, dict[str, Any]]]:
    # Read bytes and decode per line, so that a bad encoding is reported with its line like bad JSON is.
    with open(source, "rb") as file:
        for line_number, raw_line in enumerate(file, start=1):
            location = f"{source}:{line_number}"
            try:
                line = raw_line.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                handle(DataError(location, f"not valid UTF-8 ({exc.reason} at byte {exc.start})"))
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                handle(DataError(location, f"invalid JSON: {exc.msg} (column {exc.colno})"))
                continue
            if not isinstance(record, dict):
                handle(DataError(location, f"expected a JSON object, got {_json_type_name(record)}"))
                continue
            yield location, record


def _iter_json(source: str, handle: BadRecordHandler) -> Iterator[tuple[str, dict[str, Any]]]:
    with open(source, encoding="utf-8-sig") as file:
        text = file.read()
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = " (is this JSON Lines? name the file .jsonl)" if exc.msg == "Extra data" else ""
        raise DataError(f"{source}:{exc.lineno}", f"invalid JSON: {exc.msg} (column {exc.colno}){hint}") from exc
    if isinstance(document, dict) and isinstance(document.get("data"), list):
        items = document["data"]
    elif isinstance(document, list):
        items = document
    else:
        raise DataError(source, f'expected a list of objects or {{"data": [...]}}, got {_json_type_name(document)}')
    for item_number, item in enumerate(items, start=1):
        location = f"{source} item {item_number}"
        if not isinstance(item, dict):
            handle(DataError(location, f"expected a JSON object, got {_json_type_name(item)}"))
            continue
        yield location, item


def _iter_csv(source: str, handle: BadRecordHandler) -> Iterator[tuple[str, dict[str, Any]]]:
    # The stdlib reader streams, keeps every value a string (CSV has no types) and knows row boundaries.
    # Its default 128 KiB field limit is smaller than many documents; the setting is process-wide.
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
    with open(source, newline="", encoding="utf-8-sig") as file:
        reader = csv.DictReader(file)
        try:
            for row_number, row in enumerate(reader, start=1):
                location = f"{source} row {row_number}"
                columns = len(reader.fieldnames or ())
                if None in row:
                    handle(DataError(location, f"has more fields than the header's {columns} columns"))
                elif any(value is None for value in row.values()):
                    handle(DataError(location, f"has fewer fields than the header's {columns} columns"))
                else:
                    yield location, row
        except csv.Error as exc:
            raise DataError(f"{source} line {reader.line_num}", f"could not be parsed as CSV: {exc}") from exc


def _iter_parquet(source: str) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow
    import pyarrow.parquet

    try:
        parquet_file = pyarrow.parquet.ParquetFile(source)
    except pyarrow.ArrowException as exc:
        raise DataError(source, f"could not be read as Parquet: {exc}") from exc
    row_number = 0
    for batch in parquet_file.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            row_number += 1
            yield f"{source} row {row_number}", record


def _iter_hub(source: str) -> Iterator[tuple[str, dict[str, Any]]]:
    # Imported here: `datasets` takes about a second to import and most runs read local files.
    import datasets

    name, _, split = source.partition(":")
    split = split or "train"
    try:
        dataset = datasets.load_dataset(name, split=split)
    except Exception as exc:  # any loader failure becomes a DataError that names the source and what to do
        raise _hub_error(source, name, split, exc) from exc
    for row_number, record in enumerate(dataset, start=1):
        yield f"hub:{name}[{split}] row {row_number}", record


def _hub_error(source: str, name: str, split: str, exc: Exception) -> DataError:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    reason = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
    location = f"hub:{name}[{split}]"
    if _looks_offline(exc):
        return DataError(
            location,
            f"dataset {name!r} (split {split!r}) could not be loaded from the hub: "
            f"this machine seems offline ({reason}). "
            "Give a local .jsonl/.json/.parquet/.csv file instead, or set HF_DATASETS_OFFLINE=1 "
            "if a copy of the dataset is in the datasets cache.",
        )
    return DataError(
        location,
        f"dataset {name!r} (split {split!r}) could not be loaded from the hub ({reason}); "
        f"no local file {source!r} exists either. Check the name and split, or give a local "
        ".jsonl/.json/.parquet/.csv file.",
    )


def _looks_offline(exc: BaseException) -> bool:
    """True when offline mode is on or a connection error is anywhere in the exception's chain."""
    offline_vars = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    if any(os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE") for var in offline_vars):
        return True
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (ConnectionError, TimeoutError)):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False
