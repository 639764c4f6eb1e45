"""A weighted mixture of environments: every component scores each reply, and the reward is the dict of their
rewards by component name, e.g. {"correct": 1.0, "preference": 0.31, "judge": 0.78}.

    environment:
      kind: mixture
      options:
        components:
          - {name: correct, kind: arithmetic, weight: 1.0}
          - {name: preference, kind: reward_model, weight: 0.5, options: {path: runs/rm/final}}
          - {name: judge, kind: judge, weight: 0.2, options: {base_url: "http://127.0.0.1:8000", model: judge}}

The reward is a dict of named components like any multi-component environment's, so the loop treats it as such:
`reward_weights` ({name: weight}) combines it into the weighted sum the grpo/rloo/... estimators use (and
advantage.component_weights may override a weight), gdpo normalizes each component on its own, and every
component is logged as `reward/<name>`. A component whose own reward is a dict (math with reward_components, several
python functions) contributes the weighted sum of its parts, with its own reward_weights.

A sample is masked when any component fails on it (raised, timed out, NaN, no score from a judge): its reward is
None and its error names each failing component, so a broken component can never pass for a reward of 0. The
components' metadata are merged into the row's, in the order given (a later component's key replaces an earlier
one's), so a verifier's `correct` still gives the accuracy metric.

Single-turn only: a component that asks to continue an episode is an error. Options of every component are
checked against that component's constructor when the config loads (`mixture_option_problems`). The data columns a
component needs (an arithmetic component's `answer`) are checked when its first reward is computed.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Mapping
from typing import Any

from posttrain.envs.base import EnvStep, Message, check_batch, single_turn_step
from posttrain.envs.rewards import DEFAULT_WORKER_MEMORY_MB, combine_components, validate_reward

COMPONENT_KEYS = ("name", "kind", "weight", "options")
RESERVED_NAMES = frozenset({"mean", "std", "errors", "errors_total"})
"""Names the loop already logs under reward/, which a component would overwrite."""


def mixture_option_problems(options: Mapping[str, Any]) -> list[str]:
    """What is wrong with a mixture's `components`, one message per problem, each naming the component (by its
    index and name) and the key: missing or unknown keys, duplicate or reserved names, unknown or nested kinds, a
    weight that is no number, and each component's own options as `registry.option_problems` checks them."""
    from posttrain.envs.registry import ENVIRONMENTS, option_problems

    components = options.get("components")
    if not isinstance(components, list) or not components:
        return ["options.components: a mixture needs a non-empty list of components, each {name, kind, weight, "
                "options}"]
    problems, seen = [], set()
    for index, component in enumerate(components):
        where = f"options.components[{index}]"
        if not isinstance(component, Mapping):
            problems.append(f"{where}: expected a mapping {{name, kind, weight, options}}, got {component!r}")
            continue
        name = component.get("name")
        where = f"{where} ({name})" if isinstance(name, str) else where
        unknown = sorted(set(component) - set(COMPONENT_KEYS))
        if unknown:
            problems.append(f"{where}: unknown keys {unknown}; a component has {', '.join(COMPONENT_KEYS)}")
        if not isinstance(name, str) or not name or "/" in name:
            problems.append(f"{where}.name: a non-empty name without '/' is required (it is logged as "
                            f"reward/<name>), got {name!r}")
        elif name in RESERVED_NAMES:
            problems.append(f"{where}.name: {name!r} is taken by the loop's own reward/{name}; choose another")
        elif name in seen:
            problems.append(f"{where}.name: {name!r} is used by two components")
        seen.add(name)
        weight = component.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            problems.append(f"{where}.weight: expected a finite number, got {weight!r}")
        kind = component.get("kind")
        if kind == "mixture" or kind not in ENVIRONMENTS:
            known = ", ".join(sorted(k for k in ENVIRONMENTS if k != "mixture"))
            problems.append(f"{where}.kind: expected one of {known} (mixtures do not nest), got {kind!r}")
            continue
        component_options = component.get("options", {})
        if not isinstance(component_options, Mapping):
            problems.append(f"{where}.options: expected a mapping of the {kind} environment's options, got "
                            f"{component_options!r}")
            continue
        if "worker_memory_mb" in component_options:
            problems.append(f"{where}.options.worker_memory_mb: set environment.worker_memory_mb instead, the one "
                            "place for the reward workers' memory limit")
            continue
        problems += [f"{where}: {problem}" for problem in option_problems(kind, component_options)]
    return problems


class MixtureEnvironment:
    """Single turn. Reward: {component name: that component's reward} (see the module docstring).

    components: [{name, kind, weight (default 1), options (default {})}, ...], each an environment of the registry.
    worker_memory_mb: passed to the components that run reward workers (python, math).
    Metadata out: the row's metadata updated with each component's, in order.
    """

    def __init__(self, components: list[dict[str, Any]], worker_memory_mb: int = DEFAULT_WORKER_MEMORY_MB):
        from posttrain.envs.registry import ENVIRONMENTS, build_environment

        problems = mixture_option_problems({"components": components})
        if problems:
            raise ValueError("; ".join(problems))
        self.reward_weights = {c["name"]: float(c.get("weight", 1.0)) for c in components}
        self.environments: dict[str, Any] = {}
        try:
            for component in components:
                kind = component["kind"]
                limit = ({"worker_memory_mb": worker_memory_mb}
                         if "worker_memory_mb" in inspect.signature(ENVIRONMENTS[kind]).parameters else {})
                spec = {"kind": kind, **limit, **component.get("options", {})}
                self.environments[component["name"]] = build_environment(spec)
        except BaseException:  # a later component failed to build: stop the earlier ones' workers first
            self.close()
            raise

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        check_batch(message_logs, metadata)
        steps = {name: environment.step(message_logs, metadata) for name, environment in self.environments.items()}
        for name, step in steps.items():
            if not all(step.done):
                raise ValueError(f"the mixture's component {name!r} continued an episode; a mixture combines "
                                 "single-turn environments only")
        rewards, errors, metadata_out = [], [], []
        for index, row in enumerate(metadata):
            components: dict[str, float] = {}
            problems: list[str] = []
            merged = dict(row)
            for name, step in steps.items():
                merged.update(step.metadata[index])
                value, problem = self._component_value(name, step.rewards[index])
                if problem is not None:
                    problems.append(f"{name}: {step.errors[index] or problem}")
                else:
                    components[name] = value
            rewards.append(None if problems else components)
            errors.append("; ".join(problems) if problems else None)
            metadata_out.append(merged)
        return single_turn_step(rewards, errors, metadata_out)

    def close(self) -> None:
        """Close every component (stopping their worker processes)."""
        for environment in self.environments.values():
            environment.close()

    def _component_value(self, name: str, reward: Any) -> tuple[float | None, str | None]:
        """(the component's reward as one float, None), or (None, why it has none)."""
        checked, problem = validate_reward(reward)
        if problem is not None:
            return None, f"the reward {problem}"
        if isinstance(checked, dict):  # its parts, combined with the component's own weights (1 where it has none)
            weights = getattr(self.environments[name], "reward_weights", {})
            return combine_components(checked, {part: weights.get(part, 1.0) for part in checked}), None
        return checked, None
