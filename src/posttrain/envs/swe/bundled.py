"""The bundled SWE tasks: five tiny Python repositories, each with a bug, an issue describing it, a gold patch and
the tests that check it, in the SWE-bench row schema.

`ensure_bundled_tasks()` builds them on first use under the cache directory (POSTTRAIN_CACHE_DIR or the user cache
dir, like the embedded models): for each task a git repository `repos/posttrain__NAME` with two commits (the base,
then the fix with its tests, so that the source repository holds history past base_commit as real ones do) and a
`tasks.jsonl` whose rows name the base commit. Commits have fixed authors and dates, so every build gives the same
commit ids. The whole folder is built in a staging directory and renamed into place once complete.

Every task's tests are pure Python and run in well under a second.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import platformdirs

BUNDLED_VERSION = 1
"""Bumped whenever the bundled tasks change (a new cache folder is built)."""


@dataclass(frozen=True)
class _Spec:
    name: str
    problem_statement: str
    base_files: dict[str, str]
    """path -> content at the base commit (source and the tests that already pass)."""
    fix_files: dict[str, str]
    """path -> content the gold patch writes (source only)."""
    test_files: dict[str, str]
    """path -> content the test patch writes (tests only)."""
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]


def _code(text: str) -> str:
    return textwrap.dedent(text).lstrip()


_CLAMP_TESTS = _code('''
    from numbers_util import clamp


    def test_inside():
        assert clamp(5, 0, 10) == 5


    def test_below():
        assert clamp(-3, 0, 10) == 0
    ''')

_SLUG_TESTS = _code('''
    from textkit import slugify


    def test_spaces():
        assert slugify("hello world") == "hello-world"


    def test_strips_ends():
        assert slugify("  padded  ") == "padded"
    ''')

_STACK_TESTS = _code('''
    from stack import Stack


    def test_push_pop():
        stack = Stack()
        stack.push(1)
        stack.push(2)
        assert stack.pop() == 2
        assert len(stack) == 1
    ''')

_LEAP_TESTS = _code('''
    from calendar_util import is_leap_year


    def test_ordinary_years():
        assert is_leap_year(2024)
        assert not is_leap_year(2023)
    ''')

_INVENTORY_TESTS = _code('''
    from inventory import Item, total_value


    def test_empty():
        assert total_value([]) == 0


    def test_single_items():
        assert total_value([Item("pen", 2.0, 1), Item("cup", 3.0, 1)]) == 5.0
    ''')

SPECS = (
    _Spec(
        name="clamp",
        problem_statement=("clamp() returns the wrong value for numbers above the range\n\n"
                           "`numbers_util.clamp(15, 0, 10)` returns 15, but a value above `high` should be clamped to "
                           "`high` (10 here). Values inside and below the range are handled correctly."),
        base_files={"numbers_util.py": _code('''
            def clamp(value, low, high):
                """value limited to the range [low, high]."""
                if value < low:
                    return low
                return value
            '''), "tests/test_clamp.py": _CLAMP_TESTS},
        fix_files={"numbers_util.py": _code('''
            def clamp(value, low, high):
                """value limited to the range [low, high]."""
                if value < low:
                    return low
                if value > high:
                    return high
                return value
            ''')},
        test_files={"tests/test_clamp.py": _CLAMP_TESTS + _code('''


            def test_above():
                assert clamp(15, 0, 10) == 10
            ''')},
        fail_to_pass=("tests/test_clamp.py::test_above",),
        pass_to_pass=("tests/test_clamp.py::test_inside", "tests/test_clamp.py::test_below"),
    ),
    _Spec(
        name="textkit",
        problem_statement=("slugify keeps capital letters\n\n"
                           "`textkit.slugify(\"Hello World\")` gives \"Hello-World\"; a slug should be lower case: "
                           "\"hello-world\"."),
        base_files={"textkit/__init__.py": _code('''
            from textkit.slug import slugify

            __all__ = ["slugify"]
            '''), "textkit/slug.py": _code('''
            def slugify(text):
                """A URL slug: words joined by dashes."""
                return "-".join(text.split())
            '''), "tests/test_slug.py": _SLUG_TESTS},
        fix_files={"textkit/slug.py": _code('''
            def slugify(text):
                """A URL slug: lower-case words joined by dashes."""
                return "-".join(text.lower().split())
            ''')},
        test_files={"tests/test_slug.py": _SLUG_TESTS + _code('''


            def test_lower_case():
                assert slugify("Hello World") == "hello-world"
            ''')},
        fail_to_pass=("tests/test_slug.py::test_lower_case",),
        pass_to_pass=("tests/test_slug.py::test_spaces", "tests/test_slug.py::test_strips_ends"),
    ),
    _Spec(
        name="stack",
        problem_statement=("Stack.pop on an empty stack returns None\n\n"
                           "Popping an empty `Stack` silently returns None. It should raise IndexError with the "
                           "message \"pop from an empty stack\", like list.pop does."),
        base_files={"stack.py": _code('''
            class Stack:
                """A last-in, first-out stack."""

                def __init__(self):
                    self._items = []

                def push(self, item):
                    self._items.append(item)

                def pop(self):
                    if not self._items:
                        return None
                    return self._items.pop()

                def __len__(self):
                    return len(self._items)
            '''), "tests/test_stack.py": _STACK_TESTS},
        fix_files={"stack.py": _code('''
            class Stack:
                """A last-in, first-out stack."""

                def __init__(self):
                    self._items = []

                def push(self, item):
                    self._items.append(item)

                def pop(self):
                    if not self._items:
                        raise IndexError("pop from an empty stack")
                    return self._items.pop()

                def __len__(self):
                    return len(self._items)
            ''')},
        test_files={"tests/test_stack.py": _STACK_TESTS + _code('''


            def test_pop_empty_raises():
                import pytest

                with pytest.raises(IndexError, match="pop from an empty stack"):
                    Stack().pop()
            ''')},
        fail_to_pass=("tests/test_stack.py::test_pop_empty_raises",),
        pass_to_pass=("tests/test_stack.py::test_push_pop",),
    ),
    _Spec(
        name="leap",
        problem_statement=("is_leap_year is wrong for century years\n\n"
                           "`calendar_util.is_leap_year(1900)` returns True, but 1900 was not a leap year: years "
                           "divisible by 100 are leap years only when divisible by 400 (2000 was one)."),
        base_files={"calendar_util.py": _code('''
            def is_leap_year(year):
                """Whether `year` of the Gregorian calendar has 366 days."""
                return year % 4 == 0
            '''), "tests/test_leap.py": _LEAP_TESTS},
        fix_files={"calendar_util.py": _code('''
            def is_leap_year(year):
                """Whether `year` of the Gregorian calendar has 366 days."""
                return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
            ''')},
        test_files={"tests/test_leap.py": _LEAP_TESTS + _code('''


            def test_centuries():
                assert not is_leap_year(1900)
                assert is_leap_year(2000)
            ''')},
        fail_to_pass=("tests/test_leap.py::test_centuries",),
        pass_to_pass=("tests/test_leap.py::test_ordinary_years",),
    ),
    _Spec(
        name="inventory",
        problem_statement=("total_value ignores quantities\n\n"
                           "`inventory.total_value([Item(\"pen\", 2.0, 3)])` returns 2.0; it should be the sum of "
                           "price times quantity over the items, 6.0 here."),
        base_files={"inventory.py": _code('''
            from dataclasses import dataclass


            @dataclass
            class Item:
                name: str
                price: float
                quantity: int


            def total_value(items):
                """The value of all items in stock."""
                return sum(item.price for item in items)
            '''), "tests/test_inventory.py": _INVENTORY_TESTS},
        fix_files={"inventory.py": _code('''
            from dataclasses import dataclass


            @dataclass
            class Item:
                name: str
                price: float
                quantity: int


            def total_value(items):
                """The value of all items in stock."""
                return sum(item.price * item.quantity for item in items)
            ''')},
        test_files={"tests/test_inventory.py": _INVENTORY_TESTS + _code('''


            def test_quantities():
                assert total_value([Item("pen", 2.0, 3), Item("cup", 3.0, 2)]) == 12.0
            ''')},
        fail_to_pass=("tests/test_inventory.py::test_quantities",),
        pass_to_pass=("tests/test_inventory.py::test_empty", "tests/test_inventory.py::test_single_items"),
    ),
)
"""The bundled tasks, in order."""


def bundled_dir() -> Path:
    """Where the bundled tasks are (built or not): CACHE/swe/bundled-vN."""
    cache = Path(os.environ.get("POSTTRAIN_CACHE_DIR") or platformdirs.user_cache_dir("posttrain"))
    return cache / "swe" / f"bundled-v{BUNDLED_VERSION}"


def ensure_bundled_tasks() -> Path:
    """The bundled tasks file (tasks.jsonl, its repositories in repos/ beside it), built on first use."""
    target = bundled_dir()
    if (target / "tasks.jsonl").is_file():
        return target / "tasks.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        rows = [_build_repository(spec, staging / "repos" / f"posttrain__{spec.name}") for spec in SPECS]
        (staging / "tasks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "tasks.jsonl").is_file():  # another process finished the same build first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target / "tasks.jsonl"


def _git(arguments: list[str], cwd: Path, date: str = "2000-01-01T00:00:00Z") -> str:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": os.devnull, "HOME": str(cwd), "LC_ALL": "C",
           "GIT_AUTHOR_NAME": "posttrain", "GIT_AUTHOR_EMAIL": "swe@posttrain.invalid", "GIT_AUTHOR_DATE": date,
           "GIT_COMMITTER_NAME": "posttrain", "GIT_COMMITTER_EMAIL": "swe@posttrain.invalid",
           "GIT_COMMITTER_DATE": date}
    result = subprocess.run(["git", *arguments], cwd=cwd, capture_output=True, text=True, env=env, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"building the bundled SWE tasks: git {' '.join(arguments)} failed: {result.stderr}")
    return result.stdout


def _write(root: Path, files: dict[str, str]) -> None:
    for path, content in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(content, encoding="utf-8")


def _build_repository(spec: _Spec, root: Path) -> dict:
    """Build one task's repository (base commit, then the fix) and return its row."""
    root.mkdir(parents=True)
    _git(["init", "-q", "-b", "main"], root)
    _write(root, spec.base_files)
    _git(["add", "-A"], root)
    _git(["commit", "-q", "-m", "initial version"], root)
    base_commit = _git(["rev-parse", "HEAD"], root).strip()
    _write(root, spec.fix_files)
    patch = _git(["diff"], root)
    _write(root, spec.test_files)
    test_patch = _git(["diff", "--", *spec.test_files], root)
    _git(["add", "-A"], root)
    _git(["commit", "-q", "-m", f"fix: {spec.problem_statement.splitlines()[0]}"], root, "2000-01-02T00:00:00Z")
    return {"instance_id": f"posttrain__{spec.name}-1", "repo": f"posttrain/{spec.name}", "base_commit": base_commit,
            "problem_statement": spec.problem_statement, "patch": patch, "test_patch": test_patch,
            "FAIL_TO_PASS": json.dumps(list(spec.fail_to_pass)), "PASS_TO_PASS": json.dumps(list(spec.pass_to_pass)),
            "test_command": "pytest"}
