"""A stand-in for workers that live in another process: every call's arguments and result cross pickle.

`PickledCalls(worker)` forwards each call to `worker` after a pickle round trip of its arguments, and returns a
round trip of the result, as a Ray actor or a subprocess would. It shares no module with the caller
(`sampling_module()` is None, so a generator keeps its own copy), streams weights to a generator through pickle,
and records the name of every attribute the recipe asked for, so a test can check that a loop used nothing but the
worker protocols.

`pickle_every_worker(monkeypatch, calls)` makes every recipe build its workers wrapped so.
"""

from __future__ import annotations

import pickle
import time

from posttrain.algorithms import dpo, grpo, ppo, rl, rm, sft


def round_trip(value):
    return pickle.loads(pickle.dumps(value))


class PickledCalls:
    """A worker seen through pickle (see the module docstring); `calls` collects the names asked for."""

    def __init__(self, worker, calls: list[str]):
        self._worker, self._calls = worker, calls

    def __getattr__(self, name: str):
        self._calls.append(name)
        value = getattr(self._worker, name)
        if not callable(value):
            return round_trip(value)

        def call(*args, **kwargs):
            args, kwargs = round_trip((args, kwargs))
            return round_trip(value(*args, **kwargs))

        return call

    def sampling_module(self):
        """A worker in another process shares no module with the generator."""
        self._calls.append("sampling_module")
        return None

    def push_weights(self, generator) -> dict[str, float]:
        """The weights cross the process boundary tensor by tensor; the generator (on the driver's side) loads them."""
        self._calls.append("push_weights")
        started = time.perf_counter()
        streamed = (round_trip(item) for item in self._worker.named_weights())
        sent = generator.update_weights(self._worker.version, streamed)
        return {"weight_sync/seconds": time.perf_counter() - started, "weight_sync/bytes": float(sent)}

    def base_model_scorer(self, role: str = "reference"):
        self._calls.append("base_model_scorer")
        scorer = self._worker.base_model_scorer(role)
        return None if scorer is None else PickledCalls(scorer, self._calls)


def pickle_every_worker(monkeypatch=None, calls: list[str] | None = None) -> list[str]:
    """Make every recipe's policy, critic and scorers PickledCalls (through pytest's `monkeypatch`, or for good
    without one); returns the list of names they are asked for."""
    calls = [] if calls is None else calls
    patch = monkeypatch.setattr if monkeypatch is not None else setattr
    for module in (sft, dpo, rm, grpo, ppo, rl):
        for builder in ("build_policy", "build_critic", "build_scorer", "build_teacher"):
            real = getattr(module, builder, None)
            if real is not None:
                patch(module, builder, lambda *args, real=real, **kwargs: PickledCalls(real(*args, **kwargs), calls))
    return calls
