"""The recipes' environments: built from the config's `environment` section, with the models they score with.

Environments never load models (ARCHITECTURE.md, "The driver seam"): a judge with a local `path` and a reward model
are built here, on the recipe's side of the seam, and handed to `posttrain.envs.registry.build_environment`, which
builds the environment around them. A mixture's components get theirs under their names.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from posttrain.config.environments import (
    GdpvalOptions,
    HleOptions,
    JudgeOptions,
    MixtureOptions,
    RewardModelOptions,
    SweOptions,
    ToolsOptions,
    environment_section,
)
from posttrain.config.schema import ModelConfig
from posttrain.data.tokenize import tokenize_prompt
from posttrain.envs.base import Environment, Message
from posttrain.envs.registry import build_environment
from posttrain.envs.tools import detect_tool_call_format
from posttrain.generation.base import SamplingParams
from posttrain.generation.transformers_backend import TransformersGenerator
from posttrain.models.loading import default_device, load_causal_lm, load_tokenizer
from posttrain.workers.reward_model import RewardModel


RewardModelBuilder = Callable[[RewardModelOptions], Any]
"""Builds the reward model of reward_model options somewhere else than this process (`RayCluster.reward_model`)."""


class LocalJudgeModel:
    """A causal LM in this process as an LLM judge (`posttrain.envs.judge.JudgeModel`): loaded once, frozen, and
    run greedily in batches of `batch_size` by posttrain's transformers generator."""

    def __init__(self, path: str, max_new_tokens: int, batch_size: int = 16, use_chat_template: bool = True,
                 device: str | None = None):
        model_cfg = ModelConfig(name_or_path=path)
        self.tokenizer = load_tokenizer(model_cfg, padding_side="left")
        model = load_causal_lm(model_cfg, device=device if device is not None else default_device()).eval()
        model.requires_grad_(False)
        self.generator: TransformersGenerator | None = TransformersGenerator(model, self.tokenizer,
                                                                             batch_size=batch_size)
        self.max_new_tokens = max_new_tokens
        self.use_chat_template = use_chat_template and self.tokenizer.chat_template is not None

    def complete(self, conversations: list[list[Message]]) -> list[str]:
        """The judge's greedy reply to each conversation: rendered with its chat template when it has one (and
        use_chat_template is on), else as the messages' contents joined by blank lines."""
        if not conversations:
            return []
        prompts = [tokenize_prompt(c if self.use_chat_template else "\n\n".join(m["content"] for m in c),
                                   self.tokenizer) for c in conversations]
        output = self.generator.generate(prompts, SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0))
        return [samples[0].text for samples in output.completions]

    def close(self) -> None:
        """Free the model (with the generator that holds it)."""
        self.generator = None


def environment_model(options: Any, reward_model: RewardModelBuilder | None = None) -> Any:
    """The model an environment's options ask for, built: a `RewardModel` for reward_model options (by
    `reward_model` when given: a Ray reward group's, cluster.reward_workers), a `LocalJudgeModel` for a judge with
    a local path (also the judge of hle and gdpval options); None for every other environment."""
    if isinstance(options, RewardModelOptions):
        if reward_model is not None:
            return reward_model(options)
        return RewardModel.from_pretrained(options.path, device=options.device, batch_size=options.batch_size,
                                           max_length=options.max_length)
    if isinstance(options, (HleOptions, GdpvalOptions)):
        return environment_model(options.judge)
    if isinstance(options, JudgeOptions) and options.loads_model:
        return LocalJudgeModel(options.path, options.max_new_tokens, options.batch_size, options.use_chat_template,
                               options.device)
    return None


def environment_models(options: Any, reward_model: RewardModelBuilder | None = None) -> dict[str, Any]:
    """The models `build_environment` takes for `options`: under "" the environment's own, under each mixture
    component's name that component's; environments that score without a model get none."""
    if isinstance(options, MixtureOptions):
        models = {c.name: environment_model(c.options, reward_model) for c in options.components}
    else:
        models = {"": environment_model(options, reward_model)}
    return {where: model for where, model in models.items() if model is not None}


def build_recipe_environment(section: Any, tokenizer: Any = None,
                             reward_model: RewardModelBuilder | None = None) -> Environment:
    """The environment of a recipe config's `environment` section (or of its YAML mapping, {kind, options, ...}),
    with the models it scores with built and handed in. `tokenizer`: the policy's, from whose chat template (and
    model type) a tools environment with tool_call_format auto learns how the model writes tool calls.
    `reward_model`: builds the reward model of reward_model options (a Ray reward group's); loaded here without."""
    if isinstance(section, Mapping):
        section = environment_section(section)
    call_format = None
    if isinstance(section.options, (ToolsOptions, SweOptions)) and tokenizer is not None:
        call_format, _ = detect_tool_call_format(tokenizer.chat_template, _model_type(tokenizer.name_or_path))
    return build_environment(section.options, worker_memory_mb=section.worker_memory_mb,
                             models=environment_models(section.options.task.typed_options
                                                       if isinstance(section.options, ToolsOptions)
                                                       else section.options, reward_model),
                             tool_call_format=call_format)


def _model_type(name_or_path: str) -> str | None:
    """The model_type of a local model directory's config.json (None for a hub id or a directory without one):
    what picks the tool-call format when the chat template does not show it."""
    config = Path(name_or_path) / "config.json" if name_or_path else None
    if config is None or not config.is_file():
        return None
    return json.loads(config.read_text(encoding="utf-8")).get("model_type")
