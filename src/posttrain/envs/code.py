"""The code environment: the model writes a Python program, which is run against test cases.

Single turn. Each data row's metadata carries the tests:

- ``tests``: a list of ``{"input": stdin, "output": expected stdout}``; a test passes when the
  program exits with status 0 inside its limits and its stdout equals the expected output after
  stripping both and ignoring trailing whitespace on each line;
- ``assert_code``: Python statements (typically asserts) appended after the program; counts as
  one more test, passed when the combined program exits with status 0.

The program is the last fenced ```python block of the reply (``py`` and ``python3`` tags count
too), or the whole reply when it has none. Every test runs in its own sandboxed subprocess
(`posttrain.envs.sandbox`), up to `num_workers` at a time. The reward is the fraction of tests
passed, or 1/0 with `all_or_nothing`.

A program that crashes, times out, floods its output or exhausts its memory fails that test: it
is the model's doing and earns no reward for it. Only a sandbox that could not start the
program at all (an infrastructure failure) gives a None reward with an error, which masks the
sample instead of punishing the model for the machine.

Metadata out: the row's metadata plus `passed` and `total` (test counts), `correct` (all passed)
and `first_failure` (why the lowest-numbered failing test failed, or None).

The environment refuses to start on a machine where the sandbox's namespace layer does not work
(`sandbox.sandbox_info()`), unless `allow_unisolated_fallback=True`: the fallback (resource limits
and a Python audit hook only) is not a security boundary. There the program runs as the training
process's user — uid 0 with its capabilities dropped when that is root — and sees the host's whole
file system: it could read /etc/shadow, and create FIFOs and device nodes in the host's
temporary directory, which the audit hook does not see.
"""

from __future__ import annotations

import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from posttrain.errors import RunError
from posttrain.envs import sandbox
from posttrain.envs.base import (
    EnvStep,
    Message,
    check_batch,
    reply_of,
    single_turn_step,
)
from posttrain.envs.sandbox import SandboxResult, run_sandboxed

FENCED_PYTHON = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)
REASON_EXCERPT_CHARS = 200
"""How much of an expected/actual output or stderr line a failure reason quotes."""


def extract_program(reply: str) -> str:
    """The last fenced ```python block of `reply`, or all of `reply` when it has none."""
    blocks = FENCED_PYTHON.findall(reply)
    return blocks[-1] if blocks else reply


def normalize_output(text: str) -> str:
    """Compare outputs modulo surrounding blank space and trailing whitespace on each line."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


class UnisolatedSandboxError(RunError):
    """The sandbox would run without namespace isolation, and the user did not allow that."""


@dataclass(frozen=True)
class TestOutcome:
    """The verdict on one test of one rollout."""

    passed: bool
    failure: str | None
    """Why it failed (wrong answer, timeout, crash ...); None when it passed."""
    sandbox_error: str | None
    """Set when the sandbox could not run the program at all: the rollout is masked, not failed."""


@dataclass(frozen=True)
class CodeEnvironment:
    """Reward a Python program by the test cases it passes (see the module docstring)."""

    time_limit_s: float = 5.0
    """Wall-clock limit of each test run."""
    memory_limit_mb: int = 512
    """Address-space limit of each test run."""
    output_limit_bytes: int = 1_000_000
    """stdout and stderr are each cut here, and a program writing more is stopped and fails."""
    num_workers: int = 2
    """Test runs executed at once (threads, each waiting on one sandboxed subprocess)."""
    all_or_nothing: bool = False
    """Reward 1.0 only when every test passes, else 0.0; otherwise the fraction passed."""
    allow_unisolated_fallback: bool = False
    """Run programs even where the sandbox has no namespace isolation (see the module docstring): only for
    trusted programs, or on a throw-away machine."""

    def __post_init__(self) -> None:
        if self.time_limit_s <= 0 or self.memory_limit_mb <= 0 or self.output_limit_bytes <= 0:
            raise ValueError("time_limit_s, memory_limit_mb and output_limit_bytes must be positive")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {self.num_workers}")
        info = sandbox.sandbox_info()
        if info.namespaces:
            return
        why = (info.namespace_error or "the probe failed").strip().splitlines()[-1]
        if not self.allow_unisolated_fallback:
            raise UnisolatedSandboxError(
                "the code environment will not run model-written programs on this machine: the sandbox's namespace "
                f"isolation does not work here ({why}). Its fallback, resource limits and a Python audit hook, is "
                "not a security boundary: the program would run as this process's user (uid 0 with capabilities "
                "dropped, when that is root) with the host's whole file system in view — it could read files such "
                "as /etc/shadow and create FIFOs and device nodes in the host's temporary directory. Enable "
                "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 and "
                "user.max_user_namespaces > 0; in a container, a seccomp/AppArmor profile that allows unshare), "
                "or, for trusted programs only, set environment.options.allow_unisolated_fallback=true."
            )
        warnings.warn(
            f"the code environment runs programs without namespace isolation ({why}), because "
            "allow_unisolated_fallback is set: only resource limits and an audit hook, not a security boundary",
            RuntimeWarning,
            stacklevel=3,
        )

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        check_batch(message_logs, metadata)
        programs = [extract_program(reply_of(log)) for log in message_logs]
        jobs = [
            (rollout, test_index, *run)
            for rollout, (program, row) in enumerate(zip(programs, metadata))
            for test_index, run in enumerate(_test_runs(program, row))
        ]
        outcomes: list[dict[int, TestOutcome]] = [{} for _ in message_logs]
        with ThreadPoolExecutor(max_workers=self.num_workers) as pool:
            verdicts = pool.map(lambda job: self._run_test(*job[2:]), jobs)
            for (rollout, test_index, *_), outcome in zip(jobs, verdicts, strict=True):
                outcomes[rollout][test_index] = outcome
        rewards, errors, details = [], [], []
        for row, by_index in zip(metadata, outcomes):
            ordered = [by_index[index] for index in sorted(by_index)]
            passed = sum(outcome.passed for outcome in ordered)
            failures = [f"test {index}: {o.failure}" for index, o in enumerate(ordered) if o.failure is not None]
            sandbox_errors = [f"test {index}: {o.sandbox_error}" for index, o in enumerate(ordered) if o.sandbox_error]
            details.append(
                {
                    **row,
                    "passed": passed,
                    "total": len(ordered),
                    "correct": passed == len(ordered),
                    "first_failure": failures[0] if failures else None,
                }
            )
            if sandbox_errors:
                rewards.append(None)
                errors.append(f"sandbox failure: {sandbox_errors[0]}")
                continue
            fraction = passed / len(ordered)
            rewards.append(float(fraction == 1.0) if self.all_or_nothing else fraction)
            errors.append(None)
        return single_turn_step(rewards, errors, details)

    def close(self) -> None:
        """Nothing to release: each test's subprocess and directory are gone when it returns."""

    def _run_test(self, program: str, stdin: str, expected: str | None) -> TestOutcome:
        """Run one test; `expected` None means "exit status 0 is a pass" (the assert_code test)."""
        result = run_sandboxed(
            program,
            stdin,
            time_limit_s=self.time_limit_s,
            memory_limit_mb=self.memory_limit_mb,
            output_limit_bytes=self.output_limit_bytes,
        )
        if not result.started:
            return TestOutcome(False, None, f"the program did not start: {_excerpt(result.stderr.strip())}")
        failure = _run_failure(result, self.time_limit_s)
        if failure is None and expected is not None and normalize_output(result.stdout) != normalize_output(expected):
            failure = f"wrong answer: expected {_excerpt(expected)!r}, got {_excerpt(result.stdout)!r}"
        return TestOutcome(failure is None, failure, None)


def _test_runs(program: str, row: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    """(program, stdin, expected stdout or None) for each test of the row."""
    runs: list[tuple[str, str, str | None]] = [
        (program, test["input"], test["output"]) for test in row.get("tests", [])
    ]
    if row.get("assert_code"):
        runs.append((program + "\n\n" + row["assert_code"], "", None))
    if not runs:
        raise ValueError(f"a code row needs `tests` or `assert_code` in its metadata, got keys {sorted(row)}")
    return runs


def _run_failure(result: SandboxResult, time_limit_s: float) -> str | None:
    """Why the run itself failed (before comparing outputs), or None when it ran cleanly."""
    if result.timed_out:
        return f"timed out after {time_limit_s:g} s"
    if result.output_truncated:
        return "output limit exceeded"
    if result.memory_exceeded:
        return "memory limit exceeded"
    if result.killed_by_signal is not None:
        return f"killed by signal {result.killed_by_signal}"
    if result.exit_code != 0:
        last_line = result.stderr.strip().splitlines()[-1:] or [""]
        return f"exit status {result.exit_code}: {_excerpt(last_line[0])}"
    return None


def _excerpt(text: str) -> str:
    return text if len(text) <= REASON_EXCERPT_CHARS else text[:REASON_EXCERPT_CHARS] + "..."
