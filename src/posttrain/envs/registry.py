"""Build an environment from a spec such as `{"kind": "math", "timeout_s": 5.0, "num_workers": 4}`.

`kind` picks the class; every other key is a keyword argument of its constructor:

- "arithmetic": `ArithmeticEnvironment()` (no options)
- "math": `MathEnvironment(timeout_s, num_workers, format_weight, reward_components)`
- "python": `PythonRewardEnvironment(functions, timeout_s, num_workers, samples_per_call, reward_components)`
- "code": `CodeEnvironment(time_limit_s, memory_limit_mb, output_limit_bytes, num_workers, all_or_nothing)`
- "reward_model": `RewardModelEnvironment(path, conversational, batch_size, max_length, device)` (a `posttrain rm` model)
- "judge": `JudgeEnvironment(path | base_url + model, template, score_pattern, min_score, max_score, ...)` (an LLM judge)
- "mixture": `MixtureEnvironment(components, worker_memory_mb)`: several of the above, one named reward component each

How many failed samples a step tolerates (`max_error_fraction`) belongs to the training loop
(`rewards.RewardErrorBudget`), not to the environment.

The constructors are the one definition of each environment's options: `option_problems` checks names and
types against their signatures, so that the GRPO config (environment.options) is refused at load, naming the
option and the environment, instead of failing inside a constructor after the data has been read.
`NEEDED_COLUMNS` says which data columns an environment scores against, so that rows are checked with the data,
before a model loads, instead of at the first reward.
"""

from __future__ import annotations

import difflib
import inspect
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError

from posttrain.errors import RunError
from posttrain.envs.arithmetic_env import ArithmeticEnvironment
from posttrain.envs.base import Environment
from posttrain.envs.code import CodeEnvironment
from posttrain.envs.judge import JudgeEnvironment
from posttrain.envs.mixture import MixtureEnvironment, mixture_option_problems
from posttrain.envs.math import MathEnvironment
from posttrain.envs.python_reward import PythonRewardEnvironment
from posttrain.envs.reward_model_env import RewardModelEnvironment

ENVIRONMENTS: dict[str, type] = {
    "arithmetic": ArithmeticEnvironment,
    "math": MathEnvironment,
    "python": PythonRewardEnvironment,
    "code": CodeEnvironment,
    "reward_model": RewardModelEnvironment,
    "judge": JudgeEnvironment,
    "mixture": MixtureEnvironment,
}


NEEDED_COLUMNS: dict[str, tuple[str, ...]] = {
    "arithmetic": ("answer",),
    "math": ("answer",),
    "code": ("tests", "assert_code"),
}
"""The data columns each environment scores a reply against: every row needs at least one of them. python
functions take the columns they name (a missing one is None) and a reward model needs none."""

REWARD_ONLY = frozenset({"python", "reward_model", "judge"})
"""The environments that give a reward and never say whether a reply is correct; the verifiers (arithmetic, math,
code) put `correct` in each episode's metadata, for accuracy and pass@k, and so does a mixture with a verifier."""


def build_environment(spec: Mapping[str, Any]) -> Environment:
    """The environment `spec["kind"]`, constructed with the spec's other keys as keyword arguments.

    Raises ValueError for an unknown kind and TypeError (naming each option) for options its constructor does
    not take or whose values have the wrong type; see `option_problems`."""
    options = dict(spec)
    kind = options.pop("kind", None)
    if kind not in ENVIRONMENTS:
        raise ValueError(f"environment kind must be one of {sorted(ENVIRONMENTS)}, got {kind!r}")
    problems = option_problems(kind, options)
    if problems:
        raise TypeError(f"environment kind {kind!r}: {'; '.join(problems)}")
    try:
        return ENVIRONMENTS[kind](**options)
    except ValueError as error:  # a constructor refusing an option's value (a negative time limit, say)
        raise EnvironmentOptionError(f"environment.options of the {kind} environment: {error}") from error


class EnvironmentOptionError(RunError, ValueError):
    """An environment's constructor refused the value of one of its options: a message, not a traceback."""


def option_problems(kind: str, options: Mapping[str, Any]) -> list[str]:
    """What is wrong with `options` for the environment `kind`, one message per option, each naming the option
    (as options.NAME) and the environment: names its constructor does not take, required ones left out, and
    values that do not match its annotation. Types are checked strictly (an int is a float, a string is not a
    number), since the values come typed from YAML and are passed to the constructor as they are."""
    cls = ENVIRONMENTS[kind]
    parameters = inspect.signature(cls).parameters
    accepted = ", ".join(parameters) or "none"
    hints = typing.get_type_hints(cls) if cls.__init__ is object.__init__ else typing.get_type_hints(cls.__init__)
    problems = []
    for name, value in options.items():
        if name not in parameters:
            close = difflib.get_close_matches(name, list(parameters), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"options.{name}: the {kind} environment has no option {name!r}{hint}; "
                            f"its options are {accepted}")
            continue
        try:
            TypeAdapter(hints[name]).validate_python(value, strict=True)
        except ValidationError:
            problems.append(f"options.{name}: the {kind} environment expects {parameters[name].annotation}, "
                            f"got {value!r} ({type(value).__name__})")
    for name, parameter in parameters.items():
        if parameter.default is inspect.Parameter.empty and name not in options:
            problems.append(f"options.{name}: required by the {kind} environment (its options are {accepted})")
    if kind == "mixture" and not problems:  # its components are environments with options of their own
        problems += mixture_option_problems(options)
    return problems
