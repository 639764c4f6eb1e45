"""Preemption: SIGTERM and SIGUSR1 end a run at the next step boundary with a checkpoint and the report.

What a cluster sends before it takes the machine away — `timeout`'s and Kubernetes' SIGTERM, Slurm's SIGTERM
at preemption and SIGUSR1 ahead of the time limit (`--signal=USR1@120`) — no longer ends a run silently. The
first such signal is noted (one line on stderr); the step under way finishes; at its end every rank of the run
agrees to stop (the flag is gathered from every rank at each step boundary, so no rank skips a collective the
others enter), a checkpoint is written, and the loop raises `Preempted`, which the recipe's logger turns into
report.html on the way out and the command into a line saying how to resume and the exit status 128 + the
signal number (143 for SIGTERM, 138 for SIGUSR1).

A second signal more than DUPLICATE_WINDOW_S after the first ends the process at once, by that signal's
default action. Closer together they count as one request: torchrun forwards the SIGTERM it receives to its
workers, which under Slurm already got their own.

`trainer.save_every_minutes` bounds what a run killed without warning (SIGKILL, a lost node) loses: a
checkpoint is also written at the first step boundary that many minutes after the previous one (or the start).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from posttrain.errors import RunError
from posttrain.process_group import all_gather_objects

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DUPLICATE_WINDOW_S = 1.0
"""Signals this close to the first are the same request delivered twice (by the scheduler and by torchrun)."""


class Preempted(RunError):
    """The run stopped at a step boundary because a preemption signal arrived; its checkpoint is written."""

    def __init__(self, message: str, signal_number: int, step: int):
        super().__init__(message)
        self.signal_number = signal_number
        self.step = step

    @property
    def exit_status(self) -> int:
        return 128 + self.signal_number


@dataclass
class _RunState:
    received: int | None = None
    """The first preemption signal this run received (its number), or None."""
    received_at: float = 0.0
    last_save: float = 0.0
    """time.monotonic() of the run's start or its newest checkpoint: the clock of trainer.save_every_minutes."""


_state = _RunState(last_save=time.monotonic())


@contextmanager
def preemption_handlers() -> Iterator[None]:
    """Catch SIGTERM and SIGUSR1 for the block (a recipe's whole run), then restore the handlers it found. Outside
    the main thread (where Python cannot install handlers) the block runs without them."""
    global _state
    _state = _RunState(last_save=time.monotonic())
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, _on_signal) for number in PREEMPTION_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _on_signal(number: int, frame) -> None:
    name = signal.Signals(number).name
    now = time.monotonic()
    if _state.received is None:
        _state.received, _state.received_at = number, now
        sys.stderr.write(f"\nposttrain: {name} received: finishing this step, then writing a checkpoint and the "
                         "report (send it again to stop at once)\n")
        sys.stderr.flush()
        return
    if now - _state.received_at < DUPLICATE_WINDOW_S:
        return
    signal.signal(number, signal.SIG_DFL)
    signal.raise_signal(number)


@dataclass(frozen=True)
class StepBoundary:
    """What every rank agreed at the end of a step."""

    stop_signal: int | None
    """The preemption signal that ends the run here (any rank's, the lowest number if they differ), or None."""
    save_for_time: bool
    """trainer.save_every_minutes have passed since the newest checkpoint (on any rank's clock)."""


def step_boundary(save_every_minutes: float) -> StepBoundary:
    """Collective in a data-parallel run: every rank calls it at the end of every step, and all get one answer."""
    due = bool(save_every_minutes) and time.monotonic() - _state.last_save >= 60.0 * save_every_minutes
    gathered = all_gather_objects((_state.received, due))
    signals = [number for number, _ in gathered if number is not None]
    return StepBoundary(min(signals) if signals else None, any(flag for _, flag in gathered))


def checkpoint_written() -> None:
    """Restart the save_every_minutes clock."""
    _state.last_save = time.monotonic()


def preempted(signal_number: int, step: int, max_steps: int, checkpoint_path) -> Preempted:
    name = signal.Signals(signal_number).name
    return Preempted(f"stopped by {name} after step {step} of {max_steps}; checkpoint {checkpoint_path} written. Run "
                     f"the same command again to resume from step {step}", signal_number, step)
