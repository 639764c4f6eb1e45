"""Resumable, deterministic example order over epochs, and the check that a step's draw fits in the data."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from posttrain.config.schema import TrainerConfig
from posttrain.errors import RunError

MAX_PASSES_PER_STEP = 64
"""The most times one optimizer step may go over the whole training set. A step larger than the data only
weights its examples (a 5-row file with micro_batch_size 8 trains fine); one that would go over it more than
this many times is a mistyped knob (micro_batch_size=1000000000), refused before anything is built for it."""


def check_step_fits(trainer: TrainerConfig, num_examples: int, what: str = "training examples") -> None:
    """`check_draw_fits` for the recipes whose step is micro_batch_size × gradient_accumulation_steps examples
    (sft, dpo, rm)."""
    check_draw_fits({"trainer.micro_batch_size": trainer.micro_batch_size,
                     "trainer.gradient_accumulation_steps": trainer.gradient_accumulation_steps}, num_examples, what)


def check_draw_fits(knobs: Mapping[str, int], num_examples: int, what: str) -> None:
    """Refuse a step that would go over the data more than MAX_PASSES_PER_STEP times, before any model loads.

    knobs: the config keys whose product is the number of examples one step draws, with their values, e.g.
        {"trainer.micro_batch_size": 8, "trainer.gradient_accumulation_steps": 4}.
    what: what the examples are, for the message ("training examples", "training prompts").

    Every drawn index, example and batch of a step is held in memory, so a mistyped knob
    (micro_batch_size=1000000000) would otherwise fill it for minutes before anything is printed. Raises
    RunError naming the knobs and the data size.
    """
    per_step = math.prod(knobs.values())
    if per_step <= MAX_PASSES_PER_STEP * num_examples:
        return
    settings = " × ".join(f"{key}={value}" for key, value in knobs.items())
    product = f" = {per_step}" if len(knobs) > 1 else ""
    raise RunError(f"{settings}{product} {what} per step, but data.train_files hold only {num_examples}: one "
                   f"step would go over them {per_step // num_examples} times (at most {MAX_PASSES_PER_STEP} is "
                   f"allowed). Lower {' or '.join(knobs)}, or give more data")


class EpochSampler:
    """Yields example indices epoch after epoch; each epoch is a permutation seeded by (seed, epoch).

    Its whole state is (epoch, position), so a checkpoint stores two integers and a resumed run draws
    exactly the indices an uninterrupted run would have.
    """

    def __init__(self, num_examples: int, seed: int, shuffle: bool = True):
        if num_examples <= 0:
            raise ValueError("cannot sample from an empty dataset")
        self.num_examples = num_examples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_examples))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_examples, generator=generator).tolist()

    def next_indices(self, count: int) -> list[int]:
        """The next `count` indices, continuing into the next epoch's order when this one runs out. count is at
        at most MAX_PASSES_PER_STEP × num_examples (recipes check it with `check_draw_fits` before any model loads)."""
        if count > MAX_PASSES_PER_STEP * self.num_examples:
            raise ValueError(f"cannot draw {count} indices at once from {self.num_examples} examples (at most "
                             f"{MAX_PASSES_PER_STEP} passes over them)")
        out: list[int] = []
        while len(out) < count:
            if self.position == self.num_examples:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(out), self.num_examples - self.position)
            out.extend(self._order[self.position : self.position + take])
            self.position += take
        return out

    @property
    def epochs_completed(self) -> float:
        return self.epoch + self.position / self.num_examples

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_examples": self.num_examples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_examples"] != self.num_examples:
            raise ValueError(
                f"the checkpoint was taken over {state['num_examples']} training examples but the data now has "
                f"{self.num_examples}; resume with the same data or start a new output_dir"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
