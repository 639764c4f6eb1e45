"""Run an untrusted Python program in a sandboxed subprocess.

`run_sandboxed` runs a program with a stdin text in a fresh temporary directory and returns what
it printed, how it ended and how long it took. Model-generated code never runs in this process:
it runs in a separate interpreter (`python -I -S`) behind these layers, the strongest that the
machine allows (`sandbox_info` says which are active):

1. Namespaces (Linux; needs unprivileged user namespaces or root). The program gets its own
   network namespace (only a loopback interface, down: every connection fails), PID namespace
   (when its init process ends, the kernel kills every process left in it, including ones that
   left the process group), IPC and UTS namespaces, and a mount namespace whose root is a new,
   read-only tree: /usr, /bin, /lib*, the interpreter's prefix and a few device nodes bound
   read-only, a fresh /proc, and a size-capped tmpfs at the working directory, the only writable
   place, gone when the run ends. The rest of the host (/home, /root, /etc, /tmp, /sys, the
   repository) is not visible. The program runs as uid 65534 inside a user namespace of its own,
   without capabilities, and may not create further user namespaces.
2. Resource limits (always): RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE,
   RLIMIT_CORE 0 and, where it counts only the sandbox's processes, RLIMIT_NPROC; soft and hard
   limits are equal, so the program cannot raise them. A wall-clock deadline kills the whole
   process group, and output is read up to a cap, after which the program is killed.
3. An audit hook (`sys.addaudithook`, Python level, on by default everywhere), installed before
   the program runs and not removable by it: it refuses writes outside the working directory,
   network access, new processes (fork, exec, subprocess), ctypes and other native escape
   hatches, tracing and garbage-collector introspection. Where namespaces are unavailable this is
   the only guard on writes and network, and it is much weaker: it is not a security boundary
   (a determined program can find interpreter-level ways around it, C-level calls that raise no
   audit event such as `os.mkfifo` are not seen, and a symlink swapped between check and use can
   redirect a write). Keeping it on with namespaces too makes programs behave the same on every
   machine. For that reason `envs.code.CodeEnvironment` refuses to start where the namespace layer
   does not work, unless its `allow_unisolated_fallback` option says the user accepts it.

The environment holds only PATH, HOME and TMPDIR (both the working directory); `-I` ignores
PYTHON* variables and the user site, and `-S` skips `site`, so no `.pth` file runs and only the
standard library is importable (the prelude restores `exit` and `quit`, which `site` defines).

Departures from a container runtime: no cgroup, so memory that RLIMIT_AS does not count (tmpfs
and memfd pages) is bounded only by the tmpfs size, RLIMIT_FSIZE and RLIMIT_NOFILE; no seccomp
filter. bubblewrap would give the same namespace layer but is not required.

The process tree: this process -> launcher (`python -I -S sandbox.py CONFIG`, trusted, no
preexec_fn, so it is safe to call from threads) -> [namespaces: init (pid 1 of the namespace)
-> program] or [no namespaces: the launcher execs the program's interpreter].
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import platform
import re
import resource
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

SANDBOX_UID = 65534
"""The uid (and gid) the program runs as inside its user namespace (nobody)."""
SANDBOX_SETUP_FAILED = 125
"""Exit code of the launcher when it could not set the sandbox up (the program never ran)."""
MAX_PROCESSES = 64
"""RLIMIT_NPROC inside the namespaces: processes and threads the program may have at once."""
MAX_OPEN_FILES = 128
"""RLIMIT_NOFILE of the program."""
FILE_SIZE_LIMIT_MB = 64
"""RLIMIT_FSIZE of the program: no file it writes may grow past this."""
WORKDIR_SIZE_LIMIT_MB = 64
"""Size of the tmpfs working directory under namespaces (its pages are memory RLIMIT_AS does not count)."""
KILL_GRACE_S = 0.05
"""How often the output loop wakes to notice that the program exited while a pipe stays open."""


@dataclass(frozen=True)
class SandboxResult:
    """How one sandboxed run ended."""

    stdout: str
    """What the program printed (UTF-8, undecodable bytes replaced), at most output_limit_bytes."""
    stderr: str
    """Its standard error, capped the same way; tracebacks land here."""
    exit_code: int | None
    """The exit status; None when a signal killed it."""
    killed_by_signal: int | None
    """The signal that killed it (SIGKILL after a timeout or an output flood, SIGXCPU at the CPU limit)."""
    timed_out: bool
    """The wall-clock limit passed and the process group was killed."""
    memory_exceeded: bool
    """The program died of MemoryError (read from its stderr: a heuristic the program could fake)."""
    output_truncated: bool
    """stdout or stderr passed output_limit_bytes; the program was killed there."""
    started: bool
    """The sandbox was set up and the program began; False is an infrastructure failure, not the program's."""
    seconds: float
    """Wall-clock duration of the run."""
    layers: tuple[str, ...]
    """The isolation layers this run used: namespaces, rlimits, audit_hook."""

    @property
    def succeeded(self) -> bool:
        """The program ran to completion with exit status 0 inside its limits."""
        return self.started and self.exit_code == 0 and not self.timed_out and not self.output_truncated


@dataclass(frozen=True)
class SandboxInfo:
    """What isolation this machine gives a sandboxed program."""

    namespaces: bool
    """User, mount, PID, network, IPC and UTS namespaces with a read-only root work here."""
    namespace_error: str | None
    """Why the namespace layer is unavailable (None when it works)."""
    audit_hook: bool
    """The Python-level audit-hook guard is installed by default (always True on Python >= 3.8)."""
    python: str
    """The interpreter the program runs in."""
    bubblewrap: str | None
    """Path of `bwrap` when installed (not used: the namespace layer is built in)."""

    @property
    def layers(self) -> tuple[str, ...]:
        """The layers a default run uses, strongest first."""
        return ("namespaces",) * self.namespaces + ("rlimits",) + ("audit_hook",) * self.audit_hook


def run_sandboxed(
    code: str,
    stdin: str = "",
    *,
    time_limit_s: float,
    memory_limit_mb: int,
    output_limit_bytes: int,
    namespaces: bool | None = None,
    audit_hook: bool = True,
    writable_dirs: tuple[str, ...] = (),
    readable_dirs: tuple[str, ...] = (),
) -> SandboxResult:
    """Run `code` with `stdin` in a sandbox and report how it ended.

    `namespaces`: None uses them where `sandbox_info()` found that they work; True requires them
    (a setup failure then comes back as `started=False`); False runs with rlimits and the audit
    hook only. `audit_hook=False` drops the Python-level guard (to test the other layers alone;
    without namespaces that leaves the host unprotected).

    `writable_dirs`: host directories bound read-write into the new root at the same paths (a
    repository checkout that outlives the run); `readable_dirs`: bound read-only (site-packages a
    test runner needs). Both need the namespace layer, and writable ones `audit_hook=False` (the
    hook allows writes in the working directory only): the namespaces are then the boundary.
    Under root the program runs as uid 65534, so a writable directory must belong to it
    (`give_to_sandbox`).
    """
    if time_limit_s <= 0 or memory_limit_mb <= 0 or output_limit_bytes <= 0:
        raise ValueError("time_limit_s, memory_limit_mb and output_limit_bytes must be positive")
    use_namespaces = sandbox_info().namespaces if namespaces is None else namespaces
    if (writable_dirs or readable_dirs) and not use_namespaces:
        raise ValueError("binding host directories into the sandbox needs its namespace layer, which is off here"
                         f": {sandbox_info().namespace_error or 'namespaces=False'}")
    if writable_dirs and audit_hook:
        raise ValueError("writable_dirs needs audit_hook=False: the audit hook refuses writes outside the "
                         "working directory")
    for path in (*writable_dirs, *readable_dirs):
        if not os.path.isabs(path) or not os.path.isdir(path):
            raise ValueError(f"a directory bound into the sandbox must be an existing absolute path, got {path!r}")
    layers = ("namespaces",) * use_namespaces + ("rlimits",) + ("audit_hook",) * audit_hook
    root = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    try:
        workdir = os.path.join(root, "work")
        os.mkdir(workdir)
        os.mkdir(os.path.join(root, "newroot"))
        program_path = os.path.join(root, "program.py")
        with open(program_path, "w", encoding="utf-8") as file:
            file.write(code)
        stdin_path = os.path.join(root, "stdin.txt")
        with open(stdin_path, "w", encoding="utf-8") as file:
            file.write(stdin)
        config = _launcher_config(root, workdir, use_namespaces, audit_hook, time_limit_s, memory_limit_mb)
        config["binds"] = [[os.path.realpath(path), True] for path in writable_dirs]
        config["binds"] += [[os.path.realpath(path), False] for path in readable_dirs]
        return _run_launcher(config, program_path, stdin_path, time_limit_s, output_limit_bytes, layers)
    finally:
        shutil.rmtree(root)


@functools.cache
def sandbox_info() -> SandboxInfo:
    """Probe (once per process) which isolation layers work on this machine."""
    probe = run_sandboxed(
        _NAMESPACE_PROBE,
        time_limit_s=30.0,
        memory_limit_mb=256,
        output_limit_bytes=10_000,
        namespaces=True,
        audit_hook=False,
    )
    works = probe.succeeded and probe.stdout.strip() == "isolated"
    error = None if works else (probe.stderr.strip() or probe.stdout.strip() or "probe failed")[-2000:]
    return SandboxInfo(
        namespaces=works,
        namespace_error=error,
        audit_hook=hasattr(sys, "addaudithook"),
        python=_program_python(),
        bubblewrap=shutil.which("bwrap"),
    )


def give_to_sandbox(path: str) -> None:
    """Make the tree at `path` writable by the sandboxed program (for `writable_dirs`).

    Without root the program's uid maps to the caller's, which owns the tree already; under root
    it is uid 65534, so the tree is handed to that uid."""
    if os.geteuid() != 0:
        return
    os.chown(path, SANDBOX_UID, SANDBOX_UID, follow_symlinks=False)
    for parent, directories, files in os.walk(path):
        for name in directories + files:
            os.chown(os.path.join(parent, name), SANDBOX_UID, SANDBOX_UID, follow_symlinks=False)


# The probe checks the properties the namespace layer promises, from inside it: pid 2 in a fresh
# PID namespace, no writable path outside the working directory, and no route to anything.
_NAMESPACE_PROBE = """
import os, socket
assert os.getpid() == 2, os.getpid()
assert os.getuid() == 65534, os.getuid()
for path in ("/probe", "/usr/probe", "/proc/../probe"):
    try:
        open(path, "w")
    except OSError:
        pass
    else:
        raise SystemExit("wrote " + path)
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1)
except OSError:
    pass
else:
    raise SystemExit("connected")
print("isolated")
"""


# --------------------------------------------------------------------------- parent side


def _program_python() -> str:
    """The real interpreter binary (a virtual environment's `python` is a symlink to it)."""
    return os.path.realpath(sys.executable)


def _uses_user_namespace() -> bool:
    """Root sets the namespaces up directly; any other user needs a user namespace first."""
    return os.geteuid() != 0


def _python_dirs(python: str) -> list[str]:
    """Directories the interpreter needs inside the new root, outside /usr and /lib*."""
    candidates = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix), os.path.dirname(python)}
    venv = os.path.dirname(os.path.dirname(python))
    if os.path.exists(os.path.join(venv, "pyvenv.cfg")):
        candidates.add(venv)
    system = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
    kept: list[str] = []
    for path in sorted(candidates):
        covered = any(path == top or path.startswith(top + "/") for top in (*system, *kept))
        if not covered:
            kept.append(path)
    return kept


def _launcher_config(
    root: str, workdir: str, use_namespaces: bool, audit_hook: bool, time_limit_s: float, memory_limit_mb: int
) -> dict:
    python = _program_python()
    memory_bytes = memory_limit_mb * 1024 * 1024
    return {
        "python": python,
        "python_dirs": _python_dirs(python),
        "workdir": workdir,
        "newroot": os.path.join(root, "newroot"),
        "namespaces": use_namespaces,
        "user_namespace": _uses_user_namespace(),
        "audit_hook": audit_hook,
        "parent_pid": os.getpid(),
        "cpu_seconds": math.ceil(time_limit_s) + 1,
        "memory_bytes": memory_bytes,
        "file_size_bytes": min(FILE_SIZE_LIMIT_MB * 1024 * 1024, memory_bytes),
        "tmpfs_bytes": min(WORKDIR_SIZE_LIMIT_MB * 1024 * 1024, memory_bytes),
        "prelude": _PRELUDE,
    }


def _run_launcher(
    config: dict, program_path: str, stdin_path: str, time_limit_s: float, output_limit_bytes: int, layers: tuple
) -> SandboxResult:
    ready_read, ready_write = os.pipe()
    program_fd = os.open(program_path, os.O_RDONLY)
    config = {**config, "ready_fd": ready_write, "program_fd": program_fd}
    command = [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(config)]
    env = {"PATH": "/usr/bin:/bin", "HOME": config["workdir"], "TMPDIR": config["workdir"]}
    started_at = time.monotonic()
    try:
        with open(stdin_path, "rb") as stdin_file:
            process = subprocess.Popen(
                command,
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=config["workdir"],
                env=env,
                start_new_session=True,
                pass_fds=(ready_write, program_fd),
            )
    except OSError as error:
        os.close(ready_read)
        return SandboxResult(
            stdout="",
            stderr=f"could not start the sandbox: {error}",
            exit_code=None,
            killed_by_signal=None,
            timed_out=False,
            memory_exceeded=False,
            output_truncated=False,
            started=False,
            seconds=time.monotonic() - started_at,
            layers=layers,
        )
    finally:
        os.close(ready_write)
        os.close(program_fd)
    try:
        stdout, stderr, timed_out, truncated = _collect_output(process, started_at + time_limit_s, output_limit_bytes)
    finally:
        _kill_process_group(process.pid)
        returncode = process.wait()
        process.stdout.close()
        process.stderr.close()
    seconds = time.monotonic() - started_at
    os.set_blocking(ready_read, False)
    try:
        started = os.read(ready_read, 1) == b"1"
    except BlockingIOError:
        started = False
    finally:
        os.close(ready_read)
    stderr_text = stderr.decode("utf-8", "replace")
    exit_code = returncode if returncode >= 0 else None
    return SandboxResult(
        stdout=stdout.decode("utf-8", "replace"),
        stderr=stderr_text,
        exit_code=exit_code,
        killed_by_signal=-returncode if returncode < 0 else None,
        timed_out=timed_out,
        memory_exceeded=returncode != 0 and "MemoryError" in stderr_text[-2000:],
        output_truncated=truncated,
        started=started,
        seconds=seconds,
        layers=layers,
    )


def _collect_output(process: subprocess.Popen, deadline: float, limit: int) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout and stderr until both close, the deadline passes or one passes `limit` bytes.

    Returns (stdout, stderr, timed_out, truncated). Memory stays bounded: bytes beyond the limit
    are never kept, and the caller kills the program as soon as this returns.
    """
    buffers = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    timed_out = truncated = False
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and not truncated:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            events = selector.select(timeout=min(remaining, KILL_GRACE_S))
            for key, _ in events:
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                room = limit - len(buffer)
                buffer += chunk[:room]
                truncated = truncated or len(chunk) > room
            # A process left behind (only possible without namespaces) may hold a pipe open after
            # the program exited: stop reading once the launcher is gone and nothing is pending.
            if not events and process.poll() is not None:
                break
    return bytes(buffers[process.stdout.fileno()]), bytes(buffers[process.stderr.fileno()]), timed_out, truncated


def _kill_process_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------- launcher side
# Everything below runs in the launcher process (`python -I -S sandbox.py CONFIG`), never in the
# caller's process. It is trusted code: it sets the sandbox up, then execs the program's
# interpreter, which runs `_PRELUDE` and then the program.

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_NOATIME = 0x400
MS_NODIRATIME = 0x800
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MS_RELATIME = 0x200000
MNT_DETACH = 0x2
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
SECURE_BITS_NO_ROOT_LOCKED = 0x2F  # NOROOT, NO_SETUID_FIXUP and their locks; KEEP_CAPS locked off
LINUX_CAPABILITY_VERSION_3 = 0x20080522
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "full", "random", "urandom")
DEVICE_LINKS = (
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
)


class _Libc:
    """The few libc calls the launcher needs that `os` lacks on Python 3.10/3.11."""

    def __init__(self) -> None:
        self._ctypes = ctypes
        self._libc = ctypes.CDLL(None, use_errno=True)

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            errno = self._ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    def unshare(self, flags: int) -> None:
        self._check(self._libc.unshare(flags), "unshare")

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        source_b, fstype_b, data_b = (None if text is None else os.fsencode(text) for text in (source, fstype, data))
        result = self._libc.mount(source_b, os.fsencode(target), fstype_b, self._ctypes.c_ulong(flags), data_b)
        self._check(result, f"mount {source} on {target}")

    def umount2(self, target: str, flags: int) -> None:
        self._check(self._libc.umount2(os.fsencode(target), flags), f"umount {target}")

    def pivot_root(self, new_root: str, put_old: str) -> None:
        number = SYS_PIVOT_ROOT[platform.machine()]
        self._check(self._libc.syscall(number, os.fsencode(new_root), os.fsencode(put_old)), "pivot_root")

    def prctl(self, option: int, value: int) -> None:
        ulong = self._ctypes.c_ulong
        self._check(self._libc.prctl(option, ulong(value), ulong(0), ulong(0), ulong(0)), f"prctl {option}")

    def drop_capabilities(self) -> None:
        """Leave uid 0 with no capabilities, now and after exec (fallback for root without namespaces)."""
        with open("/proc/sys/kernel/cap_last_cap") as file:
            last = int(file.read())
        for capability in range(last + 1):
            self.prctl(PR_CAPBSET_DROP, capability)
        self.prctl(PR_SET_SECUREBITS, SECURE_BITS_NO_ROOT_LOCKED)
        ctypes = self._ctypes
        header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
        data = (ctypes.c_uint32 * 6)()
        self._check(self._libc.capset(header, data), "capset")


def _launch(config: dict) -> None:
    """Entry point of the launcher process; never returns."""
    libc = _Libc()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file of the launcher either
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != config["parent_pid"]:  # the caller died before the line above
        os._exit(SANDBOX_SETUP_FAILED)
    if not config["namespaces"]:
        if os.geteuid() == 0:
            libc.drop_capabilities()
        _apply_limits(config, count_processes=False)
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1)
        _exec_program(config)
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if config["user_namespace"]:
        uid, gid = os.geteuid(), os.getegid()
        libc.unshare(flags | CLONE_NEWUSER)
        _write_id_maps(inside=0, outside_uid=uid, outside_gid=gid)
    else:
        libc.unshare(flags)
    alive_read, alive_write = os.pipe()
    status_read, status_write = os.pipe()
    init_pid = os.fork()
    if init_pid == 0:
        os.close(alive_write)
        os.close(status_read)
        _run_child(_namespace_init, config, libc, alive_read, status_write)
    os.close(alive_read)
    os.close(status_write)
    _, init_status = os.waitpid(init_pid, 0)
    reported = os.read(status_read, 64)
    if not reported:  # init failed before the program ended; it wrote why to stderr
        os._exit(os.waitstatus_to_exitcode(init_status) if os.WIFEXITED(init_status) else SANDBOX_SETUP_FAILED)
    _exit_like(int(reported))


def _namespace_init(config: dict, libc: _Libc, alive_read: int, status_write: int) -> None:
    """Pid 1 of the new PID namespace: build the root, run the program, report its wait status."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if _closed(alive_read):
        os._exit(SANDBOX_SETUP_FAILED)  # the launcher died before the line above
    _build_root(config, libc)
    program_pid = os.fork()
    if program_pid == 0:
        os.close(status_write)
        os.close(alive_read)
        _run_child(_become_program, config, libc)
    while True:  # as pid 1, reap orphans too, until the program itself ends
        pid, status = os.waitpid(-1, 0)
        if pid == program_pid:
            break
    os.write(status_write, str(status).encode())
    os._exit(0)  # the kernel now kills whatever the program left in the namespace


def _closed(fd: int) -> bool:
    """The other end of the pipe `fd` is closed (its process died)."""
    readable, _, _ = select.select([fd], [], [], 0)
    return bool(readable)


def _build_root(config: dict, libc: _Libc) -> None:
    """Replace the root with a read-only tree holding only what the interpreter needs."""
    newroot = config["newroot"]
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE)
    libc.mount("tmpfs", newroot, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for path in (*SYSTEM_DIRS, *config["python_dirs"]):
        target = newroot + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(path), target)
        elif os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
            libc.mount(path, target, None, MS_BIND | MS_REC)
    os.makedirs(newroot + "/dev")
    for name in DEVICES:
        open(f"{newroot}/dev/{name}", "w").close()
        libc.mount(f"/dev/{name}", f"{newroot}/dev/{name}", None, MS_BIND)
    for name, target in DEVICE_LINKS:
        os.symlink(target, f"{newroot}/dev/{name}")
    os.makedirs(newroot + "/proc")
    libc.mount("proc", newroot + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    workdir = newroot + config["workdir"]
    os.makedirs(workdir)
    owner = "" if config["user_namespace"] else f",uid={SANDBOX_UID},gid={SANDBOX_UID}"
    options = f"mode=0700,size={config['tmpfs_bytes']},nr_inodes=4096{owner}"
    libc.mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, options)
    writable = [config["workdir"], "/proc"]
    for path, is_writable in config.get("binds", []):
        os.makedirs(newroot + path, exist_ok=True)
        libc.mount(path, newroot + path, None, MS_BIND | MS_REC)
        if is_writable:
            writable.append(path)
    os.chdir(newroot)
    libc.pivot_root(".", ".")  # the old root now sits on top of the new one ...
    libc.umount2(".", MNT_DETACH)  # ... and is detached, unreachable from here on
    os.chdir("/")
    for mount_point in _mount_points():
        if mount_point in writable:
            continue
        preserved = _mount_flags(mount_point)
        libc.mount(None, mount_point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | preserved)
    os.chdir(config["workdir"])


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as file:
        fields = [line.split() for line in file]
    # The kernel writes a space, tab, newline or backslash in a path as an octal escape (\040 ...).
    return [re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field[4]) for field in fields]


def _mount_flags(path: str) -> int:
    """The flags a remount must keep (a user namespace may not clear them)."""
    flag = os.statvfs(path).f_flag
    kept = flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    return kept | (MS_RELATIME if flag & os.ST_RELATIME else 0)


def _become_program(config: dict, libc: _Libc) -> None:
    """Drop to uid 65534 in a user namespace of its own, with no capabilities, and run the program."""
    if not config["user_namespace"]:
        os.setgroups([])
        os.setresgid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
        os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
        libc.prctl(PR_SET_DUMPABLE, 1)  # setuid made /proc/self root-owned; the id maps need it back
    uid, gid = os.geteuid(), os.getegid()
    libc.unshare(CLONE_NEWUSER)
    _write_id_maps(inside=SANDBOX_UID, outside_uid=uid, outside_gid=gid)
    # The program may not nest user namespaces: one would let it mount a tmpfs that RLIMIT_AS
    # does not count. This writes the limit of the namespace just created (its owner may).
    with open("/proc/sys/user/max_user_namespaces", "w") as file:
        file.write("0")
    _apply_limits(config, count_processes=True)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1)
    _exec_program(config)  # exec as a non-zero uid clears every capability


def _write_id_maps(inside: int, outside_uid: int, outside_gid: int) -> None:
    with open("/proc/self/setgroups", "w") as file:
        file.write("deny")
    with open("/proc/self/uid_map", "w") as file:
        file.write(f"{inside} {outside_uid} 1")
    with open("/proc/self/gid_map", "w") as file:
        file.write(f"{inside} {outside_gid} 1")


def _apply_limits(config: dict, count_processes: bool) -> None:
    """Set soft = hard for every limit, so the program cannot raise one.

    RLIMIT_NPROC counts all processes of the user (threads too), so it is set only where the
    user is the sandbox's alone (inside its user namespace).
    """
    limits = {
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_AS: config["memory_bytes"],
        resource.RLIMIT_FSIZE: config["file_size_bytes"],
        resource.RLIMIT_NOFILE: MAX_OPEN_FILES,
    }
    if count_processes:
        limits[resource.RLIMIT_NPROC] = MAX_PROCESSES
    for kind, value in limits.items():
        _, hard = resource.getrlimit(kind)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))
    # CPU: SIGXCPU at the soft limit, SIGKILL one second later; the wall clock usually fires first.
    cpu = config["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))


def _exec_program(config: dict) -> None:
    python = config["python"]
    arguments = [python, "-I", "-S", "-B", "-X", "utf8", "-c", config["prelude"]]
    arguments += [str(config["program_fd"]), str(config["ready_fd"]), config["workdir"], str(int(config["audit_hook"]))]
    os.execve(python, arguments, dict(os.environ))


def _run_child(function, *arguments) -> None:
    """Run a forked child's work; report a failure on stderr and exit without returning."""
    try:
        function(*arguments)
    except BaseException as error:  # a forked child must never return into the launcher's code
        os.write(2, f"sandbox setup failed: {type(error).__name__}: {error}\n".encode())
        os._exit(SANDBOX_SETUP_FAILED)
    os._exit(SANDBOX_SETUP_FAILED)


def _exit_like(status: int) -> None:
    """End this process the way the wait status `status` says the program ended."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught or blocked anyway
            signal.signal(number, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [number])
        os.kill(os.getpid(), number)
        os._exit(128 + number)
    os._exit(os.waitstatus_to_exitcode(status))


# The program's interpreter runs this first (`python -I -S -B -X utf8 -c PRELUDE ...`). It reads
# the program from an inherited descriptor, installs the audit hook, signals that the program
# is starting, then runs it as __main__. Every name the hook uses is bound as a default argument
# when the hook is defined (no global or builtin lookups), so the program cannot redirect it by
# patching modules, builtins or this module's globals; the hook's locals are reachable through
# tracebacks, so they are immutable, and setting a function's code or defaults is refused.
_PRELUDE = r'''
import builtins, posix, sys

program_fd, ready_fd, workdir, guard = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"


class _Quit:
    """`exit` and `quit`, which the skipped `site` module would define."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"Use {self.name}() or Ctrl-D (i.e. EOF) to exit"

    def __call__(self, code=None):
        raise SystemExit(code)


builtins.exit, builtins.quit = _Quit("exit"), _Quit("quit")

chunks = []
while True:
    chunk = posix.read(program_fd, 1 << 20)
    if not chunk:
        break
    chunks.append(chunk)
posix.close(program_fd)
source = b"".join(chunks)


def _resolve(path, dir_fd=None, _isinstance=isinstance, _int=int, _str=str, _bytes=bytes,
             _fspath=posix.fspath, _lstat=posix.lstat, _readlink=posix.readlink, _getcwd=posix.getcwd,
             _OSError=OSError, _error=PermissionError, _join="".join, _bjoin=b"".join):
    """The absolute path `path` names after following symlinks (realpath, from C primitives only)."""
    if _isinstance(path, _int):
        path = _readlink("/proc/self/fd/" + _str(path))
        if not path.startswith("/"):
            return path  # a pipe or socket: not a path at all
    path = _fspath(path)
    path = _bjoin((path,)).decode("utf-8", "surrogateescape") if _isinstance(path, _bytes) else _join((path,))
    if not path.startswith("/"):
        base = _getcwd() if dir_fd is None or dir_fd == -1 else _readlink("/proc/self/fd/" + _str(dir_fd))
        path = base + "/" + path
    pending = path.split("/")
    pending.reverse()
    resolved = []
    links = 0
    while pending:
        part = pending.pop()
        if part == "" or part == ".":
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = "/" + "/".join(resolved + [part])
        try:
            mode = _lstat(candidate).st_mode
        except _OSError:
            resolved.append(part)
            continue
        if mode & 0o170000 == 0o120000:
            links += 1
            if links > 40:
                raise _error("sandbox: too many levels of symbolic links")
            target = _readlink(candidate)
            if target.startswith("/"):
                resolved = []
            extra = target.split("/")
            extra.reverse()
            pending.extend(extra)
            continue
        resolved.append(part)
    return "/" + "/".join(resolved)


_PATH_ARGUMENTS = type(type.__dict__)({  # a read-only mapping: the hook's locals are visible in tracebacks
    # event: (indices of the paths it writes, index of its dir_fd or None)
    "os.remove": ((0,), 1), "os.rmdir": ((0,), 1), "os.mkdir": ((0,), 2),
    "os.rename": ((0, 1), 2), "os.link": ((0, 1), 2), "os.symlink": ((1,), 2),
    "os.chmod": ((0,), 2), "os.chown": ((0,), 3), "os.utime": ((0,), 3), "os.truncate": ((0,), None),
    "os.setxattr": ((0,), None), "os.removexattr": ((0,), None),
})
_REFUSED_EVENTS = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
    "socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo", "socket.sethostname",
    "resource.setrlimit", "resource.prlimit", "signal.pthread_kill",
    "sys.settrace", "sys.setprofile", "sys._current_frames",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "cpython.PyInterpreterState_New", "syslog.openlog", "syslog.syslog", "sqlite3.connect",
})
_REFUSED_MODULES = frozenset({
    "ctypes", "_ctypes", "_ctypes_test", "_posixsubprocess", "_posixshmem", "_multiprocessing",
    "_xxsubinterpreters", "_testcapi", "_testinternalcapi", "_testmultiphase", "_testbuffer",
    "_testclinic", "_testimportmultiple", "_xxtestfuzz", "_sqlite3", "_dbm", "_gdbm", "readline", "syslog",
})
_FUNCTION_INTERNALS = frozenset({"__code__", "__defaults__", "__kwdefaults__"})
_WRITE_FLAGS = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND


def _hook(event, args, _workdir=workdir, _resolve=_resolve, _paths=_PATH_ARGUMENTS, _refused=_REFUSED_EVENTS,
          _modules=_REFUSED_MODULES, _internals=_FUNCTION_INTERNALS, _write_flags=_WRITE_FLAGS,
          _own_proc="/proc/" + str(posix.getpid()), _isinstance=isinstance, _int=int, _str=str,
          _lstat=posix.lstat, _OSError=OSError, _error=PermissionError, _unix=1, _own_pid=posix.getpid(),
          _prefix=workdir + "/", _len=len):
    if event == "open":
        path, mode, flags = args
        if _isinstance(path, _int):
            return  # an already open descriptor: it passed this check when it was opened
        writes = _isinstance(flags, _int) and flags & _write_flags != 0
        writes = writes or (_isinstance(mode, _str) and ("w" in mode or "a" in mode or "x" in mode or "+" in mode))
        target = _resolve(path)
        if target == _workdir or target.startswith(_prefix):
            return
        if writes:
            raise _error(f"sandbox: writing outside the working directory is not allowed: {target}")
        if target.startswith("/proc/") and target.split("/")[2].isdigit() and not (
            target == _own_proc or target.startswith(_own_proc + "/")
        ):
            raise _error(f"sandbox: other processes are not visible: {target}")
        try:
            is_directory = _lstat(target).st_mode & 0o170000 == 0o040000
        except _OSError:
            return
        if is_directory:  # a directory descriptor outside would let *at() calls write there
            raise _error(f"sandbox: opening directories outside the working directory is not allowed: {target}")
        return
    if event in _paths:
        indices, dir_fd_index = _paths[event]
        dir_fd = None if dir_fd_index is None or dir_fd_index >= _len(args) else args[dir_fd_index]
        for index in indices:
            target = _resolve(args[index], dir_fd if _isinstance(dir_fd, _int) else None)
            if not (target == _workdir or target.startswith(_prefix)):
                raise _error(f"sandbox: {event} outside the working directory is not allowed: {target}")
        return
    if event in _refused or event.startswith("ctypes."):
        raise _error(f"sandbox: {event} is not allowed")
    if event == "import" and args[0] in _modules:
        raise _error(f"sandbox: importing {args[0]} is not allowed")
    if event == "socket.__new__" and args[1] != _unix:
        raise _error("sandbox: network sockets are not allowed")
    if (event == "os.kill" or event == "os.killpg") and args[0] != _own_pid:
        raise _error(f"sandbox: {event} is not allowed")
    if event == "object.__setattr__" and args[1] in _internals:
        raise _error(f"sandbox: setting {args[1]} is not allowed")


code = compile(source, "main.py", "exec")
if guard:
    sys.addaudithook(_hook)
posix.write(ready_fd, b"1")
posix.close(ready_fd)
main = type(sys)("__main__")
main.__builtins__ = builtins
sys.modules["__main__"] = main
sys.argv = ["main.py"]
del builtins, posix, program_fd, ready_fd, workdir, guard, chunks, chunk, source
exec(code, main.__dict__)
'''


if __name__ == "__main__":
    try:
        _launch(json.loads(sys.argv[1]))
    except Exception as error:  # report any setup failure to the caller as such, never as the program's
        print(f"sandbox setup failed: {type(error).__name__}: {error}", file=sys.stderr)
        sys.exit(SANDBOX_SETUP_FAILED)
