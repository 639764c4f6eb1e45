"""Run-level errors: what stops a run with a message rather than a traceback (importable without torch)."""

from __future__ import annotations


class RunError(RuntimeError):
    """A run cannot start or go on: its output directory is in use, no checkpoint is intact, the loss turned
    non-finite, the disk is full. The message names the path or step; nothing already written is lost."""
