"""OUTPUT/report.html: one self-contained page about a run, or several runs side by side, to explore.

The page holds everything inline (CSS, the uPlot chart library with its licence, the page's own script, the
data as JSON) and references nothing outside itself: no network, fonts or CDN, so it opens as is from a laptop,
a cluster's file system or an archive. It reads only what a run directory holds:

- metrics.jsonl: one interactive chart per metric, the known ones first (in plots.py's order, related metrics
  sharing axes), the rest grouped by prefix (``eval/<name>/...`` per evaluation set, ``time/...``,
  ``reward/...``). One control smooths every curve (an exponential moving average, the raw curve stays faint
  behind it); hovering shows each series' value; dragging across a chart zooms every chart to that range
  (double-click resets); each chart has a log-scale switch; the x axis is the step, the training time or the
  tokens processed (the last two summed from ``step_seconds`` / ``time/step`` and ``tokens_per_second``).
  Metrics that never change (a constant learning rate, ``turns/mean`` of single-turn evaluations) go to a
  small table instead of a chart.
- Checks: what looks wrong, at the top (a truncation rate near 1, reward errors, non-finite values and skipped
  steps, an evaluation metric worse at the end than at its first evaluation).
- config.yaml: the resolved config, verbatim.
- run_info.json (written by ``announce_run`` when a run starts, updated each time the run writes this page):
  the recipe, each start or resume, the data summary with its skip counts, the library versions, the host, CPU
  and GPUs, the command line and git commits, the run's status and its peak memory.
- samples.jsonl (when the run logged samples): a table one can filter by run, split, step and outcome and page
  through, with each sample's reference answer beside the completion.

A run writes the page at each evaluation and checkpoint and on every way out (end, error, SIGTERM), each time to
a temporary file renamed into place, so a reader (or a kill mid-write) never sees half a page.

Long runs stay light: each series is cut to at most ``MAX_POINTS_PER_SERIES`` points by keeping the minimum and
the maximum of each run of consecutive points (and the first and last point), so a one-step spike survives the
cut; at most ``MAX_SAMPLES_PER_RUN`` samples are kept, from evenly spaced steps. Non-finite values are not drawn;
each chart says how many there were and the first step that had one.

Everything read from these files is escaped where it enters the page (``html.escape``); text and numbers reach
the scripts as JSON with ``<``, ``>`` and ``&`` escaped and are set as text, never parsed as markup.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cache
from pathlib import Path
from typing import Any

import torch
import transformers
import yaml

from posttrain.version import __version__ as posttrain_version
from posttrain.logging.context import run_context
from posttrain.logging.metrics import read_metrics
from posttrain.logging.samples import SAMPLES_FILENAME

REPORT_FILENAME = "report.html"
RUN_INFO_FILENAME = "run_info.json"

MAX_POINTS_PER_SERIES = 1000
MAX_SAMPLES_PER_RUN = 1000
MAX_SAMPLE_CHARS = 3000
"""Longer prompts, references, completions and errors are cut to this many characters in the page (the file
keeps them)."""

SAMPLES_PER_PAGE = 20
DEFAULT_SMOOTHING = 0.6
"""The smoothing control's starting weight (TensorBoard's default): enough to read a GRPO reward curve."""
SPARSE_POINTS = 25
"""Series with at most this many points (evaluations) are drawn as points and never smoothed."""

TRUNCATION_WARNING = 0.9
"""A truncation rate at or above this, at the last logged step, is flagged."""
EVAL_WORSE_TOLERANCE = 0.01
"""An evaluation metric is flagged when its last value is worse than its first by more than this fraction."""

# Charts in this order first; each lists the metrics drawn on its axes. plots.py's panels, in its order, with the
# metrics that belong beside them (validation and evaluation counterparts, the preference recipes' accuracies).
KNOWN_CHARTS: tuple[tuple[str, ...], ...] = (
    ("loss", "eval_loss"),
    ("learning_rate",),
    ("grad_norm",),
    ("tokens_per_second", "generation/tokens_per_second"),
    ("reward/mean", "val/reward_mean"),
    ("accuracy", "val/accuracy", "eval_accuracy"),
    ("reward_accuracy", "eval_reward_accuracy"),
    ("kl",),
    ("entropy",),
    ("response_length/mean", "val/response_length"),
)

# Metrics that count what was dropped, skipped or failed: listed beside the data summary.
_COUNTER = re.compile(r"skip|errors|filtered|dropped|truncat|nonfinite")
# Checks: rates of truncated completions; counts of failed rewards; evaluation metrics and their direction.
_TRUNCATION_RATE = re.compile(r"truncat\w*rate$")
_REWARD_ERRORS = re.compile(r"(^|/)reward(/|_)errors$")
_EVALUATION = re.compile(r"^(eval_|eval/|val/)")
_HIGHER_IS_BETTER = re.compile(r"accuracy|reward_mean|reward/mean$|pass@|win_rate")
_LOWER_IS_BETTER = re.compile(r"loss$")

_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
            "#17becf")
_DASHES: tuple[list[int] | None, ...] = (None, [6, 3], [2, 2], [8, 3, 2, 3])

_ASSETS = Path(__file__).resolve().parent / "assets"


class ReportError(ValueError):
    """A report cannot be made: a run directory has no metrics.jsonl, or no directory was given."""


@dataclass
class _Series:
    steps: list[int]
    values: list[float]
    nonfinite_steps: list[int]
    """Steps whose value was NaN or infinite (not drawn)."""
    nonfinite_values: list[float] = field(default_factory=list)
    """Those values (NaN, inf or -inf), one per nonfinite_steps entry."""

    def final(self) -> tuple[int, float]:
        """The last logged step and its value as logged (inf stays inf, NaN stays NaN)."""
        if self.nonfinite_steps and (not self.steps or self.nonfinite_steps[-1] > self.steps[-1]):
            return self.nonfinite_steps[-1], self.nonfinite_values[-1]
        return self.steps[-1], self.values[-1]

    @property
    def constant(self) -> bool:
        """Every value logged is finite and the same (to a few ulps)."""
        if not self.values or self.nonfinite_steps:
            return False
        low, high = min(self.values), max(self.values)
        return high - low <= 1e-12 * max(abs(low), abs(high))


@dataclass
class _Run:
    path: Path
    label: str
    records: list[dict[str, Any]]
    series: dict[str, _Series]
    config_text: str | None
    info: dict[str, Any] | None
    samples: list[dict[str, Any]]
    samples_total: int
    samples_unreadable: int


# ---- reading a run directory ------------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _series(records: list[dict[str, Any]]) -> dict[str, _Series]:
    series: dict[str, _Series] = {}
    for record in sorted(records, key=lambda record: record["step"]):
        step = record["step"]
        for key, value in record.items():
            # JSON numbers are exactly int or float (a bool is neither); the type test is the hot loop of a long run.
            if type(value) not in (int, float) or key == "step":
                continue
            line = series.get(key)
            if line is None:
                line = series[key] = _Series([], [], [])
            if math.isfinite(value):
                line.steps.append(step)
                line.values.append(float(value))
            else:
                line.nonfinite_steps.append(step)
                line.nonfinite_values.append(float(value))
    return series


def _read_samples(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a samples.jsonl and the number of lines that were not a JSON object with an int step (a
    line cut by a kill, say): those are counted and shown, not fatal."""
    if not path.is_file():
        return [], 0
    records, unreadable = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            unreadable += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        else:
            unreadable += 1
    return records, unreadable


def _select_samples(samples: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """At most `limit` samples, all of evenly spaced steps (the first and the last step included)."""
    if len(samples) <= limit:
        return samples
    steps = sorted({sample["step"] for sample in samples})
    per_step = len(samples) / len(steps)
    wanted = max(1, int(limit / per_step))
    if wanted >= len(steps):
        chosen = set(steps)
    elif wanted == 1:
        chosen = {steps[-1]}
    else:
        chosen = {steps[round(i * (len(steps) - 1) / (wanted - 1))] for i in range(wanted)}
    return [sample for sample in samples if sample["step"] in chosen][-limit:]


def _read_run(path: Path, label: str) -> _Run:
    metrics_path = path / "metrics.jsonl"
    if not path.is_dir():
        raise ReportError(f"{path}: no such directory")
    if not metrics_path.is_file():
        raise ReportError(f"{path}: no metrics.jsonl there (not a posttrain run directory, or a run that has not "
                          "started)")
    records = read_metrics(metrics_path)
    config_path = path / "config.yaml"
    config_text = config_path.read_text(encoding="utf-8", errors="replace") if config_path.is_file() else None
    info = read_run_info(path)
    samples, unreadable = _read_samples(path / SAMPLES_FILENAME)
    return _Run(path, label, records, _series(records), config_text, info,
                _select_samples(samples, MAX_SAMPLES_PER_RUN), len(samples), unreadable)


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    """Each run's folder name, or the path as given where two runs share a folder name."""
    names = [Path(path).resolve().name for path in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [str(path) for path in run_dirs]


# ---- run_info.json ----------------------------------------------------------------------------------------


def write_run_info(output_dir: str | os.PathLike[str], recipe: str, data_summary: str, training: str,
                   resumed_from_step: int | None) -> Path:
    """Record this start of a run in OUTPUT/run_info.json, for the report: the recipe, when it started, the
    data summary (with its skip counts), what it trains, the step it resumed from, the library versions and the
    run's context (logging.context.run_context: host, CPU, GPUs, command line, git commits).

    A resume appends its start to those before; a fresh start (no checkpoint) replaces them. Only this file is
    written: nothing here touches the model, the data order or a random generator.
    """
    previous = read_run_info(output_dir) if resumed_from_step is not None else None
    start = {
        "started_at": _now(),
        "resumed_from_step": resumed_from_step,
        "data": data_summary,
        "training": training,
        "versions": {"posttrain": posttrain_version, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "context": run_context(),
        "status": "running",
    }
    return _write_json(Path(output_dir) / RUN_INFO_FILENAME,
                       {"recipe": recipe, "starts": [*(previous or {}).get("starts", []), start]})


def update_run_status(output_dir: str | os.PathLike[str], status: str, step: int | None,
                      peak_memory: dict[str, int]) -> bool:
    """Note in run_info.json's newest start how the run stands ("running", "finished", or how it ended), the last
    step it logged, its peak memory and when this was written. False (nothing written) when the run has no
    run_info.json yet: it stopped before announcing itself."""
    info = read_run_info(output_dir)
    if info is None or not info["starts"]:
        return False
    info["starts"][-1] |= {"status": status, "last_step": step, "peak_memory": peak_memory, "updated_at": _now()}
    _write_json(Path(output_dir) / RUN_INFO_FILENAME, info)
    return True


def read_run_info(output_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """OUTPUT/run_info.json, or None when the run has none (runs from before it existed) or it is unreadable."""
    path = Path(output_dir) / RUN_INFO_FILENAME
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None
    return info if isinstance(info, dict) and isinstance(info.get("starts"), list) else None


def _now() -> str:
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")


def _temporary_name(path: Path) -> Path:
    """Where `path` is written before it is renamed into place: a name of this process's own (a run rewriting its
    page and `posttrain report` never share one) in the staging form `.tmp-<what>-<pid>`, which the next run in
    the folder removes when a kill left it behind (rundir.remove_dead_staging)."""
    return path.with_name(f".tmp-{path.name}-{os.getpid()}")


def _write_json(path: Path, value: Any) -> Path:
    tmp_path = _temporary_name(path)
    tmp_path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp_path, path)
    return path


# ---- numbers and charts -----------------------------------------------------------------------------------


def downsample(steps: Sequence[int], values: Sequence[float], max_points: int = MAX_POINTS_PER_SERIES,
               ) -> tuple[list[int], list[float]]:
    """At most `max_points` of the points: the first, the last, and the minimum and maximum of each of
    (max_points - 2) // 2 runs of consecutive points, in order, so the envelope and every spike stay visible."""
    n = len(steps)
    if n <= max_points:
        return list(steps), list(values)
    buckets = max(1, (max_points - 2) // 2)
    inner = n - 2
    keep = [0]
    for bucket in range(buckets):
        low, high = 1 + bucket * inner // buckets, 1 + (bucket + 1) * inner // buckets
        if low >= high:
            continue
        chunk = values[low:high]
        lowest, highest = low + chunk.index(min(chunk)), low + chunk.index(max(chunk))
        keep += sorted({lowest, highest})
    keep.append(n - 1)
    return [steps[i] for i in keep], [values[i] for i in keep]


def _format_value(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.6g}"


def _chart_groups(keys: set[str]) -> list[tuple[str, list[tuple[str, ...]]]]:
    """(section title, charts) with the known charts first, then the rest grouped by prefix, time/ last."""
    known = [tuple(key for key in chart if key in keys) for chart in KNOWN_CHARTS]
    known = [chart for chart in known if chart]
    used = {key for chart in known for key in chart}
    groups: dict[str, list[tuple[str, ...]]] = {}
    for key in sorted(keys - used):
        parts = key.split("/")
        group = "" if len(parts) == 1 else "/".join(parts[:2]) if parts[0] == "eval" and len(parts) > 2 else parts[0]
        groups.setdefault(group, []).append((key,))
    sections = [("Training", known)] if known else []
    if "" in groups:
        sections.append(("Other metrics", groups.pop("")))
    sections += sorted(groups.items(), key=lambda item: (item[0] == "time", item[0]))
    return sections


def _seven_digits(value: float) -> float:
    """Enough digits for the page (the hover shows six) at a third of the JSON that repr would write."""
    return float(f"{value:.7g}")


def _clock(records: list[dict[str, Any]], wanted: set[int]) -> dict[str, list | None]:
    """For the x axis: the steps in `wanted` with the training time (seconds) and the tokens processed up to the
    end of each, or None for a run that logs no step time (tokens: no tokens_per_second).

    A step's seconds are its `step_seconds` (SFT, DPO, RM, distillation) or `time/step` (GRPO, PPO), and its
    tokens those seconds times its `tokens_per_second`. Steps between two logged ones are counted at the later
    one's values, so with logging.log_every > 1 the time and tokens are estimates; evaluation and checkpoint time
    are not counted."""
    steps, seconds, tokens = [], [], []
    elapsed = processed = 0.0
    previous: int | None = None
    step_seconds = rate = None
    timed = counted = False
    for record in sorted(records, key=lambda record: record["step"]):
        step = record["step"]
        if previous is not None and step <= previous:
            continue  # one record per step (a file written by hand may repeat one)
        for key in ("step_seconds", "time/step"):
            value = record.get(key)
            if _is_number(value) and math.isfinite(value):
                step_seconds, timed = float(value), True
                break
        value = record.get("tokens_per_second")
        if _is_number(value) and math.isfinite(value):
            rate, counted = float(value), True
        gap = step - (previous or 0)
        if step_seconds is not None:
            elapsed += step_seconds * gap
            if rate is not None:
                processed += rate * step_seconds * gap
        previous = step
        if step in wanted:
            steps.append(step)
            seconds.append(round(elapsed, 3))
            tokens.append(round(processed))
    return {"step": steps, "time": seconds if timed else None, "tokens": tokens if timed and counted else None}


def _chart_keys(runs: list[_Run]) -> tuple[list[tuple[str, list[tuple[str, ...]]]], list[str]]:
    """(section title, charts) of the metrics worth a chart, and the metrics that never change (a chart all of
    whose metrics are constant in every run becomes rows of the constants table instead)."""
    keys = {key for run in runs for key in run.series}

    def constant(key: str) -> bool:
        return all(run.series[key].constant for run in runs if key in run.series)

    groups, constants = [], []
    for title, charts in _chart_groups(keys):
        kept = []
        for chart in charts:
            if all(constant(key) for key in chart):
                constants += chart
            else:
                kept.append(chart)
        if kept:
            groups.append((title, kept))
    return groups, constants


def _curves_payload(runs: list[_Run], groups: list[tuple[str, list[tuple[str, ...]]]]) -> tuple[dict, list[str]]:
    """The JSON the charts' script reads, and each chart's notes (downsampling, non-finite values), in order."""
    charts, notes_per_chart = [], []
    drawn_steps: list[set[int]] = [set() for _ in runs]
    for _, group in groups:
        for chart in group:
            series, notes = [], []
            for run_index, run in enumerate(runs):
                for key_index, key in enumerate(chart):
                    line = run.series.get(key)
                    if line is None:
                        continue
                    if len(runs) > 1:
                        color, dash = _PALETTE[run_index % len(_PALETTE)], _DASHES[key_index % len(_DASHES)]
                        label = f"{run.label} · {key}" if len(chart) > 1 else run.label
                    else:
                        color, dash, label = _PALETTE[key_index % len(_PALETTE)], None, key
                    steps, values = downsample(line.steps, line.values)
                    drawn_steps[run_index].update(steps)
                    if steps:
                        series.append({"run": run_index, "key": key, "label": label, "color": color, "dash": dash,
                                       "steps": steps, "values": [_seven_digits(value) for value in values],
                                       "total": len(line.steps)})
                    if len(steps) < len(line.steps):
                        notes.append(f"{label}: {len(line.steps):,} points, {len(steps):,} drawn (each stretch's "
                                     "min and max kept)")
                    if line.nonfinite_steps:
                        notes.append(f"{label}: {len(line.nonfinite_steps):,} non-finite value(s) not drawn, the "
                                     f"first at step {line.nonfinite_steps[0]:,}")
            values = [value for line in series for value in line["values"]]
            charts.append({"title": " / ".join(chart), "series": series,
                           "positive": bool(values) and min(values) > 0})
            notes_per_chart.append(notes)
    payload = {
        "runs": [{"label": run.label, "color": _PALETTE[i % len(_PALETTE)], "clock": _clock(run.records, steps)}
                 for i, (run, steps) in enumerate(zip(runs, drawn_steps))],
        "charts": charts,
        "smoothing": DEFAULT_SMOOTHING,
        "sparse_points": SPARSE_POINTS,
    }
    return payload, notes_per_chart


def _script_json(value: Any) -> str:
    """JSON to sit inside a <script> element: only "</" could end it early, and with <, > and & as \\u escapes the
    text holds none."""
    return (json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
            .replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e"))


@cache
def _asset(name: str) -> str:
    return (_ASSETS / name).read_text(encoding="utf-8")


@cache
def _chart_library() -> str:
    """uPlot, minified as published, its banner (which names the project's web address) replaced by the licence
    notice it asks to keep with every copy."""
    code = _asset("uPlot.iife.min.js")
    banner = code.split("\n", 1)[0]
    if banner.startswith("/*!"):
        code = code[len(banner):]
    notice = _asset("uPlot.LICENSE").replace("*/", "* /")
    return f"/*! uPlot 1.6.32 (vendored in posttrain/logging/assets)\n{notice}*/\n{code}"


# ---- page sections ----------------------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int = 1) -> str:
    """An HTML table; cells are given already escaped."""
    head = "".join(f"<th>{cell}</th>" for cell in header)
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{cell}</td>' if i >= numeric_from else f"<td>{cell}</td>"
                         for i, cell in enumerate(row)) + "</tr>"
        for row in rows)
    return f'<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _swatch(run_index: int) -> str:
    return f'<span class="swatch" style="background:{_PALETTE[run_index % len(_PALETTE)]}"></span>'


def _recipe(run: _Run) -> str | None:
    return str(run.info["recipe"]) if run.info and run.info.get("recipe") else None


def _checks(run: _Run) -> list[str]:
    """What looks wrong in one run, one sentence each, in the order a reader would want them."""
    found = []
    status = _status(run)
    if status and status not in ("running", "finished"):
        found.append(f"the run did not finish: {status}")
    for key, line in sorted(run.series.items()):
        if _TRUNCATION_RATE.search(key) and line.values:
            step, value = line.final()
            if math.isfinite(value) and value >= TRUNCATION_WARNING:
                found.append(f"{key} is {_format_value(value)} at step {step:,}: most completions hit the token "
                             "limit before ending (raise max_new_tokens, or check the stop strings and the "
                             "end-of-sequence token)")
    for key, line in sorted(run.series.items()):
        if _REWARD_ERRORS.search(key) and any(value > 0 for value in line.values):
            first = next(step for step, value in zip(line.steps, line.values) if value > 0)
            failed = sum(1 for value in line.values if value > 0)
            found.append(f"{key}: rewards failed at {failed:,} of {len(line.values):,} logged steps, the first at "
                         f"step {first:,} (masked and counted; the errors are in the samples table)")
    failed_samples = [sample for sample in run.samples if sample.get("error")]
    if failed_samples and not any(_REWARD_ERRORS.search(key) for key in run.series):
        found.append(f"{len(failed_samples):,} sample(s) shown below have a scoring error, the first at step "
                     f"{failed_samples[0]['step']:,}")
    skipped = run.series.get("nonfinite_skipped_steps")
    if skipped is not None and skipped.values and skipped.values[-1] > 0:
        found.append(f"{int(skipped.values[-1]):,} step(s) skipped because the loss or gradient norm was not finite "
                     "(trainer.on_nonfinite=skip)")
    for key, line in sorted(run.series.items()):
        if line.nonfinite_steps:
            found.append(f"{key}: {len(line.nonfinite_steps):,} non-finite value(s), the first at step "
                         f"{line.nonfinite_steps[0]:,} ({_format_value(line.nonfinite_values[0])})")
    for key, line in sorted(run.series.items()):
        if not _EVALUATION.search(key) or len(line.values) < 2:
            continue
        higher = bool(_HIGHER_IS_BETTER.search(key))
        if not higher and not _LOWER_IS_BETTER.search(key):
            continue
        first, last = line.values[0], line.values[-1]
        change = (last - first) if higher else (first - last)
        if change < -EVAL_WORSE_TOLERANCE * max(abs(first), 1e-12):
            found.append(f"{key} is worse at the end than at the first evaluation: {_format_value(last)} at step "
                         f"{line.steps[-1]:,} against {_format_value(first)} at step {line.steps[0]:,} "
                         f"({'higher' if higher else 'lower'} is better)")
    return found


def _checks_section(runs: list[_Run]) -> str:
    items = []
    for run in runs:
        prefix = f"{html.escape(run.label)}: " if len(runs) > 1 else ""
        items += [f"<li>{prefix}{html.escape(text)}</li>" for text in _checks(run)]
    checked = ("Checked: the run's status, truncation rates (flagged from "
               f"{TRUNCATION_WARNING:g}), reward errors, non-finite values and skipped steps, and whether an "
               "evaluation metric (accuracy, reward, pass@k, loss) ends worse than it started.")
    if not items:
        return (f'<section id="checks" class="checks ok"><h2>Checks</h2><p>Nothing looks wrong.</p>'
                f'<p class="note">{checked}</p></section>')
    return (f'<section id="checks" class="checks warn"><h2>Checks: {len(items)} warning{"s" * (len(items) > 1)}'
            f'</h2><ul>{"".join(items)}</ul><p class="note">{checked}</p></section>')


def _status(run: _Run) -> str | None:
    starts = (run.info or {}).get("starts") or [{}]
    status = starts[-1].get("status")
    return str(status) if status else None


def _bytes(count: Any) -> str:
    if not _is_number(count):
        return "not recorded"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count / 1e3:.0f} kB"


def _context_rows(run: _Run) -> list[tuple[str, str]]:
    """(field, escaped HTML) about one run: what it is, how it stands, what it ran on and how it was started."""
    starts = (run.info or {}).get("starts", [])
    last = starts[-1] if starts else {}
    context = last.get("context") or {}
    steps = [record["step"] for record in run.records]
    resumes = [start.get("resumed_from_step") for start in starts if start.get("resumed_from_step") is not None]
    versions = ", ".join(f"{name} {version}" for name, version in (last.get("versions") or {}).items())
    status = _status(run) or "not recorded"
    if last.get("updated_at"):
        status += f" (as of {last['updated_at']}"
        status += f", step {last['last_step']:,})" if isinstance(last.get("last_step"), int) else ")"
    peak = last.get("peak_memory") or {}
    memory = f"{_bytes(peak['rss_bytes'])} resident (rank 0's process)" if "rss_bytes" in peak else "not recorded"
    if "cuda_allocated_bytes" in peak:
        memory += f"; GPU {_bytes(peak['cuda_allocated_bytes'])} allocated by torch"
    cpu = context.get("cpu") or "not recorded"
    if context.get("cpu_count"):
        cpu += f", {context['cpu_count']} cores ({context.get('torch_threads')} torch threads)"
    gpus = context.get("gpus")
    gpu = ", ".join(gpus) if gpus else ("none" if gpus == [] else "not recorded")
    commits = []
    for checkout in context.get("git") or []:
        dirty = " with uncommitted changes" if checkout.get("dirty") else ""
        commits.append(f"{checkout.get('commit', '')[:12]}{dirty} ({checkout.get('of')}: {checkout.get('repository')})")
    git = "; ".join(commits) or ("not a git checkout" if "git" in context else "not recorded")
    rows = [
        ("directory", str(run.path)),
        ("recipe", _recipe(run) or "not recorded"),
        ("status", status),
        ("logged steps", f"{len(run.records):,} ({min(steps):,}–{max(steps):,})" if steps else "none yet"),
        ("started", str(starts[0].get("started_at", "")) if starts else "not recorded"),
        ("resumed from", ", ".join(f"step {s:,}" if isinstance(s, int) else str(s) for s in resumes) or "no"),
        ("command", context.get("command") or "not recorded"),
        ("working directory", context.get("cwd") or "not recorded"),
        ("git commit", git),
        ("host", context.get("host") or "not recorded"),
        ("CPU", cpu),
        ("GPU", gpu),
        ("peak memory", memory),
        ("platform", f"{context['platform']}, Python {context.get('python')}" if context.get("platform")
         else "not recorded"),
        ("versions", versions or "not recorded"),
    ]
    return [(name, html.escape(value)) for name, value in rows]


def _context_section(runs: list[_Run]) -> str:
    per_run = [_context_rows(run) for run in runs]
    if len(runs) == 1:  # two columns of name and value: the curves start higher on the page
        items = "".join(f"<dt>{html.escape(name)}</dt><dd>{f'<code>{value}</code>' if name == 'command' else value}"
                        "</dd>" for name, value in per_run[0])
        return f'<section id="runs"><h2>Run</h2><dl class="context">{items}</dl></section>'
    names = [name for name, _ in per_run[0]]
    rows = [[html.escape(name), *(f"<code>{rows[i][1]}</code>" if name == "command" else rows[i][1]
                                  for rows in per_run)] for i, name in enumerate(names)]
    header = ["", *(_swatch(i) + html.escape(run.label) for i, run in enumerate(runs))]
    return f'<section id="runs"><h2>Run</h2>{_table(header, rows, numeric_from=99)}</section>'


_CURVE_CONTROLS = """<div class="controls sticky" id="curve-controls">
<label title="exponential moving average of each curve; the raw curve stays faint behind it">smoothing
<input id="c-smoothing" type="range" min="0" max="0.99" step="0.01" value="{smoothing}">
<output id="c-smoothing-value">{smoothing}</output></label>
<label>x axis <select id="c-x"><option value="step">step</option>
<option value="time"{time_off}>training time</option><option value="tokens"{tokens_off}>tokens</option></select></label>
<button id="c-reset" type="button">reset zoom</button>
<span class="note" id="c-range">drag across a chart to zoom all charts; double-click one to reset</span>
</div>"""


def _curves_section(runs: list[_Run]) -> str:
    groups, constants = _chart_keys(runs)
    if not groups and not constants:
        return '<section id="curves"><h2>Curves</h2><p class="empty">No metrics logged yet.</p></section>'
    payload, notes = _curves_payload(runs, groups)
    off = ' disabled title="not logged: no step_seconds or time/step"'
    parts = ['<section id="curves"><h2>Curves</h2>']
    if groups:
        parts.append(_CURVE_CONTROLS.format(
            smoothing=DEFAULT_SMOOTHING,
            time_off="" if any(run["clock"]["time"] for run in payload["runs"]) else off,
            tokens_off="" if any(run["clock"]["tokens"] for run in payload["runs"]) else
            off.replace("step_seconds or time/step", "tokens_per_second")))
    if len(runs) > 1:
        parts.append('<p class="runs-legend">' + " ".join(f'<span class="key">{_swatch(i)}{html.escape(run.label)}'
                                                          "</span>" for i, run in enumerate(runs)) + "</p>")
    index = 0
    for title, charts in groups:
        parts.append(f'<h3>{html.escape(title)}</h3><div class="charts">')
        for chart in charts:
            spec = payload["charts"][index]
            log_off = "" if spec["positive"] else ' disabled title="a value is zero or negative"'
            note = "".join(f'<p class="note">{html.escape(text)}</p>' for text in notes[index])
            body = ('<div class="plot"></div>' if spec["series"]
                    else '<p class="empty">no finite values to draw</p>')
            parts.append(f'<figure class="figure" data-chart="{index}" data-metrics="{html.escape(" ".join(chart))}">'
                         f'<figcaption><span class="title">{html.escape(spec["title"])}</span><label class="log">'
                         f'<input type="checkbox" class="c-log"{log_off}> log</label></figcaption>{body}{note}'
                         "</figure>")
            index += 1
        parts.append("</div>")
    if constants:
        parts.append(_constants_table(runs, constants))
    if groups:
        parts.append(f'<script type="application/json" id="curves-data">{_script_json(payload)}</script>'
                     f"<script>{_chart_library()}</script><script>{_asset('report_curves.js')}</script>")
    parts.append("</section>")
    return "".join(parts)


def _constants_table(runs: list[_Run], keys: list[str]) -> str:
    rows = []
    for key in keys:
        cells = []
        for run in runs:
            line = run.series.get(key)
            if line is None:
                cells.append("")
                continue
            span = (f"step {line.steps[0]:,}" if len(line.steps) == 1
                    else f"{len(line.steps):,} logged steps, {line.steps[0]:,}–{line.steps[-1]:,}")
            cells.append(f'{_format_value(line.values[0])} <span class="at">{span}</span>')
        rows.append([html.escape(key), *cells])
    header = ["metric", *(_swatch(i) + html.escape(run.label) for i, run in enumerate(runs))] if len(runs) > 1 \
        else ["metric", "value"]
    return (f'<div id="constants"><h3>Constant over the run</h3><p class="note">These metrics had one value at every '
            f"logged step, so they get a row rather than a chart.</p>{_table(header, rows)}</div>")


def _ordered_keys(runs: list[_Run]) -> list[str]:
    keys = {key for run in runs for key in run.series}
    return [key for _, charts in _chart_groups(keys) for chart in charts for key in chart]


def _final_section(runs: list[_Run]) -> str:
    rows = []
    for key in _ordered_keys(runs):
        if len(runs) == 1:
            series = runs[0].series[key]
            last_step, final = series.final()
            low = _format_value(min(series.values)) if series.values else ""
            high = _format_value(max(series.values)) if series.values else ""
            rows.append([html.escape(key), _format_value(final), f"{last_step:,}", low, high])
        else:
            cells = []
            for run in runs:
                series = run.series.get(key)
                if series is None:
                    cells.append("")
                    continue
                last_step, final = series.final()
                cells.append(f'{_format_value(final)} <span class="at">@{last_step:,}</span>')
            rows.append([html.escape(key), *cells])
    if not rows:
        return '<section id="final"><h2>Final metrics</h2><p class="empty">No metrics logged yet.</p></section>'
    header = (["metric", "final", "at step", "min", "max"] if len(runs) == 1
              else ["metric", *(_swatch(i) + html.escape(run.label) for i, run in enumerate(runs))])
    return f'<section id="final"><h2>Final metrics</h2>{_table(header, rows)}</section>'


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _timings_section(runs: list[_Run]) -> str:
    phases = sorted({key for run in runs for key in run.series if key.startswith("time/")}
                    - {"time/step"}) + ["time/step", "step_seconds"]
    phases = [key for key in phases if any(run.series.get(key) and run.series[key].values for run in runs)]
    if not phases:
        return ""
    rows = []
    for key in phases:
        cells = []
        for run in runs:
            series = run.series.get(key)
            if series is None or not series.values:
                cells.append("")
                continue
            mean = _mean(series.values)
            whole = run.series.get("time/step") or run.series.get("step_seconds")
            share = ""
            if whole is not None and whole.values and key not in ("time/step", "step_seconds"):
                share = f' <span class="at">{100 * mean / _mean(whole.values):.0f}%</span>'
            cells.append(f"{mean:.4g} s{share}")
        rows.append([html.escape(key), *cells])
    header = ["phase", *(_swatch(i) + html.escape(run.label) for i, run in enumerate(runs))]
    return ('<section id="timings"><h2>Time per step</h2><p class="note">Mean over the logged steps, and its share '
            f"of the whole step (time/step or step_seconds).</p>{_table(header, rows)}</section>")


def _data_section(runs: list[_Run]) -> str:
    parts = ['<section id="data"><h2>Data and skip counts</h2>']
    for index, run in enumerate(runs):
        starts = (run.info or {}).get("starts", [])
        if len(runs) > 1:
            parts.append(f"<h3>{_swatch(index)}{html.escape(run.label)}</h3>")
        if starts:
            last = starts[-1]
            parts.append(f'<pre class="block">data: {html.escape(str(last.get("data", "")))}\n'
                         f'{html.escape(str(last.get("training", "")))}</pre>')
        else:
            parts.append(f'<p class="empty">No {RUN_INFO_FILENAME} in this run directory, so its data summary was '
                         "not recorded.</p>")
        counters = [key for key in _ordered_keys([run]) if _COUNTER.search(key)]
        if counters:
            rows = []
            for key in counters:
                series = run.series[key]
                rows.append([html.escape(key), _format_value(series.values[-1]) if series.values else "",
                             _format_value(max(series.values)) if series.values else "",
                             _format_value(sum(series.values)) if series.values else ""])
            parts.append(_table(["counter or rate", "final", "max", "sum over logged steps"], rows))
    parts.append("</section>")
    return "".join(parts)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat |= _flatten(value, f"{prefix}{key}.")
    return flat


def _config_section(runs: list[_Run]) -> str:
    parts = ['<section id="config"><h2>Config</h2>']
    if len(runs) > 1:
        flats = []
        for run in runs:
            try:
                flats.append(_flatten(yaml.safe_load(run.config_text or "") or {}))
            except yaml.YAMLError:
                flats.append({})
        keys = sorted({key for flat in flats for key in flat})
        differing = [key for key in keys if len({json.dumps(flat.get(key), default=str) for flat in flats}) > 1]
        if differing:
            rows = [[html.escape(key), *(html.escape(json.dumps(flat.get(key), default=str)) for flat in flats)]
                    for key in differing]
            parts.append("<h3>Keys that differ</h3>" + _table(
                ["key", *(_swatch(i) + html.escape(run.label) for i, run in enumerate(runs))], rows, numeric_from=99))
        else:
            parts.append('<p class="empty">The runs have the same config.</p>')
    for index, run in enumerate(runs):
        text = run.config_text if run.config_text is not None else "(no config.yaml in this run directory)"
        opened = " open" if index == 0 else ""
        parts.append(f"<details{opened}><summary>{_swatch(index)}{html.escape(run.label)}: config.yaml</summary>"
                     f'<pre class="block">{html.escape(text)}</pre></details>')
    parts.append("</section>")
    return "".join(parts)


def _clip(text: Any) -> str:
    text = "" if text is None else str(text)
    if len(text) <= MAX_SAMPLE_CHARS:
        return text
    return text[:MAX_SAMPLE_CHARS] + f" … [{len(text) - MAX_SAMPLE_CHARS:,} more characters in {SAMPLES_FILENAME}]"


def _json_number(value: Any) -> Any:
    """A finite number as is; NaN or infinity as its text (JSON has no such numbers); anything else as text."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value if math.isfinite(value) else _format_value(float(value))
    return str(value)


def _sample_rows(runs: list[_Run]) -> list[list[Any]]:
    rows = []
    for index, run in enumerate(runs):
        for sample in run.samples:
            components = sample.get("components")
            if isinstance(components, dict):
                components = {str(name): _json_number(value) for name, value in components.items()}
            else:
                components = None
            correct = sample.get("correct")
            reference = sample.get("reference")
            rows.append([index, sample["step"], str(sample.get("split", "")), _clip(sample.get("prompt")),
                         None if reference is None else _clip(reference), _clip(sample.get("completion")),
                         _json_number(sample.get("reward")), components,
                         correct if isinstance(correct, bool) else None,
                         None if sample.get("error") is None else _clip(sample.get("error"))])
    return rows


def _sample_cells(row: list[Any], runs: list[_Run]) -> list[tuple[str, str]]:
    """(css class, text) per column; the same cells the script builds."""
    run, step, split, prompt, reference, completion, reward, components, correct, error = row
    cells = [("", runs[run].label)] if len(runs) > 1 else []
    components_text = ", ".join(f"{name}={_format_value(value)}" for name, value in components.items()) \
        if components else ""
    cells += [("num", str(step)), ("", split), ("text", prompt), ("text", "—" if reference is None else reference),
              ("text", completion),
              ("num", _format_value(reward) if reward is not None else "—"), ("", components_text),
              ("", "✓" if correct is True else "✗" if correct is False else "—"), ("text", error or "")]
    return cells


_SAMPLES_SCRIPT = """
(function () {
  const payload = JSON.parse(document.getElementById("samples-data").textContent);
  const runs = payload.runs, rows = payload.rows, pageSize = payload.page_size;
  const byId = (id) => document.getElementById(id);
  const body = byId("samples-body"), info = byId("samples-info");
  let page = 0;
  function fill(select, values, label) {
    for (const value of values) {
      const option = document.createElement("option");
      option.value = String(value);
      option.textContent = label ? label(value) : String(value);
      select.appendChild(option);
    }
  }
  fill(byId("f-split"), [...new Set(rows.map((r) => r[2]))].sort());
  fill(byId("f-step"), [...new Set(rows.map((r) => r[1]))].sort((a, b) => a - b));
  if (runs.length > 1) fill(byId("f-run"), runs.map((_, i) => i), (i) => runs[i]);
  function number(value) {
    if (value === null) return "\\u2014";
    if (typeof value !== "number") return String(value);
    return Number.isInteger(value) ? String(value) : String(Number(value.toPrecision(6)));
  }
  function matches(r) {
    const run = byId("f-run").value, split = byId("f-split").value, step = byId("f-step").value;
    const outcome = byId("f-outcome").value, text = byId("f-text").value.toLowerCase();
    if (run !== "" && r[0] !== Number(run)) return false;
    if (split !== "" && r[2] !== split) return false;
    if (step !== "" && r[1] !== Number(step)) return false;
    if (outcome === "correct" && r[8] !== true) return false;
    if (outcome === "incorrect" && r[8] !== false) return false;
    if (outcome === "error" && !r[9]) return false;
    if (text && !(r[3] + "\\n" + (r[4] || "") + "\\n" + r[5] + "\\n" + (r[9] || "")).toLowerCase().includes(text)) {
      return false;
    }
    return true;
  }
  function cell(tr, text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    tr.appendChild(td);
  }
  function render() {
    const shown = rows.filter(matches);
    const pages = Math.max(1, Math.ceil(shown.length / pageSize));
    page = Math.min(page, pages - 1);
    const rendered = [];
    for (const r of shown.slice(page * pageSize, (page + 1) * pageSize)) {
      const tr = document.createElement("tr");
      if (runs.length > 1) cell(tr, runs[r[0]], "");
      cell(tr, String(r[1]), "num");
      cell(tr, r[2], "");
      cell(tr, r[3], "text");
      cell(tr, r[4] === null ? "\\u2014" : r[4], "text");
      cell(tr, r[5], "text");
      cell(tr, number(r[6]), "num");
      cell(tr, r[7] ? Object.entries(r[7]).map(([k, v]) => k + "=" + number(v)).join(", ") : "", "");
      cell(tr, r[8] === true ? "\\u2713" : r[8] === false ? "\\u2717" : "\\u2014", "");
      cell(tr, r[9] || "", "text");
      rendered.push(tr);
    }
    body.replaceChildren(...rendered);
    info.textContent = shown.length + " of " + rows.length + " samples \\u00b7 page " + (page + 1) + " of " + pages;
    byId("f-prev").disabled = page === 0;
    byId("f-next").disabled = page >= pages - 1;
  }
  for (const id of ["f-run", "f-split", "f-step", "f-outcome", "f-text"]) {
    byId(id).addEventListener("input", () => { page = 0; render(); });
  }
  byId("f-prev").addEventListener("click", () => { page -= 1; render(); });
  byId("f-next").addEventListener("click", () => { page += 1; render(); });
  render();
})();
"""


def _samples_section(runs: list[_Run]) -> str:
    rows = _sample_rows(runs)
    notes = []
    for run in runs:
        prefix = f"{run.label}: " if len(runs) > 1 else ""
        if run.samples_total > len(run.samples):
            steps = len({sample["step"] for sample in run.samples})
            notes.append(f"{prefix}{len(run.samples):,} of {run.samples_total:,} samples shown, from {steps:,} "
                         "evenly spaced steps")
        if run.samples_unreadable:
            notes.append(f"{prefix}{run.samples_unreadable:,} line(s) of {SAMPLES_FILENAME} were not readable and "
                         "are left out")
        if not run.samples_total and not run.samples_unreadable:
            notes.append(f"{prefix}no {SAMPLES_FILENAME} in this run directory (GRPO writes its training samples "
                         "there, per logging.samples_per_step, and evaluation sets theirs)")
    note = "".join(f'<p class="note">{html.escape(text)}</p>' for text in notes)
    if not rows:
        return f'<section id="samples"><h2>Samples</h2>{note}</section>'
    columns = (["run"] if len(runs) > 1 else []) + ["step", "split", "prompt", "reference", "completion", "reward",
                                                     "components", "correct", "error"]
    first_page = "".join(
        "<tr>" + "".join(f'<td class="{cls}">{html.escape(text)}</td>' if cls else f"<td>{html.escape(text)}</td>"
                         for cls, text in _sample_cells(row, runs)) + "</tr>"
        for row in rows[:SAMPLES_PER_PAGE])
    run_filter = ('<label>run <select id="f-run"><option value="">all</option></select></label>' if len(runs) > 1
                  else '<select id="f-run" hidden><option value="">all</option></select>')
    controls = (f'<div class="controls">{run_filter}'
                '<label>split <select id="f-split"><option value="">all</option></select></label>'
                '<label>step <select id="f-step"><option value="">all</option></select></label>'
                '<label>outcome <select id="f-outcome"><option value="">all</option>'
                '<option value="correct">correct</option><option value="incorrect">incorrect</option>'
                '<option value="error">scoring error</option></select></label>'
                '<label>text <input id="f-text" type="search" placeholder="in prompt, reference, completion, '
                'error"></label>'
                '<button id="f-prev" type="button">← previous</button><button id="f-next" type="button">next →'
                f'</button><span id="samples-info">{len(rows):,} samples</span></div>')
    payload = {"runs": [run.label for run in runs], "rows": rows, "page_size": SAMPLES_PER_PAGE}
    data = _script_json(payload)
    head = "".join(f"<th>{column}</th>" for column in columns)
    return (f'<section id="samples"><h2>Samples</h2>{note}{controls}<table class="samples"><thead><tr>{head}</tr>'
            f'</thead><tbody id="samples-body">{first_page}</tbody></table>'
            f'<script type="application/json" id="samples-data">{data}</script>'
            f"<script>{_SAMPLES_SCRIPT}</script></section>")


_STYLE = """
:root { --fg: #1b1f24; --muted: #5b6470; --line: #d6dae0; --bg-soft: #f5f7f9; }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 1240px; padding: 20px 24px 60px; color: var(--fg); background: #fff;
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 19px; margin: 30px 0 10px; padding-bottom: 4px; border-bottom: 1px solid var(--line); }
h3 { font-size: 15px; margin: 18px 0 8px; color: var(--muted); }
.sub, .note, .empty, .at { color: var(--muted); }
.note { font-size: 12px; margin: 2px 0; }
nav a { margin-right: 14px; color: #0b5cad; text-decoration: none; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(380px, 1fr)); gap: 14px; }
.figure { margin: 0; padding: 8px 10px; border: 1px solid var(--line); border-radius: 6px; }
figcaption { font-weight: 600; margin-bottom: 2px; overflow-wrap: anywhere; }
svg.chart { width: 100%; height: auto; display: block; }
svg.chart .grid line { stroke: #e6e9ed; stroke-width: 1; }
svg.chart .frame { fill: none; stroke: #9aa3ad; stroke-width: 1; }
svg.chart text { font-size: 11px; fill: var(--muted); }
svg.chart .yt { text-anchor: end; }
svg.chart .xt, svg.chart .xl, svg.chart .yl { text-anchor: middle; }
svg.chart polyline { fill: none; stroke-width: 1.5; stroke-linejoin: round; }
.legend { font-size: 12px; margin-top: 4px; }
.key { display: inline-flex; align-items: center; gap: 4px; margin-right: 12px; }
.swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 5px;
  vertical-align: -1px; }
table { border-collapse: collapse; margin: 6px 0; font-size: 13px; min-width: 40%; }
#runs table, table.samples { width: 100%; }
th, td { border-bottom: 1px solid var(--line); padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: var(--bg-soft); font-weight: 600; white-space: nowrap; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.text { white-space: pre-wrap; overflow-wrap: anywhere; font-family: ui-monospace, Menlo, Consolas, monospace;
  font-size: 12px; max-width: 420px; }
table.samples td.text > * { max-height: 240px; }
pre.block { background: var(--bg-soft); border: 1px solid var(--line); border-radius: 6px; padding: 10px;
  overflow: auto; max-height: 560px; font: 12px/1.4 ui-monospace, Menlo, Consolas, monospace; white-space: pre-wrap; }
details { margin: 6px 0; }
summary { cursor: pointer; font-weight: 600; }
.controls { display: flex; flex-wrap: wrap; gap: 10px; align-items: center; margin: 8px 0; }
.controls select, .controls input, .controls button { font: inherit; padding: 2px 6px; }
.controls.sticky { position: sticky; top: 0; z-index: 5; background: #fff; padding: 6px 0;
  border-bottom: 1px solid var(--line); }
#c-smoothing { vertical-align: middle; width: 160px; }
.checks ul { margin: 6px 0; padding-left: 22px; }
.checks.warn h2 { color: #a3290f; }
.checks.warn li { margin: 3px 0; }
.checks.ok p:first-of-type { color: #1d6b32; }
figcaption { display: flex; justify-content: space-between; gap: 8px; }
figcaption .log { font-weight: 400; font-size: 12px; color: var(--muted); white-space: nowrap; }
.plot { min-height: 220px; }
.plot .uplot { width: 100%; }
.plot .u-legend { font-size: 12px; text-align: left; margin: 0; }
.plot .u-legend .u-series > * { padding: 1px 4px; }
code { font: 12px ui-monospace, Menlo, Consolas, monospace; overflow-wrap: anywhere; }
dl.context { display: grid; grid-template-columns: max-content 1fr max-content 1fr; gap: 2px 14px; margin: 6px 0;
  font-size: 13px; }
dl.context dt { color: var(--muted); }
dl.context dd { margin: 0; overflow-wrap: anywhere; }
"""


def _page(runs: list[_Run]) -> str:
    if len(runs) == 1:
        run = runs[0]
        recipe = _recipe(run)
        heading = f"{run.label}: {recipe} run" if recipe else run.label
        title = f"{run.label} — posttrain {recipe} report" if recipe else f"{run.label} — posttrain report"
    else:
        heading = f"{len(runs)} runs compared: " + ", ".join(run.label for run in runs)
        title = f"posttrain report: {', '.join(run.label for run in runs)}"
    generated = _now()
    sections = [_checks_section(runs), _context_section(runs), _curves_section(runs), _final_section(runs),
                _timings_section(runs), _data_section(runs), _samples_section(runs), _config_section(runs)]
    nav = "".join(f'<a href="#{anchor}">{name}</a>' for anchor, name in (
        ("checks", "Checks"), ("runs", "Run"), ("curves", "Curves"), ("final", "Final metrics"),
        ("timings", "Time"), ("data", "Data"), ("samples", "Samples"), ("config", "Config")))
    statuses = [f"{run.label + ': ' if len(runs) > 1 else ''}{_status(run) or 'status not recorded'}"
                for run in runs]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(title)}</title><style>{_asset('uPlot.min.css')}{_STYLE}</style></head><body>"
            f'<header><h1>{html.escape(heading)}</h1><p class="sub">posttrain run report, written {generated}; '
            f'{html.escape("; ".join(statuses))}</p>'
            f"<nav>{nav}</nav></header>{''.join(sections)}</body></html>\n")


def write_report(run_dirs: Sequence[str | os.PathLike[str]], output: str | os.PathLike[str]) -> Path:
    """Write one self-contained HTML report of `run_dirs` to `output` and return its path.

    One run: that run's report. Several: their curves overlaid (one colour per run, named in each legend), their
    final metrics side by side and the config keys that differ. An `output` that is a folder (or ends in a
    slash) gets report.html inside it. The page is written to a temporary file renamed into place, so the old page
    stays whole until the new one is; a write that fails leaves no temporary file behind. Raises ReportError
    naming the directory when one has no metrics.jsonl; a metrics.jsonl corrupt in the middle raises
    read_metrics' ValueError (file and line).
    """
    if not run_dirs:
        raise ReportError("no run directory given")
    paths = [Path(path) for path in run_dirs]
    runs = [_read_run(path, label) for path, label in zip(paths, _labels(paths))]
    as_given = os.fspath(output)
    output = Path(output)
    if output.is_dir() or as_given.endswith((os.sep, "/")):  # a folder: the report goes into it
        output = output / REPORT_FILENAME
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = _temporary_name(output)
    try:
        tmp_path.write_text(_page(runs), encoding="utf-8")
        os.replace(tmp_path, output)
    except OSError:
        tmp_path.unlink(missing_ok=True)  # no stray half-written page beside the target
        raise
    return output


def describe_finished_run(output_dir: str | os.PathLike[str], max_steps: int, final_dir: str | os.PathLike[str],
                          shown: Sequence[str] = ("loss",)) -> str:
    """The closing line of a training command: which steps this invocation trained (none when the run had already
    finished them), how many it skipped as non-finite, the newest value of each metric named in `shown` (a name
    ending in "/" stands for every metric under it) as metrics.jsonl holds it, and where the model and the report
    are. Read from the run's files, so a finished run run again says the same as it did the first time."""
    output_dir = Path(output_dir)
    info = read_run_info(output_dir) or {}
    starts = info.get("starts") or [{}]
    resumed = starts[-1].get("resumed_from_step") or 0
    metrics_path = output_dir / "metrics.jsonl"
    records = read_metrics(metrics_path) if metrics_path.is_file() else []
    if resumed >= max_steps:
        what = f"done: {output_dir} had already trained its {max_steps} steps; nothing to train"
    else:
        what = f"done: trained steps {resumed + 1}-{max_steps} of {max_steps}" + \
            (f" (resumed from step {resumed})" if resumed else "")
        skipped = records[-1].get("nonfinite_skipped_steps") if records else None
        if skipped:
            what += f", {int(skipped)} of them skipped (non-finite loss or gradient norm, not applied)"
    values: dict[str, Any] = {}
    for record in records:
        for key, value in record.items():
            if any(key == name or (name.endswith("/") and key.startswith(name)) for name in shown):
                values[key] = value
    if values:
        what += ", " + ", ".join(f"{key} {_short_number(value)}" for key, value in values.items())
    what += f"; model: {final_dir}"
    report = output_dir / REPORT_FILENAME
    if report.is_file():
        what += f"; report: {report}"
    return what


def _short_number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
