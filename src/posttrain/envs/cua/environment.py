"""The computer-use environment: each episode is a task on a desktop of its own; each reply is one action.

An episode (a data row whose `task_id` column names a task) gets, at its first step, a work directory, an Xvfb
desktop (`desktop.Desktop`) and the task's setup (the bundled app launched, files written). Every turn the reply is
parsed as one computer_13 action (`actions.parse_action`) and performed with xdotool; the observation is the app's
accessibility tree as text (role, name, text, states, position, size per widget: what a text-only policy reads),
and a screenshot is saved as WORKDIR/step_NNN.png (recorded in the episode's metadata, for a vision-language policy
or for a look afterwards). A reply that is not a valid action is answered with the error and the same tree, and
counted by kind (malformed, unknown_action, bad_parameters); it still counts as a step.

The reward of each step is the task's evaluator run on the episode's files (`tasks.evaluate`: 0 or 1), so an
episode cut off by rollout.max_turns is scored where it stopped, as OSWorld scores after its step budget. The
episode ends at DONE or FAIL, or after `max_steps` actions; then its desktop is stopped. A desktop that does not
start, an app that stops answering, or an xdotool call that fails is no fault of the policy: that episode's reward
is None with the reason (masked and counted) and it ends.

Departures from OSWorld: the desktop is Xvfb with one small Tk app, not a VM with a full Ubuntu session; the
accessibility tree is the app's own description of its widgets (`app.py`), not AT-SPI's; observations carry the
tree only as text (the screenshot is saved, not shown to the model: the rollouts carry text).
"""

from __future__ import annotations

import collections
import itertools
import json
import shutil
import socket
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from posttrain.envs.base import EnvStep, Message, check_batch, reply_of
from posttrain.envs.cua.actions import TERMINAL, ActionError, parse_action, perform
from posttrain.envs.cua.desktop import DEFAULT_SCREEN, Desktop, DesktopError, missing_programs, python_program
from posttrain.envs.cua.tasks import CuaTask, evaluate

APP_SCRIPT = Path(str(resources.files("posttrain.envs.cua") / "app.py"))
"""The bundled app, run as a program of its own (it imports tkinter, which this process never needs)."""
TREE_HEADER = "role\tname\ttext\tstates\tposition (top-left x&y)\tsize (w&h)"
"""The header of a tree rendered as text (OSWorld's linearized tree has the same layout, with class and
description columns instead of states)."""


def tree_text(nodes: list[dict[str, Any]]) -> str:
    """The accessibility tree as tab-separated lines under TREE_HEADER, one widget per line."""
    lines = [TREE_HEADER]
    for node in nodes:
        text = node["text"].replace("\n", "\\n").replace("\t", " ")
        lines.append(f"{node['role']}\t{node['name']}\t{text}\t{','.join(node['states'])}\t"
                     f"({node['x']}, {node['y']})\t({node['width']}, {node['height']})")
    return "\n".join(lines)


ACTION_HELP = (
    "Act with one action per reply, a JSON object {\"action_type\": ..., \"parameters\": {...}} from: "
    "CLICK {x, y, button?, num_clicks?}, DOUBLE_CLICK {x, y}, RIGHT_CLICK {x, y}, MOVE_TO {x, y}, "
    "MOUSE_DOWN {button?}, MOUSE_UP {button?}, DRAG_TO {x, y}, SCROLL {dx, dy}, TYPING {text}, PRESS {key}, "
    "KEY_DOWN {key}, KEY_UP {key}, HOTKEY {keys}, WAIT, DONE (the task is complete), FAIL (it cannot be done). "
    "Coordinates are screen pixels; click a widget at a point inside its box.")


def task_prompt(task: CuaTask, nodes: list[dict[str, Any]], screen: tuple[int, int]) -> str:
    """The user message that opens a task's episode: the instruction, the action space and the first tree."""
    return (f"You are operating a {screen[0]}x{screen[1]} desktop. Task: {task.instruction}\n\n{ACTION_HELP}\n\n"
            f"The screen's accessibility tree:\n{tree_text(nodes)}")


def observation_text(step: int, max_steps: int, nodes: list[dict[str, Any]], error: str | None) -> str:
    head = f"error: {error}\n" if error else ""
    return (f"{head}Step {step} of at most {max_steps} done. The screen's accessibility tree:\n{tree_text(nodes)}\n"
            "Reply with the next action.")


@dataclass
class CuaEpisode:
    """One task's work directory, desktop and app, and what it has done so far."""

    task: CuaTask
    workdir: Path
    desktop: Desktop
    tree_timeout_s: float
    socket_name: str = field(default_factory=lambda: f"posttrain-cua-{uuid.uuid4().hex}")
    """The app's abstract Unix socket, where it answers for its tree."""
    steps: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    screenshots: list[str] = field(default_factory=list)
    last_action: str | None = None

    def start(self) -> None:
        """Start the desktop and run the task's setup; DesktopError when something does not come up in time."""
        self.desktop.start()
        for step in self.task.config:
            if step.type == "write_file":
                target = self.workdir / step.parameters["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(step.parameters["content"], encoding="utf-8")
            elif step.type == "sleep":
                time.sleep(step.parameters["seconds"])
            else:
                arguments = ["--workdir", str(self.workdir), "--socket", self.socket_name]
                initial = step.parameters.get("initial_state")
                if initial is not None:
                    (self.workdir / "initial_state.json").write_text(json.dumps(initial), encoding="utf-8")
                    arguments += ["--initial-state", str(self.workdir / "initial_state.json")]
                self.desktop.launch(python_program(APP_SCRIPT, *arguments), log_name="app.log")
        self.tree()  # waits until the app answers

    def tree(self) -> list[dict[str, Any]]:
        """The app's accessibility tree, asked over its socket; DesktopError after tree_timeout_s."""
        address = "\0" + self.socket_name
        deadline = time.monotonic() + self.tree_timeout_s
        while True:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                    connection.settimeout(max(0.05, deadline - time.monotonic()))
                    connection.connect(address)
                    connection.sendall(b"tree\n")
                    answer = b""
                    while not answer.endswith(b"\n"):
                        chunk = connection.recv(65536)
                        if not chunk:
                            break
                        answer += chunk
                if answer.endswith(b"\n"):
                    return json.loads(answer)["nodes"]
            except OSError:
                pass  # not listening yet, or busy: ask again until the deadline
            if time.monotonic() >= deadline:
                log = self.workdir / "app.log"
                tail = log.read_text(errors="replace").strip()[-600:] if log.exists() else ""
                raise DesktopError(f"the {self.task.id} app did not answer for its accessibility tree within "
                                   f"{self.tree_timeout_s:g} s" + (f"; its log ends:\n{tail}" if tail else ""))
            time.sleep(0.05)

    def save_screenshot(self) -> str:
        path = self.workdir / f"step_{self.steps:03d}.png"
        path.write_bytes(self.desktop.screenshot_png())
        self.screenshots.append(str(path))
        return str(path)


class CuaEnvironment:
    """Computer-use tasks as multi-turn episodes (see the module docstring).

    tasks: the tasks data rows name by their task_id column.
    episodes_dir: where each episode's work directory (screenshots, the app's files and logs) is kept; None: a
        temporary folder removed by close().
    max_steps: actions per episode; the episode ends after this many.
    keep_episodes: how many finished episodes' folders stay (the newest; older ones are removed as episodes end,
        which bounds the disk a long run's screenshots take); None: all of them."""

    holds_episodes = True
    """An episode's desktop (its X server and programs) lives in this process: its turns must all reach it."""

    def __init__(self, tasks: list[CuaTask], *, episodes_dir: str | Path | None = None, max_steps: int = 10,
                 screen: tuple[int, int] = DEFAULT_SCREEN, start_timeout_s: float = 10.0,
                 action_timeout_s: float = 10.0, save_screenshots: bool = True, keep_episodes: int | None = None,
                 xvfb: str = "Xvfb"):
        missing = missing_programs()
        if missing:
            raise ValueError(f"the cua environment needs {' and '.join(missing)} on PATH (Debian/Ubuntu: apt-get "
                             "install -y xvfb xdotool)")
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        if start_timeout_s <= 0 or action_timeout_s <= 0:
            raise ValueError("start_timeout_s and action_timeout_s must be positive")
        if keep_episodes is not None and keep_episodes < 0:
            raise ValueError(f"keep_episodes must be at least 0 (or None: keep all), got {keep_episodes}")
        self.tasks = {task.id: task for task in tasks}
        self.max_steps, self.screen = max_steps, screen
        self.start_timeout_s, self.action_timeout_s = start_timeout_s, action_timeout_s
        self.save_screenshots, self.xvfb = save_screenshots, xvfb
        self._temporary = episodes_dir is None
        self.episodes_dir = Path(tempfile.mkdtemp(prefix="posttrain-cua-")) if episodes_dir is None \
            else Path(episodes_dir)
        self.episodes_dir.mkdir(parents=True, exist_ok=True)
        self._episodes: dict[str, CuaEpisode] = {}
        self.keep_episodes = keep_episodes
        self._finished: collections.deque[Path] = collections.deque()
        """Folders of finished episodes, oldest first (those keep_episodes still keeps)."""
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        # Also at garbage collection and interpreter exit: a recipe that never calls close() leaves no X server
        # running and no temporary folder behind.
        self._finalizer = weakref.finalize(self, _shutdown, self._episodes, self._lock,
                                           self.episodes_dir if self._temporary else None)

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        check_batch(message_logs, metadata)
        results = [self._step_one(log, row, index) for index, (log, row) in enumerate(zip(message_logs, metadata))]
        rewards, done, observations, errors, rows = (list(column) for column in zip(*results))
        return EnvStep(rewards=rewards, done=done, observations=observations, errors=errors, metadata=rows)

    def open_episode(self, task_id: str) -> tuple[str, CuaEpisode]:
        """Start a new episode of `task_id` (desktop up, setup run); its key and the episode. DesktopError when
        it does not come up (its processes are stopped first)."""
        task = self.tasks[task_id]
        while True:  # numbers go on past the episodes an earlier run left in episodes_dir (never reused: stale files)
            with self._lock:
                key = f"{task_id}-{next(self._numbers):05d}"
            workdir = self.episodes_dir / key
            try:
                workdir.mkdir(parents=True)
                break
            except FileExistsError:
                continue
        episode = CuaEpisode(task, workdir, Desktop(workdir, width=self.screen[0], height=self.screen[1],
                                                    start_timeout_s=self.start_timeout_s,
                                                    action_timeout_s=self.action_timeout_s, xvfb=self.xvfb),
                             tree_timeout_s=self.start_timeout_s)
        with self._lock:
            self._episodes[key] = episode
        try:
            episode.start()
        except BaseException:
            self._close_episode(key)
            raise
        return key, episode

    def _step_one(self, log: list[Message], row: dict[str, Any], index: int) -> tuple:
        key = row.get("cua_episode")
        if key is None:
            task_id = row.get("task_id")
            if task_id not in self.tasks:
                known = ", ".join(sorted(self.tasks)[:6])
                raise ValueError(f"the cua environment needs a task_id column naming a task; row {index} of the "
                                 f"batch has {json.dumps(task_id)} (tasks: {known})")
            try:
                key, episode = self.open_episode(task_id)
            except DesktopError as error:
                return None, True, None, f"the episode's desktop did not start: {error}", {**row, "correct": False}
        else:
            with self._lock:
                episode = self._episodes.get(key)
            if episode is None:
                raise ValueError(f"row {index}: episode {key} of the cua environment has already ended")
        reply = reply_of(log)
        episode.steps += 1
        error = None
        try:
            action = parse_action(reply, self.screen)
        except ActionError as problem:
            action, error = None, str(problem)
            episode.errors[problem.kind] = episode.errors.get(problem.kind, 0) + 1
        try:
            if action is not None:
                perform(action, episode.desktop)
                episode.last_action = action.action_type
            nodes = episode.tree()
            if self.save_screenshots:
                episode.save_screenshot()
        except DesktopError as problem:
            self._close_episode(key)
            return None, True, None, f"episode {key}: {problem}", {**row, **self._counts(key, episode),
                                                                  "correct": False}
        score = evaluate(episode.task, episode.workdir, episode.last_action)
        done = (action is not None and action.action_type in TERMINAL) or episode.steps >= self.max_steps
        metadata = {**row, **self._counts(key, episode), "correct": score == 1.0}
        if done:
            self._close_episode(key)
            return score, True, None, None, metadata
        observation = {"role": "user", "content": observation_text(episode.steps, self.max_steps, nodes, error)}
        return score, False, observation, None, metadata

    @staticmethod
    def _counts(key: str, episode: CuaEpisode) -> dict[str, Any]:
        return {"cua_episode": key, "cua_workdir": str(episode.workdir), "cua_actions": episode.steps,
                "cua_errors": sum(episode.errors.values()), "cua_error_kinds": dict(episode.errors),
                "cua_last_action": episode.last_action, "cua_screenshots": list(episode.screenshots)}

    def _close_episode(self, key: str) -> None:
        with self._lock:
            episode = self._episodes.pop(key, None)
        if episode is None:
            return
        episode.desktop.close()
        if self.keep_episodes is None:
            return
        with self._lock:
            self._finished.append(episode.workdir)
            expired = [self._finished.popleft() for _ in range(len(self._finished) - self.keep_episodes)]
        for workdir in expired:
            shutil.rmtree(workdir, ignore_errors=True)

    def close(self) -> None:
        """Stop every episode's desktop; remove the episodes' folder when it is a temporary one."""
        self._finalizer()


def _shutdown(episodes: dict[str, CuaEpisode], lock: threading.Lock, temporary_dir: Path | None) -> None:
    with lock:
        open_episodes = list(episodes.values())
        episodes.clear()
    for episode in open_episodes:
        episode.desktop.close()
    if temporary_dir is not None:
        shutil.rmtree(temporary_dir, ignore_errors=True)


def initial_tree(task: CuaTask, *, screen: tuple[int, int] = DEFAULT_SCREEN,
                 start_timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The task's first accessibility tree: its setup run on a desktop of its own, which is then stopped."""
    environment = CuaEnvironment([task], screen=screen, start_timeout_s=start_timeout_s, save_screenshots=False)
    try:
        _, episode = environment.open_episode(task.id)
        return episode.tree()
    finally:
        environment.close()


def prompt_rows(tasks: list[CuaTask], *, screen: tuple[int, int] = DEFAULT_SCREEN) -> list[dict[str, str]]:
    """Data rows for training or evaluation on `tasks`: {"prompt", "task_id"}, each prompt holding the task's
    first tree (every task is set up once on a desktop to read it; the app places its widgets the same way every
    time)."""
    return [{"prompt": task_prompt(task, initial_tree(task, screen=screen), screen), "task_id": task.id}
            for task in tasks]


__all__ = ["CuaEnvironment", "CuaEpisode", "initial_tree", "prompt_rows", "task_prompt", "tree_text"]
