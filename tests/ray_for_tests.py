"""Shared by the Ray tests: their skip marker where Ray is not installed, and the step-by-step comparison of a Ray
run's metrics with the in-process run's."""

import importlib.util

import pytest

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="cluster.backend=ray needs the ray extra (pip install 'posttrain[ray]')")


def assert_same_steps(local: list[dict], remote: list[dict], keys: tuple[str, ...]) -> None:
    """The same steps, and at each the same value of every metric in `keys` (to 1e-5)."""
    assert [r["step"] for r in local] == [r["step"] for r in remote]
    for a, b in zip(local, remote):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (a["step"], key)
