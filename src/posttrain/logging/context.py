"""What a run ran on and how it was started, for run_info.json and the run report: host, CPU, GPU, the command
line, the working directory, git commits, and the process's peak memory.

Everything here is read from the machine (``socket``, ``/proc/cpuinfo``, ``torch.cuda``, ``resource``) or from
``git`` with a deadline; nothing is computed from or fed back into training. A value that cannot be found is
None, and the report says "not recorded".
"""

from __future__ import annotations

import os
import platform
import resource
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

GIT_TIMEOUT_S = 5.0
"""How long one `git` call may take (a repository on a slow network file system) before it is given up."""


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _gpus() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]


def _git(folder: Path, *args: str) -> str | None:
    """`git -C folder ARGS`' output, or None when git is missing, the folder is not in a repository, or git takes
    longer than GIT_TIMEOUT_S."""
    try:
        done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(folder: Path) -> dict[str, Any] | None:
    """{"repository", "commit", "dirty"} of the git checkout holding `folder`, or None when it is in none."""
    top = _git(folder, "rev-parse", "--show-toplevel")
    commit = _git(folder, "rev-parse", "HEAD") if top else None
    if not top or not commit:
        return None
    status = _git(folder, "status", "--porcelain", "--untracked-files=no")
    return {"repository": top, "commit": commit, "dirty": None if status is None else bool(status)}


def command_line() -> str:
    """The command as typed: `posttrain grpo ...` rather than the console script's full path."""
    argv = list(sys.argv) or [""]
    if Path(argv[0]).name == "posttrain":
        argv[0] = "posttrain"
    return shlex.join(argv)


def run_context() -> dict[str, Any]:
    """Host, CPU, GPUs, Python, the command line, the working directory, and the git commit of the working
    directory and of posttrain's own source (each where it is a checkout; listed once when they are the same)."""
    cwd = Path.cwd()
    checkouts = []
    for what, folder in (("working directory", cwd), ("posttrain source", Path(__file__).resolve().parent)):
        state = git_state(folder)
        if state is not None and all(seen["repository"] != state["repository"] for seen in checkouts):
            checkouts.append({"of": what, **state})
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpus": _gpus(),
        "command": command_line(),
        "cwd": str(cwd),
        "git": checkouts,
    }


def peak_memory() -> dict[str, int]:
    """This process's peak resident memory ("rss_bytes", from getrusage) and, when CUDA is in use, the most GPU
    memory torch has allocated on its current device ("cuda_allocated_bytes")."""
    # Linux reports ru_maxrss in kilobytes, macOS in bytes.
    scale = 1 if sys.platform == "darwin" else 1024
    peak = {"rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["cuda_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    return peak
