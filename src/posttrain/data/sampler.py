"""Resumable, deterministic example order over epochs."""

from __future__ import annotations

import torch


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
