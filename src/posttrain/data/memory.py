"""Rows held in memory (a list of dicts, a `datasets.Dataset`) read wherever a config takes a data file.

The Python API (posttrain.api) registers each in-memory source under a name, ``memory:LABEL``, for the duration
of one call, and puts that name in the config where a file name would be (data.train_files, data.eval_files,
data.files): the config stays a tree of plain values (OUTPUT/config.yaml records the name), and every recipe reads
the rows through `iter_records` as it reads a file's, with the same validation and the same errors.

A row's location is ``LABEL[i]`` with i its 0-based index, as the list or dataset is indexed in Python
(``train_data[3]: field 'completion': expected a string, got int``). A name that is not registered (a config.yaml
of such a run given to the command line) is an error that says what it was.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from posttrain.data.errors import DataError

IN_MEMORY_PREFIX = "memory:"
"""The prefix of an in-memory source's name in a config."""

_registered: dict[str, Iterable[Any]] = {}
_lock = threading.Lock()


def is_in_memory(source: str) -> bool:
    return source.startswith(IN_MEMORY_PREFIX)


@contextlib.contextmanager
def in_memory_sources(sources: Mapping[str, Iterable[Any]]) -> Iterator[None]:
    """Make each name of `sources` (``memory:LABEL``) readable by `iter_records` while the block runs."""
    with _lock:
        taken = sorted(set(sources) & set(_registered))
        if taken:
            raise RuntimeError(f"in-memory data {', '.join(taken)} is registered already (by another call running "
                               "now); in-memory names are unique per call")
        _registered.update(sources)
    try:
        yield
    finally:
        with _lock:
            for name in sources:
                _registered.pop(name, None)


def unused_name(label: str) -> str:
    """``memory:LABEL``, or ``memory:LABEL#2`` (#3, ...) while another call has that name registered."""
    name, number = f"{IN_MEMORY_PREFIX}{label}", 1
    with _lock:
        while name in _registered:
            number += 1
            name = f"{IN_MEMORY_PREFIX}{label}#{number}"
    return name


def iter_in_memory(source: str, handle: Callable[[DataError], None]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, record) for every row of the in-memory source `source`; a row that is not a mapping goes to
    `handle` (raised or skipped and counted, as a JSONL line that is no object)."""
    with _lock:
        rows = _registered.get(source)
    if rows is None:
        raise DataError(source, "names rows held in memory by a posttrain.train/evaluate/generate call, readable "
                        "only during that call; give the rows again to the Python API, or write them to a .jsonl "
                        "file and name that file")
    label = source.removeprefix(IN_MEMORY_PREFIX).partition("#")[0]
    for index, record in enumerate(rows):
        location = f"{label}[{index}]"
        if not isinstance(record, Mapping):
            handle(DataError(location, f"expected a dict (one row: column name -> value), got "
                             f"{type(record).__name__}"))
            continue
        yield location, dict(record)
