"""The tool environment: a task environment's reward, with tool calls executed between the model's turns.

Each turn the model's reply is parsed in the model's tool-call format (`formats`). A reply that calls tools gets
their results as the next observation, one ``tool`` message per call (all of a turn's results are appended
together, so templates that merge consecutive tool messages into one turn render them as the model will see them),
and the episode goes on; its reward for that turn is 0, which stays its reward if the episode ends there (the
rollout's max_turns or the token budget reached while still calling tools). A reply without tool calls is the
final answer: the task environment (arithmetic, math, code, a judge, ...) scores it and the episode ends.

Tool calls that cannot run are answered with an error observation and counted in the episode's metadata, never
raised: malformed (unreadable JSON, no name), unknown_tool, bad_arguments (not what the tool's JSON schema says),
too_many_calls (past max_calls_per_turn), timeout (past the tool's timeout_s) and failed (the tool refused its input
or raised). A tool whose infrastructure failed (the sandbox could not start a program) masks the episode instead:
its reward is None with the reason, like any failed reward.

Each call runs in a daemon thread of its own and is waited for up to its tool's timeout_s; a call that overruns is
answered with a timeout error and left to finish in the background (a Python function cannot be stopped from
outside; the python tool's programs are stopped by the sandbox at the same limit). Tool calls of different episodes
run concurrently: the rollout calls `step` for each episode from its own thread.

Metadata out, per episode, added up over its turns: tool_calls, tool_errors and tool_error_kinds ({kind: count}),
and tool_workdir, the episode's work directory (created when it first calls a file tool, removed when the episode
ends with a final answer or, for episodes cut off earlier, when the environment closes).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from posttrain.envs.base import Environment, EnvStep, Message, ToolUse, check_batch, reply_of
from posttrain.envs.tools.formats import ToolCall, ToolCallFormat, parser_of
from posttrain.envs.tools.schema import (
    Tool,
    ToolContext,
    ToolFailure,
    ToolInfrastructureError,
    ToolTimeout,
    tool_from_function,
)

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "too_many_calls", "timeout", "failed")
"""The kinds of tool error an episode's metadata counts (tool_error_kinds)."""


class ToolEnvironment:
    """Tools executed between turns, the final answer scored by `task` (see the module docstring)."""

    holds_episodes = True
    """An episode's work directory (files tools) lives in this process: its turns must all reach it."""

    def __init__(self, task: Environment, tools: Sequence[Tool | Callable[..., Any]], *,
                 tool_call_format: str = "hermes", max_output_chars: int = 2000, max_calls_per_turn: int = 4,
                 max_episode_tokens: int | None = None):
        """task: scores the final answer. tools: `Tool`s, or Python functions (their signature and docstring
        become the schema). tool_call_format: hermes, llama3_json or mistral (the recipe resolves "auto" from the
        model). max_output_chars: a tool's answer longer than this is cut, saying how much was cut.
        max_calls_per_turn: calls past this in one reply are answered with an error, not run.
        max_episode_tokens: the episode's budget of tokens after the prompt (sampled and observation tokens),
        enforced by the rollout (None: only max_turns × max_new_tokens bounds it)."""
        if max_output_chars < 1 or max_calls_per_turn < 1:
            raise ValueError("max_output_chars and max_calls_per_turn must be at least 1")
        if max_episode_tokens is not None and max_episode_tokens < 1:
            raise ValueError(f"max_episode_tokens must be at least 1 (or null), got {max_episode_tokens}")
        self.task = task
        self.tools = {}
        for tool in tools:
            tool = tool if isinstance(tool, Tool) else tool_from_function(tool)
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        if not self.tools:
            raise ValueError("the tool environment needs at least one tool")
        self.format: ToolCallFormat = parser_of(tool_call_format)
        self.max_output_chars = max_output_chars
        self.max_calls_per_turn = max_calls_per_turn
        self.tool_use = ToolUse(tools=tuple(tool.schema for tool in self.tools.values()),
                                max_episode_tokens=max_episode_tokens)
        self._workdir_root = Path(tempfile.mkdtemp(prefix="posttrain-tools-"))
        self._lock = threading.Lock()

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        check_batch(message_logs, metadata)
        n = len(message_logs)
        rewards: list[Any] = [0.0] * n
        done, errors = [False] * n, [None] * n
        observations: list[Message | list[Message] | None] = [None] * n
        rows = [_with_counters(row) for row in metadata]
        finals = []
        for i, log in enumerate(message_logs):
            parsed = self.format.parse(reply_of(log))
            if not parsed.calls_tools:
                finals.append(i)
                continue
            turn = sum(message["role"] == "assistant" for message in log)
            try:
                observations[i], rows[i] = self._answer_calls(parsed.calls, parsed.malformed, rows[i], turn)
            except ToolInfrastructureError as error:
                rewards[i], errors[i], done[i] = None, f"tool infrastructure failure: {error}", True
                self._remove_workdir(rows[i])
        if finals:
            result = self.task.step([message_logs[i] for i in finals], [rows[i] for i in finals])
            for j, i in enumerate(finals):
                rewards[i], errors[i], done[i] = result.rewards[j], result.errors[j], result.done[j]
                observations[i], rows[i] = result.observations[j], _with_counters(result.metadata[j], rows[i])
                if done[i]:
                    self._remove_workdir(rows[i])
        return EnvStep(rewards=rewards, done=done, observations=observations, errors=errors, metadata=rows)

    @property
    def reward_weights(self) -> dict[str, float]:
        """The task's named reward components' weights (a python task with several functions), as the task says."""
        return dict(getattr(self.task, "reward_weights", {}))

    def close(self) -> None:
        """Remove every episode's work directory and close the task environment."""
        shutil.rmtree(self._workdir_root, ignore_errors=True)
        self.task.close()

    # ---- one reply's calls ------------------------------------------------------------------------------------

    def _answer_calls(self, calls: tuple[ToolCall, ...], malformed: tuple[str, ...], row: dict[str, Any],
                      turn: int) -> tuple[list[Message], dict[str, Any]]:
        """The tool messages answering one reply's calls (in order; malformed ones after the readable ones), and
        the row with its counters and work directory updated."""
        kinds = dict(row["tool_error_kinds"])
        if not row.get("tool_workdir") and any(self.tools[c.name].uses_workdir for c in calls if c.name in self.tools):
            row = {**row, "tool_workdir": self._new_workdir()}
        context = ToolContext(workdir=Path(row["tool_workdir"]) if row.get("tool_workdir") else None)
        messages = []
        for index, call in enumerate(calls):
            call_id = _call_id(call, turn, index)
            if index >= self.max_calls_per_turn:
                kind, text = "too_many_calls", (f"at most {self.max_calls_per_turn} tool calls per turn; this call "
                                                "was not run")
            else:
                kind, text = self._run_call(call, context)
            if kind is not None:
                kinds[kind] += 1
                text = f"error: {text}"
            messages.append({"role": "tool", "name": call.name, "content": self._cut(text), "tool_call_id": call_id})
        for index, why in enumerate(malformed, start=len(calls)):
            kinds["malformed"] += 1
            messages.append({"role": "tool", "content": self._cut(f"error: {why}"),
                             "tool_call_id": _call_id(None, turn, index)})
        count = len(calls) + len(malformed)
        return messages, {**row, "tool_calls": row["tool_calls"] + count, "tool_error_kinds": kinds,
                          "tool_errors": sum(kinds.values())}

    def _run_call(self, call: ToolCall, context: ToolContext) -> tuple[str | None, str]:
        """(error kind or None, the text the model reads) of one readable call."""
        tool = self.tools.get(call.name)
        if tool is None:
            return "unknown_tool", f"there is no tool {call.name!r}; the tools are {', '.join(sorted(self.tools))}"
        problem = tool.argument_error(call.arguments)
        if problem is not None:
            return "bad_arguments", f"{call.name}: {problem}"
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["text"] = tool.run(dict(call.arguments), context)
            except BaseException as error:  # reported to the model or, for infrastructure, raised below
                outcome["error"] = error

        thread = threading.Thread(target=target, name=f"tool-{call.name}", daemon=True)
        thread.start()
        thread.join(tool.timeout_s)
        if thread.is_alive():
            return "timeout", f"{call.name} did not answer within {tool.timeout_s:g} s"
        error = outcome.get("error")
        if isinstance(error, ToolTimeout):
            return "timeout", f"{call.name}: {error}"
        if isinstance(error, ToolFailure):
            return "failed", f"{call.name}: {error}"
        if isinstance(error, ToolInfrastructureError):
            raise error
        if error is not None:
            return "failed", f"{call.name} raised {type(error).__name__}: {error}"
        return None, str(outcome["text"])

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[: self.max_output_chars] + f"\n[... {len(text) - self.max_output_chars} characters cut]"

    def _new_workdir(self) -> str:
        with self._lock:
            return tempfile.mkdtemp(prefix="episode-", dir=self._workdir_root)

    def _remove_workdir(self, row: dict[str, Any]) -> None:
        if row.get("tool_workdir"):
            shutil.rmtree(row["tool_workdir"], ignore_errors=True)


def _with_counters(row: dict[str, Any], counters_from: dict[str, Any] | None = None) -> dict[str, Any]:
    """`row` with the tool counters (zero, or those of `counters_from`), as a new dict."""
    source = counters_from if counters_from is not None else row
    return {**row, "tool_calls": source.get("tool_calls", 0), "tool_errors": source.get("tool_errors", 0),
            "tool_error_kinds": dict(source.get("tool_error_kinds") or dict.fromkeys(ERROR_KINDS, 0)),
            **({"tool_workdir": source["tool_workdir"]} if source.get("tool_workdir") else {})}


def _call_id(call: ToolCall | None, turn: int, index: int) -> str:
    """The call's own id when it is 9 letters and digits (Mistral templates require that), else c + turn + index
    (deterministic, so a seeded episode renders the same)."""
    if call is not None and call.id is not None and len(call.id) == 9 and call.id.isalnum():
        return call.id
    return f"c{turn % 10000:04d}{index % 10000:04d}"
