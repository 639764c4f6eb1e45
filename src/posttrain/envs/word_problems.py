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
  assistant's calculator call in the Hermes format, the tool's result, the assistant's answer;
- for SFT of a model that has not yet learned *when* the tool helps (`posttrain/arithmetic-tools-mixed-sft`): the
  same problems, TOOL_SHARE rows in ten worked with the calculator and the others answered directly (the user's
  question and the answer, no call). A model trained on it calls the calculator on about that share of problems
  and guesses the rest; GRPO has the choice to learn, since only the calls earn reward.

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
TOOL_SHARE = 4
"""Rows in every ten of posttrain/arithmetic-tools-mixed-sft that are worked calculator episodes."""
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

    def direct_row(self) -> dict[str, Any]:
        """The question answered at once, without the tool (a 5-digit sum the embedded models cannot work out)."""
        return {"messages": [{"role": "user", "content": self.question},
                             {"role": "assistant", "content": self.answer}]}

    def mixed_sft_row(self, index: int) -> dict[str, Any]:
        """Row `index` of the mixed SFT set: a worked episode for TOOL_SHARE indices in ten, else a direct answer."""
        return self.sft_row() if index % 10 < TOOL_SHARE else self.direct_row()


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
