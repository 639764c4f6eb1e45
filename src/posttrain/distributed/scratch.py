"""The folder and the processes of one environment worker, and cleaning up after a worker that died.

An environment actor (distributed/ray_groups.py) claims a scratch folder of its own, ROOT/worker-<index>, before it
builds its environment: Python's temporary folder (`tempfile.tempdir`) and the TMPDIR its programs inherit point
into it, so every temporary folder an environment makes (a tool episode's work directory, a SWE checkout, a
desktop's episodes and framebuffers, the sandbox's programs) lands there, and every process it starts, directly
or not, inherits a marker variable naming the worker (`OWNER_VARIABLE`, a fresh token per actor).

A worker that exits normally removes its folder (`release`). One that is killed (out of memory, SIGKILL) cannot:
its programs that run in sessions of their own (Xvfb and the apps on it, started with start_new_session) outlive
it, reparented to init, and its folders stay. Its replacement, started on the same placement-group bundle (the
same node), claims the same folder and first cleans up (`clean_up`): it stops every process still carrying the dead
worker's token (SIGTERM, SIGKILL after `STOP_GRACE_S`; on SIGTERM Xvfb removes its display's socket)
and removes the folder. A resumed run's workers clean up after the workers of the run that was killed the same way,
as the folder's name does not change between runs.

What cannot be cleaned: a program started with a cleared environment (the marker with it) or as another user is
not found. The sandbox (envs/sandbox.py) starts the python and bash tools' programs and SWE commands with only PATH,
HOME and TMPDIR, so one of them still running when its worker is killed is not stopped here: its CPU-time limit
(RLIMIT_CPU) still ends a busy one, but its wall-clock limit was kept by the dead worker, so a program that sleeps
or waits lives on; its folder (under the worker's) is removed all the same. A process already exited but not
reaped by init stays a zombie until init reaps it (it holds no memory and no files); and a node that died took its
processes with it, while its folders stay on its disk until a worker runs there again with the same ROOT.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

OWNER_VARIABLE = "POSTTRAIN_ENVIRONMENT_WORKER"
"""Environment variable holding the token of the environment worker that started a process (inherited by every
process it starts)."""
OWNER_FILE = "owner.json"
"""In a worker's scratch folder: the token and process id of the worker that claimed it."""
STOP_GRACE_S = 5.0
"""How long a dead worker's process has to exit after SIGTERM before SIGKILL."""


@dataclass(frozen=True)
class Cleanup:
    """What cleaning up after a dead worker did."""

    stopped_processes: tuple[int, ...]
    """Process ids of the dead worker's processes that were still running, now stopped."""
    removed_folder: bool
    """Whether its scratch folder was there and is now removed."""


def claim(folder: Path) -> Cleanup:
    """Make `folder` this process's scratch folder, after cleaning up what an earlier owner left (`clean_up`): the
    temporary folder of this process and of the programs it starts, and the owner marker they inherit."""
    cleanup = clean_up(folder)
    temporary = folder / "tmp"
    temporary.mkdir(parents=True)
    token = uuid.uuid4().hex
    (folder / OWNER_FILE).write_text(json.dumps({"token": token, "pid": os.getpid()}), encoding="utf-8")
    os.environ[OWNER_VARIABLE] = token
    os.environ["TMPDIR"] = str(temporary)
    tempfile.tempdir = str(temporary)
    return cleanup


def release(folder: Path) -> None:
    """Remove this process's scratch folder (its environment has been closed) and stop pointing at it."""
    tempfile.tempdir = None
    os.environ.pop("TMPDIR", None)
    shutil.rmtree(folder, ignore_errors=True)


def clean_up(folder: Path) -> Cleanup:
    """Stop the processes of the worker that owned `folder` (found by the token in its owner file), then remove the
    folder. Nothing to do when the folder is not there."""
    if not folder.exists():
        return Cleanup((), False)
    owner = folder / OWNER_FILE
    stopped: tuple[int, ...] = ()
    if owner.is_file():
        token = json.loads(owner.read_text(encoding="utf-8"))["token"]
        stopped = stop_processes(token)
    shutil.rmtree(folder, ignore_errors=True)
    return Cleanup(stopped, True)


def processes_of(token: str) -> list[int]:
    """Ids of this user's running processes whose environment names `token` as their owner (this process
    excluded). Read from /proc (Linux); elsewhere, none."""
    wanted = f"{OWNER_VARIABLE}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environment = (entry / "environ").read_bytes()
        except OSError:  # exited meanwhile, or another user's
            continue
        if wanted in environment.split(b"\0"):
            found.append(int(entry.name))
    return found


def stop_processes(token: str) -> tuple[int, ...]:
    """SIGTERM every process of `token` (`processes_of`), SIGKILL those still running after STOP_GRACE_S; their ids."""
    pids = processes_of(token)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.05)
    for pid in pids:
        if _running(pid):
            _signal(pid, signal.SIGKILL)
    return tuple(pids)


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except (ProcessLookupError, PermissionError):
        pass


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited and waiting for its parent to reap it, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
