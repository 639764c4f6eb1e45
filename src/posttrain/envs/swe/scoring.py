"""Score a patch on a repository task as SWE-bench's harness does, without Docker.

1. A fresh checkout: the tree of base_commit (`git archive` of the task's local repository) in a new temporary
   directory, committed as the only commit of a new repository. No other ref, object or commit of the source
   repository is there, so history past base_commit (the fix itself) cannot be read from it.
2. The model patch is applied (`git apply`); a patch that does not apply is an error (reward 0). Its changes to
   test files and to pytest's configuration (test_*.py, *_test.py, conftest.py, anything under a tests/ or test/
   folder, pytest.ini, tox.ini, setup.cfg, pyproject.toml) are dropped, listed in the result's reset_paths: a patch
   that edits the tests, or adds a conftest.py that rewrites reports, must not pass.
3. The test patch is applied, then pytest runs the files of the FAIL_TO_PASS and PASS_TO_PASS tests inside
   `posttrain.envs.sandbox` (its namespaces: no network, a read-only root that holds only the system, the
   interpreter and pytest's site-packages, the checkout the only writable place besides a scratch tmpfs).
4. Each test's outcome is read from pytest's own per-test reports, which a small plugin records and writes as JSON
   to a folder outside the checkout; posttrain parses it. What the tests print is never read: a program that
   prints "PASSED" does not pass. A test that does not appear in the report (not collected, a collection error,
   the run timed out) counts as failed.

The task is resolved, reward 1, only when every FAIL_TO_PASS test and every PASS_TO_PASS test passed (skipped is
not passed). An empty patch is not run (status empty_patch, reward 0).

Limits, compared with SWE-bench's containers: the tests run with the interpreter and the site-packages of the
process that scores (a repository needing other packages needs them installed there), and the plugin runs in the
same process as the code under test, so code written to attack pytest itself (patching its report objects from a
module the tests import) could still forge outcomes; the guarantees are against output, edited tests and plugins
added through conftest.py or configuration.
"""

from __future__ import annotations

import functools
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from pathlib import Path, PurePosixPath

from posttrain.envs import sandbox
from posttrain.envs.swe.tasks import SweTask

STATUSES = ("resolved", "unresolved", "empty_patch", "error")
"""A scored instance's status, as the swebench harness counts them."""

DEFAULT_TEST_TIMEOUT_S = 120.0
"""Wall-clock limit of one task's test run."""
TEST_MEMORY_LIMIT_MB = 2048
"""Address-space limit of the test run."""
GIT_TIMEOUT_S = 60.0
"""Deadline of one git command on the host (archive, apply, commit)."""
_TEST_FOLDERS = frozenset({"tests", "test", "testing"})
_CONFIG_FILES = frozenset({"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"})


class SweInfrastructureError(RuntimeError):
    """The task could not be scored for reasons that are not the patch's (a missing repository or commit, no
    sandbox, no pytest): the instance is an error, and an episode's reward is masked, not 0."""


@dataclass(frozen=True)
class SweResult:
    """How one patch scored on one task."""

    instance_id: str
    status: str
    """resolved, unresolved, empty_patch or error (see STATUSES)."""
    fail_to_pass: dict[str, str] = field(default_factory=dict)
    """FAIL_TO_PASS test -> passed, failed, skipped or missing (not in pytest's report)."""
    pass_to_pass: dict[str, str] = field(default_factory=dict)
    """PASS_TO_PASS test -> the same."""
    error: str | None = None
    """Why the instance is an error (the patch did not apply, the test run could not start, ...)."""
    infrastructure_failure: bool = False
    """The error is not the patch's (a missing repository, no sandbox): an episode's reward is masked."""
    reset_paths: tuple[str, ...] = ()
    """Files whose changes in the model patch were dropped (tests and pytest configuration)."""
    seconds: float = 0.0
    """Wall-clock time of the whole scoring: checkout, patches and test run."""
    test_log: str = ""
    """The end of pytest's output (for reading only, never for judging)."""

    @property
    def resolved(self) -> bool:
        return self.status == "resolved"

    @property
    def reward(self) -> float:
        """1.0 when resolved, else 0.0."""
        return 1.0 if self.resolved else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "reset_paths": list(self.reset_paths), "resolved": self.resolved}


# ---- git on the host (only ever in a checkout this module made and no sandboxed program has written) ----------

def git(arguments: list[str], cwd: Path, *, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """Run git with no user or system configuration, under a deadline."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
           "HOME": str(cwd), "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
    command = ["git", "-c", "safe.directory=*", "-c", "core.hooksPath=/dev/null", *arguments]
    try:
        return subprocess.run(command, cwd=cwd, input=stdin, capture_output=True, env=env, timeout=GIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SweInfrastructureError(f"git {arguments[0]} in {cwd} did not finish within {GIT_TIMEOUT_S:g} s") \
            from None


def make_checkout(repository: Path, base_commit: str, destination: Path) -> None:
    """A new repository at `destination` whose only commit holds the tree of `base_commit` of `repository`."""
    archive = git(["archive", "--format=tar", base_commit], repository)
    if archive.returncode != 0:
        raise SweInfrastructureError(f"cannot read base_commit {base_commit!r} of {repository}: "
                                     f"{archive.stderr.decode(errors='replace').strip()}")
    destination.mkdir(parents=True)
    # The "tar" filter keeps a repository's own symbolic links (absolute ones too) but no member lands outside the
    # destination; Python releases before the filters existed extract as git wrote the archive.
    safety = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}
    try:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(destination, **safety)
    except tarfile.TarError as error:
        raise SweInfrastructureError(f"cannot unpack base_commit {base_commit!r} of {repository}: {error}") from None
    env_date = ["-c", "user.name=posttrain", "-c", "user.email=swe@posttrain.invalid"]
    for arguments in (["init", "-q", "-b", "main"], ["add", "-A"],
                      [*env_date, "commit", "-q", "--allow-empty", "--no-verify", "-m", "base",
                       "--date=2000-01-01T00:00:00Z"]):
        result = git(arguments, destination)
        if result.returncode != 0:
            raise SweInfrastructureError(f"git {arguments[0]} of the checkout failed: "
                                         f"{result.stderr.decode(errors='replace').strip()}")


def apply_patch(checkout: Path, patch: str) -> str | None:
    """Apply a unified diff with `git apply`; None when it applied, else git's reason."""
    result = git(["apply", "--whitespace=nowarn", "-"], checkout, stdin=patch.encode())
    return None if result.returncode == 0 else result.stderr.decode(errors="replace").strip()


def changed_paths(checkout: Path) -> list[str]:
    """Paths that differ from the checkout's commit (added, changed or deleted)."""
    git(["add", "-A"], checkout)
    result = git(["diff", "--cached", "--name-only", "-z", "HEAD"], checkout)
    return [name for name in result.stdout.decode(errors="surrogateescape").split("\0") if name]


def is_test_or_config(path: str) -> bool:
    """Whether the scorer keeps a model patch's hands off `path` (tests and pytest configuration)."""
    parts = PurePosixPath(path).parts
    name = parts[-1]
    return (name.startswith("test_") or name.endswith("_test.py") or name in _CONFIG_FILES
            or any(part in _TEST_FOLDERS for part in parts[:-1]))


def _reset(checkout: Path, paths: list[str]) -> None:
    """Put `paths` back as the checkout's commit has them (removing the ones it does not have)."""
    for path in paths:
        in_commit = git(["cat-file", "-e", f"HEAD:{path}"], checkout).returncode == 0
        if in_commit:
            git(["checkout", "HEAD", "--", path], checkout)
        else:
            git(["rm", "-q", "--cached", "--ignore-unmatch", "--", path], checkout)
            target = checkout / path
            if target.is_symlink() or target.is_file():
                target.unlink()


# ---- the test run in the sandbox ----------------------------------------------------------------------------

@functools.cache
def runner_site_dirs() -> tuple[str, ...]:
    """The site-packages folders that pytest and its dependencies are imported from."""
    folders = []
    for module in ("pytest", "_pytest", "pluggy", "iniconfig", "packaging"):
        spec = find_spec(module)
        if spec is None:
            if module == "pytest":
                raise SweInfrastructureError("SWE tasks are scored with pytest, which is not installed here "
                                             "(pip install 'posttrain[agents]')")
            continue
        location = spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin
        folder = str(Path(location).resolve().parent)
        if folder not in folders:
            folders.append(folder)
    return tuple(folders)


# Runs inside the sandbox as the program. SETTINGS is replaced by a JSON literal. The outcome of a test is that of
# its worst phase: failed if setup, call or teardown failed, passed if the call passed, else skipped.
_RUNNER = r'''
import json, os, sys
settings = json.loads(SETTINGS)
sys.path[:0] = [settings["checkout"]]
sys.path.extend(settings["site_dirs"])
os.chdir(settings["checkout"])
import pytest


class _Recorder:
    def __init__(self):
        self.phases = {}
        self.collection_errors = []

    def pytest_runtest_logreport(self, report):
        self.phases.setdefault(report.nodeid, {})[report.when] = report.outcome

    def pytest_collectreport(self, report):
        if report.failed:
            self.collection_errors.append(report.nodeid)


_recorder = _Recorder()
_exit_code = pytest.main(settings["arguments"], plugins=[_recorder])
_outcomes = {}
for _nodeid, _phases in _recorder.phases.items():
    if "failed" in _phases.values():
        _outcomes[_nodeid] = "failed"
    elif _phases.get("call") == "passed":
        _outcomes[_nodeid] = "passed"
    else:
        _outcomes[_nodeid] = "skipped"
with open(settings["report"], "w") as _file:
    json.dump({"exit_code": int(_exit_code), "outcomes": _outcomes,
               "collection_errors": _recorder.collection_errors}, _file)
'''


@dataclass(frozen=True)
class TestRun:
    """What one sandboxed pytest run reported."""

    outcomes: dict[str, str]
    """node id -> passed, failed or skipped (from pytest's reports)."""
    log: str
    """The end of pytest's output."""
    problem: str | None
    """Why there is no report (timed out, crashed, the sandbox did not start), or None."""
    sandbox_started: bool


def run_tests(checkout: Path, report_dir: Path, tests: list[str], pytest_arguments: tuple[str, ...], *,
              time_limit_s: float = DEFAULT_TEST_TIMEOUT_S) -> TestRun:
    """Run pytest on the files of `tests` in the sandbox, the checkout writable; read the plugin's report."""
    if not sandbox.sandbox_info().namespaces:
        raise SweInfrastructureError("SWE tests run only inside the sandbox's namespaces, which do not work here: "
                                     f"{sandbox.sandbox_info().namespace_error}")
    files = sorted({test.split("::")[0] for test in tests})
    report = report_dir / "pytest-report.json"
    settings = {"checkout": str(checkout), "site_dirs": list(runner_site_dirs()), "report": str(report),
                "arguments": ["-q", "-p", "no:cacheprovider", "--rootdir", str(checkout), *pytest_arguments,
                              *files]}
    sandbox.give_to_sandbox(str(checkout))
    sandbox.give_to_sandbox(str(report_dir))
    result = sandbox.run_sandboxed(
        _RUNNER.replace("SETTINGS", repr(json.dumps(settings))), time_limit_s=time_limit_s,
        memory_limit_mb=TEST_MEMORY_LIMIT_MB, output_limit_bytes=200_000, namespaces=True, audit_hook=False,
        writable_dirs=(str(checkout), str(report_dir)), readable_dirs=tuple(settings["site_dirs"]))
    log = (result.stdout + result.stderr)[-4000:]
    if not result.started:
        return TestRun({}, log, f"the sandbox did not start: {result.stderr.strip()[-500:]}", False)
    if not report.is_file():
        why = ("timed out" if result.timed_out else "its output passed the limit" if result.output_truncated
               else f"ended with exit code {result.exit_code}, signal {result.killed_by_signal}")
        return TestRun({}, log, f"pytest wrote no report: the test run {why}", True)
    try:
        outcomes = json.loads(report.read_text(encoding="utf-8"))["outcomes"]
    except (ValueError, KeyError, TypeError) as error:
        return TestRun({}, log, f"pytest's report could not be read: {error}", True)
    return TestRun({str(k): str(v) for k, v in outcomes.items()}, log, None, True)


# ---- scoring --------------------------------------------------------------------------------------------------

def score_patch(task: SweTask, model_patch: str, *, test_timeout_s: float = DEFAULT_TEST_TIMEOUT_S) -> SweResult:
    """Score `model_patch` on `task` (see the module docstring); never raises for a bad patch."""
    started = time.monotonic()
    if not model_patch.strip():
        return SweResult(task.instance_id, "empty_patch", seconds=time.monotonic() - started)
    root = Path(tempfile.mkdtemp(prefix="posttrain-swe-"))
    try:
        return _score_in(root, task, model_patch, test_timeout_s, started)
    except SweInfrastructureError as error:
        return SweResult(task.instance_id, "error", error=str(error), infrastructure_failure=True,
                         seconds=time.monotonic() - started)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _score_in(root: Path, task: SweTask, model_patch: str, test_timeout_s: float, started: float) -> SweResult:
    checkout, report_dir = root / "repo", root / "report"
    report_dir.mkdir()
    make_checkout(task.repo_path, task.base_commit, checkout)
    problem = apply_patch(checkout, model_patch)
    if problem is not None:
        return SweResult(task.instance_id, "error", error=f"the model patch does not apply: {problem[-1000:]}",
                         seconds=time.monotonic() - started)
    reset = [path for path in changed_paths(checkout) if is_test_or_config(path)]
    _reset(checkout, reset)
    problem = apply_patch(checkout, task.test_patch)
    if problem is not None:
        return SweResult(task.instance_id, "error", error=f"the test patch does not apply after the model patch: "
                         f"{problem[-1000:]}", reset_paths=tuple(reset), seconds=time.monotonic() - started)
    run = run_tests(checkout, report_dir, [*task.fail_to_pass, *task.pass_to_pass], task.pytest_arguments,
                    time_limit_s=test_timeout_s)
    if not run.sandbox_started:
        raise SweInfrastructureError(run.problem)
    fail_to_pass = {test: run.outcomes.get(test, "missing") for test in task.fail_to_pass}
    pass_to_pass = {test: run.outcomes.get(test, "missing") for test in task.pass_to_pass}
    resolved = all(outcome == "passed" for outcome in (*fail_to_pass.values(), *pass_to_pass.values()))
    return SweResult(task.instance_id, "resolved" if resolved else "unresolved", fail_to_pass=fail_to_pass,
                     pass_to_pass=pass_to_pass, error=run.problem, reset_paths=tuple(reset),
                     seconds=time.monotonic() - started, test_log=run.log)
