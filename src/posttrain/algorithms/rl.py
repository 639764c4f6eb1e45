"""Pieces the online RL loops share (GRPO today; PPO and on-policy distillation build on them): loading and
formatting prompts, building the generator for a policy worker, rollout statistics and greedy validation."""

from __future__ import annotations

import math
import statistics

from posttrain.algorithms.rollout import Episode, PromptRow, run_episodes, scalar_reward
from posttrain.config.schema import GRPOConfig
from posttrain.data.dataset import DataStats, check_not_empty, iter_rows, skip_or_raise
from posttrain.data.errors import DataError
from posttrain.data.formats import PromptOnlyRow
from posttrain.data.tokenize import tokenize_prompt
from posttrain.generation.base import Generator, SamplingParams
from posttrain.distributed.env import is_distributed
from posttrain.envs.registry import NEEDED_COLUMNS
from posttrain.models.loading import load_causal_lm, resolve_model_path
from posttrain.workers import PolicyWorker
from posttrain.workers.local import LocalPolicyWorker


def load_prompts(sources: list[str], cfg: GRPOConfig, tokenizer) -> tuple[list[PromptRow], str]:
    """Prompt rows (every non-prompt column kept as metadata for the environment), formatted and tokenized once.

    A row lacking the column the environment scores against (`registry.NEEDED_COLUMNS`: the answer, the tests)
    is malformed here, with the data, rather than at its first reward after a model has loaded."""
    if not sources:
        return [], "no data"
    data_cfg = cfg.data.model_copy(update={"format": "prompt_only"})
    stats = DataStats()
    prompts = []
    for location, row in iter_rows(sources, data_cfg, stats):
        assert isinstance(row, PromptOnlyRow)
        try:
            check_needed_columns(row, cfg.environment.kind, location)
            prompt = format_prompt(row, cfg, location)
            prompt_ids = tokenize_prompt(prompt, tokenizer)
            if len(prompt_ids) > cfg.data.max_length:
                raise DataError(location, f"the prompt has {len(prompt_ids)} tokens, more than "
                                f"data.max_length={cfg.data.max_length}", "prompt")
        except DataError as error:
            skip_or_raise(error, cfg.data.on_error, stats)
            continue
        prompts.append(PromptRow(prompt, prompt_ids, row.extras))
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


def format_prompt(row: PromptOnlyRow, cfg: GRPOConfig, location: str) -> str | list[dict]:
    """The row's prompt after prompt.template, as a string or (chat template, system prompt) as messages."""
    p = cfg.prompt
    prompt = row.prompt
    if isinstance(prompt, str):
        try:
            prompt = p.template.format(prompt=prompt, **row.extras)
        except (KeyError, IndexError, ValueError) as error:
            raise DataError(location, f"prompt.template {p.template!r} cannot be filled: {error!r} (columns: "
                            f"prompt, {', '.join(sorted(row.extras))})", "prompt") from None
        if not p.use_chat_template:
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    if p.system_prompt is not None and prompt[0]["role"] != "system":
        prompt = [{"role": "system", "content": p.system_prompt}, *prompt]
    return prompt


def build_generator(cfg: GRPOConfig, policy: PolicyWorker, tokenizer) -> Generator:
    """The rollout.backend generator for `policy`: vLLM loaded with the policy's current weights (a resumed run's,
    not the starting model's), or the transformers backend sampling from a local policy's own module (from its
    own synced copy on each rank of a data-parallel run)."""
    if cfg.rollout.backend == "vllm":
        from posttrain.generation.vllm_backend import VLLMGenerator

        generator = VLLMGenerator(resolve_model_path(cfg.model.name_or_path), seed=cfg.seed,
                                  gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization)
        generator.update_weights(dict(policy.named_weights()))
        return generator
    from posttrain.generation.transformers_backend import TransformersGenerator

    batch_size, seed = cfg.rollout.generation_batch_size, cfg.seed
    if isinstance(policy, LocalPolicyWorker) and not is_distributed():
        return TransformersGenerator(policy.model, tokenizer, batch_size=batch_size, seed=seed)
    # A sharded policy has no whole module to sample from: each rank keeps an unsharded copy, refreshed from the
    # gathered weights after every update (and now, for a resumed run's weights).
    generator = TransformersGenerator(load_causal_lm(cfg.model, device=policy.device).eval(), tokenizer,
                                      batch_size=batch_size, seed=seed, owns_weights=True)
    generator.update_weights(dict(policy.named_weights()))
    return generator


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
