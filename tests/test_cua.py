"""Computer use: the computer_13 action parser, OSWorld-style task files and evaluators, the Xvfb desktop (start-up
deadline, screenshots), the app's accessibility tree, the cua environment's episodes, the scripted policy solving
every bundled task, and `posttrain eval` driving the environment.

Tests that need a desktop skip, saying why, where Xvfb or xdotool is missing (scripts/test.sh installs them when it
runs as root with apt-get)."""

from __future__ import annotations

import gc
import importlib.util
import io
import json
import math
import re
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from posttrain.algorithms import evaluate as evaluate_module
from posttrain.algorithms import grpo as grpo_module
from posttrain.algorithms.evaluate import evaluate_files
from posttrain.algorithms.grpo import train_grpo
from posttrain.logging import read_metrics
from posttrain.config import ConfigError, load_config
from posttrain.config.schema import EvalConfig, GRPOConfig
from posttrain.envs.cua.actions import ACTION_TYPES, Action, ActionError, parse_action, xdotool_arguments
from posttrain.envs.cua.desktop import Desktop, DesktopError, missing_programs, read_xwd
from posttrain.envs.cua.environment import (
    TREE_HEADER,
    CuaEnvironment,
    initial_tree,
    prompt_rows,
    task_prompt,
    tree_text,
)
from posttrain.envs.cua.scripted import ScriptedPolicy, load_scripts, parse_tree, resolve, run_tasks
from posttrain.envs.cua.tasks import CuaTaskError, evaluate, load_tasks
from posttrain.envs.registry import EnvironmentOptionError, build_environment
from posttrain.generation.base import Completion, GenerationOutput
from rl_configs import TINY_RL

SCREEN = (640, 480)
needs_desktop = pytest.mark.skipif(bool(missing_programs()), reason=(
    f"no {' or '.join(missing_programs())} on PATH (Debian/Ubuntu: apt-get install -y xvfb xdotool; "
    "scripts/test.sh installs them when root)"))


# ---- actions (no desktop) ------------------------------------------------------------------------------------

@pytest.mark.parametrize("reply, action_type, parameters, xdotool", [
    ('{"action_type": "MOVE_TO", "parameters": {"x": 10, "y": 20}}', "MOVE_TO", {"x": 10, "y": 20},
     ["mousemove", "10", "20"]),
    ('{"action_type": "CLICK", "x": 10.4, "y": 20.6}', "CLICK", {"x": 10, "y": 21},
     ["mousemove", "10", "21", "click", "--repeat", "1", "--delay", "10", "1"]),
    ('{"action_type": "CLICK", "parameters": {"button": "right", "num_clicks": 2}}', "CLICK",
     {"button": "right", "num_clicks": 2}, ["click", "--repeat", "2", "--delay", "10", "3"]),
    ('{"action_type": "MOUSE_DOWN"}', "MOUSE_DOWN", {}, ["mousedown", "1"]),
    ('{"action_type": "MOUSE_UP", "parameters": {"button": "middle"}}', "MOUSE_UP", {"button": "middle"},
     ["mouseup", "2"]),
    ('{"action_type": "RIGHT_CLICK", "parameters": {"x": 5, "y": 6}}', "RIGHT_CLICK", {"x": 5, "y": 6},
     ["mousemove", "5", "6", "click", "--delay", "10", "3"]),
    ('{"action_type": "DOUBLE_CLICK"}', "DOUBLE_CLICK", {}, ["click", "--repeat", "2", "--delay", "10", "1"]),
    ('{"action_type": "DRAG_TO", "parameters": {"x": 100, "y": 200}}', "DRAG_TO", {"x": 100, "y": 200},
     ["mousedown", "1", "mousemove", "100", "200", "mouseup", "1"]),
    ('{"action_type": "SCROLL", "parameters": {"dx": -1, "dy": 3}}', "SCROLL", {"dx": -1, "dy": 3},
     ["click", "--repeat", "3", "--delay", "0", "4", "click", "--repeat", "1", "--delay", "0", "6"]),
    ('{"action_type": "TYPING", "parameters": {"text": "-rf /"}}', "TYPING", {"text": "-rf /"},
     ["type", "--delay", "0", "--", "-rf /"]),
    ('{"action_type": "PRESS", "parameters": {"key": "enter"}}', "PRESS", {"key": "enter"}, ["key", "--", "Return"]),
    ('{"action_type": "KEY_DOWN", "parameters": {"key": "shift"}}', "KEY_DOWN", {"key": "shift"},
     ["keydown", "--", "shift"]),
    ('{"action_type": "KEY_UP", "parameters": {"key": "a"}}', "KEY_UP", {"key": "a"}, ["keyup", "--", "a"]),
    ('{"action_type": "HOTKEY", "parameters": {"keys": ["ctrl", "shift", "F5"]}}', "HOTKEY",
     {"keys": ["ctrl", "shift", "F5"]}, ["key", "--", "ctrl+shift+F5"]),
    ('```json\n{"action_type": "wait"}\n```', "WAIT", {}, []),
    ("I am finished. DONE", None, None, None),
    ("DONE", "DONE", {}, []),
    ("`FAIL`", "FAIL", {}, []),
])
def test_each_action_type_parses_and_maps_to_xdotool(reply, action_type, parameters, xdotool):
    if action_type is None:  # prose around a bare word is no action
        with pytest.raises(ActionError) as error:
            parse_action(reply, SCREEN)
        assert error.value.kind == "malformed"
        return
    action = parse_action(reply, SCREEN)
    assert action == Action(action_type, parameters)
    assert xdotool_arguments(action) == xdotool


def test_the_parser_covers_all_sixteen_computer_13_actions():
    assert len(ACTION_TYPES) == 16
    assert set(ACTION_TYPES) == {"MOVE_TO", "CLICK", "MOUSE_DOWN", "MOUSE_UP", "RIGHT_CLICK", "DOUBLE_CLICK", "DRAG_TO",
                                 "SCROLL", "TYPING", "PRESS", "KEY_DOWN", "KEY_UP", "HOTKEY", "WAIT", "FAIL", "DONE"}


@pytest.mark.parametrize("reply, kind, message", [
    ("click the Save button", "malformed", "no action found"),
    ('{"action_type": "CLICK", "x": 10,', "malformed", "not valid JSON"),
    ('{"type": "CLICK"}', "malformed", 'string "action_type"'),
    ('{"action_type": "TELEPORT"}', "unknown_action", "unknown action_type 'TELEPORT'"),
    ('{"action_type": "MOVE_TO", "parameters": {"x": 10}}', "bad_parameters", "needs the parameter 'y'"),
    ('{"action_type": "CLICK", "x": 10}', "bad_parameters", "give both x and y"),
    ('{"action_type": "CLICK", "x": 700, "y": 10}', "bad_parameters", "off the 640x480 screen"),
    ('{"action_type": "CLICK", "x": -1, "y": 10}', "bad_parameters", "off the 640x480 screen"),
    ('{"action_type": "CLICK", "x": "10", "y": 10}', "bad_parameters", "x must be a number"),
    ('{"action_type": "CLICK", "x": true, "y": 10}', "bad_parameters", "x must be a number"),
    ('{"action_type": "CLICK", "parameters": {"button": "back"}}', "bad_parameters", "left, right or middle"),
    ('{"action_type": "CLICK", "parameters": {"num_clicks": 5}}', "bad_parameters", "num_clicks must be 1, 2 or 3"),
    ('{"action_type": "CLICK", "parameters": {"z": 1}}', "bad_parameters", "no parameter 'z'"),
    ('{"action_type": "CLICK", "parameters": [1, 2]}', "bad_parameters", '"parameters" must be an object'),
    ('{"action_type": "TYPING", "parameters": {"text": ""}}', "bad_parameters", "text is empty"),
    ('{"action_type": "PRESS", "parameters": {"key": "hyper"}}', "bad_parameters", "unknown key 'hyper'"),
    ('{"action_type": "HOTKEY", "parameters": {"keys": []}}', "bad_parameters", "non-empty list"),
    ('{"action_type": "SCROLL", "parameters": {"dx": 0, "dy": 1.5}}', "bad_parameters", "dy must be an integer"),
    ('{"action_type": "DONE", "parameters": {"x": 1, "y": 1}}', "bad_parameters", "its parameters: none"),
])
def test_malformed_actions_are_errors_with_a_kind(reply, kind, message):
    with pytest.raises(ActionError, match=message) as error:
        parse_action(reply, SCREEN)
    assert error.value.kind == kind


# ---- task files and evaluators (no desktop) -------------------------------------------------------------------

def _task_row(**changes):
    row = {"id": "t1", "instruction": "Do it.", "config": [{"type": "launch", "parameters": {"app": "contact_form"}}],
           "evaluator": {"func": "exact_match", "result": {"type": "json_field", "path": "contact.json", "key": "name"},
                         "expected": {"type": "rule", "rules": {"expected": "Ada"}}}}
    row.update(changes)
    return row


@pytest.mark.parametrize("changes, message", [
    ({"instruction": ""}, ":2: field 'instruction' must be a non-empty string"),
    ({"config": []}, ":2: field 'config' has no launch step"),
    ({"config": [{"type": "launch", "parameters": {"app": "contact_form"}}] * 2},
     ":2: field 'config' has more than one launch step"),
    ({"config": [{"type": "launch", "parameters": {"app": "gimp"}}]},
     ":2: field 'config[0].parameters.app' must be one of contact_form, got 'gimp'"),
    ({"config": [{"type": "launch", "parameters": {"app": "contact_form"}},
                 {"type": "write_file", "parameters": {"path": "../x", "content": ""}}]},
     ":2: field 'config[1].parameters.path' must be a relative path"),
    ({"config": [{"type": "execute"}]}, ":2: field 'config[0].type' must be one of launch, write_file, sleep"),
    ({"evaluator": {"func": "fuzzy_match"}}, ":2: field 'evaluator.func' must be one of exact_match"),
    ({"evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "a"}}},
     ":2: field 'evaluator.result.type' must be one of file, json_file, json_field"),
    ({"evaluator": {"func": "exact_match", "result": {"type": "json_field", "path": "contact.json"}}},
     ":2: field 'evaluator.result.key' must be a non-empty string"),
    ({"evaluator": {"func": "exact_match", "result": {"type": "file", "path": "a"},
                    "expected": {"type": "rule", "rules": {}}}},
     ":2: field 'evaluator.expected.rules.expected' is missing"),
    ({"evaluator": {"func": "check_include_exclude", "result": {"type": "file", "path": "a"},
                    "expected": {"type": "rule", "rules": {"include": "x"}}}},
     ":2: field 'evaluator.expected.rules.include' must be a list of strings"),
    ({"evaluator": {"func": ["exact_match", "infeasible"], "result": [{"type": "file", "path": "a"}],
                    "expected": [{"type": "rule", "rules": {"expected": "x"}}, None]}},
     ":2: field 'evaluator.result' must be a list as long as evaluator.func (2)"),
    ({"evaluator": {"func": "infeasible", "conj": "xor"}}, ":2: field 'evaluator.conj' must be 'and' or 'or'"),
    ({"evaluator": {"func": "compare_text_file", "result": {"type": "file", "path": "a"},
                    "expected": {"type": "file", "path": "missing.txt"}}},
     ":2: field 'evaluator.expected.path' names"),
])
def test_bad_task_files_name_the_file_line_and_field(tmp_path, changes, message):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(_task_row(id="ok")) + "\n" + json.dumps(_task_row(**changes)) + "\n")
    with pytest.raises(CuaTaskError) as error:
        load_tasks(path)
    assert str(error.value).startswith(str(path)) and message in str(error.value)


def test_task_files_refuse_bad_json_and_repeated_ids_and_read_folders(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(_task_row()) + "\n{not json\n")
    with pytest.raises(CuaTaskError, match=r"tasks.jsonl:2: not valid JSON"):
        load_tasks(path)
    path.write_text(json.dumps(_task_row()) + "\n\n" + json.dumps(_task_row()) + "\n")
    with pytest.raises(CuaTaskError, match=r"tasks.jsonl:3: field 'id': 't1' is also the id of the task at .*:1"):
        load_tasks(path)
    folder = tmp_path / "examples" / "contact"  # OSWorld's layout: one .json per task, extra keys read past
    folder.mkdir(parents=True)
    (folder / "a.json").write_text(json.dumps({**_task_row(id="a"), "snapshot": "contact", "source": "x"}))
    (folder / "b.json").write_text(json.dumps(_task_row(id="b")))
    assert [task.id for task in load_tasks(tmp_path / "examples")] == ["a", "b"]


def test_evaluator_functions(tmp_path):
    (tmp_path / "expected.txt").write_text("Call back\nMonday  \n")
    tasks = tmp_path / "tasks.jsonl"
    rows = [
        _task_row(id="exact"),
        _task_row(id="include", evaluator={
            "func": "check_include_exclude", "result": {"type": "json_field", "path": "contact.json", "key": "email"},
            "expected": {"type": "rule", "rules": {"include": ["@example.org"], "exclude": ["admin"]}}}),
        _task_row(id="text", evaluator={
            "func": "compare_text_file", "result": {"type": "file", "path": "notes.txt"},
            "expected": {"type": "file", "path": "expected.txt"}, "options": {"ignore_case": True}}),
        _task_row(id="either", evaluator={
            "func": ["exact_match", "exact_match"], "conj": "or",
            "result": [{"type": "json_field", "path": "contact.json", "key": "name"},
                       {"type": "json_field", "path": "contact.json", "key": "nested.level"}],
            "expected": [{"type": "rule", "rules": {"expected": "Grace"}}, {"type": "rule", "rules": {"expected": 2}}]}),
        _task_row(id="cannot", evaluator={"func": "infeasible"}),
    ]
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    by_id = {task.id: task for task in load_tasks(tasks)}
    work = tmp_path / "episode"
    work.mkdir()
    assert [evaluate(by_id[i], work, "DONE") for i in by_id] == [0, 0, 0, 0, 0]  # nothing saved yet
    (work / "contact.json").write_text(json.dumps({"name": "Ada", "email": "ada@example.org", "nested": {"level": 2}}))
    (work / "notes.txt").write_text("call back\nmonday\n")
    assert [evaluate(by_id[i], work, "DONE") for i in by_id] == [1, 1, 1, 1, 0]
    assert [evaluate(by_id[i], work, "FAIL") for i in by_id] == [0, 0, 0, 0, 1]  # FAIL only fits infeasible tasks
    (work / "contact.json").write_text(json.dumps({"name": "Ada ", "email": "admin@example.org", "nested": {}}))
    (work / "notes.txt").write_text("call back\ntuesday\n")
    assert [evaluate(by_id[i], work, "DONE") for i in by_id] == [0, 0, 0, 0, 0]
    (work / "contact.json").write_text("{cut sho")
    assert evaluate(by_id["exact"], work, "DONE") == 0


def test_xwd_parsing_reads_each_channel():
    width, height = 3, 2
    pixels = np.arange(width * height * 3, dtype=np.uint8).reshape(height, width, 3) * 10
    words = (pixels[..., 0].astype("<u4") << 16) | (pixels[..., 1].astype("<u4") << 8) | pixels[..., 2]
    header = [108, 7, 2, 24, width, height, 0, 0, 32, 0, 32, 32, width * 4, 4, 0xFF0000, 0xFF00, 0xFF, 8, 256, 0,
              width, height, 0, 0, 0]
    data = np.array(header, dtype=">u4").tobytes() + b"screen\0\0" + words.astype("<u4").tobytes()
    assert np.array_equal(read_xwd(data), pixels)
    with pytest.raises(ValueError, match="cut short"):
        read_xwd(data[:-4])


def test_the_tree_round_trips_through_its_text():
    nodes = [{"role": "entry", "name": "Name", "text": "Ada\tL", "states": ["focused"], "x": 92, "y": 4, "width": 276,
              "height": 23},
             {"role": "push button", "name": "Save", "text": "", "states": [], "x": 92, "y": 198, "width": 65,
              "height": 31}]
    text = tree_text(nodes)
    assert text.splitlines()[0] == TREE_HEADER
    assert text.splitlines()[1] == "entry\tName\tAda L\tfocused\t(92, 4)\t(276, 23)"
    parsed = parse_tree(f"older\n{tree_text([])}\nnewer\n{text}\nReply with the next action.")
    assert parsed[1] == nodes[1] and parsed[0]["text"] == "Ada L"
    assert json.loads(resolve({"action_type": "CLICK", "target": {"role": "push button", "name": "Save"}}, parsed)) \
        == {"action_type": "CLICK", "parameters": {"x": 124, "y": 213}}


def test_config_sections_and_turn_limits(tmp_path):
    cfg = load_config(GRPOConfig, None, [*TINY_RL, f"output_dir={tmp_path}", "environment.kind=cua",
                                         "environment.options={max_steps: 4}", "rollout.max_turns=4"])
    assert cfg.environment.options.max_steps == 4 and cfg.environment.options.screen_width == 640
    with pytest.raises(ConfigError, match=r"environment.kind=cua with rollout.max_turns=3: .*max_steps=4"):
        load_config(GRPOConfig, None, [*TINY_RL, f"output_dir={tmp_path}", "environment.kind=cua",
                                       "environment.options={max_steps: 4}", "rollout.max_turns=3"])
    with pytest.raises(ConfigError, match="environment.options.max_step"):
        load_config(GRPOConfig, None, [*TINY_RL, f"output_dir={tmp_path}", "environment.kind=cua",
                                       "environment.options={max_step: 4}", "rollout.max_turns=10"])
    with pytest.raises(EnvironmentOptionError, match="environment.options of the cua environment: .*none.jsonl: no such "
                                                     "task file"):
        build_environment(cfg.environment.options.model_copy(update={"tasks": str(tmp_path / "none.jsonl")}))


# ---- the desktop ---------------------------------------------------------------------------------------------

def test_a_desktop_that_never_starts_fails_within_its_deadline(tmp_path):
    silent = tmp_path / "silent-xvfb"
    silent.write_text("#!/bin/sh\necho 'pretending to start' >&2\nexec sleep 60\n")
    silent.chmod(0o755)
    started = time.monotonic()
    desktop = Desktop(tmp_path / "a", start_timeout_s=1.0, xvfb=str(silent))
    with pytest.raises(DesktopError, match=r"(?s)did not report its display within 1 s; its log .*pretending to start"):
        desktop.start()
    assert time.monotonic() - started < 8  # the deadline and the stop (SIGTERM) of the silent server
    assert desktop._server is None and desktop.display is None
    failing = tmp_path / "failing-xvfb"
    failing.write_text("#!/bin/sh\necho 'no screens found' >&2\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(DesktopError, match=r"(?s)exited with code 3 before reporting its display.*no screens found"):
        Desktop(tmp_path / "b", start_timeout_s=5.0, xvfb=str(failing)).start()


@needs_desktop
def test_screenshots_are_pngs_of_the_screen_that_change_after_typing(tmp_path):
    environment = CuaEnvironment(load_tasks(), episodes_dir=tmp_path, screen=(480, 360))
    try:
        _, episode = environment.open_episode("contact-name")
        nodes = episode.tree()
        entry = next(n for n in nodes if n["role"] == "entry" and n["name"] == "Name")
        # Xvfb draws the pointer into its framebuffer: put it over the entry first, so only typing changes the screen
        episode.desktop.xdotool("mousemove", str(entry["x"] + 20), str(entry["y"] + 10))
        episode.tree()
        before = Image.open(io.BytesIO(episode.desktop.screenshot_png()))
        assert before.format == "PNG" and before.size == (480, 360) and before.mode == "RGB"
        episode.desktop.xdotool("click", "1")
        episode.desktop.xdotool("type", "--delay", "0", "Ada Lovelace")
        after_nodes = episode.tree()
        after = np.asarray(Image.open(io.BytesIO(episode.desktop.screenshot_png())))
        changed = np.argwhere((np.asarray(before) != after).any(axis=2))
        assert len(changed) > 50
        # what changed lies in the Name entry (its text and cursor), nowhere else
        assert changed[:, 0].min() >= entry["y"] and changed[:, 0].max() < entry["y"] + entry["height"]
        assert changed[:, 1].min() >= entry["x"] and changed[:, 1].max() < entry["x"] + entry["width"]
        name = next(n for n in after_nodes if n["role"] == "entry" and n["name"] == "Name")
        assert name["text"] == "Ada Lovelace" and name["states"] == ["focused"]
        assert np.asarray(before)[-1, -1].tolist() == [0, 0, 0]  # outside the app's window: the bare root
    finally:
        environment.close()


# ---- episodes ------------------------------------------------------------------------------------------------

def _episode(environment, task_id, replies):
    """Drive one episode with fixed replies; the EnvStep of each turn."""
    task = environment.tasks[task_id]
    messages = [{"role": "user", "content": task_prompt(task, [], SCREEN)}]
    row, steps = {"task_id": task_id}, []
    for reply in replies:
        messages.append({"role": "assistant", "content": reply})
        result = environment.step([messages], [row])
        steps.append(result)
        row = result.metadata[0]
        if result.done[0]:
            break
        messages.append(result.observations[0])
    return steps


@needs_desktop
def test_the_scripted_policy_completes_every_bundled_task_and_the_evaluator_confirms_it(tmp_path):
    tasks = load_tasks()
    assert len(tasks) == 5
    environment = CuaEnvironment(tasks, episodes_dir=tmp_path)
    try:
        reports = run_tasks(tasks, ScriptedPolicy(load_scripts()), environment)
        assert not environment._episodes  # every desktop stopped at the episode's end
    finally:
        environment.close()
    assert [(r.task_id, r.reward, r.correct, r.action_errors, r.error) for r in reports] == [
        (task.id, 1.0, True, 0, None) for task in tasks]
    saved = json.loads((tmp_path / "contact-update-notes-00003" / "contact.json").read_text())
    assert saved == {"name": "Grace Hopper", "email": "grace@navy.mil", "subscribe": False, "category": "Work",
                     "notes": "call back Monday"}
    assert json.loads((tmp_path / "contact-name-00000" / "contact.json").read_text())["name"] == "Ada Lovelace"
    shots = sorted((tmp_path / "contact-name-00000").glob("step_*.png"))
    assert [shot.name for shot in shots] == ["step_001.png", "step_002.png", "step_003.png", "step_004.png"]


@needs_desktop
def test_keep_episodes_bounds_the_finished_episodes_folders_and_scores_before_removing(tmp_path):
    tasks = [task for task in load_tasks() if task.id in ("contact-name", "contact-send-email")]
    environment = CuaEnvironment(tasks, episodes_dir=tmp_path, keep_episodes=1)
    try:
        first, second = run_tasks(tasks, ScriptedPolicy(load_scripts()), environment)
        # each scored by the evaluator on its saved form before its folder could go
        assert (first.reward, second.reward) == (1.0, 1.0)
        assert not Path(first.workdir).exists() and Path(second.workdir).is_dir()  # only the newest stays
        assert sorted(path.name for path in tmp_path.iterdir()) == [Path(second.workdir).name]
        (none_kept,) = run_tasks(tasks[:1], ScriptedPolicy(load_scripts()),
                                 bare := CuaEnvironment(tasks, episodes_dir=tmp_path / "none", keep_episodes=0))
        bare.close()
        assert none_kept.reward == 1.0 and not any((tmp_path / "none").iterdir())
    finally:
        environment.close()
    with pytest.raises(ValueError, match="keep_episodes must be at least 0"):
        CuaEnvironment(tasks, keep_episodes=-1)


@needs_desktop
def test_episodes_in_a_folder_an_earlier_run_used_get_fresh_directories(tmp_path):
    (tmp_path / "contact-name-00000").mkdir()
    (tmp_path / "contact-name-00000" / "contact.json").write_text('{"name": "Ada Lovelace"}')  # a finished episode
    environment = CuaEnvironment(load_tasks(), episodes_dir=tmp_path)
    try:
        key, episode = environment.open_episode("contact-name")
        assert key == "contact-name-00001" and not (episode.workdir / "contact.json").exists()
    finally:
        environment.close()


@needs_desktop
def test_wrong_actions_score_zero_and_invalid_ones_are_counted(tmp_path):
    environment = CuaEnvironment(load_tasks(), episodes_dir=tmp_path, max_steps=5)
    nodes = initial_tree(environment.tasks["contact-name"])  # where the widgets are depends on the machine's fonts
    name_entry = resolve({"action_type": "CLICK", "target": {"role": "entry", "name": "Name"}}, nodes)
    save = resolve({"action_type": "CLICK", "target": {"role": "push button", "name": "Save"}}, nodes)
    try:
        # the wrong name, saved
        steps = _episode(environment, "contact-name",
                         [name_entry, '{"action_type": "TYPING", "parameters": {"text": "Ada Byron"}}', save, "DONE"])
        assert [s.rewards[0] for s in steps] == [0, 0, 0, 0] and steps[-1].done[0]
        # the right name, never saved: cut off at max_steps (5 actions), still scored
        steps = _episode(environment, "contact-name",
                         [name_entry, '{"action_type": "TYPING", "parameters": {"text": "Ada Lovelace"}}', "WAIT",
                          "WAIT", "WAIT", "WAIT"])
        assert len(steps) == 5 and steps[-1].done[0] and steps[-1].rewards == [0.0]
        assert steps[-1].metadata[0]["cua_actions"] == 5
        # the right name, saved, then FAIL: a feasible task given up scores 0
        steps = _episode(environment, "contact-name",  # clicking where the pointer already is (no wait for a move)
                         [name_entry, name_entry, '{"action_type": "TYPING", "parameters": {"text": "Ada Lovelace"}}',
                          save, "FAIL"])
        assert [s.rewards[0] for s in steps] == [0, 0, 0, 1, 0]
        # an infeasible task answered DONE
        assert _episode(environment, "contact-send-email", ["DONE"])[-1].rewards == [0.0]
        # invalid actions: answered with the error and the tree, counted by kind, the episode goes on
        steps = _episode(environment, "contact-name", ["press save please", '{"action_type": "JUMP"}', "DONE"])
        first = steps[0]
        assert not first.done[0] and first.rewards == [0.0] and first.errors == [None]
        assert first.observations[0]["content"].startswith("error: no action found")
        assert TREE_HEADER in first.observations[0]["content"]
        assert re.search(r"\nentry\tName\t\t\t\(\d+, \d+\)\t\(\d+, \d+\)\n", first.observations[0]["content"])
        assert steps[-1].metadata[0]["cua_errors"] == 2
        assert steps[-1].metadata[0]["cua_error_kinds"] == {"malformed": 1, "unknown_action": 1}
        assert not environment._episodes
    finally:
        environment.close()


@needs_desktop
def test_an_episode_whose_desktop_fails_is_masked_not_zero(tmp_path):
    silent = tmp_path / "silent-xvfb"
    silent.write_text("#!/bin/sh\nexec sleep 60\n")
    silent.chmod(0o755)
    environment = CuaEnvironment(load_tasks(), episodes_dir=tmp_path / "episodes", start_timeout_s=0.5,
                                 xvfb=str(silent))
    try:
        result = environment.step([[{"role": "user", "content": "x"}, {"role": "assistant", "content": "DONE"}]],
                                  [{"task_id": "contact-name"}])
    finally:
        environment.close()
    assert result.rewards == [None] and result.done == [True]
    assert "desktop did not start" in result.errors[0] and "within 0.5 s" in result.errors[0]
    with pytest.raises(ValueError, match="needs a task_id column naming a task; row 0 of the batch has \"nope\""):
        CuaEnvironment(load_tasks()).step([[{"role": "assistant", "content": "DONE"}]], [{"task_id": "nope"}])


class ScriptedGenerator:
    """A stand-in generator whose every sample is the scripted policy's next action for the prompt's task (the
    embedded models have not learned to operate a desktop)."""

    def __init__(self, inner, tokenizer, tasks, second_sample_fails: bool = False):
        self.inner, self.tokenizer = inner, tokenizer
        self.tasks, self.second_sample_fails = tasks, second_sample_fails
        self.policy = ScriptedPolicy(load_scripts())
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    @property
    def weights_version(self):
        return self.inner.weights_version

    def update_weights(self, version, weights):
        return self.inner.update_weights(version, weights)

    def generate(self, prompts, params, num_samples=1):
        completions = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            task = next(task for task in self.tasks if f"Task: {task.instruction}" in text)
            turns = text.count("The screen's accessibility tree:") - 1  # the prompt's, then one per observation
            messages = [{"role": "assistant", "content": ""}] * turns + [{"role": "user", "content": text}]
            replies = [self.policy.reply(task.id, messages)] * num_samples
            if self.second_sample_fails and num_samples > 1:
                replies[1] = "FAIL"  # gives up at once: 0 on a feasible task, 1 on the infeasible one
            samples = []
            for reply in replies:
                ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.im_end]
                samples.append(Completion(prompt, ids, [-1.0] * len(ids), reply, "stop"))
            completions.append(samples)
        return GenerationOutput(completions, 0.0, sum(len(c.token_ids) for s in completions for c in s))


@needs_desktop
def test_eval_drives_the_cua_environment_to_the_evaluator(tmp_path, tiny_model_dir, monkeypatch):
    tasks = load_tasks()
    build_generator = evaluate_module.build_generator
    monkeypatch.setattr(evaluate_module, "build_generator", lambda model, backend, tokenizer, policy=None, **kwargs:
                        ScriptedGenerator(build_generator(model, backend, tokenizer, policy, **kwargs), tokenizer,
                                          tasks))
    data = tmp_path / "cua.jsonl"  # the data rows cua-run --write-prompts writes: each prompt holds the first tree
    data.write_text("".join(json.dumps(row) + "\n" for row in prompt_rows(
        [task for task in tasks if task.id in ("contact-subscribe-work", "contact-send-email")])))
    cfg = load_config(EvalConfig, None, [
        f"model.name_or_path={tiny_model_dir}", f"data.files=['{data}']", "environment.kind=cua",
        f"environment.options={{max_steps: 5, episodes_dir: '{tmp_path / 'episodes'}'}}", "max_turns=5",
        "max_new_tokens=4", "data.max_length=4096"])
    report = evaluate_files(cfg)
    assert report.metrics["accuracy"] == 1.0
    assert report.metrics["cua/actions_mean"] == 2.5  # click, click, click, DONE; FAIL
    assert report.metrics["cua/action_errors_mean"] == 0.0


@pytest.mark.slow  # about 40 s on 2 loaded cores: a step trains on episodes of about 5,000 tokens
@needs_desktop
def test_a_grpo_step_on_cua_tasks_logs_the_evaluators_rewards(tmp_path, tiny_model_dir, monkeypatch):
    tasks = load_tasks()
    policy_generator = grpo_module.policy_generator
    monkeypatch.setattr(grpo_module, "policy_generator", lambda cfg, tokenizer, policy, cluster=None: ScriptedGenerator(
        policy_generator(cfg, tokenizer, policy), tokenizer, tasks, second_sample_fails=True))
    data = tmp_path / "cua.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in prompt_rows(
        [task for task in tasks if task.id in ("contact-subscribe-work", "contact-send-email")])))
    cfg = load_config(GRPOConfig, None, [
        *TINY_RL, f"output_dir={tmp_path / 'run'}", f"data.train_files=['{data}']", "data.max_length=2048",
        "environment.kind=cua", "environment.options={max_steps: 5}", "rollout.max_turns=5",
        "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.num_generations_per_prompt=2",
        "trainer.max_steps=1", "trainer.save_every=0", "trainer.micro_batch_size=4"])
    train_grpo(cfg)
    record = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    # subscribe-work: the script (4 actions) earns 1, FAIL 0; send-email: FAIL earns 1 both times
    assert record["reward/mean"] == 0.75 and record["cua/actions_mean"] == 1.75
    assert record["cua/action_errors_mean"] == 0.0 and record["turns/max"] == 4
    assert record["tokens/observation_mean"] > 0 and math.isfinite(record["loss"])


@needs_desktop
def test_the_benchmark_times_every_part(tmp_path):
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "cua.py"
    spec = importlib.util.spec_from_file_location("cua_benchmark", script)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    output = tmp_path / "cua.json"
    assert benchmark.main(["--episodes", "1", "--repeats", "3", "--output", str(output)]) == 0
    results = json.loads(output.read_text())
    assert results["startup"]["n"] == 1 and all(row["n"] == 3 for row in results["parts"].values())
    assert len(results["parts"]) == 7
    assert results["steps_with_screenshots"]["steps"] == 3
    assert results["steps_without_screenshots"]["actions_per_second"] > 0


@needs_desktop
def test_cua_run_runs_a_users_tasks_and_scripts_and_writes_reports(tmp_path, capsys):
    from posttrain.cli import main

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(_task_row(id="notes", evaluator={
        "func": "exact_match", "result": {"type": "json_field", "path": "contact.json", "key": "notes"},
        "expected": {"type": "rule", "rules": {"expected": "tea at five"}}})) + "\n")
    scripts = tmp_path / "scripts.json"
    scripts.write_text(json.dumps({"notes": [
        {"action_type": "CLICK", "target": {"role": "entry", "name": "Notes"}},
        {"action_type": "TYPING", "parameters": {"text": "tea at five"}},
        {"action_type": "CLICK", "target": {"role": "push button", "name": "Save"}}]}))  # then DONE by itself
    output = tmp_path / "out"
    assert main(["cua-run", "--tasks", str(tasks), "--scripts", str(scripts), "--output", str(output)]) == 0
    assert "notes: solved, 4 actions" in capsys.readouterr().out
    assert json.loads((output / "report.json").read_text())["solved_ids"] == ["notes"]
    report = json.loads((output / "tasks" / "notes.json").read_text())
    assert report["reward"] == 1.0 and report["actions"] == 4 and report["action_errors"] == 0
    assert sorted(p.name for p in Path(report["workdir"]).glob("step_*.png"))[-1] == "step_004.png"
    scripts.write_text(json.dumps({"other": []}))
    assert main(["cua-run", "--tasks", str(tasks), "--scripts", str(scripts), "--output", str(output)]) == 1
    assert "no script for task 'notes'" in capsys.readouterr().err
    assert main(["cua-run", "--tasks", str(tmp_path / "none.jsonl"), "--output", str(output)]) == 1
    assert "none.jsonl: no such task file or folder" in capsys.readouterr().err
    prompts = tmp_path / "prompts.jsonl"
    assert main(["cua-run", "--tasks", str(tasks), "--write-prompts", str(prompts)]) == 0
    row = json.loads(prompts.read_text())
    assert row["task_id"] == "notes" and re.search(r"\nentry\tNotes\t\t\t\(\d+, \d+\)\t\(\d+, \d+\)\n", row["prompt"])


@needs_desktop
def test_an_environment_dropped_without_close_stops_its_desktops_and_removes_its_folder():
    environment = CuaEnvironment(load_tasks())
    _, episode = environment.open_episode("contact-name")
    server, folder = episode.desktop._server, environment.episodes_dir
    assert server.poll() is None and folder.is_dir()
    del environment, episode
    gc.collect()
    assert server.poll() is not None and not folder.exists()
