"""Reading raw records from local files (.jsonl, .json, .parquet, .csv) and `datasets` hub names.

Every record comes with its location ("data/train.jsonl:12", "file.csv row 5", "hub:name[split] row 5"),
so that later validation errors can point at it. Row, item and line numbers are 1-based; CSV rows are
counted from the first data row (the header is not a row).

Bytes that are not valid UTF-8 are a problem of the record that holds them, in every format: text files are
decoded with "surrogateescape", so that a bad byte survives as a lone surrogate in the string it belongs to,
and the record holding one is reported (or skipped) with its location and field, as bad JSON is. Only bad
bytes outside any record (a JSON document's structure, a CSV header) or a file in another encoding altogether
(a UTF-16 byte-order mark) stop the whole file.

A source that looks like a local path (a folder in it, a file extension, a leading "." or "/", a first folder
that exists here) is never looked up on the hub: a typo in a file name gets "file not found" at once, not
network retries.
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from posttrain.data.embedded import is_embedded_dataset, iter_embedded
from posttrain.data.errors import DataError
from posttrain.data.memory import is_in_memory, iter_in_memory

BadRecordHandler = Callable[[DataError], None]
"""Called with the error of a record that cannot be read (bad JSON line, non-object item); may raise it."""

LOCAL_EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")

_FILE_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,9}$")
"""A file extension at the end of a name: ".txt", ".jsonl", ".gz", but not the ".5" of a hub name like
"teknium/OpenHermes-2.5"."""

_UNDECODABLE = re.compile("[\udc80-\udcff]+")
"""What "surrogateescape" decoding makes of bytes that are not UTF-8: one lone surrogate per byte."""

_OTHER_ENCODINGS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
                    (b"\xfe\xff", "UTF-16"))
"""Byte-order marks of encodings that are not UTF-8 (longest first: UTF-32 LE begins like UTF-16 LE)."""


def iter_records(source: str, on_bad_record: BadRecordHandler | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (location, record) for every record of a local file or a `datasets` hub dataset.

    source: a path ending in .jsonl, .json, .parquet or .csv, or a hub name "name" / "name:split"
        (split defaults to "train"), or an embedded dataset such as "posttrain/arithmetic" (see
        posttrain.data.embedded), or rows the Python API holds in memory ("memory:train_data", see
        posttrain.data.memory). A missing file is "file not found" whenever the source looks like a
        path (see `local_path_reason`); only what does not is taken as a hub name.
    on_bad_record: what to do with a record that cannot be read (a JSONL line that is not valid JSON
        or not an object, a CSV row with the wrong number of fields, a record holding bytes that are not
        UTF-8). None raises its DataError; a handler may count it and return, and iteration goes on.
        Problems with the whole source (missing file, unreadable file, unloadable dataset) always raise.
    """
    path = Path(source)
    suffix = path.suffix.lower()
    handle = on_bad_record if on_bad_record is not None else _raise
    if is_in_memory(source):
        yield from iter_in_memory(source, handle)
        return
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
            yield from _iter_parquet(source, handle)
        else:
            raise DataError(source, f"unsupported file type {suffix!r}; use one of {', '.join(LOCAL_EXTENSIONS)}")
    elif suffix in LOCAL_EXTENSIONS:
        raise DataError(source, "file not found" + _looked_for(path))
    elif is_embedded_dataset(source):
        yield from iter_embedded(source)
    elif (reason := local_path_reason(source)) is not None:
        unsupported = (f"; {suffix!r} is not a supported file type either (use one of {', '.join(LOCAL_EXTENSIONS)})"
                       if _FILE_EXTENSION.search(path.name) else "")
        raise DataError(source, f"file not found{_looked_for(path)}{unsupported}. It is read as a local path, "
                        f"not a hub dataset name, because {reason}")
    else:
        yield from _iter_hub(source)


def local_path_reason(source: str) -> str | None:
    """Why `source` names a local path rather than a hub dataset ("name" or "owner/name", with an optional
    ":split"), or None when it could be a hub name.

    Hub names have at most one "/", no leading "." or "/" and no file extension. A first folder that exists in
    the current directory also makes a path: "data/train.jsnl" next to a data/ folder is a typo, not a dataset.
    """
    name = source.partition(":")[0]
    if source.startswith(("/", ".", "~")):
        return f"it starts with {source[0]!r}"
    if "\\" in source:
        return "it contains a backslash"
    if name.count("/") > 1:
        return "it has more than one '/' (a hub name is name or owner/name)"
    extension = _FILE_EXTENSION.search(Path(source).name)
    if extension:
        return f"it ends in a file extension ({extension.group()})"
    first = name.split("/")[0]
    if "/" in name and Path(first).is_dir():
        return f"its first folder {first!r} exists in the current directory"
    return None


def _looked_for(path: Path) -> str:
    return "" if path.is_absolute() else f" (looked for {path.absolute()})"


def _check_encoding(source: str, head: bytes) -> None:
    """A whole-file error for a text file in an encoding other than UTF-8 (recognized by its byte-order mark)."""
    for mark, encoding in _OTHER_ENCODINGS:
        if head.startswith(mark):
            raise DataError(source, f"is encoded as {encoding} (it starts with a {encoding} byte-order mark), not "
                            "UTF-8; save it as UTF-8")


def _undecodable(text: str) -> str | None:
    """The first run of bytes in `text` that were not UTF-8 (kept by "surrogateescape"), described; else None."""
    match = _UNDECODABLE.search(text)
    if match is None:
        return None
    raw = match.group().encode("utf-8", "surrogateescape")
    return f"not valid UTF-8 (bytes {raw.hex(' ')} at character {match.start() + 1})"


def _first_undecodable(value: Any, path: str = "") -> tuple[str, str] | None:
    """(field path, description) of the first string in a record (keys included) holding bytes that were not
    UTF-8; None when every string decoded."""
    if isinstance(value, str):
        problem = _undecodable(value)
        return None if problem is None else (path, problem)
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            found = _first_undecodable(key, where) or _first_undecodable(item, where)
            if found is not None:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _first_undecodable(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def _raise(error: DataError) -> None:
    raise error


def _json_type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _iter_jsonl(source: str, handle: BadRecordHandler) -> Iterator[tuple[str, dict[str, Any]]]:
    # Read bytes and decode per line, so that a bad encoding is reported with its line like bad JSON is.
    with open(source, "rb") as file:
        _check_encoding(source, file.read(4))
        file.seek(0)
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
    with open(source, "rb") as file:
        raw = file.read()
    _check_encoding(source, raw)
    text = raw.decode("utf-8-sig", errors="surrogateescape")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"{source}:{exc.lineno}"
        if exc.pos < len(text) and _UNDECODABLE.match(text, exc.pos):
            raise DataError(where, f"{_undecodable(text[exc.pos:])} outside any string (column {exc.colno}), so "
                            "the document cannot be parsed; save the file as UTF-8") from None
        hint = " (is this JSON Lines? name the file .jsonl)" if exc.msg == "Extra data" else ""
        raise DataError(where, f"invalid JSON: {exc.msg} (column {exc.colno}){hint}") from exc
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
        undecodable = _first_undecodable(item)
        if undecodable is not None:
            handle(DataError(location, undecodable[1], undecodable[0]))
            continue
        yield location, item


def _iter_csv(source: str, handle: BadRecordHandler) -> Iterator[tuple[str, dict[str, Any]]]:
    # The stdlib reader streams, keeps every value a string (CSV has no types) and knows row boundaries.
    # Its default 128 KiB field limit is smaller than many documents; the setting is process-wide.
    # Bytes that are not UTF-8 decode as lone surrogates ("surrogateescape"), so the row holding them is known.
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
    with open(source, "rb") as file:
        _check_encoding(source, file.read(4))
    with open(source, newline="", encoding="utf-8-sig", errors="surrogateescape") as file:
        reader = csv.DictReader(file)
        try:
            header = reader.fieldnames or []
            for column, name in enumerate(header, start=1):
                if (problem := _undecodable(name)) is not None:
                    raise DataError(f"{source} line 1 (header)", f"column {column}: {problem}; without its column "
                                    "names no row can be read, so save the file as UTF-8")
            for row_number, row in enumerate(reader, start=1):
                location = f"{source} row {row_number}"
                columns = len(header)
                undecodable = _first_undecodable({key: value for key, value in row.items() if key is not None})
                if None in row:
                    handle(DataError(location, f"has more fields than the header's {columns} columns"))
                elif any(value is None for value in row.values()):
                    handle(DataError(location, f"has fewer fields than the header's {columns} columns"))
                elif undecodable is not None:
                    handle(DataError(location, f"{undecodable[1]} on line {reader.line_num}", undecodable[0]))
                else:
                    yield location, row
        except csv.Error as exc:
            raise DataError(f"{source} line {reader.line_num}", f"could not be parsed as CSV: {exc}") from exc


def _iter_parquet(source: str, handle: BadRecordHandler) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow
    import pyarrow.parquet

    try:
        parquet_file = pyarrow.parquet.ParquetFile(source)
    except pyarrow.ArrowException as exc:
        raise DataError(source, f"could not be read as Parquet: {exc}") from exc
    row_number = 0
    batches = parquet_file.iter_batches(batch_size=1024)
    while True:
        try:
            batch = next(batches, None)
        except pyarrow.ArrowException as exc:
            raise DataError(f"{source} row {row_number + 1}", f"could not be read as Parquet: {exc}") from exc
        if batch is None:
            return
        try:
            records: list[dict[str, Any] | DataError] = batch.to_pylist()
        except UnicodeDecodeError:
            # Parquet strings must be UTF-8, but writers do not all check: find the rows and columns at fault.
            records = [_parquet_record(batch, index, f"{source} row {row_number + index + 1}")
                       for index in range(batch.num_rows)]
        for record in records:
            row_number += 1
            if isinstance(record, DataError):
                handle(record)
            else:
                yield f"{source} row {row_number}", record


def _parquet_record(batch: Any, index: int, location: str) -> dict[str, Any] | DataError:
    """Row `index` of a record batch as a dict, or the DataError of its first string column that is not UTF-8."""
    record = {}
    for name, column in zip(batch.schema.names, batch.columns):
        try:
            record[name] = column[index].as_py()
        except UnicodeDecodeError as exc:
            return DataError(location, f"not valid UTF-8 ({exc.reason} at byte {exc.start})", name)
    return record


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
