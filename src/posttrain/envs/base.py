"""The `Environment` protocol: message logs in; observations, rewards and done flags out.

An environment scores a batch of rollouts at once. Each rollout is a message log (a list of
``{"role", "content"}`` dicts whose last message is the model's reply) and the metadata of
its data row (for example ``{"answer": "42"}``). A single-turn environment returns done for
every rollout; a multi-turn one returns an observation (the next user or tool message) for
the rollouts that continue, up to the loop's ``max_turns``.

A reward is a float, a dict of named float components (for multi-reward estimators such as
GDPO), or None when scoring failed; a failed sample is masked out of the loss and counted,
never turned into a zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

Message = dict[str, str]
Reward = float | dict[str, float] | None


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer for a batch of N rollouts."""

    rewards: list[Reward]
    """[N] the reward of each rollout's last turn; None when scoring failed (masked and counted)."""
    done: list[bool]
    """[N] True when the episode ended."""
    observations: list[Message | list[Message] | None]
    """[N] the next message (or messages, appended together: a turn's tool results) for rollouts that continue;
    None where done."""
    errors: list[str | None]
    """[N] why scoring failed (exception, timeout, NaN, wrong count), or None."""
    metadata: list[dict[str, Any]]
    """[N] per-rollout details to carry to the next turn and to metrics (for example `correct`)."""


class EpisodeLost(Exception):
    """Raised by an environment's `step` for an episode whose state it no longer holds: the process that held the
    episode's work directory, sandbox or checkout died (a Ray environment actor, replaced). The rollout then
    restarts the episode from its first turn; nothing of its earlier turns is kept."""


@runtime_checkable
class Environment(Protocol):
    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        """Score the last assistant message of each log; say which episodes continue."""
        ...


@dataclass(frozen=True)
class ToolUse:
    """What an environment that offers tools asks of the rollout."""

    tools: tuple[dict[str, Any], ...]
    """The tools' JSON schemas (OpenAI function format), rendered into every prompt and turn by the chat template
    (`apply_chat_template(..., tools=...)`)."""
    max_episode_tokens: int | None = None
    """The episode's budget of tokens after the prompt (sampled and observation tokens together); None: none."""


@runtime_checkable
class OffersTools(Protocol):
    """An environment whose episodes call tools (posttrain.envs.tools.ToolEnvironment)."""

    tool_use: ToolUse


def tool_use_of(environment: Environment) -> ToolUse | None:
    """The environment's tools and token budget, or None for an environment without tools."""
    return environment.tool_use if isinstance(environment, OffersTools) else None


@runtime_checkable
class HoldsEpisodes(Protocol):
    """An environment whose multi-turn episodes keep state in the process that stepped their first turn (a tool
    episode's work directory, a SWE checkout, a desktop with its programs): every later turn must reach that same
    process, and an episode whose process died can only start again (`EpisodeLost`)."""

    holds_episodes: bool


def holds_episodes(environment: Environment) -> bool:
    """Whether the environment's episodes live in its process (`HoldsEpisodes`)."""
    return isinstance(environment, HoldsEpisodes) and environment.holds_episodes


def reply_of(message_log: list[Message]) -> str:
    """The content of the log's last message, which must be the assistant's reply."""
    if not message_log or message_log[-1]["role"] != "assistant":
        last = message_log[-1]["role"] if message_log else "nothing (empty log)"
        raise ValueError(f"a message log must end with the assistant's reply, but it ends with {last}")
    return message_log[-1]["content"]


def prompt_of(message_log: list[Message]) -> str:
    """The content of the last user message before the reply ("" when there is none)."""
    return next((m["content"] for m in reversed(message_log[:-1]) if m["role"] == "user"), "")


def check_batch(message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> None:
    """Raise ValueError unless there is one metadata dict per message log."""
    if len(message_logs) != len(metadata):
        raise ValueError(
            f"got {len(message_logs)} message logs but {len(metadata)} metadata dicts; pass one per rollout"
        )


def single_turn_step(rewards: list[Reward], errors: list[str | None], metadata: list[dict[str, Any]]) -> EnvStep:
    """The EnvStep of a single-turn environment: every episode is done, no observations."""
    n = len(rewards)
    return EnvStep(rewards=rewards, done=[True] * n, observations=[None] * n, errors=errors, metadata=metadata)


def required_column(metadata: list[dict[str, Any]], key: str, environment: str) -> list[Any]:
    """`row[key]` for every row, or a ValueError naming the first row that lacks it."""
    for index, row in enumerate(metadata):
        if key not in row:
            raise ValueError(
                f"the {environment} environment needs a {key!r} column, "
                f"but row {index} of the batch has only {sorted(row)}"
            )
    return [row[key] for row in metadata]
