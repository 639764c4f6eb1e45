"""Embedded datasets, generated offline and named like hub datasets.

    posttrain/arithmetic                 the training split of 2-digit additions (prompt, completion, answer)
    posttrain/arithmetic:heldout         the held-out split (never overlaps the training split)
    posttrain/arithmetic:train[:300]     the first 300 rows of the (seeded, shuffled) training split
    posttrain/arithmetic-preference      the same problems as preference pairs (prompt, chosen = the sum,
                                         rejected = a plausible wrong sum); same splits and [:N] limits
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from posttrain.data.errors import DataError

_NAME = re.compile(r"^posttrain/(?P<task>[a-z_-]+)(?::(?P<split>[a-z]+))?(?:\[:(?P<count>\d+)\])?$")
TASKS = ("arithmetic", "arithmetic-preference")


def is_embedded_dataset(source: str) -> bool:
    return source.startswith("posttrain/")


def iter_embedded(source: str) -> Iterator[tuple[str, dict[str, Any]]]:
    from posttrain.envs import arithmetic

    match = _NAME.match(source)
    if match is None or match["task"] not in TASKS:
        raise DataError(source, f"unknown embedded dataset; embedded datasets: {', '.join(f'posttrain/{t}' for t in TASKS)} "
                        "with an optional :train or :heldout split and [:N] row limit")
    split = match["split"] or "train"
    if split not in ("train", "heldout"):
        raise DataError(source, f"unknown split {split!r}; the arithmetic task has train and heldout")
    count = int(match["count"]) if match["count"] else None
    for row_number, problem in enumerate(arithmetic.sample_problems(split, count), start=1):
        if match["task"] == "arithmetic-preference":
            rejected = arithmetic.wrong_answer(problem, arithmetic.preference_rng(problem))
            yield f"{source} row {row_number}", {"prompt": problem.prompt, "chosen": problem.answer, "rejected": rejected}
        else:
            yield f"{source} row {row_number}", {"prompt": problem.prompt, "completion": problem.answer, "answer": problem.answer}
