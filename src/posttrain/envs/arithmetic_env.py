"""The arithmetic task as an RL environment: exact match of the reply's answer against the row's sum.

Scoring is a string comparison that cannot hang, so it runs in the calling thread
(`rewards.score_in_process`), at a few microseconds per sample, with no worker processes.
"""

from __future__ import annotations

from typing import Any

from posttrain.envs.arithmetic import extract_answer
from posttrain.envs.base import (
    EnvStep,
    Message,
    check_batch,
    reply_of,
    required_column,
    single_turn_step,
)
from posttrain.envs.rewards import score_in_process, validate_outcomes


def _score(reply: str, answer: str) -> float:
    return 1.0 if extract_answer(reply) == answer else 0.0


class ArithmeticEnvironment:
    """Single turn. Reward 1.0 when `arithmetic.extract_answer(reply)` equals `metadata["answer"]`, else 0.0.

    Metadata out: the row's metadata plus `correct` (bool) and `extracted_answer` (str).
    """

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        check_batch(message_logs, metadata)
        answers = [str(a) for a in required_column(metadata, "answer", "arithmetic")]
        replies = [reply_of(log) for log in message_logs]
        calls = [{"reply": reply, "answer": answer} for reply, answer in zip(replies, answers)]
        scored = validate_outcomes(score_in_process(_score, calls), "arithmetic exact match")
        metadata_out = [
            {**row, "correct": reward == 1.0, "extracted_answer": extract_answer(reply)}
            for row, reward, reply in zip(metadata, scored.rewards, replies)
        ]
        return single_turn_step(scored.rewards, scored.errors, metadata_out)

    def close(self) -> None:
        """Nothing to release; present so every environment can be closed alike."""
