"""Reward functions that misbehave, for tests/test_reward_workers.py (loaded by file path in the workers)."""

import os
import subprocess
import sys
import time
from pathlib import Path

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def huge(completions, **kwargs):
    """Finite in float64, not in float32."""
    return [1e308 if c == "huge" else 0.5 for c in completions]


def floods_output(completions, **kwargs):
    """3 MB on stdout and 3 MB on stderr per call, then fails on "fail"."""
    for _ in range(3):
        print("x" * 1_000_000)
        print("y" * 1_000_000, file=sys.stderr)
    print("the last words of the call")
    if "fail" in completions:
        raise ValueError("failed after a flood")
    return [1.0] * len(completions)


def allocates(completions, **kwargs):
    """Allocates (and touches) the number of MiB each completion names."""
    blocks = [bytearray(int(c) * 1024 * 1024) for c in completions]
    return [float(len(b) > 0) for b in blocks]


def hangs_after_starting_children(completions, pid_dir, **kwargs):
    """Starts a child in a new session and an orphaned grandchild in another, records every pid, then hangs.

    Writes `<pid_dir>/<worker pid>`: "worker supervisor child grandchild".
    """
    child = subprocess.Popen(SLEEPER, start_new_session=True)
    # The intermediate process exits at once, so the grandchild is an orphan in a session of its own.
    spawner = (
        "import subprocess, sys; "
        f"print(subprocess.Popen({SLEEPER!r}, start_new_session=True, stdout=subprocess.DEVNULL).pid)"
    )
    grandchild = int(subprocess.run([sys.executable, "-c", spawner], stdout=subprocess.PIPE, check=True).stdout)
    pids = f"{os.getpid()} {os.getppid()} {child.pid} {grandchild}"
    record = Path(pid_dir[0], str(os.getpid()))
    record.with_suffix(".tmp").write_text(pids)
    record.with_suffix(".tmp").rename(record)
    time.sleep(600)
    return [1.0] * len(completions)
