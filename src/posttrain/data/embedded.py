"""Embedded datasets, generated offline and named like hub datasets.

    posttrain/arithmetic                 the training split of 2-digit additions (prompt, completion, answer)
    posttrain/arithmetic:heldout         the held-out split (never overlaps the training split)
    posttrain/arithmetic:train[:300]     the first 300 rows of the (seeded, shuffled) training split
    posttrain/arithmetic-preference      the same problems as preference pairs (prompt, chosen = the sum,
                                         rejected = a plausible wrong sum: off by one or ten, or two digits
                                         swapped; one fixed pair per problem); same splits and [:N] limits
    posttrain/arithmetic-preference-dense
                                         every problem paired with EVERY such wrong sum and every number
                                         that differs from the sum in one digit (about 24 pairs per problem,
                                         consecutive); [:N] is the first N pairs. Reward models learn to check
                                         each digit from it (a lone pair per problem shows too few of them)
    posttrain/arithmetic-judge           a judge's lessons, two prompt/completion rows per problem: "12+34=46?" ->
                                         "46. Score: 1", and the same for one wrong reply (a plausible wrong sum,
                                         or a quarter of the time any number to 199) -> "46. Score: 0"; same
                                         splits, [:N] is the first N rows
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from posttrain.data.errors import DataError

if TYPE_CHECKING:
    from posttrain.envs.arithmetic import Problem

_NAME = re.compile(r"^posttrain/(?P<task>[a-z_-]+)(?::(?P<split>[a-z]+))?(?:\[:(?P<count>\d+)\])?$")
TASKS = ("arithmetic", "arithmetic-preference", "arithmetic-preference-dense", "arithmetic-judge")


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
    dense = match["task"] in ("arithmetic-preference-dense", "arithmetic-judge")  # several rows per problem
    rows = _rows(match["task"], arithmetic.sample_problems(split, None if dense else count))
    row_number = 0
    for row_number, row in enumerate(itertools.islice(rows, count), start=1):
        yield f"{source} row {row_number}", row
    if count is not None and row_number < count:
        raise DataError(source, f"asked for {count} rows, but the {split} split has {row_number}")


def _rows(task: str, problems: list[Problem]) -> Iterator[dict[str, Any]]:
    from posttrain.envs import arithmetic

    for problem in problems:
        if task == "arithmetic-preference":
            rejected = arithmetic.wrong_answer(problem, arithmetic.preference_rng(problem))
            yield {"prompt": problem.prompt, "chosen": problem.answer, "rejected": rejected}
        elif task == "arithmetic-preference-dense":
            for rejected in arithmetic.wrong_answers(problem, every_digit=True):
                yield {"prompt": problem.prompt, "chosen": problem.answer, "rejected": rejected}
        elif task == "arithmetic-judge":
            for question, verdict in arithmetic.judge_rows(problem):
                yield {"prompt": question, "completion": verdict}
        else:
            yield {"prompt": problem.prompt, "completion": problem.answer, "answer": problem.answer}
