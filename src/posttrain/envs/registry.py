"""Build an environment from a spec such as `{"kind": "math", "timeout_s": 5.0, "num_workers": 4}`.

`kind` picks the class; every other key is a keyword argument of its constructor:

- "arithmetic": `ArithmeticEnvironment()` (no options)
- "math": `MathEnvironment(timeout_s, num_workers, format_weight, reward_components)`
- "python": `PythonRewardEnvironment(functions, timeout_s, num_workers, samples_per_call, reward_components)`
- "code": `CodeEnvironment(time_limit_s, memory_limit_mb, output_limit_bytes, num_workers, all_or_nothing)`
- "reward_model": `RewardModelEnvironment(path, conversational, batch_size, max_length, device)` (a `posttrain rm` model)

How many failed samples a step tolerates (`max_error_fraction`) belongs to the training loop
(`rewards.RewardErrorBudget`), not to the environment.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from posttrain.envs.arithmetic_env import ArithmeticEnvironment
from posttrain.envs.base import Environment
from posttrain.envs.code import CodeEnvironment
from posttrain.envs.math import MathEnvironment
from posttrain.envs.python_reward import PythonRewardEnvironment
from posttrain.envs.reward_model_env import RewardModelEnvironment

ENVIRONMENTS: dict[str, type] = {
    "arithmetic": ArithmeticEnvironment,
    "math": MathEnvironment,
    "python": PythonRewardEnvironment,
    "code": CodeEnvironment,
    "reward_model": RewardModelEnvironment,
}


def build_environment(spec: Mapping[str, Any]) -> Environment:
    """The environment `spec["kind"]`, constructed with the spec's other keys as keyword arguments."""
    options = dict(spec)
    kind = options.pop("kind", None)
    if kind not in ENVIRONMENTS:
        raise ValueError(f"environment kind must be one of {sorted(ENVIRONMENTS)}, got {kind!r}")
    cls = ENVIRONMENTS[kind]
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as error:
        accepted = [name for name in inspect.signature(cls).parameters]
        raise TypeError(f"environment kind {kind!r}: {error}; its options are {accepted or 'none'}") from None
    return cls(**options)
