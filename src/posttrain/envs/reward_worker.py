"""The process side of `rewards.RewardWorkerPool`: one supervisor per worker, and the worker loop.

Each worker of the pool is two processes (Linux):

    training process ──pipes──► supervisor (trusted code only) ──fork──► worker (runs the scorers)
                                                                             └─► whatever a scorer starts

The supervisor is there so that nothing a scorer runs outlives the training process or the
deadline of its call, whatever the scorer does:

- It is a child subreaper (`PR_SET_CHILD_SUBREAPER`): a process that a scorer starts stays a
  descendant of the supervisor even when its own parent dies or when it calls `setsid()`
  (`start_new_session=True`), which takes it out of every process group and session a kill could
  name. Killing the worker therefore means killing every descendant of the supervisor, found
  through /proc and killed round after round until none is left (`kill_descendants`).
- It watches the training process: the pipe from it reaching end-of-file (the pool was closed,
  or the training process died in any way, SIGKILL included — the kernel closes its pipes) or its
  parent pid changing makes the supervisor kill the tree and exit, within `POLL_INTERVAL_S`.
  SIGTERM or SIGHUP sent to the supervisor itself does the same.
- The worker has `PR_SET_PDEATHSIG` = SIGKILL, so it dies with the supervisor even when someone
  kills the supervisor with SIGKILL; only then can the worker's own children survive.
- It enforces each call's deadline: past it, the tree is killed and the call reported as timed
  out. The pool keeps a later deadline of its own in case a supervisor stops answering.
- It captures the stdout and stderr of the worker and of everything the worker starts through one
  pipe, keeps the last `output_tail_bytes` of each call and sends them with that call's failure.
  Nothing a scorer prints reaches the console, and a flood of output costs no memory.

The worker sets its memory limit (RLIMIT_AS, soft = hard, inherited by whatever it starts) before
it imports any scorer, so an import that needs too much memory fails as a start-up error.

The supervisor is single-threaded and imports only this module and `rewards`, so forking the
worker from it is safe and costs about a millisecond; the training process starts it as a fresh
interpreter (fork+exec), never by forking itself.

Messages, each one pickled object per `multiprocessing.connection` frame:

- pool → supervisor: first the configuration dict, then `("call", timeout_s, task_bytes)`;
- supervisor → worker: `task_bytes`, the pickled `(function_path, kwargs)`;
- worker → supervisor: `(kind, payload)`: `("ready", None)`, `("startup_error", text)`,
  `("ok", pickled_value)`, `("error", text)`;
- supervisor → pool: `(kind, payload, (output_bytes, output_tail))`, where kind is one of the
  worker's kinds, or "timeout" or "died" (payload: how the worker ended), after which the
  supervisor has killed the tree and exits. A returned value stays pickled until the pool reads
  it, so the supervisor never imports a scorer's classes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import resource
import select
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from posttrain.envs.rewards import describe_exception, load_function

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
POLL_INTERVAL_S = 0.1
"""The longest the supervisor goes without checking that the training process and the worker live."""
KILL_TREE_TIMEOUT_S = 5.0
"""How long the supervisor keeps killing descendants (a fork bomb refills the tree) before it gives up."""
WORKER_EXIT_WAIT_S = 1.0
"""How long a worker that closed its pipe gets to exit by itself, so that its own exit status is reported."""
NATIVE_ALLOCATION_SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS)
"""How native code often dies when an allocation fails under RLIMIT_AS."""


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    ulong = ctypes.c_ulong
    if libc.prctl(option, ulong(value), ulong(0), ulong(0), ulong(0)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}, {value}): {os.strerror(errno)}")


def descendants(root: int) -> list[int]:
    """Pids of the live (not zombie) descendants of `root`, read from /proc."""
    children: dict[int, list[int]] = {}
    zombies: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                stat = file.read()
        except OSError:  # the process ended while we looked
            continue
        # pid (comm) state ppid ...; comm may hold spaces and parentheses, so split after the last ')'.
        state, ppid = stat[stat.rindex(b")") + 2 :].split()[:2]
        children.setdefault(int(ppid), []).append(int(entry))
        if state == b"Z":
            zombies.add(int(entry))
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            stack.append(child)
            if child not in zombies:
                found.append(child)
    return found


def kill_descendants(timeout_s: float = KILL_TREE_TIMEOUT_S) -> dict[int, int]:
    """SIGKILL every descendant of this process, again and again until none is left.

    A descendant that forks between two scans is found by the next one: as a subreaper this
    process inherits the orphans of the ones killed, so the new process is still a descendant.
    Returns the wait status of each child reaped on the way (pid → status).
    """
    deadline = time.monotonic() + timeout_s
    ended: dict[int, int] = {}
    while True:
        alive = descendants(os.getpid())
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        ended |= reap_children()
        if not alive or time.monotonic() > deadline:
            return ended
        time.sleep(0.005)


def reap_children() -> dict[int, int]:
    """Collect every child that has ended (orphans inherited as subreaper included): pid → wait status."""
    ended = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended[pid] = status


def _memory_note(memory_limit_mb: int) -> str:
    return f" (reward workers are limited to worker_memory_mb={memory_limit_mb} MiB of address space)"


# --------------------------------------------------------------------------- the supervisor


def _exit_on_signal(number: int, frame: Any) -> None:
    raise SystemExit(128 + number)


def supervise(command_fd: int, reply_fd: int) -> None:
    """Entry point of a supervisor process (see the module docstring); returns when it should exit."""
    commands = Connection(command_fd, writable=False)
    replies = Connection(reply_fd, readable=False)
    config = commands.recv()
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != config["parent_pid"]:  # the training process died before the line above
        return
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, _exit_on_signal)
    supervisor = _Supervisor(commands, replies, config)
    try:
        supervisor.run()
    finally:
        for number in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(number, signal.SIG_IGN)
        kill_descendants()


class _Supervisor:
    def __init__(self, commands: Connection, replies: Connection, config: dict[str, Any]):
        self.commands = commands
        self.replies = replies
        self.parent_pid: int = config["parent_pid"]
        self.memory_limit_mb: int = config["memory_limit_mb"]
        self.preload: list[str] = config["preload"]
        self.tail_limit: int = config["output_tail_bytes"]
        self.output_tail = bytearray()
        self.output_bytes = 0
        """Bytes the worker (and its children) wrote since the current call began."""
        self.deadline: float | None = None
        """When the current call times out; None while the worker is idle or starting."""
        self.worker_status: int | None = None

    def run(self) -> None:
        """Relay calls and answers until the training process goes, the worker ends or a call times out."""
        self._start_worker()
        while True:
            if os.getppid() != self.parent_pid:
                return
            wait_s = POLL_INTERVAL_S
            if self.deadline is not None:
                wait_s = max(0.0, min(wait_s, self.deadline - time.monotonic()))
            watched = [self.commands.fileno(), self.answers.fileno()]
            watched += [self.output_fd] if self.output_fd is not None else []
            readable, _, _ = select.select(watched, [], [], wait_s)
            if self.output_fd in readable:
                self._read_output()
            if self.answers.fileno() in readable and not self._on_answer():
                return
            if self.commands.fileno() in readable and not self._on_command():
                return
            if self._reap():
                self._report_death()
                return
            if self.deadline is not None and time.monotonic() >= self.deadline:
                kill_descendants()
                self._drain_output()
                self._reply("timeout", None)
                return

    def _start_worker(self) -> None:
        task_read, task_write = os.pipe()
        answer_read, answer_write = os.pipe()
        output_read, output_write = os.pipe()
        supervisor_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            self.commands.close()
            self.replies.close()
            for fd in (task_write, answer_read, output_read):
                os.close(fd)
            try:
                _become_worker(supervisor_pid, output_write, self.memory_limit_mb)
                _worker_main(task_read, answer_write, self.preload, self.memory_limit_mb)
            except BaseException:  # a forked child must never return into the supervisor's code
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        self.worker_pid = pid
        for fd in (task_read, answer_write, output_write):
            os.close(fd)
        self.tasks = Connection(task_write, readable=False)
        self.answers = Connection(answer_read, writable=False)
        self.output_fd: int | None = output_read

    def _reply(self, kind: str, payload: Any) -> bool:
        """Send one message to the pool; False when the training process is gone."""
        try:
            self.replies.send((kind, payload, (self.output_bytes, bytes(self.output_tail))))
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    def _on_command(self) -> bool:
        try:
            _, timeout_s, task = self.commands.recv()
        except (EOFError, OSError):  # the pool was closed or the training process died
            return False
        self.output_tail.clear()
        self.output_bytes = 0
        try:
            self.tasks.send_bytes(task)
        except (BrokenPipeError, ConnectionResetError):  # the worker died while idle
            self._wait_for_worker()
            self._report_death()
            return False
        self.deadline = time.monotonic() + timeout_s
        return True

    def _on_answer(self) -> bool:
        try:
            kind, payload = self.answers.recv()
        except (EOFError, OSError):  # the worker ended (or closed its end of the pipe)
            self._wait_for_worker()
            self._report_death()
            return False
        self._drain_output()  # the worker flushed its output before answering
        self.deadline = None
        if kind == "ok":  # a returned value's output is not needed: only failures show it
            self.output_tail.clear()
            self.output_bytes = 0
        if not self._reply(kind, payload):
            return False
        return kind != "startup_error"

    def _reap(self, ended: dict[int, int] | None = None) -> bool:
        """Reap ended children (or take `ended`); True once the worker itself has ended."""
        ended = reap_children() if ended is None else ended
        if self.worker_pid in ended:
            self.worker_status = ended[self.worker_pid]
        return self.worker_status is not None

    def _wait_for_worker(self) -> None:
        """Give a worker that closed its pipe a moment to exit by itself, so its own status is reported."""
        deadline = time.monotonic() + WORKER_EXIT_WAIT_S
        while not self._reap() and time.monotonic() < deadline:
            time.sleep(0.005)

    def _report_death(self) -> None:
        """Kill what is left of the tree and tell the pool how the worker ended."""
        self._reap(kill_descendants())
        self._drain_output()
        code = os.waitstatus_to_exitcode(self.worker_status) if self.worker_status is not None else None
        if code is None:
            description = "worker process ended"
        elif code < 0:
            description = f"worker process died from signal {signal.Signals(-code).name}"
            if self.memory_limit_mb and -code in NATIVE_ALLOCATION_SIGNALS:
                description += f"; a native allocation may have failed{_memory_note(self.memory_limit_mb)}"
        else:
            description = f"worker process exited with code {code}"
        self._reply("died", description)

    def _read_output(self) -> None:
        chunk = os.read(self.output_fd, 65536)
        if not chunk:  # the worker and everything it started closed their stdout and stderr
            os.close(self.output_fd)
            self.output_fd = None
            return
        self.output_bytes += len(chunk)
        self.output_tail += chunk
        if len(self.output_tail) > self.tail_limit:
            del self.output_tail[: len(self.output_tail) - self.tail_limit]

    def _drain_output(self, max_reads: int = 64) -> None:
        """Read what is already in the output pipe (at most `max_reads` chunks: a writer may never stop)."""
        for _ in range(max_reads):
            if self.output_fd is None or not select.select([self.output_fd], [], [], 0)[0]:
                return
            self._read_output()


# --------------------------------------------------------------------------- the worker


def _become_worker(supervisor_pid: int, output_fd: int, memory_limit_mb: int) -> None:
    """Die with the supervisor, send all output to it, and apply the memory limit."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != supervisor_pid:  # the supervisor died before the line above
        os._exit(1)
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    if output_fd not in (1, 2):
        os.close(output_fd)
    # Line-buffered, so that the tail of a call that hangs or crashes is already in the pipe.
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    if memory_limit_mb:
        limit = memory_limit_mb * 1024 * 1024
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(ValueError, OSError):  # a scorer closed or broke the stream
                stream.flush()


def _describe_failure(error: BaseException, memory_limit_mb: int) -> str:
    message = describe_exception(error)
    if isinstance(error, MemoryError) and memory_limit_mb:
        message += _memory_note(memory_limit_mb)
    return message


def _worker_main(task_fd: int, answer_fd: int, preload: list[str], memory_limit_mb: int) -> None:
    """A worker's loop: load the preloaded scorers, say ready, then answer calls until the pipe closes."""
    tasks = Connection(task_fd, writable=False)
    answers = Connection(answer_fd, readable=False)
    functions = {}
    try:
        for path in preload:
            functions[path] = load_function(path)
    except BaseException as error:
        _flush_output()
        answers.send(("startup_error", _describe_failure(error, memory_limit_mb)))
        return
    answers.send(("ready", None))
    while True:
        try:
            function_path, kwargs = pickle.loads(tasks.recv_bytes())
        except EOFError:  # the supervisor closed the pipe or died
            return
        try:
            if function_path not in functions:
                functions[function_path] = load_function(function_path)
            value = functions[function_path](**kwargs)
        except BaseException as error:  # SystemExit and signal-raised timeouts included: report, keep serving
            _flush_output()
            answers.send(("error", _describe_failure(error, memory_limit_mb)))
            continue
        try:
            payload = pickle.dumps(value)
        except Exception as error:  # a local class, an open file ...: the sample fails, the worker goes on
            message = f"returned a value that cannot be sent between processes: {describe_exception(error)}"
            _flush_output()
            answers.send(("error", message))
            continue
        _flush_output()
        answers.send(("ok", payload))
