"""Computer-use tasks in OSWorld's task format, and the evaluator functions that score them.

A task is a JSON object (one per line of a .jsonl file, or one per .json file in a folder, as OSWorld lays out
`evaluation_examples/examples/<domain>/<id>.json`):

    {"id": "contact-name",
     "instruction": "Type Ada Lovelace into the Name field of the contact form and press Save.",
     "config": [{"type": "launch", "parameters": {"app": "contact_form"}}],
     "evaluator": {"func": "exact_match",
                   "result": {"type": "json_field", "path": "contact.json", "key": "name"},
                   "expected": {"type": "rule", "rules": {"expected": "Ada Lovelace"}}}}

config: setup steps run in order before the first observation, each {type, parameters}:
- launch {app: contact_form, initial_state: {...} (optional)}: start the bundled app (`app.py`) on the desktop and
  wait until it answers; initial_state fills its form.
- write_file {path, content}: write a text file into the episode's work directory.
- sleep {seconds}.

evaluator: {func, result, expected, options} as in OSWorld; func may be a list, with result, expected (and options)
lists of the same length, combined by `conj` ("and", the default, or "or").
- result getters: {type: file, path} (the file's text, None when missing), {type: json_file, path} (its JSON),
  {type: json_field, path, key} (one key of that JSON object; a dotted key reads nested objects). Paths are in the
  episode's work directory, where the app saves.
- expected getters: {type: rule, rules: {...}}; {type: file, path} (a text file, relative to the task file's folder).
- functions: exact_match (rules.expected equals the result), check_include_exclude (the result as text contains
  every string of rules.include and none of rules.exclude), compare_text_file (the result's text equals the expected
  file's, trailing whitespace ignored; options.ignore_case), infeasible (takes no result: 1 when the episode ended
  with FAIL, OSWorld's convention for tasks that cannot be done). Every other task scores 0 when it ends with FAIL.

A result that is missing (the app never saved) scores 0. Other keys of OSWorld's files (snapshot, source,
related_apps, ...) are read past. Every error names the file, the line (for .jsonl) and the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from posttrain.errors import RunError

APPS = ("contact_form",)
"""The apps a launch step can start (bundled with posttrain)."""
SETUP_TYPES = ("launch", "write_file", "sleep")
RESULT_TYPES = ("file", "json_file", "json_field")
EXPECTED_TYPES = ("rule", "file")


class CuaTaskError(RunError, ValueError):
    """A task file that cannot be read: the message names the file, the line and the field."""


@dataclass(frozen=True)
class SetupStep:
    """One step of a task's config."""

    type: str
    """launch, write_file or sleep."""
    parameters: dict[str, Any]


@dataclass(frozen=True)
class Check:
    """One evaluator function with its result and expected getters."""

    func: str
    result: dict[str, Any] | None
    """The result getter ({type, path, key}); None for infeasible."""
    expected: Any
    """The expected value (rules dict, or the expected file's text), resolved when the task loads."""
    options: dict[str, Any]


@dataclass(frozen=True)
class CuaTask:
    """One task (see the module docstring)."""

    id: str
    instruction: str
    config: tuple[SetupStep, ...]
    checks: tuple[Check, ...]
    conj: str
    """How the checks combine: "and" or "or"."""
    source: str
    """Where the task was read ("file:line"), for messages."""


# ---- evaluator functions ---------------------------------------------------------------------------------------

def exact_match(result: Any, rules: dict[str, Any], options: dict[str, Any]) -> float:
    return float(result is not None and result == rules["expected"])


def check_include_exclude(result: Any, rules: dict[str, Any], options: dict[str, Any]) -> float:
    if result is None:
        return 0.0
    text = result if isinstance(result, str) else json.dumps(result)
    return float(all(item in text for item in rules.get("include", []))
                 and not any(item in text for item in rules.get("exclude", [])))


def compare_text_file(result: Any, expected: str, options: dict[str, Any]) -> float:
    if not isinstance(result, str):
        return 0.0

    def normal(text: str) -> list[str]:
        lines = [line.rstrip() for line in text.rstrip().splitlines()]
        return [line.lower() for line in lines] if options.get("ignore_case") else lines

    return float(normal(result) == normal(expected))


EVALUATORS: dict[str, Callable[[Any, Any, dict[str, Any]], float]] = {
    "exact_match": exact_match,
    "check_include_exclude": check_include_exclude,
    "compare_text_file": compare_text_file,
}
"""The evaluator functions by name (infeasible is handled by `evaluate`, as it reads the last action)."""
_RULE_KEYS = {"exact_match": ({"expected"}, set()), "check_include_exclude": (set(), {"include", "exclude"})}
"""Per rule-based function: the rules it needs, and those it may have."""


def read_result(getter: dict[str, Any], workdir: Path) -> Any:
    """What a result getter reads from the episode's work directory; None when the file is missing, unreadable
    JSON or lacks the key (the app never saved, or saved something else: the task is not done)."""
    path = workdir / getter["path"]
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    if getter["type"] == "file":
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if getter["type"] == "json_file":
        return value
    for part in getter["key"].split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def evaluate(task: CuaTask, workdir: Path, last_action: str | None) -> float:
    """The task's score, 0 or 1, from the files in `workdir` and the episode's last action type."""
    scores = []
    for check in task.checks:
        if check.func == "infeasible":
            scores.append(float(last_action == "FAIL"))
        elif last_action == "FAIL":
            scores.append(0.0)
        else:
            scores.append(EVALUATORS[check.func](read_result(check.result, workdir), check.expected, check.options))
    return min(scores) if task.conj == "and" else max(scores)


# ---- loading ---------------------------------------------------------------------------------------------------

def bundled_tasks_path() -> Path:
    """The bundled tasks' file (contact-form tasks written for posttrain)."""
    return Path(str(resources.files("posttrain.envs.cua") / "tasks" / "contact_form.jsonl"))


def load_tasks(path: str | Path | None = None) -> list[CuaTask]:
    """The tasks of a .jsonl file, a .json file (one task) or a folder of .json files (searched recursively);
    None: the bundled tasks. CuaTaskError naming the file, line and field for anything wrong; ids must be unique."""
    path = Path(path) if path is not None else bundled_tasks_path()
    if path.is_dir():
        sources = [(file, None, file.read_text(encoding="utf-8")) for file in sorted(path.rglob("*.json"))]
        if not sources:
            raise CuaTaskError(f"{path}: no .json task files in this folder")
    elif path.is_file():
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            sources = [(path, number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
        else:
            sources = [(path, None, text)]
    else:
        raise CuaTaskError(f"{path}: no such task file or folder")
    tasks: list[CuaTask] = []
    seen: dict[str, str] = {}
    for file, line, text in sources:
        where = f"{file}:{line}" if line is not None else str(file)
        try:
            row = json.loads(text)
        except json.JSONDecodeError as error:
            raise CuaTaskError(f"{where}: not valid JSON ({error.msg}, column {error.colno})") from None
        task = _task(row, where, file.parent)
        if task.id in seen:
            raise CuaTaskError(f"{where}: field 'id': {task.id!r} is also the id of the task at {seen[task.id]}")
        seen[task.id] = where
        tasks.append(task)
    if not tasks:
        raise CuaTaskError(f"{path}: no tasks in this file")
    return tasks


def _task(row: Any, where: str, folder: Path) -> CuaTask:
    def fail(field: str, message: str) -> CuaTaskError:
        return CuaTaskError(f"{where}: field '{field}' {message}")

    if not isinstance(row, dict):
        raise CuaTaskError(f"{where}: a task is a JSON object, got {type(row).__name__}")
    for name in ("id", "instruction"):
        if not isinstance(row.get(name), str) or not row[name].strip():
            raise fail(name, "must be a non-empty string")
    config = row.get("config", [])
    if not isinstance(config, list):
        raise fail("config", "must be a list of setup steps {type, parameters}")
    steps = tuple(_setup_step(step, f"config[{index}]", fail) for index, step in enumerate(config))
    if not any(step.type == "launch" for step in steps):
        raise fail("config", "has no launch step: nothing would be on the screen (add {\"type\": \"launch\", "
                             "\"parameters\": {\"app\": \"contact_form\"}})")
    if sum(step.type == "launch" for step in steps) > 1:
        raise fail("config", "has more than one launch step: an episode's desktop runs one app")
    evaluator = row.get("evaluator")
    if not isinstance(evaluator, dict):
        raise fail("evaluator", "must be an object {func, result, expected, options}")
    funcs = evaluator.get("func")
    several = isinstance(funcs, list)
    funcs = funcs if several else [funcs]
    if not funcs:
        raise fail("evaluator.func", "is an empty list")
    conj = evaluator.get("conj", "and")
    if conj not in ("and", "or"):
        raise fail("evaluator.conj", f"must be 'and' or 'or', got {conj!r}")

    def part(key: str, index: int, default: Any) -> tuple[Any, str]:
        value = evaluator.get(key, default if not several else [default] * len(funcs))
        if not several:
            return value, f"evaluator.{key}"
        if not isinstance(value, list) or len(value) != len(funcs):
            raise fail(f"evaluator.{key}", f"must be a list as long as evaluator.func ({len(funcs)})")
        return value[index], f"evaluator.{key}[{index}]"

    checks = []
    for index, func in enumerate(funcs):
        func_field = f"evaluator.func[{index}]" if several else "evaluator.func"
        if func not in (*EVALUATORS, "infeasible"):
            raise fail(func_field, f"must be one of {', '.join([*EVALUATORS, 'infeasible'])}, got {func!r}")
        options, options_field = part("options", index, {})
        if not isinstance(options, dict):
            raise fail(options_field, "must be an object")
        if func == "infeasible":
            checks.append(Check(func, None, None, options))
            continue
        result, result_field = part("result", index, None)
        expected, expected_field = part("expected", index, None)
        checks.append(Check(func, _result_getter(result, result_field, fail),
                            _expected(func, expected, expected_field, folder, fail), options))
    return CuaTask(row["id"], row["instruction"], steps, tuple(checks), conj, where)


def _setup_step(step: Any, field: str, fail: Callable[[str, str], CuaTaskError]) -> SetupStep:
    if not isinstance(step, dict) or step.get("type") not in SETUP_TYPES:
        raise fail(f"{field}.type", f"must be one of {', '.join(SETUP_TYPES)}")
    parameters = step.get("parameters", {})
    if not isinstance(parameters, dict):
        raise fail(f"{field}.parameters", "must be an object")
    if step["type"] == "launch":
        if parameters.get("app") not in APPS:
            raise fail(f"{field}.parameters.app", f"must be one of {', '.join(APPS)}, got {parameters.get('app')!r}")
        if not isinstance(parameters.get("initial_state", {}), dict):
            raise fail(f"{field}.parameters.initial_state", "must be an object (the form's fields)")
    elif step["type"] == "write_file":
        for name in ("path", "content"):
            if not isinstance(parameters.get(name), str):
                raise fail(f"{field}.parameters.{name}", "must be a string")
        _relative(parameters["path"], f"{field}.parameters.path", fail)
    else:
        seconds = parameters.get("seconds")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 60:
            raise fail(f"{field}.parameters.seconds", "must be a number of seconds from 0 to 60")
    return SetupStep(step["type"], parameters)


def _relative(path: str, field: str, fail: Callable[[str, str], CuaTaskError]) -> None:
    if not path or Path(path).is_absolute() or ".." in Path(path).parts:
        raise fail(field, f"must be a relative path inside the episode's work directory, got {path!r}")


def _result_getter(getter: Any, field: str, fail: Callable[[str, str], CuaTaskError]) -> dict[str, Any]:
    if not isinstance(getter, dict) or getter.get("type") not in RESULT_TYPES:
        raise fail(f"{field}.type", f"must be one of {', '.join(RESULT_TYPES)}")
    if not isinstance(getter.get("path"), str):
        raise fail(f"{field}.path", "must be a string")
    _relative(getter["path"], f"{field}.path", fail)
    if getter["type"] == "json_field" and (not isinstance(getter.get("key"), str) or not getter["key"]):
        raise fail(f"{field}.key", "must be a non-empty string (a dotted key reads nested objects)")
    return getter


def _expected(func: str, expected: Any, field: str, folder: Path, fail: Callable[[str, str], CuaTaskError]) -> Any:
    if not isinstance(expected, dict) or expected.get("type") not in EXPECTED_TYPES:
        raise fail(f"{field}.type", f"must be one of {', '.join(EXPECTED_TYPES)}")
    if func == "compare_text_file":
        if expected["type"] != "file" or not isinstance(expected.get("path"), str):
            raise fail(field, "must be {type: file, path} for compare_text_file")
        path = folder / expected["path"]
        if not path.is_file():
            raise fail(f"{field}.path", f"names {path}, which does not exist")
        return path.read_text(encoding="utf-8")
    rules = expected.get("rules")
    if expected["type"] != "rule" or not isinstance(rules, dict):
        raise fail(field, f"must be {{type: rule, rules: {{...}}}} for {func}")
    needed, allowed = _RULE_KEYS[func]
    for name in needed - set(rules):
        raise fail(f"{field}.rules.{name}", f"is missing ({func} needs it)")
    for name in set(rules) - needed - allowed:
        known = ", ".join(sorted(needed | allowed))
        raise fail(f"{field}.rules.{name}", f"is not a rule of {func} (its rules: {known})")
    for name in allowed & set(rules):
        if not isinstance(rules[name], list) or not all(isinstance(item, str) for item in rules[name]):
            raise fail(f"{field}.rules.{name}", "must be a list of strings")
    return rules
