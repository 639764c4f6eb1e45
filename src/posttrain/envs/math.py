"""Math answers checked with math-verify: reward 1.0 when the reply's final answer equals the gold answer.

Which part of the reply is the answer: math-verify's extraction with `\\boxed{}` given the highest
priority. So a reply with a `\\boxed{...}` is judged by its last boxed answer (several boxed
answers in one expression read as a set); without one, by an anchored "final answer is ..." /
"answer: ...", and failing that by the rightmost LaTeX expression (`$...$`, `\\(...\\)`) or plain
number or expression. A reply with no answer at all scores 0.0 (it is wrong, not unscorable).

The gold answer `metadata["answer"]` is a string, possibly LaTeX ("\\frac{1}{2}", "42",
"$x^2+1$"). Without `$`, `\\(`, `\\[` or `\\boxed` it is read as one inline LaTeX expression. A
gold answer that math-verify cannot parse masks the sample (a data problem, not the model's).

Timeouts: math-verify times itself with `signal.alarm`, which only works in a main thread and
otherwise raises, or — with its default `raise_on_error=False` — silently returns False, which
would be a zero reward for a scoring failure (verl PR #5635). Here it is called with
`raise_on_error=True` in the main thread of worker processes (`rewards.RewardWorkerPool`), where
its own per-operation limit (a third of `timeout_s`, at least 1 s) usually fires first and the
pool's deadline of `timeout_s` per sample is the hard stop. With `num_workers=0` it runs in the
calling thread, which must then be the main thread, with only its own limit. Either way a
timeout or an exception masks the sample.

Reward: `correct + format_weight * format`, where `format` is 1.0 when the reply puts its answer
in `\\boxed{}`. With `reward_components=True` the reward is the dict
`{"correct": ..., "format": ...}` and `reward_weights` says how to combine it.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

from posttrain.envs.base import (
    EnvStep,
    Message,
    check_batch,
    reply_of,
    required_column,
    single_turn_step,
)
from posttrain.envs.rewards import (
    DEFAULT_WORKER_MEMORY_MB,
    CallOutcome,
    RewardWorkerPool,
    Task,
    score_in_process,
)

SCORER_PATH = "posttrain.envs.math:score_math_answer"


def _extraction_config():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout_s: int) -> list[Any]:
    # A group of generations shares one gold answer: parse it once.
    from math_verify import parse

    delimited = any(marker in gold for marker in ("$", "\\(", "\\[", "\\boxed"))
    return parse(gold if delimited else f"${gold}$", parsing_timeout=timeout_s, raise_on_error=True)


def score_math_answer(reply: str, gold: str, timeout_s: int) -> dict[str, Any]:
    """Judge one reply: {"correct": 0.0|1.0, "format": 0.0|1.0, "extracted_answer": str}.

    Raises (so the sample is masked) when math-verify times out or fails, or when the gold answer
    cannot be parsed. `timeout_s` is math-verify's own limit per parse or comparison.
    """
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        gold_parsed = _parse_gold(gold, timeout_s)
        if not gold_parsed:
            raise ValueError(f"math-verify could not parse the gold answer {gold!r}")
        predicted = parse(reply, extraction_config=_extraction_config(), parsing_timeout=timeout_s, raise_on_error=True)
        correct = bool(predicted) and verify(gold_parsed, predicted, timeout_seconds=timeout_s, raise_on_error=True)
    except TimeoutException as error:  # a BaseException: turn it into an ordinary error so every path masks it
        raise TimeoutError(f"math-verify took longer than its {timeout_s} s limit") from error
    return {
        "correct": 1.0 if correct else 0.0,
        "format": 1.0 if "\\boxed{" in reply else 0.0,
        "extracted_answer": str(predicted[-1]) if predicted else "",
    }


class MathEnvironment:
    """Single turn. Reward from math-verify's judgement of the reply against `metadata["answer"]`.

    Metadata out: the row's metadata plus `correct` (bool; False when scoring failed) and
    `extracted_answer` (the answer string math-verify read from the reply).
    """

    def __init__(
        self,
        timeout_s: float = 5.0,
        num_workers: int = 2,
        format_weight: float = 0.0,
        reward_components: bool = False,
        worker_memory_mb: int = DEFAULT_WORKER_MEMORY_MB,
    ):
        """`timeout_s`: time limit per sample. `num_workers`: scorer processes (0: score in the calling
        thread, which must be the main thread). `format_weight`: weight of the boxed-answer format
        component. `reward_components`: return {"correct", "format"} dicts instead of floats.
        `worker_memory_mb`: address-space limit of each scorer process (0: none)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be 0 (in-process) or more, got {num_workers}")
        self.timeout_s = timeout_s
        self.format_weight = format_weight
        self.reward_components = reward_components
        self.reward_weights = {"correct": 1.0, "format": format_weight}
        """How to sum the components of a dict reward into one number."""
        self._verify_timeout_s = max(1, math.floor(timeout_s / 3))
        self._pool = (
            RewardWorkerPool(num_workers, preload=[SCORER_PATH], memory_limit_mb=worker_memory_mb)
            if num_workers > 0
            else None
        )

    def _score(self, replies: list[str], answers: list[str]) -> list[CallOutcome]:
        calls = [{"reply": r, "gold": a, "timeout_s": self._verify_timeout_s} for r, a in zip(replies, answers)]
        if self._pool is not None:
            return self._pool.run([Task(SCORER_PATH, call, self.timeout_s) for call in calls])
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "MathEnvironment(num_workers=0) scores in the calling thread, which must be the main thread "
                "(math-verify times itself with signal.alarm); use num_workers >= 1 from other threads"
            )
        return score_in_process(score_math_answer, calls)

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        check_batch(message_logs, metadata)
        answers = [str(a) for a in required_column(metadata, "answer", "math")]
        replies = [reply_of(log) for log in message_logs]
        rewards, errors, metadata_out = [], [], []
        for row, outcome in zip(metadata, self._score(replies, answers)):
            if outcome.error is not None:
                rewards.append(None)
                errors.append(f"math-verify: {outcome.error}")
                metadata_out.append({**row, "correct": False, "extracted_answer": None})
                continue
            judged = outcome.value
            components = {"correct": judged["correct"], "format": judged["format"]}
            scalar = components["correct"] + self.format_weight * components["format"]
            rewards.append(components if self.reward_components else scalar)
            errors.append(None)
            correct = judged["correct"] == 1.0
            metadata_out.append({**row, "correct": correct, "extracted_answer": judged["extracted_answer"]})
        return single_turn_step(rewards, errors, metadata_out)

    def close(self) -> None:
        """Stop the scorer processes (they also stop when the environment is garbage collected)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> MathEnvironment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
