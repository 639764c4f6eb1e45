"""The arithmetic task: n-digit additions (and, as a second task, subtractions) with a verifiable answer.

A problem is the prompt ``"a+b="`` with the answer ``str(a + b)``, or ``"a-b="`` (a >= b, so the answer is never
negative) with ``str(a - b)``. Every problem belongs to exactly one split, decided by a hash of its prompt text,
so the training and held-out splits never overlap whatever sizes or seeds are asked for. About a tenth of the
problems are held out.

The task provides SFT rows (prompt/completion), preference pairs (the correct sum chosen, a
plausible wrong one rejected: `wrong_answer`) and, through the same problems, the prompts and
answers that RL recipes score with `exact_match`.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Split = Literal["train", "heldout"]
Operation = Literal["+", "-"]
HELDOUT_FRACTION_DENOMINATOR = 10


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    op: Operation = "+"

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b if self.op == "+" else self.a - self.b)

    @property
    def task(self) -> str:
        """The `task` column of this problem's row in posttrain/arithmetic-two-tasks."""
        return "addition" if self.op == "+" else "subtraction"


def split_of(a: int, b: int, op: Operation = "+") -> Split:
    """Deterministic split membership of the problem a op b, independent of Python's hash seed."""
    return split_of_text(f"{a}{op}{b}")


def split_of_text(text: str) -> Split:
    """Held out when the SHA-256 of `text` says so (one in HELDOUT_FRACTION_DENOMINATOR)."""
    digest = hashlib.sha256(text.encode()).digest()
    return "heldout" if digest[0] % HELDOUT_FRACTION_DENOMINATOR == 0 else "train"


def all_problems(split: Split, num_digits: int = 2, op: Operation = "+") -> list[Problem]:
    """Every problem of the split, both operands with exactly `num_digits` digits (for subtraction a >= b), in a
    fixed order."""
    low, high = 10 ** (num_digits - 1) if num_digits > 1 else 0, 10**num_digits
    return [Problem(a, b, op) for a in range(low, high) for b in range(low, high)
            if (op == "+" or a >= b) and split_of(a, b, op) == split]


def sample_problems(split: Split, n: int | None = None, seed: int = 0, num_digits: int = 2,
                    op: Operation = "+") -> list[Problem]:
    """`n` distinct problems of the split in a seeded random order (all of them when n is None)."""
    problems = all_problems(split, num_digits, op)
    stream = "arithmetic" if op == "+" else "subtraction"  # addition's order is the one every sweep was run on
    random.Random(f"{stream}/{split}/{num_digits}/{seed}").shuffle(problems)
    if n is None:
        return problems
    if n > len(problems):
        raise ValueError(f"asked for {n} {split} problems with {num_digits} digits, but the split has {len(problems)}")
    return problems[:n]


def two_task_problems(split: Split, n: int | None = None, seed: int = 0) -> list[Problem]:
    """Additions and subtractions of the split, alternating (addition first) while both last, then the rest of
    the longer list; `n` of them (all when None). Each operation's problems come in `sample_problems`' order."""
    additions, subtractions = sample_problems(split, seed=seed), sample_problems(split, seed=seed, op="-")
    mixed = [p for pair in zip(additions, subtractions) for p in pair]
    shorter = min(len(additions), len(subtractions))
    mixed += additions[shorter:] + subtractions[shorter:]
    if n is not None and n > len(mixed):
        raise ValueError(f"asked for {n} {split} problems of the two tasks, but the split has {len(mixed)}")
    return mixed if n is None else mixed[:n]


def wrong_answer(problem: Problem, rng: random.Random) -> str:
    """A plausible wrong sum for `problem`: off by one, off by ten, or two digits swapped.

    Drawn with `rng` among `wrong_answers(problem)`; for the pair's fixed rejected completion use
    `preference_rng(problem)`, so every split and size agrees.
    """
    return rng.choice(wrong_answers(problem))


def wrong_answers(problem: Problem, every_digit: bool = False) -> list[str]:
    """The plausible wrong sums for `problem`, in increasing order: off by one, off by ten, two adjacent digits
    swapped; with `every_digit` also every number that differs from the sum in exactly one digit (no leading
    zero). Never negative, never the sum itself."""
    total = problem.a + problem.b
    candidates = {total + 1, total - 1, total + 10, total - 10}
    digits = str(total)
    for i in range(len(digits) - 1):
        swapped = digits[:i] + digits[i + 1] + digits[i] + digits[i + 2 :]
        if not swapped.startswith("0"):
            candidates.add(int(swapped))
    if every_digit:
        for i in range(len(digits)):
            for digit in "0123456789"[1 if i == 0 and len(digits) > 1 else 0 :]:
                candidates.add(int(digits[:i] + digit + digits[i + 1 :]))
    return [str(c) for c in sorted(c for c in candidates if c >= 0 and c != total)]


def multiple_choices(problem: Problem, count: int = 4) -> list[str]:
    """The answer and `count` - 1 plausible wrong sums (`wrong_answers`), in an order fixed per problem: the
    choices of posttrain/arithmetic-mc."""
    rng = random.Random(f"arithmetic-mc/{problem.a}{problem.op}{problem.b}")
    choices = [problem.answer, *rng.sample(wrong_answers(problem), count - 1)]
    rng.shuffle(choices)
    return choices


def preference_rng(problem: Problem) -> random.Random:
    """The seeded RNG that fixes the rejected completion of `problem` (independent of order and split size)."""
    return random.Random(f"arithmetic-preference/{problem.a}+{problem.b}")


JUDGE_TEMPLATE = "{prompt}{response}?"
"""The question the arithmetic judge (posttrain/arithmetic-judge, configs/sft_judge_arithmetic.yaml) is trained on:
the judge environment's `template` in configs/grpo_judge_arithmetic.yaml."""
JUDGE_RANDOM_FRACTION = 0.25
"""Share of the judge's wrong replies that are any number from 0 to 199 rather than a plausible wrong sum."""
JUDGE_APPENDED_FRACTION = 0.15
"""Share of the judge's wrong replies that are the right sum with one more digit after it (a judge never shown
them accepted a third of them, a reward a policy could learn to hack)."""


def judge_rows(problem: Problem) -> list[tuple[str, str]]:
    """Two (question, verdict) rows for training a judge on `problem`: the correct sum and one wrong reply.

    The question is JUDGE_TEMPLATE filled in ("12+34=47?"); the verdict works the sum out and sets the reply
    beside it before scoring ("46 vs 47. Score: 0"), so the comparison is of two adjacent strings.
    The wrong reply is fixed per problem: for JUDGE_RANDOM_FRACTION of the problems any other number up to 199, for
    JUDGE_APPENDED_FRACTION the right sum with a digit appended, else a plausible wrong sum (`wrong_answers`).
    """
    rng = random.Random(f"arithmetic-judge/{problem.a}+{problem.b}")
    draw = rng.random()
    if draw < JUDGE_RANDOM_FRACTION:
        wrong = str(rng.choice([n for n in range(200) if n != problem.a + problem.b]))
    elif draw < JUDGE_RANDOM_FRACTION + JUDGE_APPENDED_FRACTION:
        wrong = problem.answer + str(rng.randrange(10))
    else:
        wrong = rng.choice(wrong_answers(problem))
    return [(JUDGE_TEMPLATE.format(prompt=problem.prompt, response=reply), judge_verdict(problem, reply))
            for reply in (problem.answer, wrong)]


def judge_verdict(problem: Problem, reply: str) -> str:
    """What the arithmetic judge is trained to answer about `reply`: the sum, the reply's answer, then Score: 1
    (right) or 0 (wrong)."""
    return f"{problem.answer} vs {extract_answer(reply)}. Score: {int(exact_match(reply, problem.answer))}"


def extract_answer(completion: str) -> str:
    """The model's answer: the completion up to its first newline, spaces stripped."""
    return completion.split("\n", 1)[0].strip()


def exact_match(completion: str, answer: str) -> float:
    return 1.0 if extract_answer(completion) == answer else 0.0


def write_jsonl(problems: list[Problem], path: Path) -> Path:
    """Write prompt/completion rows (plus an `answer` column for reward functions)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p.prompt, "completion": p.answer, "answer": p.answer}) + "\n")
    return path


def correct_reward(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    """Batched reward function (environment kind "python"): exact match of each completion's answer."""
    return [exact_match(completion, str(gold)) for completion, gold in zip(completions, answer)]


def format_reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """Batched reward function: 1.0 when the completion's first line is a bare non-negative integer."""
    return [1.0 if extract_answer(completion).isdigit() else 0.0 for completion in completions]
