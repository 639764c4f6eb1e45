"""Metrics that carry their own reduction, so one reducer serves micro-batches, optimizer updates and ranks.

A loss function or a worker returns `dict[str, Metric]`; the loop folds the records of a step together with
`reduce_metrics` (or `Metric.merge`), and only at the end turns them into plain floats with `as_floats`. The
reduction travels with the value instead of being guessed from the metric's name:

    Metric.sum(x)            added up (a loss already divided by the step's normalizer, a token count)
    Metric.mean(x, weight)   a weighted mean (per-token statistics weighted by the token count, per-pair ones by
                             the pair count); stored as (x * weight, weight) so partial sums merge exactly
    Metric.min(x), .max(x)   extremes (the smallest and largest importance ratio)

`all_reduce_metrics` applies the same rules across data-parallel ranks in one collective per reduction kind.

A value may be a 0-dim tensor still on the device: it is kept there (as float64, so sums and weighted means are
computed exactly as with Python floats) until `as_floats`, `materialized` or `all_reduce_metrics` reads every
metric of the step back in one transfer. So a loop's micro-batches never wait for the device to report a metric.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

Reduction = Literal["sum", "mean", "min", "max"]


Number = float | torch.Tensor
"""A Python number, or a 0-dim tensor (kept on its device, float64)."""


def _number(value) -> Number:
    """`value` as a float, or, for a tensor, detached as a 0-dim float64 tensor on its device (no sync)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64).reshape(())
    return float(value)


@dataclass(frozen=True)
class Metric:
    """One metric's partial value: for "mean", `total` is the weighted sum and `weight` the summed weight."""

    total: Number
    weight: Number
    reduction: Reduction

    @staticmethod
    def sum(value: Number) -> Metric:
        return Metric(_number(value), 1.0, "sum")

    @staticmethod
    def mean(value: Number, weight: Number = 1.0) -> Metric:
        weight = _number(weight)
        return Metric(_number(value) * weight, weight, "mean")

    @staticmethod
    def min(value: Number) -> Metric:
        return Metric(_number(value), 1.0, "min")

    @staticmethod
    def max(value: Number) -> Metric:
        return Metric(_number(value), 1.0, "max")

    @property
    def value(self) -> float:
        total, weight = float(self.total), float(self.weight)
        if self.reduction == "mean":
            return total / weight if weight else 0.0
        return total

    def merge(self, other: Metric) -> Metric:
        if other.reduction != self.reduction:
            raise ValueError(f"cannot merge a {self.reduction} metric with a {other.reduction} one")
        if self.reduction in ("min", "max"):
            a, b = self.total, other.total
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                device = (a if isinstance(a, torch.Tensor) else b).device
                # A float becomes a tensor by a fill on the device, not a copy from the host (no sync).
                a, b = (x if isinstance(x, torch.Tensor) else torch.full((), x, dtype=torch.float64, device=device)
                        for x in (a, b))
                return Metric(torch.minimum(a, b) if self.reduction == "min" else torch.maximum(a, b), 1.0,
                              self.reduction)
            return Metric(min(a, b) if self.reduction == "min" else max(a, b), 1.0, self.reduction)
        return Metric(self.total + other.total, self.weight + other.weight, self.reduction)


MetricDict = dict[str, Metric]


def materialized(metrics: Mapping[str, Metric]) -> MetricDict:
    """The metrics with plain float fields, every tensor among them read back in one transfer per device."""
    slots = [(name, field) for name, metric in metrics.items() for field in ("total", "weight")
             if isinstance(getattr(metric, field), torch.Tensor)]
    if not slots:
        return dict(metrics)
    read: dict[tuple[str, str], float] = {}
    by_device: dict[torch.device, list[tuple[str, str]]] = {}
    for slot in slots:
        by_device.setdefault(getattr(metrics[slot[0]], slot[1]).device, []).append(slot)
    for group in by_device.values():
        values = torch.stack([getattr(metrics[name], field) for name, field in group]).tolist()
        read.update(zip(group, values))
    return {name: Metric(read.get((name, "total"), metric.total), read.get((name, "weight"), metric.weight),
                         metric.reduction) for name, metric in metrics.items()}


def reduce_metrics(records: Iterable[Mapping[str, Metric]]) -> MetricDict:
    """Fold records key by key with each metric's own reduction (a key missing from a record is skipped)."""
    out: MetricDict = {}
    for record in records:
        for name, metric in record.items():
            out[name] = out[name].merge(metric) if name in out else metric
    return out


def as_floats(metrics: Mapping[str, Metric]) -> dict[str, float]:
    return {name: metric.value for name, metric in materialized(metrics).items()}


def all_reduce_metrics(metrics: Mapping[str, Metric], group=None) -> MetricDict:
    """The metrics reduced over every rank of the default process group (or `group`); every rank gets the result.

    Every rank must pass the same keys with the same reductions (the loops guarantee it: ranks run the same code
    on equally many micro-batches). Sums and means travel as one float64 SUM collective, minima and maxima as
    one MIN and one MAX.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(metrics)
    metrics = materialized(metrics)
    names = sorted(metrics)
    additive = [n for n in names if metrics[n].reduction in ("sum", "mean")]
    out: MetricDict = {}
    if additive:
        packed = torch.tensor([[metrics[n].total, metrics[n].weight] for n in additive], dtype=torch.float64)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        for name, (total, weight) in zip(additive, packed.tolist()):
            out[name] = Metric(total, weight, metrics[name].reduction)
    for reduction, op in (("min", dist.ReduceOp.MIN), ("max", dist.ReduceOp.MAX)):
        chosen = [n for n in names if metrics[n].reduction == reduction]
        if chosen:
            packed = torch.tensor([metrics[n].total for n in chosen], dtype=torch.float64)
            dist.all_reduce(packed, op=op, group=group)
            out.update({name: Metric(value, 1.0, reduction) for name, value in zip(chosen, packed.tolist())})
    return {name: out[name] for name in names}
