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

Single-turn only: a component that asks to continue an episode is an error. The components' names, weights, kinds
and options are checked when the config loads (`posttrain.config.environments.MixtureOptions`); the registry builds
each component and hands them in. The data columns a component needs (an arithmetic component's `answer`) are
checked when its first reward is computed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain.envs.base import Environment, EnvStep, Message, check_batch, single_turn_step
from posttrain.envs.rewards import combine_components, validate_reward


class MixtureEnvironment:
    """Single turn. Reward: {component name: that component's reward} (see the module docstring).

    environments: {component name: its environment}, built (`registry.build_environment` builds them from
        `MixtureOptions`); the mixture closes them.
    reward_weights: {component name: weight} of the weighted sum the loop trains on.
    Metadata out: the row's metadata updated with each component's, in order.
    """

    def __init__(self, environments: Mapping[str, Environment], reward_weights: Mapping[str, float]):
        if set(environments) != set(reward_weights):
            raise ValueError(f"a weight for every component and no other: components {sorted(environments)}, "
                             f"weights {sorted(reward_weights)}")
        self.environments: dict[str, Any] = dict(environments)
        self.reward_weights = {name: float(reward_weights[name]) for name in environments}

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
