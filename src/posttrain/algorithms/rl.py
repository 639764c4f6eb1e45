"""Pieces the online RL loops share (GRPO and PPO; on-policy distillation builds on them), and evaluation
(algorithms/evaluate.py) with them: loading and formatting prompts, building the generator for a policy worker or
a model, rollout statistics and greedy validation."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from posttrain.advantages import RunningRewardNorm
from posttrain.algorithms.rollout import Episode, PromptRow, RolloutTimes, run_episodes, scalar_reward
from posttrain.config.schema import DataConfig, GRPOConfig, ModelConfig, PromptSection, RolloutSection, TrainerConfig
from posttrain.data.dataset import DataStats, check_not_empty, iter_rows, skip_or_raise
from posttrain.data.errors import DataError
from posttrain.data.formats import PromptOnlyRow
from posttrain.data.sampler import check_draw_fits
from posttrain.data.tokenize import tokenize_prompt
from posttrain.data.types import RolloutBatch
from posttrain.process_group import all_gather_results, is_distributed, rank, world_size
from posttrain.envs.base import Environment
from posttrain.algorithms.environments import build_recipe_environment
from posttrain.envs.registry import NEEDED_COLUMNS
from posttrain.envs.rewards import RewardErrorBudget
from posttrain.errors import RunError
from posttrain.generation.base import Generator, SamplingParams
from posttrain.models.loading import default_device, load_causal_lm, load_tokenizer, resolve_model_path
from posttrain.workers import Metric, MetricDict, PolicyWorker, as_floats, reduce_metrics
from posttrain.workers.metrics import materialized
from posttrain.workers.local import LocalPolicyWorker


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
    or the transformers backend sampling from a local policy's own module (a LoRA policy through its base model,
    into whose layers peft put the adapters), or from its own synced copy on each rank of a data-parallel run.
    Without one: `model` itself, loaded for sampling (vLLM, or transformers on the default device)."""
    if backend == "vllm":
        from posttrain.generation.vllm_backend import VLLMGenerator

        generator = VLLMGenerator(resolve_model_path(model.name_or_path), seed=seed,
                                  gpu_memory_utilization=vllm_gpu_memory_utilization)
        if policy is not None:
            generator.update_weights(dict(policy.named_weights()))
        return generator
    from posttrain.generation.transformers_backend import TransformersGenerator

    if policy is None:
        return TransformersGenerator(load_causal_lm(model, device=default_device()).eval(), tokenizer,
                                     batch_size=batch_size, seed=seed)
    if isinstance(policy, LocalPolicyWorker) and not is_distributed():
        module = policy.model.get_base_model() if policy.is_lora else policy.model
        return TransformersGenerator(module, tokenizer, batch_size=batch_size, seed=seed)
    # A sharded policy has no whole module to sample from: each rank keeps an unsharded copy, refreshed from the
    # gathered weights after every update (and now, for a resumed run's weights).
    generator = TransformersGenerator(load_causal_lm(model, device=policy.device).eval(), tokenizer,
                                      batch_size=batch_size, seed=seed, owns_weights=True)
    generator.update_weights(dict(policy.named_weights()))
    return generator


def sync_generator(generator: Generator, policy: PolicyWorker) -> None:
    """Give a generator that holds its own copy of the weights (vLLM, a data-parallel rank's copy) the policy's
    current ones; nothing is gathered for one that samples from the policy's own module (for a LoRA policy that
    would merge and unmerge the adapters, which rounds the base weights)."""
    from posttrain.generation.transformers_backend import TransformersGenerator

    if isinstance(generator, TransformersGenerator) and not generator.owns_weights:
        return
    generator.update_weights(dict(policy.named_weights()))


def rollout_metrics(episodes: list[Episode], weights: dict[str, float]) -> dict[str, float]:
    """Reward, accuracy, length and truncation statistics of the step's episodes (masked episodes excluded
    from reward statistics)."""
    if not episodes:
        return {}
    rewards = [scalar_reward(e.reward, weights) for e in episodes if e.reward is not None]
    lengths = [e.num_sampled_tokens for e in episodes]
    metrics = {
        "reward/mean": sum(rewards) / len(rewards) if rewards else math.nan,
        "reward/std": statistics.stdev(rewards) if len(rewards) > 1 else 0.0,
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": max(lengths),
        "truncation_rate": sum(e.truncated for e in episodes) / len(episodes),
        "turns/mean": sum(e.num_turns for e in episodes) / len(episodes),
    }
    correct = [e.metadata["correct"] for e in episodes if e.reward is not None and "correct" in e.metadata]
    if correct:
        metrics["accuracy"] = sum(map(float, correct)) / len(correct)
    components = sorted({name for e in episodes if isinstance(e.reward, dict) for name in e.reward})
    for name in components:
        values = [e.reward[name] for e in episodes if isinstance(e.reward, dict)]
        metrics[f"reward/{name}"] = sum(values) / len(values)
    return metrics


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


def step_timings(*, generate: float, score: float, logprobs: float, train: float, step: float, tokens: float,
                 generated_tokens: int, epoch: int) -> dict[str, float]:
    """The step's time/... metrics and throughputs: `tokens` in the training batch (prompt and completion) per
    second of the whole step, sampled tokens per second of generation."""
    return {"time/generate": generate, "time/score": score, "time/logprobs": logprobs, "time/train": train,
            "time/step": step, "tokens_per_second": tokens / step,
            "generation/tokens_per_second": generated_tokens / max(generate, 1e-9), "epoch": epoch}


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


def load_rl_data(cfg: GRPOConfig) -> RLData:
    """The tokenizer, the training and validation prompts (checked against the environment's columns and against
    rollout.prompts_per_step) and the environment of an RL config (GRPO, PPO)."""
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    kind = cfg.environment.kind
    prompts, data_summary = load_prompts(cfg.data.train_files, cfg.data, cfg.prompt, kind, tokenizer)
    eval_prompts = load_prompts(cfg.data.eval_files, cfg.data, cfg.prompt, kind, tokenizer)[0]
    check_draw_fits({"rollout.prompts_per_step": cfg.rollout.prompts_per_step}, len(prompts), "training prompts")
    environment = build_recipe_environment(cfg.environment)
    return RLData(tokenizer, prompts, eval_prompts[: cfg.data.max_eval_examples], data_summary, environment)


def sample_round(rows: list[PromptRow], first_group_id: int, cfg: GRPOConfig, generator: Generator,
                 environment: Environment, tokenizer, sampling: SamplingParams) -> tuple[list[Episode], RolloutTimes]:
    """One sampling round of an RL step: `rollout.num_generations_per_prompt` episodes of each row, sampled and
    scored, with group ids from `first_group_id` (the run's group counter, checkpointed: a resumed run samples
    what an uninterrupted one would).

    Seeded per round (the default), the round's one seed comes from the group counter and every rank of a
    data-parallel run samples every group. With `rollout.seed_per_group`, the ranks divide the round's groups in
    contiguous blocks, each samples and scores its block from the groups' own streams, and the episodes are
    gathered on every rank in group order: the same episodes as one process, for a share of its sampling work."""
    rollout = cfg.rollout
    num_samples = rollout.num_generations_per_prompt
    if not rollout.seed_per_group:
        seeded = replace(sampling, seed=cfg.seed * 1_000_003 + first_group_id)
        return run_episodes(rows, first_group_id, num_samples, generator, environment, tokenizer, seeded,
                            rollout.max_turns)
    ranks, me = world_size(), rank()
    start, stop = len(rows) * me // ranks, len(rows) * (me + 1) // ranks

    def sample_share():
        if stop == start:
            return [], RolloutTimes(0.0, 0.0, 0)
        return run_episodes(rows[start:stop], first_group_id + start, num_samples, generator, environment, tokenizer,
                            sampling, rollout.max_turns, group_seed=cfg.seed)

    if ranks == 1:
        return sample_share()
    shares = all_gather_results(sample_share, "while sampling the round's groups")
    episodes = [episode for rank_episodes, _ in shares for episode in rank_episodes]
    times = [rank_times for _, rank_times in shares]
    # The round lasts as long as its slowest rank; every rank's sampled tokens count.
    return episodes, RolloutTimes(max(t.generate for t in times), max(t.score for t in times),
                                  sum(t.generated_tokens for t in times))


def rollout_sampling(rollout: RolloutSection) -> tuple[SamplingParams, SamplingParams]:
    """(training sampling, greedy validation) parameters of the rollout section."""
    sampling = SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                              top_p=rollout.top_p, top_k=rollout.top_k, stop_strings=tuple(rollout.stop_strings))
    greedy = SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=0.0,
                            stop_strings=tuple(rollout.stop_strings))
    return sampling, greedy


def policy_generator(cfg: GRPOConfig, tokenizer, policy: PolicyWorker) -> Generator:
    """The rollout.backend generator sampling from `policy` (see build_generator)."""
    rollout = cfg.rollout
    return build_generator(cfg.model, rollout.backend, tokenizer, policy, batch_size=rollout.generation_batch_size,
                           seed=cfg.seed, vllm_gpu_memory_utilization=rollout.vllm_gpu_memory_utilization)


def reward_normalizer(cfg: GRPOConfig) -> RunningRewardNorm | None:
    """The run's running reward statistics when environment.normalize_rewards is on."""
    return RunningRewardNorm() if cfg.environment.normalize_rewards else None


def restore_rl_state(state: dict, budget: RewardErrorBudget, reward_norm: RunningRewardNorm | None) -> int:
    """The group counter (which seeds sampling) from a resumed trainer state, the reward-error counts restored
    into `budget` and the running reward statistics into `reward_norm`; 0 for a fresh run."""
    if not state:
        return 0
    budget.load_state_dict(state["reward_errors"])
    if reward_norm is not None:
        if "reward_norm" not in state:
            raise RunError("environment.normalize_rewards is on, but the checkpoint to resume holds no running "
                           "reward statistics (it was written with it off); resume with the setting it was "
                           "written with, or start a new output_dir")
        reward_norm.load_state_dict(state["reward_norm"])
    return state.get("next_group_id", 0)


def rl_state(budget: RewardErrorBudget, next_group_id: int, reward_norm: RunningRewardNorm | None) -> dict:
    """What `restore_rl_state` reads back: saved in every checkpoint's trainer state."""
    state = {"reward_errors": budget.state_dict(), "next_group_id": next_group_id}
    if reward_norm is not None:
        state["reward_norm"] = reward_norm.state_dict()
    return state


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
    from posttrain.algorithms.common import is_eval_step

    metrics: dict[str, float] = {}
    if data.eval_prompts and is_eval_step(step, cfg.trainer):
        metrics.update(validate(data.eval_prompts, generator, data.environment, data.tokenizer, greedy,
                                cfg.rollout.max_turns, weights))
    if evaluation.is_due(step):
        metrics.update(evaluation.run(step, generator, run_log))
    return metrics
