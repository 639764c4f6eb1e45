"""Shared by the Ray tests: their skip marker where Ray is not installed, the step-by-step comparison of a Ray
run's metrics with the in-process run's, and a thread that kills a group's actor mid-run."""

import importlib.util
import threading
import time
from pathlib import Path

import pytest

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="cluster.backend=ray needs the ray extra (pip install 'posttrain[ray]')")


def assert_same_steps(local: list[dict], remote: list[dict], keys: tuple[str, ...]) -> None:
    """The same steps, and at each the same value of every metric in `keys` (to 1e-5)."""
    assert [r["step"] for r in local] == [r["step"] for r in remote]
    for a, b in zip(local, remote):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (a["step"], key)


class KillAfterSteps:
    """A thread that waits until the run logging to `metrics` has written `steps` steps, then kills actor 0 of the
    running cluster's group `group` (ray.kill, as if its process died) and records that actor's name in `killed`.
    Use as a context manager around the run; it gives up after 600 s."""

    def __init__(self, metrics: Path, group: str, steps: int = 2):
        self.metrics, self.group, self.steps = metrics, group, steps
        self.killed: list[str] = []
        self._thread = threading.Thread(target=self._kill, daemon=True)

    def _kill(self) -> None:
        import ray

        from posttrain.distributed import cluster as clusters

        give_up = time.monotonic() + 600
        while time.monotonic() < give_up:
            if self.metrics.is_file() and len(self.metrics.read_text().splitlines()) >= self.steps:
                group = next(g for g in clusters._started[0].groups if g.name == self.group)
                ray.kill(group.actors[0], no_restart=True)
                self.killed.append(group.worker_name(0))
                return
            time.sleep(0.02)

    def __enter__(self) -> "KillAfterSteps":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._thread.join(timeout=5)
