"""A trained reward model as an RL environment: the reward of a reply is the model's score of (prompt, reply).

The model is any directory `posttrain rm` wrote (OUTPUT/final/) or another one-label sequence classifier. The
environment never loads it: the caller builds the scorer (the recipes, in `posttrain.algorithms.environments`, build
a posttrain.workers.reward_model.RewardModel, so text is tokenized as the reward model was trained) and hands it in.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from posttrain.envs.base import (
    EnvStep,
    Message,
    check_batch,
    prompt_of,
    reply_of,
    single_turn_step,
)


class RewardScorer(Protocol):
    """A reward model built by the caller (posttrain.workers.RewardModel is one)."""

    def score(self, prompts: list[Any], completions: list[Any]) -> list[float]:
        """One score per (prompt, completion); each a string, or a list of chat messages when conversational."""
        ...


class RewardModelEnvironment:
    """Single turn. Reward: the reward model's score of the reply given the prompt.

    scorer: the reward model, built by the caller (from environment.options: path, batch_size, max_length, device).
    conversational: score the message log with the reward model's chat template (prompt = every message but the
        reply, completion = the reply) instead of the last user message and the reply as plain strings.
    A non-finite score masks the sample (counted as a reward error). Metadata out: the row's metadata unchanged.
    """

    def __init__(self, scorer: RewardScorer, conversational: bool = False):
        self.model = scorer
        self.conversational = conversational

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        check_batch(message_logs, metadata)
        replies = [reply_of(log) for log in message_logs]
        if self.conversational:
            prompts = [log[:-1] for log in message_logs]
            completions = [[log[-1]] for log in message_logs]
        else:
            prompts, completions = [prompt_of(log) for log in message_logs], replies
        scores = self.model.score(prompts, completions)
        rewards = [score if math.isfinite(score) else None for score in scores]
        errors = [None if reward is not None else f"reward model returned {score}" for reward, score in zip(rewards, scores)]
        return single_turn_step(rewards, errors, [dict(row) for row in metadata])

    def close(self) -> None:
        """Nothing to release; the model is freed with the environment."""
