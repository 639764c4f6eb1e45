"""A scripted policy for the computer-use tasks, and the loop that runs tasks with it (`posttrain cua-run`).

A script is a list of steps per task id (JSON: {"TASK_ID": [step, ...]}). A step is a computer_13 action, except
that it may name a widget instead of a point: `{"action_type": "CLICK", "target": {"role": "push button", "name":
"Save"}}` clicks the centre of the first widget with that role and name in the accessibility tree of the latest
observation. The policy reads the tree from the conversation's text, as a text-only model would, so a script
exercises the same observations and actions as a model's episode. After its last step it answers DONE.

The bundled tasks' scripts (`tasks/solutions.json`) solve them; the tests check that the evaluator confirms each.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from posttrain.envs.base import Message
from posttrain.envs.cua.environment import TREE_HEADER, CuaEnvironment, initial_tree, task_prompt
from posttrain.envs.cua.tasks import CuaTask, CuaTaskError


def bundled_solutions_path() -> Path:
    """The scripts that solve the bundled tasks."""
    return Path(str(resources.files("posttrain.envs.cua") / "tasks" / "solutions.json"))


def load_scripts(path: str | Path | None = None) -> dict[str, list[dict[str, Any]]]:
    """{task id: steps} from a JSON file (None: the bundled solutions); CuaTaskError naming the task and step."""
    path = Path(path) if path is not None else bundled_solutions_path()
    try:
        scripts = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise CuaTaskError(f"{path}: cannot read the scripts ({error})") from None
    if not isinstance(scripts, dict):
        raise CuaTaskError(f"{path}: the scripts are an object {{task id: [step, ...]}}")
    for task_id, steps in scripts.items():
        if not isinstance(steps, list):
            raise CuaTaskError(f"{path}: field '{task_id}' must be a list of steps")
        for index, step in enumerate(steps):
            if not isinstance(step, dict) or not isinstance(step.get("action_type"), str):
                raise CuaTaskError(f"{path}: field '{task_id}[{index}]' must be an action with an action_type")
            target = step.get("target")
            if target is not None and (not isinstance(target, dict) or set(target) - {"role", "name"}
                                       or not target):
                raise CuaTaskError(f"{path}: field '{task_id}[{index}].target' must be {{role, name}}")
    return scripts


def parse_tree(text: str) -> list[dict[str, Any]]:
    """The widgets of the last accessibility tree in `text` (rendered by `environment.tree_text`)."""
    start = text.rfind(TREE_HEADER)
    if start < 0:
        return []
    nodes = []
    for line in text[start + len(TREE_HEADER):].strip("\n").splitlines():
        cells = line.split("\t")
        if len(cells) != 6:
            break
        x, y = (int(part) for part in cells[4].strip("()").split(","))
        width, height = (int(part) for part in cells[5].strip("()").split(","))
        nodes.append({"role": cells[0], "name": cells[1], "text": cells[2],
                      "states": [state for state in cells[3].split(",") if state], "x": x, "y": y,
                      "width": width, "height": height})
    return nodes


def resolve(step: dict[str, Any], nodes: list[dict[str, Any]]) -> str:
    """The step as the JSON action a model would write: a target becomes the centre of its widget. A target that
    is not on the screen stays a target, which the environment answers as a bad parameter."""
    step = dict(step)
    target = step.pop("target", None)
    parameters = dict(step.get("parameters", {}))
    if target is not None:
        match = next((node for node in nodes if all(node.get(key) == value for key, value in target.items())), None)
        if match is None:
            parameters["target"] = target
        else:
            parameters["x"] = match["x"] + match["width"] // 2
            parameters["y"] = match["y"] + match["height"] // 2
    return json.dumps({"action_type": step["action_type"], "parameters": parameters})


class ScriptedPolicy:
    """Replies with a task's scripted steps in order (see the module docstring)."""

    def __init__(self, scripts: dict[str, list[dict[str, Any]]]):
        self.scripts = scripts

    def reply(self, task_id: str, messages: list[Message]) -> str:
        """The next action of `task_id`'s script, given the conversation so far (ending with a user message)."""
        done = sum(message["role"] == "assistant" for message in messages)
        steps = self.scripts[task_id]
        if done >= len(steps):
            return "DONE"
        return resolve(steps[done], parse_tree(messages[-1]["content"]))


@dataclass(frozen=True)
class TaskReport:
    """How one task's scripted episode went."""

    task_id: str
    reward: float | None
    """The evaluator's score at the end (None: the desktop failed; see error)."""
    correct: bool
    actions: int
    action_errors: int
    error: str | None
    workdir: str | None
    """The episode's folder: screenshots step_NNN.png, the app's files and logs."""
    seconds: float


def run_tasks(tasks: list[CuaTask], policy: ScriptedPolicy, environment: CuaEnvironment) -> list[TaskReport]:
    """Each task's episode with `policy`, driven through `environment.step` as the rollout drives it."""
    reports = []
    for task in tasks:
        started = time.perf_counter()
        if task.id not in policy.scripts:
            raise CuaTaskError(f"no script for task {task.id!r} ({task.source}); the scripts cover "
                               f"{', '.join(sorted(policy.scripts)) or 'no task'}")
        messages: list[Message] = [{"role": "user", "content": task_prompt(
            task, initial_tree(task, screen=environment.screen, start_timeout_s=environment.start_timeout_s),
            environment.screen)}]
        row: dict[str, Any] = {"task_id": task.id}
        while True:
            messages.append({"role": "assistant", "content": policy.reply(task.id, messages)})
            result = environment.step([messages], [row])
            row = result.metadata[0]
            if result.done[0]:
                break
            messages.append(result.observations[0])
        reward = result.rewards[0]
        reports.append(TaskReport(task.id, reward, bool(row.get("correct")), row.get("cua_actions", 0),
                                  row.get("cua_errors", 0), result.errors[0], row.get("cua_workdir"),
                                  time.perf_counter() - started))
    return reports


def write_reports(reports: list[TaskReport], output: Path) -> None:
    """OUTPUT/tasks/ID.json per task and OUTPUT/report.json (counts and ids by outcome)."""
    (output / "tasks").mkdir(parents=True, exist_ok=True)
    for report in reports:
        (output / "tasks" / f"{report.task_id}.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    summary = {"tasks": len(reports), "solved": sum(r.correct for r in reports),
               "failed": sum(r.reward is not None and not r.correct for r in reports),
               "errors": sum(r.reward is None for r in reports),
               "solved_ids": [r.task_id for r in reports if r.correct],
               "failed_ids": [r.task_id for r in reports if r.reward is not None and not r.correct],
               "error_ids": [r.task_id for r in reports if r.reward is None]}
    (output / "report.json").write_text(json.dumps(summary, indent=1) + "\n")
