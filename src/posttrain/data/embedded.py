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
                                         "46 vs 46. Score: 1", and the same for one wrong reply (a plausible wrong sum,
                                         or a quarter of the time any number to 199) -> "46 vs 47. Score: 0"; same
                                         splits, [:N] is the first N rows
    posttrain/arithmetic-mc              the same problems as multiple-choice questions: prompt "12+34=", four
                                         choices (the sum and three plausible wrong sums, in a fixed order per
                                         problem) and the 0-based index of the sum in `answer`; same splits and
                                         [:N] limits. The bundled task of `posttrain eval --task arithmetic_mc`
    posttrain/subtraction                2-digit subtractions a-b with a >= b (prompt "57-23=", completion "34",
                                         answer); their own train/heldout splits, [:N] limits as for arithmetic
    posttrain/arithmetic-two-tasks       additions and subtractions alternating, each row with a `task` column
                                         ("addition" or "subtraction"): the data for routing samples to one
                                         teacher per task; same splits, [:N] is the first N rows
    posttrain/arithmetic-tools           word problems around two 5-digit numbers, to solve with the calculator tool
                                         (envs.word_problems): prompt = [the user's question], answer = the result;
                                         20,000 training and 2,000 held-out rows (their own hash-decided splits),
                                         [:N] limits as for arithmetic
    posttrain/arithmetic-tools-sft       the same problems as worked tool-use episodes (messages: the question, a
                                         Hermes-format calculator call, the tool's result, the answer)
    posttrain/arithmetic-tools-mixed-sft the same problems, four rows in ten worked with the calculator and the
                                         other six answered directly without it (word_problems.TOOL_SHARE)
    posttrain/bench-lengths              benchmark rows with real-world length spread: prompt and completion
                                         each 16-1,024 characters (one token each for the byte-level
                                         tokenizer), log-normal (median ~128), random words; 4,096 rows per
                                         split, fixed. Also as posttrain/bench-lengths-messages (a user and an
                                         assistant message) and posttrain/bench-lengths-preference (the
                                         completion chosen, another of its length distribution rejected)
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

from posttrain.data.errors import DataError
from posttrain.envs import arithmetic, word_problems
from posttrain.envs.arithmetic import Problem

_NAME = re.compile(r"^posttrain/(?P<task>[a-z_-]+)(?::(?P<split>[a-z]+))?(?:\[:(?P<count>\d+)\])?$")
TASKS = ("arithmetic", "arithmetic-mc", "arithmetic-preference", "arithmetic-preference-dense", "arithmetic-judge", "subtraction",
         "arithmetic-two-tasks", "arithmetic-tools", "arithmetic-tools-sft",
         "arithmetic-tools-mixed-sft", "bench-lengths", "bench-lengths-messages", "bench-lengths-preference")
BENCH_ROWS = 4096
WORD_PROBLEM_ROWS = {"train": 20_000, "heldout": 2_000}
BENCH_LENGTHS = (16, 1024)
"""Shortest and longest prompt or completion of posttrain/bench-lengths, in characters."""
BENCH_MEDIAN, BENCH_SIGMA = 128, 1.0
"""The log-normal the lengths are drawn from (then clipped to BENCH_LENGTHS)."""
WORDS = ("the", "model", "data", "token", "learning", "rate", "batch", "gradient", "answer", "question", "reward",
         "policy", "value", "sample", "length", "memory", "step", "train", "loss", "state")


def is_embedded_dataset(source: str) -> bool:
    return source.startswith("posttrain/")


def iter_embedded(source: str) -> Iterator[tuple[str, dict[str, Any]]]:
    match = _NAME.match(source)
    if match is None or match["task"] not in TASKS:
        raise DataError(source, f"unknown embedded dataset; embedded datasets: {', '.join(f'posttrain/{t}' for t in TASKS)} "
                        "with an optional :train or :heldout split and [:N] row limit")
    split = match["split"] or "train"
    if split not in ("train", "heldout"):
        raise DataError(source, f"unknown split {split!r}; the embedded tasks have train and heldout")
    count = int(match["count"]) if match["count"] else None
    if match["task"].startswith("bench-lengths"):
        yield from _limited(source, _bench_rows(match["task"], split), count, split)
        return
    if match["task"].startswith("arithmetic-tools"):
        stories = itertools.islice(word_problems.problems(split), WORD_PROBLEM_ROWS[split])
        row_of: dict[str, Callable[[int, word_problems.WordProblem], dict[str, Any]]] = {
            "arithmetic-tools": lambda _, story: story.rl_row(),
            "arithmetic-tools-sft": lambda _, story: story.sft_row(),
            "arithmetic-tools-mixed-sft": lambda index, story: story.mixed_sft_row(index)}
        rows = (row_of[match["task"]](index, story) for index, story in enumerate(stories))
        yield from _limited(source, rows, count, split)
        return
    dense = match["task"] in ("arithmetic-preference-dense", "arithmetic-judge")  # several rows per problem
    limit = None if dense else count
    if match["task"] == "subtraction":
        problems = arithmetic.sample_problems(split, limit, op="-")
    elif match["task"] == "arithmetic-two-tasks":
        problems = arithmetic.two_task_problems(split, limit)
    else:
        problems = arithmetic.sample_problems(split, limit)
    yield from _limited(source, _rows(match["task"], problems), count, split)


def _limited(source: str, rows: Iterator[dict[str, Any]], count: int | None, split: str
             ) -> Iterator[tuple[str, dict[str, Any]]]:
    row_number = 0
    for row_number, row in enumerate(itertools.islice(rows, count), start=1):
        yield f"{source} row {row_number}", row
    if count is not None and row_number < count:
        raise DataError(source, f"asked for {count} rows, but the {split} split has {row_number}")


def _bench_rows(task: str, split: str) -> Iterator[dict[str, Any]]:
    for index in range(BENCH_ROWS):
        rng = random.Random(f"bench-lengths/{split}/{index}")
        prompt, completion, rejected = (_bench_text(rng) for _ in range(3))
        if task == "bench-lengths-messages":
            yield {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]}
        elif task == "bench-lengths-preference":
            yield {"prompt": prompt, "chosen": completion, "rejected": rejected}
        else:
            yield {"prompt": prompt, "completion": completion}


def _bench_text(rng: random.Random) -> str:
    """Random words, exactly a log-normal number of characters (clipped to BENCH_LENGTHS)."""
    low, high = BENCH_LENGTHS
    length = min(high, max(low, round(rng.lognormvariate(math.log(BENCH_MEDIAN), BENCH_SIGMA))))
    text = rng.choice(WORDS)
    while len(text) < length:
        text += " " + rng.choice(WORDS)
    return text[:length]


def _rows(task: str, problems: list[Problem]) -> Iterator[dict[str, Any]]:
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
        elif task == "arithmetic-mc":
            choices = arithmetic.multiple_choices(problem)
            yield {"prompt": problem.prompt, "choices": choices, "answer": choices.index(problem.answer)}
        elif task == "arithmetic-two-tasks":
            yield {"prompt": problem.prompt, "completion": problem.answer, "answer": problem.answer,
                   "task": problem.task}
        else:
            yield {"prompt": problem.prompt, "completion": problem.answer, "answer": problem.answer}
