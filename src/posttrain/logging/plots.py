"""OUTPUT/training_curves.png from metrics.jsonl.

Built on ``matplotlib.figure.Figure`` rather than pyplot: a Figure saved to .png renders with
Agg, needs no display, and touches no global pyplot state of the user's process.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from posttrain.logging.metrics import read_metrics

MAX_PANELS = 8

# Panels in this order first; each panel lists the metrics drawn on its axes. Loss and
# eval_loss share axes so over-fitting shows as the two curves parting.
_KNOWN_PANELS: tuple[tuple[str, ...], ...] = (
    ("loss", "eval_loss"),
    ("learning_rate",),
    ("grad_norm",),
    ("tokens_per_second",),
    ("reward/mean", "val/reward_mean"),
    ("accuracy", "val/accuracy"),
    ("kl",),
    ("entropy",),
    ("response_length/mean",),
)


def _is_number(value: Any) -> bool:
    """Plottable: a finite int or float (a diverged NaN/inf loss would wreck the axis scale)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _panels(records: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    numeric_keys = {key for record in records for key, value in record.items() if _is_number(value)} - {"step"}
    panels = [tuple(key for key in panel if key in numeric_keys) for panel in _KNOWN_PANELS]
    panels = [panel for panel in panels if panel]
    known = {key for panel in _KNOWN_PANELS for key in panel}
    panels += [(key,) for key in sorted(numeric_keys - known)]
    return panels


def plot_training_curves(metrics_path: str | os.PathLike[str], png_path: str | os.PathLike[str]) -> Path | None:
    """One panel per metric against step (at most MAX_PANELS, known metrics first).

    Returns the PNG path, or None without writing anything when there are no records.
    """
    metrics_path, png_path = Path(metrics_path), Path(png_path)
    records = read_metrics(metrics_path)
    if not records:
        return None
    panels = _panels(records)
    shown = panels[:MAX_PANELS]
    columns = 1 if len(shown) == 1 else 2
    rows = max(1, math.ceil(len(shown) / columns))

    figure = Figure(figsize=(6 * columns, 3 * rows), layout="constrained")
    title = metrics_path.resolve().parent.name
    if len(panels) > len(shown):
        title += f" ({len(panels) - len(shown)} more metrics in {metrics_path.name})"
    figure.suptitle(title)
    axes_grid = figure.subplots(rows, columns, squeeze=False)
    for axes, panel in zip(axes_grid.flat, shown):
        for key in panel:
            points = [(record["step"], record[key]) for record in records if _is_number(record.get(key))]
            steps, values = zip(*points)
            # Sparse series (eval_loss every eval_every steps) get markers so single points show.
            marker = "o" if len(points) < len(records) / 2 or len(points) == 1 else None
            axes.plot(steps, values, label=key, marker=marker, markersize=3)
        axes.set_title(" / ".join(panel))
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        if len(panel) > 1:
            axes.legend()
    for axes in list(axes_grid.flat)[len(shown) :]:
        axes.set_visible(False)

    png_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, dpi=100)
    return png_path
