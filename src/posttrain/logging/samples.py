"""OUTPUT/samples.jsonl: what the model wrote, one JSON object per sample.

Each line is exactly

    {"step": int, "split": "train" | "eval/<name>", "prompt": str, "reference": str | null, "completion": str,
     "reward": float | null, "components": {name: float} | null, "correct": bool | null, "error": str | null}

`reference` is what the reply is checked against, from the prompt's row (its `answer`, or the tests of code
environments; `algorithms.evaluate.reference_text`), null when the row has none. `reward` is the scalar reward
(the weighted sum of `components` when the environment gives named ones), null when scoring failed, and then
`error` says why; `correct` is null when the environment does not judge correctness. An RL recipe's "train"
record also has `group_id` (the run's group counter: which prompt draw the episode answers; samples of one prompt
share it), `policy_version` (the optimizer steps taken by the policy whose weights sampled it; with in-flight weight
updates the oldest that sampled any of its tokens) and `version_spans` (with in-flight weight updates, [index of the
first sampled token, version] where the weights that sampled its tokens changed; else []), from which a run's file
shows which prompts every step trained on and how stale they were.
GRPO appends the first `logging.samples_per_step` episodes of each step (split "train"); every evaluation set its
first `samples_logged` samples (split "eval/<name>"). Like metrics.jsonl each line is one write followed by a
flush, and a resumed run drops the lines of steps after its checkpoint (`logging.metrics.truncate_metrics`, which
reads any file of step-keyed lines), so a resumed run's file equals an uninterrupted one's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

SAMPLES_FILENAME = "samples.jsonl"
SAMPLE_KEYS = ("prompt", "reference", "completion", "reward", "components", "correct", "error")
"""The keys of a sample record, besides step and split."""
EPISODE_KEYS = ("group_id", "policy_version", "version_spans")
"""The keys an RL recipe's training episode adds (all or none)."""


class SamplesFile:
    """Append-only writer of samples.jsonl lines; the file is created by the first write, so a run that logs no
    samples leaves none."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None

    def write(self, step: int, split: str, records: Sequence[Mapping[str, Any]]) -> None:
        """One line per record; each record has exactly the SAMPLE_KEYS, or those and the EPISODE_KEYS."""
        lines = []
        for record in records:
            keys = (*SAMPLE_KEYS, *EPISODE_KEYS) if EPISODE_KEYS[0] in record else SAMPLE_KEYS
            if set(record) != set(keys):
                raise ValueError(f"a samples.jsonl record has the keys {', '.join(SAMPLE_KEYS)} (and an RL episode "
                                 f"{', '.join(EPISODE_KEYS)}); got {sorted(record)}")
            lines.append(json.dumps({"step": int(step), "split": split, **{key: record[key] for key in keys}}))
        if not lines:
            return
        if self._file is None:
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write("".join(line + "\n" for line in lines))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_samples(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of a samples.jsonl, in file order."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
