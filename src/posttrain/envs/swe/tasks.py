"""SWE-style repository tasks in the SWE-bench row schema, and the predictions that `posttrain swe-eval` scores.

A task row (one JSON object per line of a .jsonl file, as SWE-bench's datasets are exported) has:

- instance_id: unique id, e.g. "owner__name-123".
- repo: "owner/name"; the git repository is found, in this order, at the row's optional `repo_path` (absolute, or
  relative to the tasks file), at REPOS_DIR/owner__name, or at REPOS_DIR/owner/name, where REPOS_DIR is the caller's
  `repos_dir` (`swe-eval --repos`, `environment.options.repos_dir`), else the `repos` folder beside the tasks file.
  Nothing is cloned: point REPOS_DIR at your own clones.
- base_commit: the commit the task starts from (any revision git understands in that repository).
- problem_statement: the issue text the agent reads.
- patch: the gold fix; test_patch: the tests that check it (unified diffs, as `git diff` writes them).
- FAIL_TO_PASS, PASS_TO_PASS: pytest node ids ("tests/test_x.py::test_y"), as a JSON list or as a string holding
  a JSON list (SWE-bench's own files encode them that way).
- test_command (optional, default "pytest"): how the tests run; "pytest" followed by extra pytest arguments.

A prediction row is SWE-bench's: instance_id, model_patch (a unified diff; empty or null for no patch) and
model_name_or_path. Every error names the file, the line and the field.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.errors import RunError

TASK_FIELDS = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch", "FAIL_TO_PASS",
               "PASS_TO_PASS")
"""The fields every task row must have (test_command and repo_path are optional)."""


class SweTaskError(RunError, ValueError):
    """A task or prediction file that cannot be read: the message names the file, line and field."""


@dataclass(frozen=True)
class SweTask:
    """One repository task (see the module docstring for the fields' meaning)."""

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    """Tests that fail at base_commit and must pass with a fix."""
    pass_to_pass: tuple[str, ...]
    """Tests that pass at base_commit and must still pass."""
    test_command: str
    """"pytest" and extra pytest arguments."""
    repo_path: Path
    """The local git repository holding base_commit."""

    @property
    def pytest_arguments(self) -> tuple[str, ...]:
        """The arguments after "pytest" in test_command."""
        return tuple(shlex.split(self.test_command)[1:])

    def as_row(self) -> dict[str, Any]:
        """The task as a SWE-bench row (what a tasks file line holds)."""
        return {"instance_id": self.instance_id, "repo": self.repo, "base_commit": self.base_commit,
                "problem_statement": self.problem_statement, "patch": self.patch, "test_patch": self.test_patch,
                "FAIL_TO_PASS": list(self.fail_to_pass), "PASS_TO_PASS": list(self.pass_to_pass),
                "test_command": self.test_command}


@dataclass(frozen=True)
class Prediction:
    """One model patch to score (SWE-bench's predictions format)."""

    instance_id: str
    model_patch: str
    model_name_or_path: str
    line: int
    """The line of the predictions file it came from."""


def _rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line of a JSON-lines file."""
    if not path.is_file():
        raise SweTaskError(f"{path}: no such file")
    rows = []
    with open(path, encoding="utf-8") as file:
        for number, text in enumerate(file, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as error:
                raise SweTaskError(f"{path}:{number}: not a JSON object: {error.msg} (column {error.colno})") from None
            if not isinstance(row, dict):
                raise SweTaskError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            rows.append((number, row))
    return rows


def _string(row: dict[str, Any], field: str, where: str, *, allow_empty: bool = False) -> str:
    value = row.get(field)
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        got = "missing" if field not in row else f"got {value!r}"[:120]
        raise SweTaskError(f"{where}: field {field!r} must be a non-empty string ({got})")
    return value


def _test_ids(row: dict[str, Any], field: str, where: str) -> tuple[str, ...]:
    value = row.get(field)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise SweTaskError(f"{where}: field {field!r} is a string but not a JSON list: {error.msg}") from None
    if not isinstance(value, list) or not all(isinstance(test, str) and test.strip() for test in value):
        got = "missing" if field not in row else f"got {row.get(field)!r}"[:120]
        raise SweTaskError(f"{where}: field {field!r} must be a list of test ids (or a JSON string of one), {got}")
    return tuple(value)


def _repository(row: dict[str, Any], where: str, tasks_file: Path, repos_dir: Path | None) -> Path:
    if "repo_path" in row:
        path = Path(_string(row, "repo_path", where))
        candidates = [path if path.is_absolute() else tasks_file.parent / path]
    else:
        base = repos_dir if repos_dir is not None else tasks_file.parent / "repos"
        owner_name = row["repo"]
        candidates = [base / owner_name.replace("/", "__"), base / owner_name]
    for candidate in candidates:
        if (candidate / ".git").exists() or (candidate / "HEAD").is_file():
            return candidate.resolve()
    raise SweTaskError(f"{where}: no git repository for repo {row['repo']!r}; looked at "
                       f"{', '.join(str(c) for c in candidates)} (clone it there, set the row's repo_path, or pass "
                       "the folder of your clones as repos_dir / --repos)")


def load_tasks(path: str | Path, repos_dir: str | Path | None = None) -> list[SweTask]:
    """The tasks of a JSON-lines file, checked row by row (see the module docstring)."""
    path = Path(path)
    repos = Path(repos_dir) if repos_dir is not None else None
    tasks: list[SweTask] = []
    seen: dict[str, int] = {}
    for number, row in _rows(path):
        where = f"{path}:{number}"
        for field in ("instance_id", "repo", "base_commit", "problem_statement"):
            _string(row, field, where)
        instance_id = row["instance_id"]
        if instance_id in seen:
            raise SweTaskError(f"{where}: instance_id {instance_id!r} repeats line {seen[instance_id]}")
        seen[instance_id] = number
        fail_to_pass = _test_ids(row, "FAIL_TO_PASS", where)
        if not fail_to_pass:
            raise SweTaskError(f"{where}: field 'FAIL_TO_PASS' is empty: a task needs a test its fix makes pass")
        test_command = row.get("test_command", "pytest")
        if not isinstance(test_command, str) or shlex.split(test_command)[:1] != ["pytest"]:
            raise SweTaskError(f"{where}: field 'test_command' must be \"pytest\" followed by pytest arguments "
                               f"(the report is pytest's), got {test_command!r}")
        tasks.append(SweTask(
            instance_id=instance_id, repo=row["repo"], base_commit=row["base_commit"],
            problem_statement=row["problem_statement"], patch=_string(row, "patch", where),
            test_patch=_string(row, "test_patch", where), fail_to_pass=fail_to_pass,
            pass_to_pass=_test_ids(row, "PASS_TO_PASS", where), test_command=test_command,
            repo_path=_repository(row, where, path, repos)))
    if not tasks:
        raise SweTaskError(f"{path}: no tasks (the file has no rows)")
    return tasks


def load_predictions(path: str | Path) -> list[Prediction]:
    """The predictions of a JSON-lines file (a JSON list of them, as some tools write, is read too)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.is_file() else None
    if text is not None and text.lstrip().startswith("["):
        try:
            listed = json.loads(text)
        except json.JSONDecodeError as error:
            raise SweTaskError(f"{path}: not a JSON list: {error.msg} (line {error.lineno})") from None
        rows = [(index + 1, row) for index, row in enumerate(listed)]
        label = "item"
    else:
        rows = _rows(path)
        label = None
    predictions = []
    seen: dict[str, int] = {}
    for number, row in rows:
        where = f"{path}:{number}" if label is None else f"{path} {label} {number}"
        if not isinstance(row, dict):
            raise SweTaskError(f"{where}: expected a JSON object, got {type(row).__name__}")
        instance_id = _string(row, "instance_id", where)
        if instance_id in seen:
            raise SweTaskError(f"{where}: a second prediction for {instance_id!r} "
                               f"(the first is at {seen[instance_id]})")
        seen[instance_id] = number
        patch = row.get("model_patch")
        if patch is not None and not isinstance(patch, str):
            raise SweTaskError(f"{where}: field 'model_patch' must be a string (a unified diff) or null, "
                               f"got {type(patch).__name__}")
        name = row.get("model_name_or_path", "")
        if not isinstance(name, str):
            raise SweTaskError(f"{where}: field 'model_name_or_path' must be a string, got {name!r}")
        predictions.append(Prediction(instance_id=instance_id, model_patch=patch or "", model_name_or_path=name,
                                      line=number))
    return predictions
