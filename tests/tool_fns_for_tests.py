"""Tool functions for the tests, loaded by path ("tests/tool_fns_for_tests.py:NAME") where the environment is built,
in a Ray environment actor too."""

import os
import time


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
