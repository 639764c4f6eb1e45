"""Rewards from plain Python functions named by import path.

Convention (batched, as in TRL): a reward function is called with keyword arguments

    fn(prompts=[...], completions=[...], **columns) -> list[float | None]

where `prompts` are the contents of the last user message before each reply, `completions` the
contents of the replies, and `columns` one list per metadata column of the batch's rows (a row
without the column gives None). It returns exactly one float per completion, or None for a
completion it cannot score (which masks that sample). A function that declares `**kwargs`
receives every column; one that does not receives only the columns it names. TRL reward
functions such as `def accuracy(completions, answer, **kwargs)` work unchanged as long as their
completions are plain strings.

A function is named "package.module:function" (found on sys.path) or "path/to/file.py:function".
It runs in worker processes (`rewards.RewardWorkerPool`) with a time limit of `timeout_s` per
sample: calls of `samples_per_call` completions (default 1, so one slow or failing sample masks
only itself) get `samples_per_call * timeout_s` seconds each. Larger calls amortize a function's
per-call cost (a model forward pass, say) at the price of masking the whole call when it fails.
With `num_workers=0` the functions run in the calling thread with no time limit, for debugging.
Each worker may use `worker_memory_mb` of address space (0: no limit); what a function prints is
kept out of the console and shown, its last bytes, in the error of a call that fails.

Several functions combine into named components: `functions=[("accuracy", "my.rewards:accuracy",
1.0), ("length", "my.rewards:length_penalty", 0.1)]` gives the rewards
`{"accuracy": ..., "length": ...}` (`reward_components=True`, the default for several functions)
or their weighted sum (`reward_components=False`, the default for one function); `reward_weights`
holds the weights. A sample is masked when any of its functions fails on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.envs.base import (
    EnvStep,
    Message,
    Reward,
    check_batch,
    prompt_of,
    reply_of,
    single_turn_step,
)
from posttrain.envs.rewards import (
    DEFAULT_WORKER_MEMORY_MB,
    CallOutcome,
    RewardWorkerPool,
    Task,
    accepted_keywords,
    load_function,
    score_in_process,
    split_batched_outcome,
    validate_reward,
)

RESERVED_ARGUMENTS = ("prompts", "completions")
DICT_VALUE_ERROR = (
    "returned a dict; a reward function returns one float per completion "
    "(combine several functions for named components)"
)


@dataclass(frozen=True)
class RewardFunction:
    """One reward function of a `PythonRewardEnvironment`."""

    path: str
    """Import path: "package.module:function" or "path/to/file.py:function"."""
    name: str
    """Name of its reward component (and in error messages)."""
    weight: float = 1.0
    """Weight in the weighted sum of components."""


def _as_reward_function(spec: str | Sequence[Any] | Mapping[str, Any] | RewardFunction) -> RewardFunction:
    if isinstance(spec, RewardFunction):
        return spec
    if isinstance(spec, str):
        return RewardFunction(path=spec, name=spec.rpartition(":")[2])
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"path", "name", "weight"}
        if unknown or "path" not in spec:
            raise ValueError(f"a reward function spec needs 'path' and may have 'name' and 'weight'; got {dict(spec)}")
        name = spec.get("name", spec["path"].rpartition(":")[2])
        return RewardFunction(path=spec["path"], name=name, weight=float(spec.get("weight", 1.0)))
    if len(spec) != 3:
        raise ValueError(f"a reward function given as a sequence must be (name, path, weight); got {spec!r}")
    name, path, weight = spec
    return RewardFunction(path=path, name=name, weight=float(weight))


class PythonRewardEnvironment:
    """Single turn. Rewards from one or several batched Python reward functions (see the module docstring)."""

    def __init__(
        self,
        functions: str | Sequence[str | Sequence[Any] | Mapping[str, Any] | RewardFunction],
        timeout_s: float = 10.0,
        num_workers: int = 2,
        samples_per_call: int = 1,
        reward_components: bool | None = None,
        worker_memory_mb: int = DEFAULT_WORKER_MEMORY_MB,
    ):
        """`functions`: one import path, or a list of import paths, (name, path, weight) triples,
        {"name", "path", "weight"} dicts or `RewardFunction`s. `timeout_s`: time limit per sample.
        `num_workers`: worker processes (0: call in this thread without a time limit).
        `samples_per_call`: completions per call of a function. `reward_components`: dict rewards
        keyed by function name (default: True for several functions, False for one).
        `worker_memory_mb`: address-space limit of each worker process (0: none)."""
        specs = [functions] if isinstance(functions, str) else list(functions)
        if not specs:
            raise ValueError("PythonRewardEnvironment needs at least one reward function")
        self.functions = [_as_reward_function(spec) for spec in specs]
        names = [f.name for f in self.functions]
        if len(set(names)) != len(names):
            raise ValueError(f"reward function names must be distinct, got {names}; name them explicitly")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be 0 (in-process) or more, got {num_workers}")
        if samples_per_call < 1:
            raise ValueError(f"samples_per_call must be at least 1, got {samples_per_call}")
        # Import here too: a bad path fails at construction with a precise message, not as masked samples.
        self._callables = {f.name: load_function(f.path) for f in self.functions}
        self._keywords = {name: accepted_keywords(fn) for name, fn in self._callables.items()}
        self.timeout_s = timeout_s
        self.samples_per_call = samples_per_call
        self.reward_components = len(self.functions) > 1 if reward_components is None else reward_components
        self.reward_weights = {f.name: f.weight for f in self.functions}
        """How to sum the components of a dict reward into one number."""
        preload = [f.path for f in self.functions]
        self._pool = (
            RewardWorkerPool(num_workers, preload=preload, memory_limit_mb=worker_memory_mb) if num_workers > 0 else None
        )

    def _calls(
        self, function: RewardFunction, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]
    ):
        """(kwargs, number of samples) of each call of `function` over the batch."""
        columns = sorted({key for row in metadata for key in row})
        reserved = [c for c in columns if c in RESERVED_ARGUMENTS]
        if reserved:
            raise ValueError(
                f"metadata columns {reserved} clash with the reward function arguments {RESERVED_ARGUMENTS}"
            )
        accepted = self._keywords[function.name]
        for start in range(0, len(prompts), self.samples_per_call):
            stop = min(start + self.samples_per_call, len(prompts))
            kwargs = {"prompts": prompts[start:stop], "completions": completions[start:stop]}
            kwargs |= {c: [row.get(c) for row in metadata[start:stop]] for c in columns}
            if accepted is not None:
                kwargs = {k: v for k, v in kwargs.items() if k in accepted}
            yield kwargs, stop - start

    def _run(self, calls: list[tuple[RewardFunction, dict[str, Any], int]]) -> list[CallOutcome]:
        if self._pool is not None:
            return self._pool.run([Task(f.path, kwargs, self.timeout_s * size) for f, kwargs, size in calls])
        return [score_in_process(self._callables[f.name], [kwargs])[0] for f, kwargs, _ in calls]

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        check_batch(message_logs, metadata)
        completions = [reply_of(log) for log in message_logs]
        prompts = [prompt_of(log) for log in message_logs]
        calls = [
            (function, kwargs, size)
            for function in self.functions
            for kwargs, size in self._calls(function, prompts, completions, metadata)
        ]
        per_sample: dict[str, list[CallOutcome]] = {f.name: [] for f in self.functions}
        for (function, _, size), outcome in zip(calls, self._run(calls)):
            per_sample[function.name] += split_batched_outcome(outcome, size)

        rewards: list[Reward] = []
        errors: list[str | None] = []
        for index in range(len(message_logs)):
            components: dict[str, float] = {}
            sample_errors = []
            for function in self.functions:
                outcome = per_sample[function.name][index]
                value, error = (None, outcome.error) if outcome.error is not None else validate_reward(outcome.value)
                if error is None and isinstance(value, dict):
                    error = DICT_VALUE_ERROR
                if error is not None:
                    sample_errors.append(f"reward function {function.name!r} ({function.path}): {error}")
                else:
                    components[function.name] = value
            if sample_errors:
                rewards.append(None)
                errors.append("; ".join(sample_errors))
            elif self.reward_components:
                rewards.append(components)
                errors.append(None)
            else:
                rewards.append(sum(self.reward_weights[name] * value for name, value in components.items()))
                errors.append(None)
        return single_turn_step(rewards, errors, [dict(row) for row in metadata])

    def close(self) -> None:
        """Stop the worker processes (they also stop when the environment is garbage collected)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> PythonRewardEnvironment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
