"""Tool functions for the tests, loaded by path ("tests/tool_fns_for_tests.py:NAME") where the environment is built,
in a Ray environment actor too."""

import os
import tempfile
import time
from pathlib import Path


def process_id() -> str:
    """The id of the process that runs the tool."""
    return str(os.getpid())


def never_returns(question: str) -> str:
    """A tool that never answers (a stuck service).

    Args:
        question: what it is asked
    """
    time.sleep(3600)
    return question


def rendezvous(meeting: str, party: str) -> str:
    """Wait up to 20 s for a second party to the same meeting in this process: "met" when one came, "alone" when
    none did.

    Args:
        meeting: the meeting's name
        party: the caller's name, unique in the meeting
    """
    folder = Path(tempfile.gettempdir()) / f"posttrain-rendezvous-{meeting}-{os.getpid()}"
    folder.mkdir(exist_ok=True)
    (folder / party).touch()
    give_up = time.monotonic() + 20
    while time.monotonic() < give_up:
        if len(list(folder.iterdir())) >= 2:
            return "met"
        time.sleep(0.01)
    return "alone"


def sleep_for(seconds: float) -> str:
    """Sleep `seconds`, then answer "awake" (a tool that straggles when asked to).

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "awake"


def wait_for_the_version_after(metrics: str, version: int) -> str:
    """Once a run has logged a step, wait (up to 60 s) until it has logged step `version` + 1, whose weight push
    installs version + 1: what the episode samples after this answer, weights newer than `version` sample. Before
    the first step, no wait (the first step needs the first round's episodes).

    Args:
        metrics: the run's metrics.jsonl
        version: the weights version that sampled the episode's first turn
    """
    path = Path(metrics)

    def logged() -> int:
        return len(path.read_text().splitlines()) if path.is_file() else 0

    if not logged():
        return "first"
    give_up = time.monotonic() + 60
    while time.monotonic() < give_up:
        if logged() > version:
            return "next"
        time.sleep(0.01)
    return "timed out"
