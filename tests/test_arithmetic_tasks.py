"""The embedded arithmetic tasks: addition's rows are unchanged by the second task; subtractions and the two-task
mixture have disjoint splits, right answers and a task column."""

import hashlib
import json

from posttrain.data.embedded import iter_embedded
from posttrain.envs import arithmetic


def rows(source):
    return [row for _, row in iter_embedded(source)]


def test_addition_rows_are_the_ones_every_sweep_ran_on():
    # The first rows and a digest of the whole training split, as they were before subtraction existed.
    train = rows("posttrain/arithmetic:train")
    assert len(train) == 7281
    assert set(train[0]) == {"prompt", "completion", "answer"}
    digest = hashlib.sha256(json.dumps(train).encode()).hexdigest()
    assert digest == ADDITION_TRAIN_SHA256


def test_subtraction_splits_are_disjoint_and_answers_right():
    train, heldout = rows("posttrain/subtraction:train"), rows("posttrain/subtraction:heldout")
    assert 3000 < len(train) < 4000 and 300 < len(heldout) < 500
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    for row in train + heldout:
        a, b = map(int, row["prompt"].rstrip("=").split("-"))
        assert a >= b and row["completion"] == row["answer"] == str(a - b)
    assert len(train) + len(heldout) == sum(1 for a in range(10, 100) for b in range(10, 100) if a >= b)


def test_two_tasks_alternate_with_a_task_column():
    mixed = rows("posttrain/arithmetic-two-tasks:heldout[:6]")
    assert [r["task"] for r in mixed] == ["addition", "subtraction"] * 3
    assert [r["prompt"] for r in mixed[0::2]] == [r["prompt"] for r in rows("posttrain/arithmetic:heldout[:3]")]
    assert [r["prompt"] for r in mixed[1::2]] == [r["prompt"] for r in rows("posttrain/subtraction:heldout[:3]")]
    whole = rows("posttrain/arithmetic-two-tasks:train")
    assert len(whole) == len(rows("posttrain/arithmetic:train")) + len(rows("posttrain/subtraction:train"))
    held = {r["prompt"] for r in rows("posttrain/arithmetic-two-tasks:heldout")}
    assert not held & {r["prompt"] for r in whole}


ADDITION_TRAIN_SHA256 = "03d81f429225f2549f5f8f0dfcae8b2bcac339ac6446af9fc1b1b0cff391aa9c"
"""posttrain/arithmetic:train as JSON, computed on the code before the subtraction task was added."""


def test_problem_answers():
    assert arithmetic.Problem(57, 23, "-").prompt == "57-23=" and arithmetic.Problem(57, 23, "-").answer == "34"
    assert arithmetic.Problem(57, 23).answer == "80" and arithmetic.Problem(57, 23).task == "addition"
