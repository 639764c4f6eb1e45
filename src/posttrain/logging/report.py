"""OUTPUT/report.html: one self-contained page about a run, or several runs side by side.

The page holds everything inline (CSS, SVG charts drawn here, a little JavaScript to page through samples) and
references nothing outside itself: no network, fonts or CDN, so it opens as is from a laptop, a cluster's file
system or an archive. It reads only what a run directory holds:

- metrics.jsonl: one chart per metric, the known ones first (in plots.py's order, related metrics sharing axes),
  the rest grouped by prefix (``eval/<name>/...`` per evaluation set, ``time/...``, ``reward/...``); the final
  value of every metric; the mean of each ``time/*`` phase.
- config.yaml: the resolved config, verbatim.
- run_info.json (written by ``announce_run`` when a run starts): the recipe, each start or resume, the data
  summary with its skip counts, the library versions.
- samples.jsonl (when the run logged samples): a table one can filter by run, split, step and outcome and page
  through.

Long runs stay light: each series is cut to at most ``MAX_POINTS_PER_SERIES`` points by keeping the minimum and
the maximum of each run of consecutive points (and the first and last point), so a one-step spike survives the
cut; at most ``MAX_SAMPLES_PER_RUN`` samples are kept, from evenly spaced steps. Non-finite values are not drawn;
each chart says how many there were and the first step that had one.

Everything read from these files is escaped where it enters the page (``html.escape``); sample text reaches the
script as JSON with ``<``, ``>`` and ``&`` escaped and is set as text, never parsed as markup.
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
from pathlib import Path
from typing import Any

import torch
import transformers
import yaml

from posttrain.version import __version__ as posttrain_version
from posttrain.logging.metrics import read_metrics
from posttrain.logging.samples import SAMPLES_FILENAME

REPORT_FILENAME = "report.html"
RUN_INFO_FILENAME = "run_info.json"

MAX_POINTS_PER_SERIES = 1000
MAX_SAMPLES_PER_RUN = 1000
MAX_SAMPLE_CHARS = 3000
"""Longer prompts, completions and errors are cut to this many characters in the page (the file keeps them)."""

SAMPLES_PER_PAGE = 20

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

_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
            "#17becf")
_DASHES = ("", "6 3", "2 2", "8 3 2 3")

# Chart geometry (SVG user units; the SVG scales to its box).
_W, _H = 520, 230
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 24, 10, 38


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
            if key == "step" or not _is_number(value):
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
    data summary (with its skip counts), what it trains, the step it resumed from and the library versions.

    A resume appends its start to those before; a fresh start (no checkpoint) replaces them. Only this file is
    written: nothing here touches the model, the data order or a random generator.
    """
    path = Path(output_dir) / RUN_INFO_FILENAME
    previous = read_run_info(output_dir) if resumed_from_step is not None else None
    start = {
        "started_at": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"),
        "resumed_from_step": resumed_from_step,
        "data": data_summary,
        "training": training,
        "versions": {"posttrain": posttrain_version, "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }
    info = {"recipe": recipe, "starts": [*(previous or {}).get("starts", []), start]}
    tmp_path = path.with_name(path.name + ".tmp")
    tmp_path.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp_path, path)
    return path


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


def _nice_ticks(low: float, high: float, count: int = 5, integer: bool = False) -> tuple[float, float, list[float]]:
    """An axis range covering [low, high] that starts and ends on round ticks, and those ticks."""
    if not high - low > 1e-9 * max(abs(low), abs(high)):  # flat (or flat to a few ulps): pad to a visible range
        pad = max(abs(low), abs(high)) * 0.05 or 1.0
        low, high = low - pad, high + pad
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if raw <= m * magnitude)
    if integer:
        step = max(1.0, round(step))
    start, end = math.floor(low / step) * step, math.ceil(high / step) * step
    ticks = [start + i * step for i in range(round((end - start) / step) + 1)]
    return start, end, ticks


def _tick_labels(ticks: list[float], integer: bool = False) -> list[str]:
    """The ticks' labels, all in one style: thousands separators for steps; fixed decimals enough to tell the
    ticks apart for ordinary magnitudes; scientific notation (same number of digits) for tiny or huge ones."""
    if integer:
        return [f"{round(tick):,}" for tick in ticks]
    spacing = abs(ticks[1] - ticks[0])
    largest = max(abs(tick) for tick in ticks)
    digits = -math.floor(math.log10(spacing) + 1e-9)
    if round(spacing / 10 ** -digits, 6) == 2.5:  # 0.25, 2.5, 25: one digit more
        digits += 1
    if 1e-3 <= largest < 1e6:
        return [f"{tick:.{max(0, digits)}f}" if tick != 0 else "0" for tick in ticks]
    mantissa_digits = max(0, math.floor(math.log10(largest) + 1e-9) + digits)
    return [f"{tick:.{mantissa_digits}e}" if tick != 0 else "0" for tick in ticks]


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


@dataclass
class _Line:
    label: str
    color: str
    dash: str
    steps: list[int]
    values: list[float]
    total_points: int


def _chart_svg(lines: list[_Line], y_label: str) -> str:
    drawn = [line for line in lines if line.steps]
    all_steps = [step for line in drawn for step in (line.steps[0], line.steps[-1])]
    all_values = [value for line in drawn for value in (min(line.values), max(line.values))]
    x0, x1, x_ticks = _nice_ticks(min(all_steps), max(all_steps), count=6, integer=True)
    y0, y1, y_ticks = _nice_ticks(min(all_values), max(all_values))
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def x_of(step: float) -> float:
        return _LEFT + (step - x0) / (x1 - x0) * plot_w

    def y_of(value: float) -> float:
        return _TOP + (1 - (value - y0) / (y1 - y0)) * plot_h

    parts = [f'<svg class="chart" viewBox="0 0 {_W} {_H}" role="img" aria-label="{html.escape(y_label)} against step">']
    grid = [f'<line x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{y_of(t):.1f}" y2="{y_of(t):.1f}"/>' for t in y_ticks]
    grid += [f'<line x1="{x_of(t):.1f}" x2="{x_of(t):.1f}" y1="{_TOP}" y2="{_TOP + plot_h}"/>' for t in x_ticks]
    parts.append(f'<g class="grid">{"".join(grid)}</g>')
    parts.append(f'<rect class="frame" x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}"/>')
    labels = [f'<text class="yt" x="{_LEFT - 5}" y="{y_of(t) + 4:.1f}">{text}</text>'
              for t, text in zip(y_ticks, _tick_labels(y_ticks))]
    labels += [f'<text class="xt" x="{x_of(t):.1f}" y="{_TOP + plot_h + 15}">{text}</text>'
               for t, text in zip(x_ticks, _tick_labels(x_ticks, integer=True))]
    parts.append(f'<g class="ticks">{"".join(labels)}</g>')
    parts.append(f'<text class="xl" x="{_LEFT + plot_w / 2:.0f}" y="{_H - 4}">step</text>')
    parts.append(f'<text class="yl" transform="translate(12 {_TOP + plot_h / 2:.0f}) rotate(-90)">'
                 f'{html.escape(y_label)}</text>')
    densest = max(len(line.steps) for line in drawn)
    for line in drawn:
        label = html.escape(line.label)
        dash = f' stroke-dasharray="{line.dash}"' if line.dash else ""
        points = " ".join(f"{x_of(s):.1f},{y_of(v):.1f}" for s, v in zip(line.steps, line.values))
        parts.append(f'<g class="series" data-label="{label}" data-points="{len(line.steps)}">'
                     f"<title>{label}</title>")
        if len(line.steps) > 1:
            parts.append(f'<polyline points="{points}" stroke="{line.color}"{dash}/>')
        # Sparse series (an evaluation every few hundred steps, a single point) get markers so each shows.
        if len(line.steps) <= 25 or (len(line.steps) <= 60 and 2 * len(line.steps) < densest):
            parts.append("".join(f'<circle cx="{x_of(s):.1f}" cy="{y_of(v):.1f}" r="2.6" fill="{line.color}"/>'
                                 for s, v in zip(line.steps, line.values)))
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


def _legend(lines: list[_Line]) -> str:
    items = []
    for line in lines:
        dash = f' stroke-dasharray="{line.dash}"' if line.dash else ""
        items.append(f'<span class="key"><svg width="24" height="8" aria-hidden="true"><line x1="0" y1="4" x2="24" '
                     f'y2="4" stroke="{line.color}" stroke-width="2"{dash}/></svg>{html.escape(line.label)}</span>')
    return f'<div class="legend">{"".join(items)}</div>'


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


def _chart_figure(runs: list[_Run], chart: tuple[str, ...]) -> str:
    lines, notes = [], []
    for run_index, run in enumerate(runs):
        for key_index, key in enumerate(chart):
            series = run.series.get(key)
            if series is None:
                continue
            if len(runs) > 1:
                color, dash = _PALETTE[run_index % len(_PALETTE)], _DASHES[key_index % len(_DASHES)]
                label = f"{run.label} · {key}" if len(chart) > 1 else run.label
            else:
                color, dash, label = _PALETTE[key_index % len(_PALETTE)], "", key
            steps, values = downsample(series.steps, series.values)
            lines.append(_Line(label, color, dash, steps, values, len(series.steps)))
            if len(steps) < len(series.steps):
                notes.append(f"{label}: {len(series.steps):,} points, {len(steps):,} drawn (each stretch's min "
                             "and max kept)")
            if series.nonfinite_steps:
                notes.append(f"{label}: {len(series.nonfinite_steps):,} non-finite value(s) not drawn, the first "
                             f"at step {series.nonfinite_steps[0]:,}")
    title = " / ".join(chart)
    if any(line.steps for line in lines):
        # The y label is the metric; a chart of several names them in its legend, and the caption holds them all.
        y_label = title if len(title) <= 30 else title[:29] + "…"
        body = _chart_svg(lines, y_label)
    else:
        body = '<p class="empty">no finite values to draw</p>'
    legend = _legend(lines) if len(lines) > 1 else ""
    note = "".join(f'<p class="note">{html.escape(text)}</p>' for text in notes)
    return (f'<figure class="figure" data-metrics="{html.escape(" ".join(chart))}"><figcaption>{html.escape(title)}'
            f"</figcaption>{body}{legend}{note}</figure>")


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


def _runs_section(runs: list[_Run]) -> str:
    rows = []
    for index, run in enumerate(runs):
        steps = [record["step"] for record in run.records]
        span = f"{min(steps):,}–{max(steps):,}" if steps else "none yet"
        starts = (run.info or {}).get("starts", [])
        started = str(starts[0].get("started_at", "")) if starts else "not recorded"
        resumes = [start.get("resumed_from_step") for start in starts if start.get("resumed_from_step") is not None]
        resumed = ", ".join(f"step {step:,}" if isinstance(step, int) else str(step) for step in resumes) or "no"
        versions = starts[-1].get("versions", {}) if starts else {}
        versions_text = ", ".join(f"{name} {version}" for name, version in versions.items()) or "not recorded"
        rows.append([_swatch(index) + html.escape(run.label), html.escape(str(run.path)),
                     html.escape(_recipe(run) or "not recorded"), f"{len(run.records):,}", span,
                     html.escape(started), html.escape(resumed), html.escape(versions_text)])
    return ('<section id="runs"><h2>Runs</h2>'
            + _table(["run", "directory", "recipe", "logged steps", "steps", "started", "resumed from",
                      "versions"], rows, numeric_from=99)
            + "</section>")


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


def _curves_section(runs: list[_Run]) -> str:
    keys = {key for run in runs for key in run.series}
    if not keys:
        return '<section id="curves"><h2>Curves</h2><p class="empty">No metrics logged yet.</p></section>'
    parts = ['<section id="curves"><h2>Curves</h2>']
    if len(runs) > 1:
        parts.append('<p class="runs-legend">' + " ".join(f'<span class="key">{_swatch(i)}{html.escape(run.label)}'
                                                          "</span>" for i, run in enumerate(runs)) + "</p>")
    for title, charts in _chart_groups(keys):
        parts.append(f"<h3>{html.escape(title)}</h3><div class=\"charts\">")
        parts += [_chart_figure(runs, chart) for chart in charts]
        parts.append("</div>")
    parts.append("</section>")
    return "".join(parts)


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
            rows.append([index, sample["step"], str(sample.get("split", "")), _clip(sample.get("prompt")),
                         _clip(sample.get("completion")), _json_number(sample.get("reward")), components,
                         correct if isinstance(correct, bool) else None,
                         None if sample.get("error") is None else _clip(sample.get("error"))])
    return rows


def _sample_cells(row: list[Any], runs: list[_Run]) -> list[tuple[str, str]]:
    """(css class, text) per column; the same cells the script builds."""
    run, step, split, prompt, completion, reward, components, correct, error = row
    cells = [("", runs[run].label)] if len(runs) > 1 else []
    components_text = ", ".join(f"{name}={_format_value(value)}" for name, value in components.items()) \
        if components else ""
    cells += [("num", str(step)), ("", split), ("text", prompt), ("text", completion),
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
    if (outcome === "correct" && r[7] !== true) return false;
    if (outcome === "incorrect" && r[7] !== false) return false;
    if (outcome === "error" && !r[8]) return false;
    if (text && !(r[3] + "\\n" + r[4] + "\\n" + (r[8] || "")).toLowerCase().includes(text)) return false;
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
      cell(tr, r[4], "text");
      cell(tr, number(r[5]), "num");
      cell(tr, r[6] ? Object.entries(r[6]).map(([k, v]) => k + "=" + number(v)).join(", ") : "", "");
      cell(tr, r[7] === true ? "\\u2713" : r[7] === false ? "\\u2717" : "\\u2014", "");
      cell(tr, r[8] || "", "text");
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
    columns = (["run"] if len(runs) > 1 else []) + ["step", "split", "prompt", "completion", "reward",
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
                '<label>text <input id="f-text" type="search" placeholder="in prompt, completion, error"></label>'
                '<button id="f-prev" type="button">← previous</button><button id="f-next" type="button">next →'
                f'</button><span id="samples-info">{len(rows):,} samples</span></div>')
    payload = {"runs": [run.label for run in runs], "rows": rows, "page_size": SAMPLES_PER_PAGE}
    # Inside a <script> element only "</" could end it early: with <, > and & as \\u escapes the JSON holds none.
    data = (json.dumps(payload, ensure_ascii=False, allow_nan=False)
            .replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e"))
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
    generated = datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")
    sections = [_runs_section(runs), _curves_section(runs), _final_section(runs), _timings_section(runs),
                _data_section(runs), _samples_section(runs), _config_section(runs)]
    nav = "".join(f'<a href="#{anchor}">{name}</a>' for anchor, name in (
        ("runs", "Runs"), ("curves", "Curves"), ("final", "Final metrics"), ("timings", "Time"),
        ("data", "Data"), ("samples", "Samples"), ("config", "Config")))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
            f'<header><h1>{html.escape(heading)}</h1><p class="sub">posttrain run report, generated {generated}</p>'
            f"<nav>{nav}</nav></header>{''.join(sections)}</body></html>\n")


def write_report(run_dirs: Sequence[str | os.PathLike[str]], output: str | os.PathLike[str]) -> Path:
    """Write one self-contained HTML report of `run_dirs` to `output` and return its path.

    One run: that run's report. Several: their curves overlaid (one colour per run, named in each legend), their
    final metrics side by side and the config keys that differ. An `output` that is a folder (or ends in a
    slash) gets report.html inside it; a write that fails leaves no temporary file behind. Raises ReportError naming the directory when one
    has no metrics.jsonl; a metrics.jsonl corrupt in the middle raises read_metrics' ValueError (file and line).
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
    tmp_path = output.with_name(output.name + ".tmp")
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
