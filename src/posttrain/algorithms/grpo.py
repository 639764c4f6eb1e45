"""Online RL from verifiable rewards: GRPO and its family in one loop.

Each step, top to bottom:
  1. sample   — draw prompts, sample `num_generations_per_prompt` episodes each (DAPO dynamic sampling
                draws more prompts until enough groups have reward variance)
  2. score    — the environment rewards every episode; failed scores are masked and counted
  3. advantages — group-relative (or RLOO, GDPO, REINFORCE++, raw) from the rewards
  4. logprobs — π_old (skipped when the update is on-policy: then π_old is the current policy itself)
                and π_ref (only when the KL penalty is on)
  5. train    — `ppo_epochs` passes over the batch in `num_minibatches` minibatches, one optimizer step each,
                with the clipped policy-gradient loss normalized over the minibatch
  6. sync     — push the new weights to the generator (nothing to do when it samples from the trained model)
  7. log, validate, checkpoint

Which knob makes which algorithm is in docs/rl.md; the presets configs/*_arithmetic.yaml differ from
configs/grpo_arithmetic.yaml only in those knobs.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from posttrain.advantages import (
    gdpo_advantages,
    grpo_advantages,
    raw_reward_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from posttrain.algorithms.common import (
    announce_run,
    autocast,
    configure_torch,
    export_model,
    is_eval_step,
    is_save_step,
    log_step,
    optimizer_step,
    prepare_output_dir,
    seed_everything,
)
from posttrain.algorithms.rollout import (
    Episode,
    PromptRow,
    RolloutBatch,
    groups_of,
    has_reward_variance,
    overlong_penalty,
    run_episodes,
    scalar_reward,
    to_batch,
)
from posttrain.checkpoint import (
    latest_checkpoint,
    load_training_state,
    save_checkpoint,
)
from posttrain.config.schema import GRPOConfig, TrainerConfig
from posttrain.data.dataset import DataStats, check_not_empty, iter_rows, skip_or_raise
from posttrain.data.errors import DataError
from posttrain.data.formats import PromptOnlyRow
from posttrain.data.sampler import EpochSampler
from posttrain.data.tokenize import tokenize_prompt
from posttrain.envs.registry import build_environment
from posttrain.envs.rewards import RewardErrorBudget
from posttrain.generation.base import SamplingParams
from posttrain.logging import RunLogger
from posttrain.losses.nll import token_logprobs
from posttrain.losses.policy_gradient import (
    loss_normalizer,
    masked_entropy,
    policy_gradient_loss,
)
from posttrain.models.loading import (
    default_device,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)
from posttrain.optim import build_optimizer, build_scheduler

PROGRESS_METRICS = ("reward/mean", "accuracy", "val/accuracy", "kl", "response_length/mean")


@dataclass(frozen=True)
class GRPOResult:
    output_dir: Path
    final_dir: Path
    steps: int
    final_metrics: dict[str, float]


def train_grpo(cfg: GRPOConfig) -> GRPOResult:
    output_dir, changed_keys = prepare_output_dir(cfg, cfg.output_dir)
    configure_torch(cfg.trainer)
    seed_everything(cfg.seed)
    device = default_device()
    trainer, rollout = cfg.trainer, cfg.rollout

    # Data and environment first: a malformed row or reward path should fail before a model loads.
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    prompts, data_summary = load_prompts(cfg.data.train_files, cfg, tokenizer)
    eval_prompts = load_prompts(cfg.data.eval_files, cfg, tokenizer)[0][: cfg.data.max_eval_examples]
    environment = build_environment({"kind": cfg.environment.kind, **cfg.environment.options})
    reward_weights = {**getattr(environment, "reward_weights", {}), **cfg.advantage.component_weights}
    loss_cfg = cfg.loss.to_loss_config(rollout.max_new_tokens * rollout.max_turns)

    resume = latest_checkpoint(output_dir)
    model = load_causal_lm(cfg.model, path=resume.path if resume else None, device=device)
    model.train()
    # The reference is the starting model, also when resuming; loaded only when the KL penalty needs it.
    reference = None
    if loss_cfg.reference_kl_penalty > 0:
        reference = load_causal_lm(cfg.model, device=device).eval().requires_grad_(False)
    updates_per_step = cfg.update.ppo_epochs * cfg.update.num_minibatches
    optimizer = build_optimizer(model, trainer)
    scheduler = build_scheduler(optimizer, _per_update_schedule(trainer, updates_per_step))
    generator = build_generator(cfg, model, tokenizer)
    sampler = EpochSampler(len(prompts), seed=cfg.seed, shuffle=cfg.data.shuffle)
    budget = RewardErrorBudget(cfg.environment.max_error_fraction)
    sampling = SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                              top_p=rollout.top_p, top_k=rollout.top_k, stop_strings=tuple(rollout.stop_strings))
    greedy = SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=0.0,
                            stop_strings=tuple(rollout.stop_strings))
    next_group_id, start_step = 0, 0
    if resume is not None:
        state = load_training_state(resume, optimizer, scheduler)
        sampler.load_state_dict(state["sampler"])
        budget.load_state_dict(state["reward_errors"])
        next_group_id, start_step = state["next_group_id"], resume.step

    # closing(): reward worker processes stop with the run, also when it fails.
    with RunLogger(output_dir, cfg.logging, recipe="grpo", total_steps=trainer.max_steps, start_step=start_step,
                   run_config=cfg.model_dump(mode="json"), progress_metrics=PROGRESS_METRICS) as run_log, \
            contextlib.closing(environment):
        announce_run(run_log, data_summary, resume, changed_keys, model,
                     f"{rollout.prompts_per_step} prompts x {rollout.num_generations_per_prompt} samples per step, "
                     f"{updates_per_step} optimizer step(s) per rollout batch")
        metrics: dict[str, float] = {}
        for step in range(start_step + 1, trainer.max_steps + 1):
            step_started = time.perf_counter()

            # 1-2. Sample and score (dynamic sampling: until enough groups carry signal).
            kept: list[list[Episode]] = []  # groups of episodes, in sampling order
            metrics = {"reward/errors": 0}
            rounds = 0
            generate_seconds = score_seconds = 0.0
            generated_tokens = 0
            while True:
                rows = [prompts[i] for i in sampler.next_indices(rollout.prompts_per_step)]
                # Seeded per round from the group counter, so a resumed run samples what an uninterrupted one would.
                seeded = replace(sampling, seed=cfg.seed * 1_000_003 + next_group_id)
                new, times = run_episodes(rows, next_group_id, rollout.num_generations_per_prompt, generator,
                                          environment, tokenizer, seeded, rollout.max_turns)
                next_group_id += len(rows)
                rounds += 1
                generate_seconds, score_seconds = generate_seconds + times.generate, score_seconds + times.score
                generated_tokens += times.generated_tokens
                metrics["reward/errors"] += budget.record([e.error for e in new]).step_errors
                groups = groups_of(new)
                kept += [g for g in groups if has_reward_variance(g, reward_weights)] if rollout.dynamic_sampling else groups
                if not rollout.dynamic_sampling or len(kept) >= rollout.prompts_per_step \
                        or rounds == rollout.max_sampling_rounds:
                    break
            kept = kept[: rollout.prompts_per_step]
            episodes = [e for group in kept for e in group]
            if rollout.dynamic_sampling:
                metrics.update({"sampling/rounds": rounds, "sampling/groups_kept": len(kept),
                                "sampling/groups_filtered": rounds * rollout.prompts_per_step - len(kept)})
            metrics.update(rollout_metrics(episodes, reward_weights))
            metrics["reward/errors_total"] = budget.run_errors
            if not episodes:
                run_log.message(f"step {step}: every group of {rounds} sampling round(s) had equal rewards; "
                                "no update this step")
                log_and_save(run_log, step, metrics, cfg, model, tokenizer, optimizer, scheduler, output_dir,
                             sampler, budget, next_group_id)
                continue
            penalties = [overlong_penalty(e.last_turn_length, e.truncated, rollout.max_new_tokens,
                                          rollout.overlong_buffer_length, rollout.overlong_penalty_factor)
                         for e in episodes]
            batch = to_batch(episodes, tokenizer.pad_token_id, reward_weights, rollout.overlong_filtering, penalties)

            # 3. Advantages, per episode.
            advantages = compute_advantages(cfg, batch)

            # 4. Logprobs of π_old and π_ref. On-policy (one update per batch) π_old is the current policy:
            # the loss then uses the training pass's own detached logprobs and the ratio is exactly 1.
            started = time.perf_counter()
            on_policy = updates_per_step == 1
            old_logprobs = None if on_policy else score_tokens(model, batch, cfg, device)
            reference_logprobs = score_tokens(reference, batch, cfg, device) if reference is not None else None
            logprob_seconds = time.perf_counter() - started

            # 5. Train: ppo_epochs passes, num_minibatches optimizer steps each.
            started = time.perf_counter()
            update_metrics = []
            for _ in range(cfg.update.ppo_epochs):
                order = torch.randperm(len(batch))
                for minibatch in torch.tensor_split(order, cfg.update.num_minibatches):
                    learning_rate = scheduler.get_last_lr()[0]
                    stats = accumulate_policy_gradients(model, batch, minibatch, advantages, old_logprobs,
                                                        reference_logprobs, loss_cfg, cfg, device)
                    stats["grad_norm"] = optimizer_step(model, optimizer, scheduler, trainer.max_grad_norm)
                    stats["learning_rate"] = learning_rate
                    update_metrics.append(stats)
            train_seconds = time.perf_counter() - started

            # 6. Weight sync: a no-op for the transformers backend, which samples from `model` itself.
            generator.update_weights(model.state_dict())

            # 7. Metrics, validation, checkpoint.
            step_seconds = time.perf_counter() - step_started
            metrics.update(mean_of(update_metrics))
            metrics.update({
                "time/generate": generate_seconds, "time/score": score_seconds, "time/logprobs": logprob_seconds,
                "time/train": train_seconds, "time/step": step_seconds,
                "tokens_per_second": float(batch.attention_mask.sum()) / step_seconds,
                "generation/tokens_per_second": generated_tokens / max(generate_seconds, 1e-9),
                "epoch": sampler.epochs_completed,
            })
            if eval_prompts and is_eval_step(step, trainer):
                metrics.update(validate(eval_prompts, generator, environment, tokenizer, greedy, rollout.max_turns,
                                        reward_weights))
            log_and_save(run_log, step, metrics, cfg, model, tokenizer, optimizer, scheduler, output_dir,
                         sampler, budget, next_group_id)

        final_dir = export_model(output_dir, model, tokenizer, run_log)
    return GRPOResult(output_dir, final_dir, trainer.max_steps, metrics)


# ---- pieces of the loop ----------------------------------------------------------------------------------


def load_prompts(sources: list[str], cfg: GRPOConfig, tokenizer) -> tuple[list[PromptRow], str]:
    """Prompt rows (every non-prompt column kept as metadata for the environment), formatted and tokenized once."""
    if not sources:
        return [], "no data"
    data_cfg = cfg.data.model_copy(update={"format": "prompt_only"})
    stats = DataStats()
    prompts = []
    for location, row in iter_rows(sources, data_cfg, stats):
        assert isinstance(row, PromptOnlyRow)
        try:
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


def build_generator(cfg: GRPOConfig, model, tokenizer):
    if cfg.rollout.backend == "vllm":
        from posttrain.generation.vllm_backend import VLLMGenerator

        generator = VLLMGenerator(resolve_model_path(cfg.model.name_or_path), seed=cfg.seed,
                                  gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization)
        generator.update_weights(model.state_dict())  # a resumed run's weights, not the starting model's
        return generator
    from posttrain.generation.transformers_backend import TransformersGenerator

    return TransformersGenerator(model, tokenizer, batch_size=cfg.rollout.generation_batch_size, seed=cfg.seed)


def _per_update_schedule(trainer: TrainerConfig, updates_per_step: int) -> TrainerConfig:
    """The learning-rate schedule counts optimizer steps; trainer.max_steps and warmup_steps count RL steps."""
    return trainer.model_copy(update={"max_steps": trainer.max_steps * updates_per_step,
                                      "warmup_steps": trainer.warmup_steps * updates_per_step})


def compute_advantages(cfg: GRPOConfig, batch: RolloutBatch) -> torch.Tensor:
    """[N] advantages from the batch's rewards, with the configured estimator (posttrain.advantages)."""
    a = cfg.advantage
    if a.estimator == "grpo":
        return grpo_advantages(batch.rewards, batch.group_ids, normalize_std=a.normalize_std,
                               leave_one_out=a.leave_one_out, valid=batch.valid)
    if a.estimator == "rloo":
        return rloo_advantages(batch.rewards, batch.group_ids, valid=batch.valid)
    if a.estimator == "gdpo":
        if not batch.reward_components:
            raise ValueError("advantage.estimator='gdpo' needs rewards with named components; this environment "
                             "returns scalars (for python rewards give several functions, for math set "
                             "environment.options.reward_components=true)")
        weights = {name: a.component_weights.get(name, 1.0) for name in batch.reward_components}
        return gdpo_advantages(batch.reward_components, batch.group_ids, weights, normalize_std=a.normalize_std,
                               valid=batch.valid)
    if a.estimator == "reinforce++":
        return reinforce_plus_plus_advantages(batch.rewards, valid=batch.valid)
    return raw_reward_advantages(batch.rewards, valid=batch.valid)


def policy_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float,
                    cfg: GRPOConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs [n, T] (entry t: token t given < t) under the sampling temperature, and the logits."""
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    with autocast(cfg.trainer, device):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits.float() / temperature
    return token_logprobs(logits, input_ids), logits


@torch.no_grad()
def score_tokens(model, batch: RolloutBatch, cfg: GRPOConfig, device: torch.device) -> torch.Tensor:
    """Logprobs [N, T] of the batch's tokens under `model`, in micro-batches, without a graph."""
    was_training = model.training
    model.eval()
    parts = []
    for index in torch.arange(len(batch)).split(cfg.trainer.micro_batch_size):
        logprobs, _ = policy_logprobs(model, batch.input_ids[index], batch.attention_mask[index],
                                      cfg.rollout.temperature, cfg, device)
        parts.append(logprobs.cpu())
    model.train(was_training)
    return torch.cat(parts)


def accumulate_policy_gradients(model, batch: RolloutBatch, minibatch: torch.Tensor, advantages: torch.Tensor,
                                old_logprobs: torch.Tensor | None, reference_logprobs: torch.Tensor | None,
                                loss_cfg, cfg: GRPOConfig, device: torch.device) -> dict[str, float]:
    """Forward/backward the minibatch in micro-batches; the loss is normalized over the whole minibatch."""
    normalizer = loss_normalizer(batch.loss_mask[minibatch], loss_cfg)
    totals: dict[str, float] = {"loss": 0.0}
    weighted: dict[str, float] = {}
    tokens_seen = 0.0
    if normalizer == 0:  # every sample masked (all filtered or failed): nothing to learn from
        return {"loss": 0.0}
    for index in minibatch.split(cfg.trainer.micro_batch_size):
        mask = batch.loss_mask[index].to(device)
        logprobs, logits = policy_logprobs(model, batch.input_ids[index], batch.attention_mask[index],
                                           cfg.rollout.temperature, cfg, device)
        old = logprobs.detach() if old_logprobs is None else old_logprobs[index].to(device)
        loss, metrics = policy_gradient_loss(
            logprobs, old, advantages[index].to(device), mask, loss_cfg, normalizer,
            generator_logprobs=batch.generator_logprobs[index].to(device),
            reference_logprobs=None if reference_logprobs is None else reference_logprobs[index].to(device),
        )
        loss.backward()
        totals["loss"] += float(loss.detach())
        metrics["entropy"] = masked_entropy(logits.detach(), mask)
        tokens = float(mask.sum())
        tokens_seen += tokens
        for name, value in metrics.items():  # token-weighted means over the minibatch
            reduce = min if name == "ratio_min" else max if name == "ratio_max" else None
            if reduce is not None:
                weighted[name] = reduce(weighted.get(name, float(value)), float(value))
            else:
                weighted[name] = weighted.get(name, 0.0) + float(value) * tokens
    for name, value in weighted.items():
        totals[name] = value if name in ("ratio_min", "ratio_max") else value / max(tokens_seen, 1.0)
    return totals


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


def log_and_save(run_log: RunLogger, step: int, metrics: dict[str, float], cfg: GRPOConfig, model, tokenizer,
                 optimizer, scheduler, output_dir: Path, sampler: EpochSampler, budget: RewardErrorBudget,
                 next_group_id: int) -> None:
    trainer = cfg.trainer
    log_step(run_log, step, metrics, trainer)
    if is_save_step(step, trainer):
        state: dict[str, Any] = {"sampler": sampler.state_dict(), "reward_errors": budget.state_dict(),
                                 "next_group_id": next_group_id}
        save_checkpoint(output_dir, step, model, tokenizer, optimizer, scheduler, state, trainer.keep_last)


def mean_of(records: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over the step's optimizer updates (min/max for ratio_min/ratio_max)."""
    if not records:
        return {}
    out = {}
    for name in records[0]:
        values = [r[name] for r in records if name in r]
        out[name] = min(values) if name == "ratio_min" else max(values) if name == "ratio_max" else sum(values) / len(values)
    return out
