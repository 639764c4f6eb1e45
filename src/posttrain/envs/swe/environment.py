"""The SWE episode environment: the agent works in a sandboxed checkout with bash, view and str_replace tools;
its reward is the scoring of what it changed (`scoring.score_patch`) when it ends the episode.

Each episode (a data row with an `instance_id` column naming one of the tasks) gets its own fresh checkout of the
task's base_commit (`scoring.make_checkout`: one commit, no history past it) when its first turn is stepped. The
tools, run between turns by `envs.tools.ToolEnvironment`:

- bash(command): runs `bash -c COMMAND` in the checkout inside `posttrain.envs.sandbox`'s namespaces: no network,
  a read-only root holding the system, the interpreter and pytest's site-packages (so `python -m pytest` works), the
  checkout the only writable place besides a scratch tmpfs; every process it starts ends with the command, at the
  tool's timeout at the latest. The answer is the exit code and what the command printed.
- view(path, start_line?, end_line?): a file's lines, numbered, or a folder's entries; paths are relative to the
  checkout and refused when they resolve outside it (symbolic links followed).
- str_replace(path, old_str, new_str): replaces old_str, which must occur exactly once, by new_str.

A reply that calls no tool ends the episode: the checkout's changes are taken as a patch (`git diff` run inside the
sandbox: the checkout, its .git included, is the agent's to write, so git never runs on it outside) and scored in a
fresh checkout with the task's tests. Reward 1 when the task is resolved, 0 when not (an empty patch, a failing
test, a patch that does not apply); None (masked and counted) when the scoring itself could not run. An episode cut
off while still calling tools (rollout.max_turns, the token budget) keeps reward 0, as in any tools environment.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from posttrain.envs import sandbox
from posttrain.envs.base import EnvStep, Message, check_batch, single_turn_step
from posttrain.envs.swe.scoring import (
    DEFAULT_TEST_TIMEOUT_S,
    SweInfrastructureError,
    git,
    make_checkout,
    runner_site_dirs,
    score_patch,
)
from posttrain.envs.swe.tasks import SweTask
from posttrain.envs.tools import Tool, ToolContext, ToolEnvironment, ToolFailure
from posttrain.envs.tools.schema import ToolInfrastructureError, ToolTimeout

COMMAND_MEMORY_LIMIT_MB = 2048
"""Address-space limit of one bash command."""
MAX_VIEW_LINES = 400
"""view shows at most this many lines per call."""


def swe_prompt(task: SweTask) -> str:
    """The user message of a task's episode: the issue, and what the agent is to do."""
    return (f"You are working in a checkout of the repository {task.repo}. Resolve this issue by editing the "
            f"source files:\n\n{task.problem_statement}\n\nUse the bash, view and str_replace tools (paths are "
            "relative to the repository root). Reply without a tool call when you are done.")


def prompt_rows(tasks: list[SweTask]) -> list[dict[str, str]]:
    """Data rows for training or evaluation on `tasks`: {"prompt", "instance_id"}."""
    return [{"prompt": swe_prompt(task), "instance_id": task.instance_id} for task in tasks]


# ---- tools -----------------------------------------------------------------------------------------------------

def _inside(context: ToolContext, path: str) -> Path:
    """`path` (relative to the checkout) resolved; ToolFailure when it leaves the checkout."""
    root = context.workdir.resolve()
    target = (root / path).resolve()
    if target != root and root not in target.parents:
        raise ToolFailure(f"{path!r} is outside the repository checkout")
    return target


def _bash_program(checkout: Path, command: str) -> str:
    python_bin = os.path.dirname(os.path.realpath(sys.executable))
    environment = {"PATH": f"{python_bin}:/usr/bin:/bin", "PYTHONPATH": ":".join(runner_site_dirs()),
                   "PYTHONDONTWRITEBYTECODE": "1", "GIT_CONFIG_NOSYSTEM": "1"}
    return (f"import os\nos.environ.update({environment!r})\nos.chdir({str(checkout)!r})\n"
            f"os.execv('/bin/bash', ['bash', '-c', {command!r}])\n")


def bash_tool(timeout_s: float, max_output_chars: int) -> Tool:
    def run(arguments: dict[str, Any], context: ToolContext) -> str:
        checkout = context.workdir.resolve()
        result = sandbox.run_sandboxed(
            _bash_program(checkout, arguments["command"]), time_limit_s=timeout_s,
            memory_limit_mb=COMMAND_MEMORY_LIMIT_MB, output_limit_bytes=max_output_chars * 4, namespaces=True,
            audit_hook=False, writable_dirs=(str(checkout),), readable_dirs=runner_site_dirs())
        if not result.started:
            raise ToolInfrastructureError(f"the sandbox did not start: {result.stderr.strip()[-500:]}")
        if result.timed_out:
            raise ToolTimeout(f"the command was stopped after {timeout_s:g} s")
        ending = (f"exit code {result.exit_code}" if result.exit_code is not None
                  else f"killed by signal {result.killed_by_signal}")
        return f"{ending}\n{result.stdout}{result.stderr}"

    return Tool("bash", "Run a bash command in the repository checkout (no network).",
                {"type": "object", "properties": {"command": {"type": "string", "description": "The command."}},
                 "required": ["command"]}, run, timeout_s=timeout_s + 5, uses_workdir=True)


def view_tool(timeout_s: float) -> Tool:
    def run(arguments: dict[str, Any], context: ToolContext) -> str:
        target = _inside(context, arguments["path"])
        if target.is_dir():
            entries = sorted(p.name + "/" * p.is_dir() for p in target.iterdir() if p.name != ".git")
            return "\n".join(entries) or "(empty folder)"
        if not target.is_file():
            raise ToolFailure(f"{arguments['path']!r} does not exist")
        lines = target.read_text(encoding="utf-8", errors="replace").splitlines()
        start = max(1, arguments.get("start_line", 1))
        end = min(len(lines), arguments.get("end_line", len(lines)), start + MAX_VIEW_LINES - 1)
        return "\n".join(f"{number:6d}\t{lines[number - 1]}" for number in range(start, end + 1)) or "(empty file)"

    return Tool("view", "Show a file's lines, numbered, or a folder's entries.",
                {"type": "object", "properties": {
                    "path": {"type": "string", "description": "Path relative to the repository root."},
                    "start_line": {"type": "integer", "minimum": 1, "description": "First line to show."},
                    "end_line": {"type": "integer", "minimum": 1, "description": "Last line to show."}},
                 "required": ["path"]}, run, timeout_s=timeout_s, uses_workdir=True)


def str_replace_tool(timeout_s: float) -> Tool:
    def run(arguments: dict[str, Any], context: ToolContext) -> str:
        target = _inside(context, arguments["path"])
        if not target.is_file():
            raise ToolFailure(f"{arguments['path']!r} is not a file")
        text = target.read_text(encoding="utf-8")
        count = text.count(arguments["old_str"])
        if count != 1:
            raise ToolFailure(f"old_str occurs {count} times in {arguments['path']}; it must occur exactly once "
                              "(include more surrounding lines)")
        target.write_text(text.replace(arguments["old_str"], arguments["new_str"]), encoding="utf-8")
        return f"edited {arguments['path']}"

    return Tool("str_replace", "Replace the one occurrence of old_str in a file by new_str.",
                {"type": "object", "properties": {
                    "path": {"type": "string", "description": "Path relative to the repository root."},
                    "old_str": {"type": "string", "minLength": 1, "description": "The exact text to replace."},
                    "new_str": {"type": "string", "description": "The text to put in its place."}},
                 "required": ["path", "old_str", "new_str"]}, run, timeout_s=timeout_s, uses_workdir=True)


# ---- the environment -----------------------------------------------------------------------------------------

_DIFF_COMMAND = ("git -c core.fsmonitor=false -c core.hooksPath=/dev/null add -A >/dev/null 2>&1 && "
                 "git -c core.fsmonitor=false diff --cached --binary --no-ext-diff --no-textconv HEAD")


class _PatchScorer:
    """The task environment of the episodes' final turn: the checkout's changes, scored as a patch."""

    def __init__(self, tasks: dict[str, SweTask], test_timeout_s: float):
        self.tasks = tasks
        self.test_timeout_s = test_timeout_s

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        check_batch(message_logs, metadata)
        rewards, errors, rows = [], [], []
        for row in metadata:
            checkout = Path(row["tool_workdir"])
            result = sandbox.run_sandboxed(
                _bash_program(checkout, _DIFF_COMMAND), time_limit_s=60, memory_limit_mb=COMMAND_MEMORY_LIMIT_MB,
                output_limit_bytes=10_000_000, namespaces=True, audit_hook=False, writable_dirs=(str(checkout),),
                readable_dirs=runner_site_dirs())
            if not result.started:
                rewards.append(None)
                errors.append(f"the sandbox did not start: {result.stderr.strip()[-500:]}")
                rows.append(row)
                continue
            scored = score_patch(self.tasks[row["instance_id"]], result.stdout if result.succeeded else "",
                                 test_timeout_s=self.test_timeout_s)
            rewards.append(None if scored.infrastructure_failure else scored.reward)
            errors.append(scored.error if scored.infrastructure_failure else None)
            rows.append({**row, "correct": scored.resolved, "swe_status": scored.status,
                         "swe_patch_chars": len(result.stdout)})
        return single_turn_step(rewards, errors, rows)

    def close(self) -> None:
        pass


class SweEnvironment:
    """Repository tasks as tool-using episodes (see the module docstring)."""

    holds_episodes = True
    """An episode's checkout lives in this process: its turns must all reach it."""

    def __init__(self, tasks: list[SweTask], *, tool_call_format: str = "hermes", command_timeout_s: float = 30.0,
                 test_timeout_s: float = DEFAULT_TEST_TIMEOUT_S, max_output_chars: int = 4000,
                 max_calls_per_turn: int = 4, max_episode_tokens: int | None = None):
        if not sandbox.sandbox_info().namespaces:
            raise ValueError("the swe environment runs commands only inside the sandbox's namespaces, which do not "
                             f"work on this machine: {sandbox.sandbox_info().namespace_error}")
        self.tasks = {task.instance_id: task for task in tasks}
        for task in tasks:  # a wrong base_commit stops here, not at an episode
            if git(["cat-file", "-e", f"{task.base_commit}^{{commit}}"], task.repo_path).returncode != 0:
                raise ValueError(f"task {task.instance_id}: {task.repo_path} has no commit {task.base_commit!r}")
        self._root = Path(tempfile.mkdtemp(prefix="posttrain-swe-episodes-"))
        tools = [bash_tool(command_timeout_s, max_output_chars), view_tool(command_timeout_s),
                 str_replace_tool(command_timeout_s)]
        self._tools = ToolEnvironment(_PatchScorer(self.tasks, test_timeout_s), tools,
                                      tool_call_format=tool_call_format, max_output_chars=max_output_chars,
                                      max_calls_per_turn=max_calls_per_turn, max_episode_tokens=max_episode_tokens)
        self.tool_use = self._tools.tool_use

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        check_batch(message_logs, metadata)
        return self._tools.step(message_logs, [self._with_checkout(row, index) for index, row in enumerate(metadata)])

    def close(self) -> None:
        """Remove every episode's checkout."""
        self._tools.close()
        shutil.rmtree(self._root, ignore_errors=True)

    def _with_checkout(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        if row.get("tool_workdir"):
            return row
        instance_id = row.get("instance_id")
        if instance_id not in self.tasks:
            known = ", ".join(sorted(self.tasks)[:5])
            raise ValueError(f"the swe environment needs an instance_id column naming a task; row {index} of the "
                             f"batch has {json.dumps(instance_id)} (tasks: {known}, ...)")
        task = self.tasks[instance_id]
        checkout = Path(tempfile.mkdtemp(prefix="episode-", dir=self._root)) / "repo"
        try:
            make_checkout(task.repo_path, task.base_commit, checkout)
        except SweInfrastructureError as error:
            raise RuntimeError(f"episode of {instance_id}: {error}") from error
        sandbox.give_to_sandbox(str(checkout))
        return {**row, "tool_workdir": str(checkout)}
