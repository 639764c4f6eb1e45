"""The code environment and its sandbox: rewards from test cases, and every escape attempt fails.

Isolation tests run under each layer alone where this machine has it: the namespaces without
the audit hook (as set up for root, and through an unprivileged user namespace), the audit
hook without namespaces, and the default combination.
"""

import os
import signal
import socket
import textwrap
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

from posttrain.envs import sandbox
from posttrain.envs.base import Environment
from posttrain.envs.code import CodeEnvironment, extract_program, normalize_output
from posttrain.envs.sandbox import run_sandboxed, sandbox_info

LIMITS = {"time_limit_s": 5.0, "memory_limit_mb": 256, "output_limit_bytes": 100_000}
SLACK_S = 1.5
"""How long past its time limit a killed program may take to come back (process start, kill, wait)."""

ISOLATIONS = ["default", "namespaces", "user-namespace", "audit-hook"]


@pytest.fixture(autouse=True)
def _fallback_allowed_where_namespaces_are_missing(monkeypatch):
    """These tests check scoring, not isolation: where the machine has no user namespaces they run in the
    sandbox's fallback, which the code environment refuses unless allowed (that refusal has its own test)."""
    if sandbox.sandbox_info().namespaces:
        return
    original = CodeEnvironment.__init__

    def allowing(self, *args, allow_unisolated_fallback: bool = True, **kwargs):
        original(self, *args, allow_unisolated_fallback=allow_unisolated_fallback, **kwargs)

    monkeypatch.setattr(CodeEnvironment, "__init__", allowing)


class Isolation(NamedTuple):
    name: str
    kwargs: dict
    """Keyword arguments of run_sandboxed that select this setup."""

    @property
    def audit_hook(self) -> bool:
        return self.kwargs.get("audit_hook", True)


@pytest.fixture(params=ISOLATIONS)
def isolation(request, monkeypatch) -> Isolation:
    if request.param in ("namespaces", "user-namespace") and not sandbox_info().namespaces:
        pytest.skip(f"namespaces unavailable here: {sandbox_info().namespace_error}")
    if request.param == "user-namespace":  # the unprivileged path, taken even when the tests run as root
        monkeypatch.setattr(sandbox, "_uses_user_namespace", lambda: True)
    kwargs = {
        "default": {},
        "namespaces": {"namespaces": True, "audit_hook": False},
        "user-namespace": {"namespaces": True, "audit_hook": False},
        "audit-hook": {"namespaces": False, "audit_hook": True},
    }[request.param]
    return Isolation(request.param, kwargs)


def run(code: str, stdin: str = "", **overrides):
    return run_sandboxed(textwrap.dedent(code), stdin, **{**LIMITS, **overrides})


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose command line contains `marker` (this one excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:  # the process ended while we looked
                pass
    return found


def reply(program: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "solve"}, {"role": "assistant", "content": program}]


SUM_TESTS = {"tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"}]}
CORRECT = "Here it is:\n```python\na, b = map(int, input().split())\nprint(a + b)   \n```\n"
WRONG = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"


# --------------------------------------------------------------------------- rewards


def test_correct_program_gets_full_reward_and_wrong_one_gets_partial_credit():
    env = CodeEnvironment(num_workers=2)
    assert isinstance(env, Environment)
    # WRONG multiplies: it fails both sum tests, and passes "2 2" but not "1 2" of half_tests.
    half_tests = {"tests": [{"input": "2 2", "output": "4"}, {"input": "1 2", "output": "3"}]}
    step = env.step([reply(CORRECT), reply(WRONG), reply(WRONG)], [SUM_TESTS, SUM_TESTS, half_tests])
    assert step.rewards == [1.0, 0.0, 0.5]
    assert step.done == [True, True, True] and step.observations == [None, None, None]
    assert step.errors == [None, None, None]
    assert step.metadata[0] == {**SUM_TESTS, "passed": 2, "total": 2, "correct": True, "first_failure": None}
    assert step.metadata[1]["passed"] == 0 and step.metadata[1]["total"] == 2
    assert step.metadata[1]["first_failure"] == "test 0: wrong answer: expected '3\\n', got '2\\n'"
    assert step.metadata[2]["first_failure"].startswith("test 1: wrong answer")

    strict = CodeEnvironment(all_or_nothing=True).step([reply(WRONG)], [half_tests])
    assert strict.rewards == [0.0] and strict.metadata[0]["passed"] == 1


def test_assert_code_counts_as_one_more_test():
    program = "```python\ndef add(a, b):\n    return a + b\n```"
    rows = [
        {"assert_code": "assert add(2, 3) == 5\nassert add(-1, 1) == 0"},
        {"assert_code": "assert add(2, 3) == 6, 'add is wrong'"},
        {"tests": [{"input": "", "output": ""}], "assert_code": "assert add(1, 1) == 3"},
    ]
    step = CodeEnvironment().step([reply(program)] * 3, rows)
    assert step.rewards == [1.0, 0.0, 0.5]
    assert step.metadata[1]["first_failure"] == "test 0: exit status 1: AssertionError: add is wrong"
    assert step.metadata[2]["first_failure"].startswith("test 1: exit status 1: AssertionError")


def test_crash_and_timeout_fail_the_test_but_are_not_errors():
    rows = [{"tests": [{"input": "", "output": "x"}]}] * 2
    programs = ["```python\nraise ValueError('boom')\n```", "```python\nwhile True: pass\n```"]
    step = CodeEnvironment(time_limit_s=1.0).step([reply(p) for p in programs], rows)
    assert step.rewards == [0.0, 0.0] and step.errors == [None, None]
    assert step.metadata[0]["first_failure"] == "test 0: exit status 1: ValueError: boom"
    assert step.metadata[1]["first_failure"] == "test 0: timed out after 1 s"


def test_sandbox_that_cannot_start_python_masks_the_reward(monkeypatch):
    env = CodeEnvironment()  # probes the sandbox with the real interpreter first
    monkeypatch.setattr(sandbox, "_program_python", lambda: "/nonexistent/python3")
    step = env.step([reply(CORRECT)], [SUM_TESTS])
    assert step.rewards == [None]
    assert step.errors[0].startswith("sandbox failure: test 0: the program did not start")


def test_row_without_tests_is_an_error():
    with pytest.raises(ValueError, match="needs `tests` or `assert_code`"):
        CodeEnvironment().step([reply(CORRECT)], [{"answer": "3"}])


def test_extract_program_takes_the_last_python_block_else_the_whole_reply():
    text = "```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```\n```\nnot code\n```"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("print(3)") == "print(3)"
    assert extract_program("```python\nprint(4)  # never closed") == "```python\nprint(4)  # never closed"


def test_normalize_output_ignores_trailing_whitespace_only():
    assert normalize_output("\n 1 2  \r\n3\t\n\n") == "1 2\n3"
    assert normalize_output("1  2") != normalize_output("1 2")


# --------------------------------------------------------------------------- the sandbox


def test_sandbox_info_reports_the_layers():
    info = sandbox_info()
    assert info.layers[-2:] == ("rlimits", "audit_hook")
    assert info.namespaces == (info.namespace_error is None)
    assert os.path.isfile(info.python)


def test_stdin_stdout_and_exit(isolation):
    program = "import sys\nprint(input()[::-1])\nprint('err', file=sys.stderr)\nexit(3)"
    result = run(program, "olleh\n", **isolation.kwargs)
    assert result.started and result.stdout == "hello\n" and result.stderr == "err\n"
    assert result.exit_code == 3 and result.killed_by_signal is None and not result.succeeded


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGABRT"])
def test_death_by_signal_is_reported(isolation, signal_name):
    result = run(f"import os, signal\nos.kill(os.getpid(), signal.{signal_name})", **isolation.kwargs)
    assert result.started and not result.timed_out and result.exit_code is None
    assert result.killed_by_signal == getattr(signal, signal_name)


def test_network_is_unreachable(isolation):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    result = run(
        f"""
        import socket
        for name, connect in [
            ("public", lambda: socket.create_connection(("1.1.1.1", 80), timeout=3)),
            ("loopback", lambda: socket.socket().connect(("127.0.0.1", {port}))),
        ]:
            try:
                connect()
                print(name, "connected")
            except OSError as error:
                print(name, "failed:", type(error).__name__, error)
        """,
        **isolation.kwargs,
    )
    with listener, pytest.raises(TimeoutError):
        listener.accept()  # nothing ever reached the host's loopback
    assert result.succeeded, result.stderr
    assert "connected" not in result.stdout
    assert "public failed:" in result.stdout and "loopback failed:" in result.stdout


def test_no_writes_outside_the_working_directory(isolation, tmp_path):
    targets = {
        "tmp": tmp_path / "escape.txt",
        "home": Path.home() / f".posttrain-sandbox-escape-{uuid.uuid4().hex}",
        "via_symlink": tmp_path / "via-link.txt",
        "mkdir": tmp_path / "escape-dir",
        "rename": tmp_path / "renamed.txt",
    }
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    result = run(
        f"""
        import os
        attempts = {{
            "tmp": lambda: open({str(targets["tmp"])!r}, "w").write("x"),
            "home": lambda: open({str(targets["home"])!r}, "w").write("x"),
            "via_symlink": lambda: (os.symlink({str(targets["via_symlink"])!r}, "link"), open("link", "w").write("x")),
            "mkdir": lambda: os.mkdir({str(targets["mkdir"])!r}),
            "rename": lambda: os.rename({str(victim)!r}, {str(targets["rename"])!r}),
            "remove": lambda: os.remove({str(victim)!r}),
            "inside": lambda: open("inside.txt", "w").write("x"),
        }}
        for name, attempt in attempts.items():
            try:
                attempt()
                print(name, "wrote")
            except OSError as error:
                print(name, "refused:", type(error).__name__)
        """,
        **isolation.kwargs,
    )
    assert result.succeeded, result.stderr
    assert "inside wrote" in result.stdout  # the working directory itself is writable
    for name, path in targets.items():
        assert not path.exists(), name
        assert f"{name} refused:" in result.stdout
    assert victim.read_text() == "keep me"


@pytest.mark.parametrize("program", ["while True: pass", "import time; time.sleep(100)"])
def test_runaway_program_is_killed_at_the_time_limit(program):
    result = run(program, time_limit_s=1.0)
    assert result.timed_out and result.killed_by_signal == 9 and result.started
    assert 1.0 <= result.seconds < 1.0 + SLACK_S


def test_forked_child_does_not_outlive_the_program(isolation):
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    result = run(
        f"""
        import os, time
        if os.fork() == 0:
            os.setsid()  # leave the process group: only the PID namespace can still reach it
            os.execv("/bin/sleep", ["sleep", "{marker}"])
        print("forked", flush=True)
        time.sleep(100)
        """,
        time_limit_s=1.0,
        **isolation.kwargs,
    )
    deadline = time.monotonic() + 2.0
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []
    assert result.seconds < 1.0 + SLACK_S
    if isolation.audit_hook:
        assert "PermissionError: sandbox: os.fork is not allowed" in result.stderr
    else:
        assert result.stdout == "forked\n" and result.timed_out


def test_fork_bomb_is_bounded(isolation):
    if isolation.audit_hook:
        pytest.skip("the audit hook refuses fork itself (covered above)")
    if isolation.name == "user-namespace" and os.geteuid() == 0:
        pytest.skip("this path maps the program to the caller's uid, and RLIMIT_NPROC never applies to uid 0")
    result = run(
        """
        import os, time
        children = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                children += 1
        except OSError as error:
            print("stopped after", children, type(error).__name__)
        """,
        **isolation.kwargs,
    )
    assert result.succeeded and result.stdout.startswith("stopped after"), result.stderr
    assert int(result.stdout.split()[2]) < sandbox.MAX_PROCESSES


def test_memory_bomb_is_stopped():
    result = run("chunks = []\nwhile True: chunks.append(bytearray(10**7))", memory_limit_mb=256)
    assert result.memory_exceeded and not result.succeeded and not result.timed_out
    assert "MemoryError" in result.stderr


def test_output_flood_is_truncated():
    started = time.monotonic()
    result = run("while True: print('x' * 1000)", output_limit_bytes=10_000)
    assert result.output_truncated and not result.succeeded and result.killed_by_signal == 9
    assert len(result.stdout) == 10_000 and set(result.stdout) <= {"x", "\n"}
    assert time.monotonic() - started < 2.0


def test_temporary_directory_is_removed(isolation):
    result = run("import os\nopen('scratch.txt', 'w').write('x' * 1000)\nprint(os.getcwd())", **isolation.kwargs)
    assert result.succeeded, result.stderr
    workdir = Path(result.stdout.strip())
    assert workdir.name == "work" and workdir.parent.name.startswith("posttrain-sandbox-")
    assert not workdir.parent.exists()


def test_parent_environment_is_not_visible(isolation, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("POSTTRAIN_SANDBOX_SECRET", secret)
    result = run(
        """
        import os
        print(dict(os.environ))
        for pid in [p for p in os.listdir("/proc") if p.isdigit()] + [str(os.getppid())]:
            try:
                print(open(f"/proc/{pid}/environ", "rb").read())
            except OSError as error:
                print(pid, type(error).__name__)
        """,
        **isolation.kwargs,
    )
    assert result.succeeded, result.stderr
    assert secret not in result.stdout + result.stderr
    assert "POSTTRAIN_SANDBOX_SECRET" not in result.stdout


def test_audit_hook_resists_tampering(tmp_path):
    target = tmp_path / "tampered.txt"
    result = run(
        f"""
        import builtins, os, posixpath, sys
        builtins.isinstance = lambda *args: True
        posixpath.realpath = lambda path, **kwargs: os.getcwd()
        os.getcwd = lambda: "/"
        try:
            open("/nonexistent-dir-for-the-hook", "w")
        except PermissionError as error:
            traceback = error.__traceback__
        while traceback.tb_next is not None:
            traceback = traceback.tb_next
        hook_frame = traceback.tb_frame
        for name, value in [("__code__", (lambda path, *a: os.getcwd()).__code__), ("__defaults__", ())]:
            try:
                setattr(hook_frame.f_locals["_resolve"], name, value)
                print("replaced", name)
            except PermissionError:
                print("kept", name)
        hook_frame.f_globals["_resolve"] = lambda path, *args: "{tmp_path}"
        for name in ("ctypes", "_posixsubprocess"):
            try:
                __import__(name)
                print("imported", name)
            except PermissionError:
                print("refused", name)
        try:
            sys.settrace(lambda *args: None)
            print("traced")
        except PermissionError:
            print("refused settrace")
        try:
            open({str(target)!r}, "w").write("x")
            print("wrote")
        except PermissionError:
            print("refused write")
        """,
        namespaces=False,
        audit_hook=True,
    )
    assert result.succeeded, result.stderr
    assert result.stdout.split("\n")[:-1] == [
        "kept __code__",
        "kept __defaults__",
        "refused ctypes",
        "refused _posixsubprocess",
        "refused settrace",
        "refused write",
    ]
    assert not target.exists()
