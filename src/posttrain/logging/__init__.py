"""Run logging: OUTPUT/metrics.jsonl, console progress, experiment trackers and the curves plot.

A recipe loop uses one ``RunLogger``::

    with RunLogger(output_dir, config.logging, recipe="sft", total_steps=max_steps,
                   start_step=resumed_step, run_config=config.model_dump(mode="json")) as run_logger:
        for step in range(resumed_step + 1, max_steps + 1):
            ...
            if step % log_every == 0:
                run_logger.log(step, {"loss": loss, "learning_rate": lr})
            else:
                run_logger.advance(step)

Create it on one process only (rank 0) in distributed runs. ``write_report()`` rewrites OUTPUT/report.html during
the run (the recipes call it after each evaluation and checkpoint); closing the logger writes it a last time, with
how the run ended.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from posttrain.config.schema import LoggingConfig
from posttrain.logging.context import peak_memory
from posttrain.logging.loggers import ExperimentLogger, create_experiment_loggers
from posttrain.logging.metrics import MetricsFile, read_metrics, truncate_metrics
from posttrain.logging.plots import plot_training_curves
from posttrain.logging.progress import DEFAULT_KEY_METRICS, ProgressReporter, create_progress
from posttrain.logging.report import REPORT_FILENAME, update_run_status, write_report
from posttrain.logging.samples import SAMPLES_FILENAME, SamplesFile, read_samples

METRICS_FILENAME = "metrics.jsonl"
PLOT_FILENAME = "training_curves.png"
REPORT_TIME_SHARE = 0.1
"""Rewriting the report during a run takes at most about this share of the run's time: after a rewrite that took
REPORT_SLOW_S or more, the next is skipped until its duration / REPORT_TIME_SHARE has passed (a 1-second page of a
10,000-step run: at most one rewrite every 10 seconds). The last page is always written."""
REPORT_SLOW_S = 0.25
"""Rewrites quicker than this (a run of a few thousand steps) are never skipped."""
_clock = time.monotonic


class RunLogger:
    """Writes metrics.jsonl (and samples.jsonl), forwards to the enabled trackers and drives the progress display.

    On resume (``start_step`` > 0, the checkpoint's step) metrics.jsonl and samples.jsonl keep only records with
    ``step <= start_step`` before appending, and the progress starts at ``start_step``. A run
    restarted without a checkpoint (``start_step`` 0) likewise drops the stale records.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        cfg: LoggingConfig,
        *,
        recipe: str,
        total_steps: int,
        start_step: int = 0,
        run_config: Mapping[str, Any] | None = None,
        progress_metrics: Sequence[str] = DEFAULT_KEY_METRICS,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.cfg = cfg
        self.recipe = recipe
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.output_dir / METRICS_FILENAME
        self.plot_path: Path | None = None
        self.report_path: Path | None = None
        self._closed = False
        self._last_step: int | None = None
        self._reported = True
        """Nothing was logged since the report was last written (or the run started): a rewrite would say the same."""
        self._report_due = 0.0
        """time.monotonic() before which an in-run rewrite is skipped (REPORT_TIME_SHARE)."""

        run_name = cfg.run_name or self.output_dir.resolve().name
        # Trackers first: they may print while starting (W&B does), which would tear a live bar.
        self._experiment_loggers: list[ExperimentLogger] = create_experiment_loggers(
            self.output_dir,
            cfg,
            run_name=run_name,
            recipe=recipe,
            start_step=start_step,
            run_config=run_config,
        )
        if self.metrics_path.exists():
            truncate_metrics(self.metrics_path, start_step)
        self._metrics_file = MetricsFile(self.metrics_path)
        self.samples_path = self.output_dir / SAMPLES_FILENAME
        if self.samples_path.exists():
            truncate_metrics(self.samples_path, start_step)
        self._samples_file = SamplesFile(self.samples_path)
        self._progress: ProgressReporter = create_progress(
            cfg.progress,
            recipe=recipe,
            total_steps=total_steps,
            start_step=start_step,
            key_metrics=progress_metrics,
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` for ``step`` everywhere and update the progress display."""
        self._metrics_file.write(step, metrics)
        self._last_step, self._reported = step, False
        for experiment_logger in self._experiment_loggers:
            experiment_logger.log(step, metrics)
        self._progress.update(step, metrics)

    def log_samples(self, step: int, split: str, records: Sequence[Mapping[str, Any]]) -> None:
        """Append ``records`` (prompt, reference, completion, reward, components, correct, error) to samples.jsonl."""
        self._samples_file.write(step, split, records)
        self._reported = False

    def advance(self, step: int, metrics: Mapping[str, float] | None = None) -> None:
        """Update the progress display only (for steps that are not logged)."""
        self._progress.update(step, metrics)

    def message(self, text: str) -> None:
        """Print a line to the console (above the bar in rich mode)."""
        self._progress.message(text)

    def write_report(self) -> Path | None:
        """Rewrite OUTPUT/report.html now, as the run stands (after an evaluation or a checkpoint), unless
        logging.report is off, nothing was logged since the last time, or the last rewrite was too recent for its
        cost (REPORT_TIME_SHARE). The page is replaced whole (a temporary file renamed into place). A report that
        cannot be drawn is said on stderr and the run goes on; a disk error (OSError) is raised, as any other write
        of the run's would be."""
        if self._closed or self._reported or not self.cfg.report or _clock() < self._report_due:
            return self.report_path
        self._report("running", failed=False)
        return self.report_path

    def _report(self, status: str, failed: bool) -> None:
        started = _clock()
        try:
            update_run_status(self.output_dir, status, self._last_step, peak_memory())
            self.report_path = write_report([self.output_dir], self.output_dir / REPORT_FILENAME)
            self._reported = True
            took = _clock() - started
            self._report_due = started + took / REPORT_TIME_SHARE if took >= REPORT_SLOW_S else 0.0
        except Exception as error:  # noqa: BLE001 - the report is a view of the run, never its outcome
            if isinstance(error, OSError) and not failed:
                raise  # a full or read-only disk is news, as for the plot below
            # A report that cannot be drawn does not undo a run (its metrics, checkpoints and final/ are written),
            # and a failing run's own error is the one to see; `posttrain report` redoes it.
            print(f"posttrain: could not write the run report: {error} (posttrain report "
                  f"{self.output_dir} retries)", file=sys.stderr)

    def close(self, failed: bool = False, status: str | None = None) -> None:
        """Stop the progress display, close the trackers, write the run report (logging.report) and the curves plot
        (logging.plot).

        ``failed`` marks the tracker runs as failed (the context manager sets it on an exception); ``status`` is
        how the run ended, for run_info.json and the report ("finished", or the context manager's description of
        the exception). Safe to call twice.
        """
        if self._closed:
            return
        self._closed = True
        self._progress.close()
        for experiment_logger in self._experiment_loggers:
            experiment_logger.close(failed=failed)
        self._metrics_file.close()
        self._samples_file.close()
        if self.cfg.report:
            self._report(status or ("failed" if failed else "finished"), failed)
        if not self.cfg.plot:
            return
        try:
            self.plot_path = plot_training_curves(self.metrics_path, self.output_dir / PLOT_FILENAME)
        except OSError as error:
            if not failed:
                raise
            # The run is already failing: its own error is the one to see, not the plot's (a full disk fails
            # both, and the plot's error would be the one printed last).
            print(f"posttrain: could not write the training-curves plot: {error}", file=sys.stderr)

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # The report and the plot are written on failure too: the curves up to a crash are what one looks at.
        self.close(failed=exc_type is not None, status=ending(exc_value))


def ending(error: BaseException | None) -> str:
    """How a run ended, in a few words, from the exception that ended it (None: it finished)."""
    if error is None:
        return "finished"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if len(text) > 300:
        text = text[:300] + "…"
    return f"ended by {type(error).__name__}" + (f": {text}" if text else "")


__all__ = [
    "METRICS_FILENAME",
    "PLOT_FILENAME",
    "REPORT_FILENAME",
    "SAMPLES_FILENAME",
    "MetricsFile",
    "RunLogger",
    "plot_training_curves",
    "read_metrics",
    "read_samples",
    "truncate_metrics",
    "write_report",
]
