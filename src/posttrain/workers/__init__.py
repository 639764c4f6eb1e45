"""The seam between models and recipe loops: worker protocols, local implementations, metrics with reductions.

See workers/base.py for the protocols (`PolicyWorker`, `ScoringWorker`, `CriticWorker`), workers/objectives.py for
the loss descriptions they take, workers/local.py for the in-process
implementations every recipe uses on one device, and posttrain.distributed for FSDP2 ones.
"""

from typing import Any

from posttrain.workers.base import (
    CriticWorker,
    Exported,
    PolicyWorker,
    ScoringWorker,
    TrainBatch,
    WeightReceiver,
)
from posttrain.workers.metrics import Metric, MetricDict, all_reduce_metrics, as_floats, reduce_metrics



def __getattr__(name: str) -> Any:  # lazy: RewardModel imports the data pipeline
    if name == "RewardModel":
        from posttrain.workers.reward_model import RewardModel

        return RewardModel
    raise AttributeError(f"module 'posttrain.workers' has no attribute {name!r}")


__all__ = [
    "RewardModel",
    "CriticWorker", "Exported", "Metric", "MetricDict", "PolicyWorker", "ScoringWorker", "TrainBatch",
    "WeightReceiver",
    "all_reduce_metrics", "as_floats", "reduce_metrics",
]
