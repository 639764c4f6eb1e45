"""Build an environment from its typed options (`posttrain.config.environments`): `MathOptions` builds a
`MathEnvironment`, `JudgeOptions` a `JudgeEnvironment`, and so on.

The options classes are the one definition of each environment's options: the config loader checks them (names,
strict types) when the config loads, naming `environment.options.NAME`, so a misspelt option stops before the data
is read or a model loads. What a constructor still refuses (a negative time limit, a judge given both a path and a
server) is an `EnvironmentOptionError` naming the environment.

Environments never load models: a judge given a local `path` and a reward model are scored through models the
caller builds (`posttrain.algorithms.environments` does it for the recipes) and hands in as `models`, keyed by
where they are used: "" for the environment itself, a component's name for a mixture's components.

How many failed samples a step tolerates (`max_error_fraction`) belongs to the training loop
(`rewards.RewardErrorBudget`), not to the environment. `NEEDED_COLUMNS` says which data columns an environment scores
against, so that rows are checked with the data, before a model loads, instead of at the first reward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from posttrain.config.environments import (
    DEFAULT_WORKER_MEMORY_MB,
    REWARD_ONLY,
    AnyEnvironmentOptions,
    ArithmeticOptions,
    CodeOptions,
    CuaOptions,
    EnvironmentOptions,
    GdpvalOptions,
    HleOptions,
    JudgeOptions,
    MathOptions,
    MixtureOptions,
    PythonOptions,
    RewardModelOptions,
    SweOptions,
    ToolsOptions,
)
from posttrain.envs.arithmetic_env import ArithmeticEnvironment
from posttrain.envs.base import Environment
from posttrain.envs.code import CodeEnvironment
from posttrain.envs.cua.environment import CuaEnvironment
from posttrain.envs.cua.tasks import load_tasks as load_cua_tasks
from posttrain.envs.judge import JudgeEnvironment, JudgeModel, judge_backend
from posttrain.envs.judged.environments import GdpvalEnvironment, HleEnvironment
from posttrain.envs.judged.tasks import bundled_gdpval_tasks, bundled_hle_tasks, load_gdpval_tasks, load_hle_tasks
from posttrain.envs.math import MathEnvironment
from posttrain.envs.mixture import MixtureEnvironment
from posttrain.envs.python_reward import PythonRewardEnvironment
from posttrain.envs.reward_model_env import RewardModelEnvironment, RewardScorer
from posttrain.envs.rewards import load_function
from posttrain.envs.swe.bundled import ensure_bundled_tasks
from posttrain.envs.swe.environment import SweEnvironment
from posttrain.envs.swe.tasks import load_tasks
from posttrain.envs.tools import ToolEnvironment, tool_from_function, tool_from_schema
from posttrain.envs.tools.builtin import calculator_tool, file_tools, python_tool, search_tool
from posttrain.envs.tools.schema import Tool
from posttrain.errors import RunError

__all__ = ["NEEDED_COLUMNS", "REWARD_ONLY", "EnvironmentOptionError", "build_environment"]

NEEDED_COLUMNS: dict[str, tuple[str, ...]] = {
    "arithmetic": ("answer",),
    "math": ("answer",),
    "code": ("tests", "assert_code"),
    "swe": ("instance_id",),
    "cua": ("task_id",),
    "hle": ("id",),
    "gdpval": ("task_id",),
}
"""The data columns each environment scores a reply against: every row needs at least one of them. python
functions take the columns they name (a missing one is None) and a reward model needs none."""


class EnvironmentOptionError(RunError, ValueError):
    """An environment's constructor refused the value of one of its options: a message, not a traceback."""


def build_environment(options: AnyEnvironmentOptions, *, worker_memory_mb: int = DEFAULT_WORKER_MEMORY_MB,
                      models: Mapping[str, Any] | None = None, tool_call_format: str | None = None) -> Environment:
    """The environment of `options` (a `posttrain.config.environments` options object).

    worker_memory_mb: address-space limit of each reward worker process (python and math environments, also as
        mixture components); environment.worker_memory_mb in a recipe config.
    models: the models environments score with, built by the caller: under "" a `JudgeModel` for a judge with a
        local `path`, or a `RewardScorer` for a reward_model environment; a mixture's components' under their names.
    tool_call_format: for a tools environment whose options say auto, the format the model writes (the recipe
        detects it from the tokenizer: `envs.tools.detect_tool_call_format`); hermes when not given.
    Raises EnvironmentOptionError when a constructor refuses an option's value, and ValueError when a model the
    options need was not handed in."""
    models = dict(models or {})
    if isinstance(options, MixtureOptions):
        return _mixture(options, worker_memory_mb, models)
    if isinstance(options, ToolsOptions):
        return _tools(options, worker_memory_mb, models.get(""), tool_call_format or "hermes")
    if isinstance(options, SweOptions):
        return _swe(options, tool_call_format or "hermes")
    return _build_one(options, worker_memory_mb, models.get(""))


def _build_one(options: EnvironmentOptions, worker_memory_mb: int, model: Any) -> Environment:
    if options.loads_model and model is None:
        raise ValueError(f"the {options.kind} environment scores with a model the caller builds and hands in "
                         "(posttrain.algorithms.environments.build_recipe_environment does it from the config)")
    try:
        return _BUILDERS[type(options)](options, worker_memory_mb, model)
    except ValueError as error:  # a constructor refusing an option's value (a negative time limit, say)
        raise EnvironmentOptionError(f"environment.options of the {options.kind} environment: {error}") from error


def _mixture(options: MixtureOptions, worker_memory_mb: int, models: dict[str, Any]) -> MixtureEnvironment:
    environments: dict[str, Environment] = {}
    try:
        for component in options.components:
            try:
                environments[component.name] = _build_one(component.options, worker_memory_mb,
                                                           models.get(component.name))
            except EnvironmentOptionError as error:
                raise EnvironmentOptionError(f"environment.options.components ({component.name}): {error}") \
                    from error
    except BaseException:  # a later component failed to build: stop the earlier ones' workers first
        for environment in environments.values():
            environment.close()
        raise
    return MixtureEnvironment(environments, {c.name: c.weight for c in options.components})


def _tools(options: ToolsOptions, worker_memory_mb: int, model: Any, detected_format: str) -> ToolEnvironment:
    try:
        tools = [tool for index, entry in enumerate(options.tools) for tool in _tool_entry(options, index, entry)]
    except (ValueError, ImportError) as error:
        raise EnvironmentOptionError(f"environment.options.tools of the tools environment: {error}") from error
    try:
        task = _build_one(options.task.typed_options, worker_memory_mb, model)
    except EnvironmentOptionError as error:
        raise EnvironmentOptionError(f"environment.options.task: {error}") from error
    name = detected_format if options.tool_call_format == "auto" else options.tool_call_format
    try:
        return ToolEnvironment(task, tools, tool_call_format=name, max_output_chars=options.max_output_chars,
                               max_calls_per_turn=options.max_calls_per_turn,
                               max_episode_tokens=options.max_episode_tokens)
    except ValueError as error:
        task.close()
        raise EnvironmentOptionError(f"environment.options of the tools environment: {error}") from error


def _swe(options: SweOptions, detected_format: str) -> SweEnvironment:
    tasks = load_tasks(options.tasks or ensure_bundled_tasks(), options.repos_dir)  # SweTaskError names the line
    name = detected_format if options.tool_call_format == "auto" else options.tool_call_format
    try:
        return SweEnvironment(tasks, tool_call_format=name, command_timeout_s=options.command_timeout_s,
                              test_timeout_s=options.test_timeout_s, max_output_chars=options.max_output_chars,
                              max_calls_per_turn=options.max_calls_per_turn,
                              max_episode_tokens=options.max_episode_tokens)
    except ValueError as error:
        raise EnvironmentOptionError(f"environment.options of the swe environment: {error}") from error


def _tool_entry(options: ToolsOptions, index: int, entry: str | dict[str, Any]) -> list[Tool]:
    """The tools of `options.tools[index]`: a built-in's (files gives three), or a Python function's."""
    timeout = options.timeout_s
    if isinstance(entry, dict):
        timeout = float(entry.get("timeout_s", timeout))
        if "function" in entry:
            function = load_function(entry["function"])
            if "schema" in entry:
                return [tool_from_schema(entry["schema"], function, timeout_s=timeout)]
            return [tool_from_function(function, timeout_s=timeout)]
        entry = entry["name"]
    if entry == "calculator":
        return [calculator_tool(timeout)]
    if entry == "python":
        return [python_tool(timeout, options.python_memory_limit_mb, options.max_output_chars * 4,
                            options.allow_unisolated_fallback)]
    if entry == "files":
        return file_tools(timeout)
    if entry == "search":
        return [search_tool(timeout, options.search_corpus)]
    if ":" in entry:
        return [tool_from_function(load_function(entry), timeout_s=timeout)]
    raise ValueError(f"tools[{index}]: {entry!r} is neither a built-in tool (calculator, python, files, search) nor "
                     "an import path (pkg.module:function or file.py:function)")


def _judge(options: JudgeOptions, worker_memory_mb: int, model: JudgeModel | None) -> JudgeEnvironment:
    return JudgeEnvironment(**options.model_dump(exclude={"path", "batch_size", "use_chat_template", "device"}),
                            local_model=model)


def _judge_backend(options: JudgeOptions, model: JudgeModel | None) -> Any:
    return judge_backend(model, options.base_url, options.model, options.api_key_env, options.max_new_tokens,
                         options.timeout_s, options.max_response_bytes, options.max_retries, options.retry_backoff_s,
                         options.concurrency)


def _hle(options: HleOptions, worker_memory_mb: int, model: JudgeModel | None) -> HleEnvironment:
    tasks = load_hle_tasks(options.tasks or bundled_hle_tasks())  # JudgedTaskError names the line and field
    return HleEnvironment(tasks, _judge_backend(options.judge, model))


def _gdpval(options: GdpvalOptions, worker_memory_mb: int, model: JudgeModel | None) -> GdpvalEnvironment:
    tasks = load_gdpval_tasks(options.tasks or bundled_gdpval_tasks())  # JudgedTaskError names the line and field
    return GdpvalEnvironment(tasks, _judge_backend(options.judge, model))


def _cua(options: CuaOptions, worker_memory_mb: int, model: Any) -> CuaEnvironment:
    tasks = load_cua_tasks(options.tasks)  # CuaTaskError names the file, line and field
    return CuaEnvironment(tasks, episodes_dir=options.episodes_dir, max_steps=options.max_steps,
                          screen=(options.screen_width, options.screen_height),
                          start_timeout_s=options.start_timeout_s, action_timeout_s=options.action_timeout_s,
                          save_screenshots=options.save_screenshots, keep_episodes=options.keep_episodes)


def _reward_model(options: RewardModelOptions, worker_memory_mb: int, model: RewardScorer) -> RewardModelEnvironment:
    return RewardModelEnvironment(model, conversational=options.conversational)


_BUILDERS: dict[type, Callable[[Any, int, Any], Environment]] = {
    ArithmeticOptions: lambda options, worker_memory_mb, model: ArithmeticEnvironment(),
    MathOptions: lambda options, worker_memory_mb, model: MathEnvironment(**options.model_dump(),
                                                                          worker_memory_mb=worker_memory_mb),
    PythonOptions: lambda options, worker_memory_mb, model: PythonRewardEnvironment(**options.model_dump(),
                                                                                    worker_memory_mb=worker_memory_mb),
    CodeOptions: lambda options, worker_memory_mb, model: CodeEnvironment(**options.model_dump()),
    RewardModelOptions: _reward_model,
    JudgeOptions: _judge,
    HleOptions: _hle,
    GdpvalOptions: _gdpval,
    CuaOptions: _cua,
}
"""How each kind of options becomes its environment (mixtures: `_mixture`)."""
