"""Where an online RL run's generation and environment workers live, and a distillation run's teachers:
`cluster.backend` (docs/ray.md).

    cluster = start_cluster(cfg.cluster, output_dir)      # None for backend=local; a RayCluster for backend=ray
    environment = cluster.environment(build, cfg.environment)
    generator = cluster.generator(model, tokenizer, ...)  # both behind the protocols the loop already speaks

A recipe entry point decorated with `@stops_clusters` shuts down every cluster it started when it returns or
fails, so a local Ray instance never outlives its run. Ray is an optional extra: it is imported here only when a
config asks for it (posttrain.distributed.ray_groups imports it at the top).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from posttrain.config.schema import ClusterSection, WeightSyncSection
from posttrain.errors import RunError
from posttrain.process_group import is_distributed

R = TypeVar("R")

_started: list[Any] = []
"""The clusters this process started for the run in progress (closed by `stops_clusters`)."""


def start_cluster(section: ClusterSection, weight_sync: WeightSyncSection, output_dir: Path) -> Any | None:
    """None for cluster.backend=local; for ray, a `RayCluster` (posttrain.distributed.ray_groups) on a local Ray
    instance started for this run or on the cluster at cluster.address. RunError under torchrun (Ray worker groups
    and torchrun ranks do not mix yet); ImportError naming the extra when ray is not installed."""
    if section.backend == "local":
        return None
    if is_distributed():
        raise RunError("cluster.backend=ray under torchrun: the Ray worker groups run from one driver process; "
                       "run without torchrun (or --nproc-per-node), or set cluster.backend=local")
    try:
        from posttrain.distributed.ray_groups import RayCluster  # optional extra, loaded only when asked for
    except ImportError as error:
        if error.name != "ray":
            raise
        raise ImportError("cluster.backend=ray needs the ray package: pip install 'posttrain[ray]'") from None
    cluster = RayCluster(section, weight_sync, output_dir)
    _started.append(cluster)
    return cluster


def stops_clusters(train: Callable[..., R]) -> Callable[..., R]:
    """Decorate a recipe's entry point: every cluster `start_cluster` started during the call is closed (actors
    killed, a local Ray instance shut down) when it returns or raises."""

    @functools.wraps(train)
    def run(*args, **kwargs) -> R:
        try:
            return train(*args, **kwargs)
        finally:
            while _started:
                _started.pop().close()

    return run
