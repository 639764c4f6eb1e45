"""The seam between models and recipe loops: worker protocols, local implementations, metrics with reductions.

See workers/base.py for the protocols (`PolicyWorker`, `ScoringWorker`), workers/local.py for the in-process
implementations every recipe uses on one device, and posttrain.distributed for FSDP2 ones.
"""

from posttrain.workers.base import Exported, LossFn, MetricsFn, PolicyWorker, ScoringWorker
from posttrain.workers.metrics import Metric, MetricDict, all_reduce_metrics, as_floats, reduce_metrics

__all__ = [
    "Exported", "LossFn", "Metric", "MetricDict", "MetricsFn", "PolicyWorker", "ScoringWorker",
    "all_reduce_metrics", "as_floats", "reduce_metrics",
]
