"""Pieces the online RL loops share (GRPO and PPO; on-policy distillation builds on them), and evaluation
(algorithms/evaluate.py) with them: loading and formatting prompts, building the generator for a policy worker or
a model, greedy validation; the set-up before and around the workers (`start_rl_run`: output directory, data,
environment, resume; `RLRun.rollout_source`: the rollout source and the resumed state) and the step's batch."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from posttrain.advantages import RunningRewardNorm
from posttrain.algorithms.common import (
    configure_torch,
    is_eval_step,
    prepare_output_dir,
    resume_trainer_state,
    seed_everything,
)
from posttrain.algorithms.rollout import (
    EPISODE_THREADS,
    Episode,
    PromptRow,
    overlong_penalty,
    rollout_metrics,
    run_episodes,
    to_batch,
)
from posttrain.algorithms.rollout_source import (
    AsynchronousRolloutSource,
    RolloutSource,
    SampledGroups,
    SynchronousRolloutSource,
)
from posttrain.checkpoint import Checkpoint, checkpoint_to_resume
from posttrain.config.schema import (EPISODE_HOLDING_KINDS, DataConfig, GRPOConfig, ModelConfig, PromptSection,
                                      RolloutSection, TrainerConfig)
from posttrain.data.dataset import DataStats, check_not_empty, iter_rows, skip_or_raise
from posttrain.data.errors import DataError
from posttrain.data.formats import PromptOnlyRow
from posttrain.data.sampler import EpochSampler, check_draw_fits
from posttrain.data.tokenize import check_prefix_preserving, tokenize_prompt
from posttrain.data.types import RolloutBatch
from posttrain.envs.base import Environment, tool_use_of
from posttrain.algorithms.environments import build_recipe_environment
from posttrain.envs.registry import NEEDED_COLUMNS
from posttrain.envs.rewards import RewardErrorBudget
from posttrain.errors import RunError
from posttrain.generation.base import Generator, SamplingParams
from posttrain.generation.transformers_backend import TransformersGenerator
from posttrain.models.loading import default_device, load_causal_lm, load_tokenizer, resolve_model_path
from posttrain.distributed.builders import build_scorer
from posttrain.distributed.cluster import start_cluster
from posttrain.workers import Metric, MetricDict, PolicyWorker, ScoringWorker, as_floats, reduce_metrics
from posttrain.workers.metrics import materialized


def load_prompts(sources: list[str], data: DataConfig, prompt: PromptSection, environment_kind: str | None,
                 tokenizer, limit: int | None = None) -> tuple[list[PromptRow], str]:
    """Prompt rows (every non-prompt column kept as metadata for the environment), formatted and tokenized once;
    at most `limit` of them (the first ones), and a one-line summary of what was read.

    `data` gives the column map, the malformed-row policy (data.on_error) and the longest prompt (data.max_length).
    A row lacking the column the environment `environment_kind` scores against (`registry.NEEDED_COLUMNS`: the
    answer, the tests) is malformed here, with the data, rather than at its first reward after a model has
    loaded; None checks no columns (prompts that nothing scores)."""
    if not sources:
        return [], "no data"
    data_cfg = data.model_copy(update={"format": "prompt_only"})
    stats = DataStats()
    prompts = []
    for location, row in iter_rows(sources, data_cfg, stats):
        assert isinstance(row, PromptOnlyRow)
        try:
            if environment_kind is not None:
                check_needed_columns(row, environment_kind, location)
            text = format_prompt(row, prompt, location)
            prompt_ids = tokenize_prompt(text, tokenizer)
            if len(prompt_ids) > data.max_length:
                raise DataError(location, f"the prompt has {len(prompt_ids)} tokens, more than "
                                f"data.max_length={data.max_length}", "prompt")
        except DataError as error:
            skip_or_raise(error, data.on_error, stats)
            continue
        prompts.append(PromptRow(text, prompt_ids, row.extras))
        if limit is not None and len(prompts) == limit:
            break
    stats.examples = len(prompts)
    check_not_empty(sources, stats)
    return prompts, stats.summary()


def offer_tools(prompts: list[PromptRow], tokenizer, environment: Environment, max_length: int) -> list[PromptRow]:
    """The prompts re-rendered with the environment's tools (the chat template's `tools=`) when it offers tools, a
    string prompt becoming one user message; unchanged otherwise. Refuses a chat template that rewrites history
    (`check_prefix_preserving`) and a prompt that no longer fits data.max_length."""
    tool_use = tool_use_of(environment)
    if tool_use is None:
        return prompts
    check_prefix_preserving(tokenizer, tool_use.tools)
    if prompts and tokenize_prompt(_as_messages(prompts[0].prompt), tokenizer) == \
            tokenize_prompt(_as_messages(prompts[0].prompt), tokenizer, tool_use.tools):
        warnings.warn(f"the chat template of tokenizer {tokenizer.name_or_path!r} does not render tools (it ignores "
                      "apply_chat_template's tools=), so the model is not shown the tools' descriptions; put them "
                      "in prompt.system_prompt, or use a template with a tool section", RuntimeWarning, stacklevel=2)
    offered = []
    for index, row in enumerate(prompts):
        messages = _as_messages(row.prompt)
        prompt_ids = tokenize_prompt(messages, tokenizer, tool_use.tools)
        if len(prompt_ids) > max_length:
            raise RunError(f"prompt {index} has {len(prompt_ids)} tokens with the tools' descriptions rendered by the "
                           f"chat template, more than data.max_length={max_length}; raise data.max_length")
        offered.append(PromptRow(messages, prompt_ids, row.metadata))
    return offered


def _as_messages(prompt: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def check_needed_columns(row: PromptOnlyRow, kind: str, location: str) -> None:
    """DataError (at location, field: the column) when the row has none of the columns environment `kind`
    scores against."""
    needed = NEEDED_COLUMNS.get(kind, ())
    if needed and not any(column in row.extras for column in needed):
        either = " or ".join(repr(column) for column in needed)
        columns = ", ".join(["prompt", *sorted(row.extras)])
        raise DataError(location, f"missing: the {kind} environment scores each reply against the row's {either} "
                        f"(columns found: {columns}; data.column_map can rename one)", needed[0])


def format_prompt(row: PromptOnlyRow, prompt: PromptSection, location: str) -> str | list[dict]:
    """The row's prompt after prompt.template, as a string or (chat template, system prompt) as messages."""
    text = row.prompt
    if isinstance(text, str):
        try:
            text = prompt.template.format(prompt=text, **row.extras)
        except (KeyError, IndexError, ValueError) as error:
            raise DataError(location, f"prompt.template {prompt.template!r} cannot be filled: {error!r} (columns: "
                            f"prompt, {', '.join(sorted(row.extras))})", "prompt") from None
        if not prompt.use_chat_template:
            return text
        text = [{"role": "user", "content": text}]
    if prompt.system_prompt is not None and text[0]["role"] != "system":
        text = [{"role": "system", "content": prompt.system_prompt}, *text]
    return text


def build_generator(model: ModelConfig, backend: str, tokenizer, policy: PolicyWorker | None = None, *,
                    batch_size: int, seed: int, vllm_gpu_memory_utilization: float = 0.3) -> Generator:
    """The generator of every recipe and of `posttrain eval` / `generate`.

    With a `policy`: vLLM loaded with the policy's current weights (a resumed run's, not the starting model's),
    or the transformers backend sampling from the module the policy shares in this process (a LoRA policy's base
    model, into whose layers peft put the adapters), or from its own copy filled by the policy's weight pushes
    (a sharded policy on each rank of a data-parallel run, or one that shares no module).
    Without one: `model` itself, loaded for sampling (vLLM, or transformers on the default device)."""
    if backend == "vllm":
        from posttrain.generation.vllm_backend import VLLMGenerator

        generator = VLLMGenerator(resolve_model_path(model.name_or_path), seed=seed,
                                  gpu_memory_utilization=vllm_gpu_memory_utilization)
        if policy is not None:
            policy.push_weights(generator)
        return generator
    if policy is None:
        return TransformersGenerator(load_causal_lm(model, device=default_device()).eval(), tokenizer,
                                     batch_size=batch_size, seed=seed)
    module = policy.sampling_module()
    if module is not None:
        return TransformersGenerator(module, tokenizer, batch_size=batch_size, seed=seed,
                                     weights_version=policy.version)
    generator = TransformersGenerator(load_causal_lm(model, device=default_device()).eval(), tokenizer,
                                      batch_size=batch_size, seed=seed, owns_weights=True)
    policy.push_weights(generator)
    return generator


def validate(prompts: list[PromptRow], generator, environment, tokenizer, params: SamplingParams, max_turns: int,
             weights: dict[str, float]) -> dict[str, float]:
    """Greedy episodes on the eval prompts: val/reward_mean, val/accuracy (when the environment reports
    `correct`), val/response_length."""
    episodes, _ = run_episodes(prompts, 0, 1, generator, environment, tokenizer, params, max_turns)
    metrics = rollout_metrics(episodes, weights)
    out = {"val/reward_mean": metrics["reward/mean"], "val/response_length": metrics["response_length/mean"]}
    if "accuracy" in metrics:
        out["val/accuracy"] = metrics["accuracy"]
    return out


# ---- the set-up and bookkeeping GRPO and PPO share ------------------------------------------------------------


@dataclass(frozen=True)
class RLResult:
    """What `train_grpo` and `train_ppo` return."""

    output_dir: Path
    final_dir: Path
    steps: int
    final_metrics: dict[str, float]


def per_update_schedule(trainer: TrainerConfig, updates_per_step: int) -> TrainerConfig:
    """The learning-rate schedule counts optimizer steps; trainer.max_steps and warmup_steps count RL steps."""
    return trainer.model_copy(update={"max_steps": trainer.max_steps * updates_per_step,
                                      "warmup_steps": trainer.warmup_steps * updates_per_step})


def mean_over_updates(records: list[MetricDict]) -> dict[str, float]:
    """Each metric's mean over the step's optimizer updates (the extremes for ratio_min / ratio_max)."""
    per_update = ({name: m if m.reduction in ("min", "max") else Metric.mean(m.value)
                   for name, m in materialized(r).items()} for r in records)
    return as_floats(reduce_metrics(per_update))


def step_timings(sampled: SampledGroups, source: SynchronousRolloutSource, batch: RolloutBatch, *, logprobs: float,
                 train: float, step: float) -> dict[str, float]:
    """The step's time/... metrics and throughputs: the training batch's tokens (prompt and completion) per second
    of the whole step, sampled tokens per second of generation; and the epoch of the prompt sampler."""
    times = sampled.times
    return {"time/generate": times.generate, "time/score": times.score, "time/logprobs": logprobs,
            "time/train": train, "time/step": step, "tokens_per_second": float(batch.attention_mask.sum()) / step,
            "generation/tokens_per_second": times.generated_tokens / max(times.generate, 1e-9),
            "epoch": source.sampler.epochs_completed}


@dataclass
class RLData:
    """What an online RL loop reads before any model loads, so that a malformed row or reward path fails first."""

    tokenizer: Any
    prompts: list[PromptRow]
    """Training prompts, formatted and tokenized."""
    eval_prompts: list[PromptRow]
    """At most data.max_eval_examples validation prompts (greedy, every trainer.eval_every steps)."""
    data_summary: str
    environment: Environment


def load_rl_data(cfg: GRPOConfig, cluster: Any | None = None) -> RLData:
    """The tokenizer, the training and validation prompts (checked against the environment's columns and against
    rollout.prompts_per_step) and the environment of an RL config (GRPO, PPO): built here, or with a `cluster`
    (cluster.backend=ray) in its environment workers, or with cluster.reward_workers here around the cluster's
    reward group."""
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    kind = cfg.environment.kind
    prompts, data_summary = load_prompts(cfg.data.train_files, cfg.data, cfg.prompt, kind, tokenizer)
    eval_prompts = load_prompts(cfg.data.eval_files, cfg.data, cfg.prompt, kind, tokenizer)[0]
    check_draw_fits({"rollout.prompts_per_step": cfg.rollout.prompts_per_step}, len(prompts), "training prompts")
    if cluster is None:
        environment = build_recipe_environment(cfg.environment, tokenizer)
    elif cfg.cluster.reward_workers:
        # The reward model in a Ray group of its own: the environment (tokenizing, any other components) runs here,
        # and its reward model's passes in the group's actors.
        environment = build_recipe_environment(cfg.environment, tokenizer, reward_model=cluster.reward_model)
    else:
        # An episode that lives in an actor (tools, swe, cua) has all its turns go there, and its tools or desktop
        # may be slow: each actor answers as many calls at once as the rollout has episodes in flight, so one slow
        # episode holds back no other.
        concurrency = EPISODE_THREADS if kind in EPISODE_HOLDING_KINDS else 1
        environment = cluster.environment(build_recipe_environment, cfg.environment, tokenizer,
                                          concurrency=concurrency)
    prompts = offer_tools(prompts, tokenizer, environment, cfg.data.max_length)
    eval_prompts = offer_tools(eval_prompts[: cfg.data.max_eval_examples], tokenizer, environment, cfg.data.max_length)
    return RLData(tokenizer, prompts, eval_prompts, data_summary, environment)


def rollout_sampling(rollout: RolloutSection) -> tuple[SamplingParams, SamplingParams]:
    """(training sampling, greedy validation) parameters of the rollout section."""
    sampling = SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                              top_p=rollout.top_p, top_k=rollout.top_k, stop_strings=tuple(rollout.stop_strings))
    greedy = SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=0.0,
                            stop_strings=tuple(rollout.stop_strings))
    return sampling, greedy


def policy_generator(cfg: GRPOConfig, tokenizer, policy: PolicyWorker, cluster: Any | None = None) -> Generator:
    """The rollout.backend generator sampling from `policy` (see build_generator); with a `cluster`
    (cluster.backend=ray) its generation workers, loaded with the policy's current weights, unless
    cluster.colocated, where generation shares the driver's trained module as with backend=local, or with a policy
    group (cluster.policy_workers > 0) runs on its ranks, each filling a copy of its own in its process."""
    rollout = cfg.rollout
    if cluster is None or (cfg.cluster.colocated and not cfg.cluster.policy_workers):
        return build_generator(cfg.model, rollout.backend, tokenizer, policy, batch_size=rollout.generation_batch_size,
                               seed=cfg.seed, vllm_gpu_memory_utilization=rollout.vllm_gpu_memory_utilization)
    model = cfg.model.model_copy(update={"name_or_path": resolve_model_path(cfg.model.name_or_path)})
    if cfg.cluster.colocated:
        return cluster.colocated_generator(policy, model, tokenizer, batch_size=rollout.generation_batch_size,
                                           seed=cfg.seed)
    generator = cluster.generator(model, tokenizer, batch_size=rollout.generation_batch_size, seed=cfg.seed,
                                  backend=rollout.backend, lora=cfg.lora,
                                  vllm_gpu_memory_utilization=rollout.vllm_gpu_memory_utilization)
    policy.push_weights(generator)
    return generator


@dataclass
class RLRun:
    """What an online RL recipe (GRPO, PPO) sets up before and around its workers (`start_rl_run`)."""

    output_dir: Path
    changed_keys: list[str]
    device: torch.device
    data: RLData
    resume: Checkpoint | None
    reward_norm: RunningRewardNorm | None
    """The run's running reward statistics when environment.normalize_rewards is on."""
    sampling: SamplingParams
    """Training sampling (rollout.temperature, top_p, top_k, stop strings)."""
    greedy: SamplingParams
    """Greedy validation sampling."""
    cluster: Any | None = None
    """The run's Ray cluster (cluster.backend=ray: its generation and environment workers), or None."""

    def worker_dir(self, role: str) -> Path | None:
        """The checkpoint folder of worker `role` to resume from, or None for a new run."""
        return self.resume.worker_dir(role) if self.resume else None

    def rollout_source(self, cfg: GRPOConfig, generator: Generator, weights: dict[str, float],
                       dynamic_sampling: bool = False) -> tuple[RolloutSource, int]:
        """The run's rollout source sampling from `generator`, and the last finished step (0 for a new run). Call
        it after the workers are built: a resumed run restores the RNG here, with the sampler's position, the group
        counter, the reward-error counts and the running reward statistics."""
        sampler = EpochSampler(len(self.data.prompts), seed=cfg.seed, shuffle=cfg.data.shuffle)
        budget = RewardErrorBudget(cfg.environment.max_error_fraction)
        if cfg.rollout.asynchronous:
            source = AsynchronousRolloutSource(cfg, self.data.prompts, sampler, generator, self.data.environment,
                                               self.data.tokenizer, self.sampling, weights, budget,
                                               cfg.cluster.timeout_s, dynamic_sampling)
        else:
            source = SynchronousRolloutSource(cfg, self.data.prompts, sampler, generator, self.data.environment,
                                              self.data.tokenizer, self.sampling, weights, budget, dynamic_sampling)
        start_step, state = resume_trainer_state(self.resume, sampler)
        source.load_state_dict(state)
        if self.cluster is not None and "cluster" in state:  # the fault counts go on (max_restarts is per run)
            self.cluster.load_state_dict(state["cluster"])
        if state and self.reward_norm is not None:
            if "reward_norm" not in state:
                raise RunError("environment.normalize_rewards is on, but the checkpoint to resume holds no running "
                               "reward statistics (it was written with it off); resume with the setting it was "
                               "written with, or start a new output_dir")
            self.reward_norm.load_state_dict(state["reward_norm"])
        return source, start_step

    def cluster_metrics(self) -> dict[str, float]:
        """Each Ray worker group's heartbeat/<group>_seconds (since it last answered) and faults/<group>_restarts,
        _retried_samples; none locally."""
        return {} if self.cluster is None else self.cluster.metrics()

    def trainer_state(self, source: RolloutSource) -> dict:
        """What `rollout_source` reads back: saved in every checkpoint's trainer state (asked for only when one is
        written: an asynchronous source waits for its rounds in flight to keep them)."""
        state = source.state_dict()
        if self.cluster is not None:
            state["cluster"] = self.cluster.state_dict()
        if self.reward_norm is not None:
            state["reward_norm"] = self.reward_norm.state_dict()
        return state


def start_rl_run(cfg: GRPOConfig) -> RLRun:
    """Torch settings, the output directory, the seed, then the data and the environment (a malformed row or
    reward path fails before a model loads) and the checkpoint to resume from, if any. With cluster.backend=ray
    the cluster starts here (before the environment, which its workers build); the recipe's entry point is
    decorated with `stops_clusters`, which shuts it down when the run ends or fails."""
    configure_torch(cfg.trainer)
    output_dir, changed_keys = prepare_output_dir(cfg, cfg.output_dir)
    seed_everything(cfg.seed)
    device = default_device()
    cluster = start_cluster(cfg.cluster, cfg.weight_sync, output_dir)
    data = load_rl_data(cfg, cluster)
    sampling, greedy = rollout_sampling(cfg.rollout)
    reward_norm = RunningRewardNorm() if cfg.environment.normalize_rewards else None
    return RLRun(output_dir, changed_keys, device, data, checkpoint_to_resume(output_dir), reward_norm, sampling,
                 greedy, cluster)


def reference_worker(policy: PolicyWorker, cfg: GRPOConfig, device: torch.device,
                     cluster: Any | None = None) -> ScoringWorker:
    """π_ref, the starting model: the policy's own weights with its adapters switched off when it can give them
    (LoRA), else a frozen copy (with a Ray `cluster`: in its reference group, cluster.reference_workers, or on its
    policy group when it has one)."""
    return policy.base_model_scorer() or build_scorer(cfg.model, cfg.trainer, device, cluster=cluster)


def rollout_batch(episodes: list[Episode], cfg: GRPOConfig, run: RLRun, weights: dict[str, float],
                  metrics: dict[str, float]) -> RolloutBatch:
    """The step's episodes as a RolloutBatch: DAPO's overlong penalty added to the rewards, overlong filtering,
    then the rewards normalized by the run's running statistics (metrics updated) when that is on."""
    rollout = cfg.rollout
    penalties = [overlong_penalty(e.last_turn_length, e.truncated, rollout.max_new_tokens,
                                  rollout.overlong_buffer_length, rollout.overlong_penalty_factor) for e in episodes]
    batch = to_batch(episodes, run.data.tokenizer.pad_token_id, weights, rollout.overlong_filtering, penalties)
    return normalize_batch_rewards(batch, run.reward_norm, metrics)


def normalize_batch_rewards(batch: RolloutBatch, reward_norm: RunningRewardNorm | None,
                            metrics: dict[str, float]) -> RolloutBatch:
    """`batch` with its rewards normalized by the run's running statistics (updated with them first), and those
    statistics in `metrics`; `batch` itself when normalization is off."""
    if reward_norm is None:
        return batch
    rewards = reward_norm.normalize(batch.rewards, batch.valid)
    metrics.update({"reward/running_mean": reward_norm.mean, "reward/running_std": reward_norm.std})
    return replace(batch, rewards=rewards)


def due_evaluations(step: int, cfg: GRPOConfig, data: RLData, generator: Generator, greedy: SamplingParams,
                    weights: dict[str, float], evaluation, run_log) -> dict[str, float]:
    """The step's scheduled evaluations with the rollout generator: greedy validation on data.eval_files every
    trainer.eval_every steps (val/...), and the `evaluation:` sets that are due (eval/<name>/...)."""
    metrics: dict[str, float] = {}
    if data.eval_prompts and is_eval_step(step, cfg.trainer):
        metrics.update(validate(data.eval_prompts, generator, data.environment, data.tokenizer, greedy,
                                cfg.rollout.max_turns, weights))
    if evaluation.is_due(step):
        metrics.update(evaluation.run(step, generator, run_log))
    return metrics
