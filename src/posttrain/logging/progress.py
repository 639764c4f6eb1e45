"""Console progress: a rich bar on a terminal, a tqdm bar (a widget) in a Jupyter notebook, plain lines in log
files, or nothing.

All four reporters share one interface (``update``, ``message``, ``close``) and are chosen
once by ``create_progress`` from ``logging.progress``. The plain reporter exists because a
live bar written to a file (SLURM logs, ``nohup``, CI) becomes thousands of carriage-return
frames; there it prints a line every ``every_steps`` steps or ``every_seconds`` seconds,
whichever comes first, plus the first and the last step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from tqdm.auto import tqdm

ProgressMode = Literal["auto", "rich", "tqdm", "plain", "none"]

DEFAULT_KEY_METRICS: tuple[str, ...] = ("loss", "eval_loss", "learning_rate", "tokens_per_second")
"""Metrics shown beside the progress, in this order, when present."""

_LABELS = {"learning_rate": "lr", "tokens_per_second": "tok/s"}


def _compact_count(value: float) -> str:
    """5300 -> '5.3k', 2.1e6 -> '2.1M': short enough for a bar's text column."""
    for divisor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= divisor:
            return f"{value / divisor:.1f}{suffix}"
    return f"{value:.0f}"


def _format_value(key: str, value: float, *, compact: bool) -> str:
    if key == "learning_rate":
        return f"{value:.1e}"
    if key == "tokens_per_second":
        return _compact_count(value) if compact else f"{value:.0f}"
    return f"{value:.4g}"


def format_metrics(latest: Mapping[str, float], key_metrics: Sequence[str], *, compact: bool) -> str:
    """'loss 1.234 lr 1.0e-04 tok/s 5.3k' for the key metrics present in ``latest``."""
    return " ".join(
        f"{_LABELS.get(key, key)} {_format_value(key, latest[key], compact=compact)}"
        for key in key_metrics
        if key in latest
    )


def format_duration(seconds: float) -> str:
    """72 -> '1m12s', 3720 -> '1h02m', 9 -> '9s'."""
    total = int(round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


class ProgressReporter(Protocol):
    def update(self, step: int, metrics: Mapping[str, float] | None = None) -> None:
        """Step ``step`` (1-based, out of total_steps) is done; ``metrics`` are its latest values."""

    def message(self, text: str) -> None:
        """Print a line (above the bar when there is one)."""

    def close(self) -> None:
        """Stop the display; safe to call twice."""


class NoProgress:
    """logging.progress=none: no progress display. ``message`` still prints: it carries events
    the user must see (resumed from a checkpoint, checkpoint saved), not progress."""

    def update(self, step: int, metrics: Mapping[str, float] | None = None) -> None:
        pass

    def message(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


class PlainProgress:
    """One line per report, e.g. ``[sft] step 40/200 (20%) loss 1.234 lr 1.0e-04 tok/s 5300 eta 1m12s``."""

    def __init__(
        self,
        *,
        recipe: str,
        total_steps: int,
        start_step: int = 0,
        key_metrics: Sequence[str] = DEFAULT_KEY_METRICS,
        every_steps: int | None = None,
        every_seconds: float = 10.0,
    ) -> None:
        self.recipe = recipe
        self.total_steps = total_steps
        self.start_step = start_step
        self.key_metrics = tuple(key_metrics)
        # About ten lines per run from the step rule; the time rule covers slow steps.
        self.every_steps = every_steps or max(1, total_steps // 10)
        self.every_seconds = every_seconds
        self._latest: dict[str, float] = {}
        self._start_time = time.monotonic()
        self._last_print_time: float | None = None

    def update(self, step: int, metrics: Mapping[str, float] | None = None) -> None:
        # Keep the latest value of every metric: eval_loss is logged only every eval_every steps
        # but stays worth showing in between.
        self._latest.update(metrics or {})
        now = time.monotonic()
        due = (
            self._last_print_time is None
            or step >= self.total_steps
            or step % self.every_steps == 0
            or now - self._last_print_time >= self.every_seconds
        )
        if due:
            self._last_print_time = now
            print(self._line(step, now), flush=True)

    def _line(self, step: int, now: float) -> str:
        percent = 100 * step // self.total_steps if self.total_steps else 100
        parts = [f"[{self.recipe}] step {step}/{self.total_steps} ({percent}%)"]
        metrics_text = format_metrics(self._latest, self.key_metrics, compact=False)
        if metrics_text:
            parts.append(metrics_text)
        # Rate over the steps done by this process only: steps before a resume took no time here.
        steps_done = step - self.start_step
        if 0 < steps_done and step < self.total_steps:
            seconds_per_step = (now - self._start_time) / steps_done
            parts.append(f"eta {format_duration(seconds_per_step * (self.total_steps - step))}")
        return " ".join(parts)

    def message(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


class RichProgress:
    """A live rich bar: recipe, bar, step/total, elapsed, ETA and the key metrics."""

    def __init__(
        self,
        *,
        recipe: str,
        total_steps: int,
        start_step: int = 0,
        key_metrics: Sequence[str] = DEFAULT_KEY_METRICS,
        console: Console | None = None,
    ) -> None:
        self.key_metrics = tuple(key_metrics)
        self._latest: dict[str, float] = {}
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            # markup=False: metric names may contain '[' and must be shown as they are.
            TextColumn("{task.fields[metrics]}", markup=False),
            console=console,
        )
        # The bar starts at start_step on resume; rich estimates the speed from updates made
        # after that, so the ETA is not skewed by the steps done before the restart.
        self._task = self._progress.add_task(recipe, total=total_steps, completed=start_step, metrics="")
        self._progress.start()

    def update(self, step: int, metrics: Mapping[str, float] | None = None) -> None:
        self._latest.update(metrics or {})
        text = format_metrics(self._latest, self.key_metrics, compact=True)
        self._progress.update(self._task, completed=step, metrics=text)

    def message(self, text: str) -> None:
        self._progress.console.print(text)

    def close(self) -> None:
        self._progress.stop()


class TqdmProgress:
    """A tqdm.auto bar: an ipywidgets bar in a Jupyter notebook (a text bar where ipywidgets is missing or outside
    a notebook), with the step count, rate, ETA and the key metrics as its postfix."""

    def __init__(
        self,
        *,
        recipe: str,
        total_steps: int,
        start_step: int = 0,
        key_metrics: Sequence[str] = DEFAULT_KEY_METRICS,
    ) -> None:
        self.key_metrics = tuple(key_metrics)
        self._latest: dict[str, float] = {}
        # initial=start_step: a resumed run's bar starts where the checkpoint left off, and tqdm's rate counts only
        # the steps done by this process.
        self._bar = tqdm(total=total_steps, initial=start_step, desc=recipe, unit="step", dynamic_ncols=True)

    def update(self, step: int, metrics: Mapping[str, float] | None = None) -> None:
        self._latest.update(metrics or {})
        self._bar.set_postfix_str(format_metrics(self._latest, self.key_metrics, compact=True), refresh=False)
        self._bar.update(step - self._bar.n)

    def message(self, text: str) -> None:
        self._bar.write(text)

    def close(self) -> None:
        self._bar.close()


def in_notebook() -> bool:
    """True inside a Jupyter kernel (or Colab, Databricks): rich's detection, which reads IPython's shell class."""
    return Console().is_jupyter


def create_progress(
    mode: ProgressMode,
    *,
    recipe: str,
    total_steps: int,
    start_step: int = 0,
    key_metrics: Sequence[str] = DEFAULT_KEY_METRICS,
) -> ProgressReporter:
    """The reporter for ``logging.progress``; ``auto`` is tqdm in a notebook, rich on a terminal, plain otherwise."""
    if mode == "auto":
        mode = "tqdm" if in_notebook() else "rich" if Console().is_terminal else "plain"
    if mode == "tqdm":
        return TqdmProgress(recipe=recipe, total_steps=total_steps, start_step=start_step, key_metrics=key_metrics)
    if mode == "rich":
        return RichProgress(recipe=recipe, total_steps=total_steps, start_step=start_step, key_metrics=key_metrics)
    if mode == "plain":
        return PlainProgress(recipe=recipe, total_steps=total_steps, start_step=start_step, key_metrics=key_metrics)
    return NoProgress()


__all__ = [
    "DEFAULT_KEY_METRICS",
    "NoProgress",
    "PlainProgress",
    "ProgressMode",
    "ProgressReporter",
    "RichProgress",
    "TqdmProgress",
    "create_progress",
    "format_duration",
    "format_metrics",
    "in_notebook",
]
