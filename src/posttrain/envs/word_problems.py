"""Arithmetic word problems with numbers too large to add in one's head: the embedded tool-use task.

A problem is a one-sentence story around two 5-digit numbers ("Ava had 48213 coins and got 39127 more. How many
coins now?"); the verb says whether to add or subtract ("got ... more" adds, "gave away" subtracts, the second
number never larger than the first). The answer is the result as digits. The embedded models cannot add 5-digit
numbers unaided in one pass, but they can learn to copy the two numbers into a calculator call and the calculator's
result into the answer: that is the skill `configs/grpo_tools_arithmetic.yaml` trains.

Rows (`posttrain/arithmetic-tools` in data.embedded):
- for RL and evaluation: ``{"prompt": [user message], "answer": "87340"}``, scored by the arithmetic environment
  behind the tools environment;
- for SFT (`posttrain/arithmetic-tools-sft`): ``{"messages": [...]}``, a worked episode: the user's question, the
  assistant's calculator call in the Hermes format, the tool's result, the assistant's answer.

As in `arithmetic`, a hash of the problem decides its split, so the training and held-out splits never overlap;
a tenth is held out. Problems are drawn at random (the space is too large to enumerate) from a generator seeded by
the split, so every split and row count is the same on every machine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from posttrain.envs.arithmetic import Split, split_of_text

Operation = Literal["+", "-"]
LOW, HIGH = 10_000, 99_999
NAMES = ("Ava", "Ben", "Mia", "Leo", "Zoe", "Sam", "Ivy", "Max")
ITEMS = ("coins", "stamps", "beads", "cards", "shells", "pins")


@dataclass(frozen=True)
class WordProblem:
    a: int
    b: int
    op: Operation
    name: str
    item: str

    @property
    def question(self) -> str:
        if self.op == "+":
            return f"{self.name} had {self.a} {self.item} and got {self.b} more. How many {self.item} now?"
        return f"{self.name} had {self.a} {self.item} and gave away {self.b}. How many {self.item} now?"

    @property
    def expression(self) -> str:
        return f"{self.a}{self.op}{self.b}"

    @property
    def answer(self) -> str:
        return str(self.a + self.b if self.op == "+" else self.a - self.b)

    def tool_call(self) -> str:
        """The assistant's calculator call, as a Hermes-format model writes it."""
        call = {"name": "calculator", "arguments": {"expression": self.expression}}
        return f"<tool_call>{json.dumps(call)}</tool_call>"

    def rl_row(self) -> dict[str, Any]:
        return {"prompt": [{"role": "user", "content": self.question}], "answer": self.answer}

    def sft_row(self) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": self.question},
                             {"role": "assistant", "content": self.tool_call()},
                             {"role": "tool", "content": self.answer},
                             {"role": "assistant", "content": self.answer}]}


def split_of(problem: WordProblem) -> Split:
    """Held out when the hash of the question's text says so (a tenth of the problems)."""
    return split_of_text(problem.question)


def problems(split: Split) -> Iterator[WordProblem]:
    """The split's problems in a fixed order, without end and without repeats."""
    rng = random.Random(f"word-problems/{split}")
    seen: set[WordProblem] = set()
    while True:
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        op: Operation = rng.choice(("+", "-"))
        if op == "-" and b > a:
            a, b = b, a
        problem = WordProblem(a, b, op, rng.choice(NAMES), rng.choice(ITEMS))
        if problem not in seen and split_of(problem) == split:
            seen.add(problem)
            yield problem
