"""The seam between models and recipe loops: worker protocols, local implementations, metrics with reductions.

See workers/base.py for the protocols (`PolicyWorker`, `ScoringWorker`, `CriticWorker`), workers/objectives.py for
the loss descriptions they take, workers/local.py for the in-process
implementations every recipe uses on one device, and posttrain.distributed for FSDP2 ones.
"""

from posttrain.workers.base import (
    CriticWorker,
    Exported,
    PolicyWorker,
    ScoringWorker,
    TrainBatch,
    WeightReceiver,
)
from posttrain.workers.metrics import Metric, MetricDict, all_reduce_metrics, as_floats, reduce_metrics
from posttrain.workers.reward_model import RewardModel

__all__ = [
    "RewardModel",
    "CriticWorker", "Exported", "Metric", "MetricDict", "PolicyWorker", "ScoringWorker", "TrainBatch",
    "WeightReceiver",
    "all_reduce_metrics", "as_floats", "reduce_metrics",
]
