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
import time
from pathlib import Path

import torch

from posttrain.advantages import (
    gdpo_advantages,
    grpo_advantages,
    raw_reward_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from posttrain.algorithms.common import (
    NonFiniteGuard,
    announce_run,
    configure_torch,
    export_policy,
    log_step,
    prepare_output_dir,
    resume_trainer_state,
    run_logger,
    save_if_due,
    seed_everything,
)
from posttrain.algorithms.evaluate import TrainingEvaluation, reward_weights, sample_record
from posttrain.algorithms.rl import (
    RLResult,
    due_evaluations,
    load_rl_data,
    mean_over_updates,
    per_update_schedule,
    policy_generator,
    normalize_batch_rewards,
    restore_rl_state,
    reward_normalizer,
    rl_state,
    rollout_metrics,
    rollout_sampling,
    sample_round,
    step_timings,
    sync_generator,
)
from posttrain.algorithms.rollout import (
    Episode,
    groups_of,
    has_reward_variance,
    overlong_penalty,
    to_batch,
)
from posttrain.checkpoint import POLICY, checkpoint_to_resume
from posttrain.config.schema import GRPOConfig
from posttrain.data.sampler import EpochSampler
from posttrain.data.types import RolloutBatch
from posttrain.envs.rewards import RewardErrorBudget
from posttrain.distributed import build_policy, build_scorer
from posttrain.process_group import world_size
from posttrain.logging import RunLogger
from posttrain.rundir import one_run_per_output_dir
from posttrain.losses.policy_gradient import (
    PolicyLossConfig,
    loss_normalizer,
    policy_gradient_loss,
)
from posttrain.models.loading import default_device
from posttrain.workers import LossFn, Metric, MetricDict, PolicyWorker, ScoringWorker, reduce_metrics
from posttrain.workers.forward import TargetScores
from posttrain.workers.local import base_model_scorer

PROGRESS_METRICS = ("reward/mean", "accuracy", "val/accuracy", "kl", "response_length/mean")


@one_run_per_output_dir
def train_grpo(cfg: GRPOConfig) -> RLResult:
    configure_torch(cfg.trainer)
    output_dir, changed_keys = prepare_output_dir(cfg, cfg.output_dir)
    seed_everything(cfg.seed)
    device = default_device()
    trainer, rollout = cfg.trainer, cfg.rollout

    # Data and environment first: a malformed row or reward path should fail before a model loads.
    data = load_rl_data(cfg)
    tokenizer, prompts, environment = data.tokenizer, data.prompts, data.environment
    weights = {**reward_weights(environment), **cfg.advantage.component_weights}
    evaluation = TrainingEvaluation(cfg.evaluation, tokenizer, trainer.max_steps)
    loss_cfg = cfg.loss.resolved(max_completion_tokens=rollout.max_new_tokens * rollout.max_turns)

    resume = checkpoint_to_resume(output_dir)
    updates_per_step = cfg.update.ppo_epochs * cfg.update.num_minibatches
    policy = build_policy(cfg.model, cfg.lora, trainer, tokenizer, device,
                          schedule=per_update_schedule(trainer, updates_per_step),
                          resume_dir=resume.worker_dir(POLICY) if resume else None)
    # The reference is the starting model, also when resuming; loaded only when the KL penalty needs it. With LoRA
    # it is the policy itself with its adapters switched off (no second copy).
    reference = reference_worker(policy, cfg, device) if loss_cfg.reference_kl_penalty > 0 else None
    generator = policy_generator(cfg, tokenizer, policy)
    sampler = EpochSampler(len(prompts), seed=cfg.seed, shuffle=cfg.data.shuffle)
    budget = RewardErrorBudget(cfg.environment.max_error_fraction)
    sampling, greedy = rollout_sampling(rollout)
    start_step, state = resume_trainer_state(resume, sampler)
    reward_norm = reward_normalizer(cfg)
    next_group_id = restore_rl_state(state, budget, reward_norm)

    # closing(): reward worker processes stop with the run, also when it fails.
    with run_logger(output_dir, cfg.logging, recipe="grpo", total_steps=trainer.max_steps, start_step=start_step,
                   run_config=cfg.model_dump(mode="json"), progress_metrics=PROGRESS_METRICS) as run_log, \
            contextlib.closing(environment), contextlib.closing(evaluation):
        announce_run(run_log, data.data_summary, resume, changed_keys, policy,
                     f"{rollout.prompts_per_step} prompts x {rollout.num_generations_per_prompt} samples per step, "
                     f"{updates_per_step} optimizer step(s) per rollout batch")
        metrics: dict[str, float] = {}
        guard = NonFiniteGuard(trainer, output_dir)
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
                new, times = sample_round(rows, next_group_id, cfg, generator, environment, tokenizer, sampling)
                next_group_id += len(rows)
                rounds += 1
                generate_seconds, score_seconds = generate_seconds + times.generate, score_seconds + times.score
                generated_tokens += times.generated_tokens
                metrics["reward/errors"] += budget.record([e.error for e in new]).step_errors
                groups = groups_of(new)
                kept += [g for g in groups if has_reward_variance(g, weights)] if rollout.dynamic_sampling else groups
                if not rollout.dynamic_sampling or len(kept) >= rollout.prompts_per_step \
                        or rounds == rollout.max_sampling_rounds:
                    break
            kept = kept[: rollout.prompts_per_step]
            episodes = [e for group in kept for e in group]
            if rollout.dynamic_sampling:
                metrics.update({"sampling/rounds": rounds, "sampling/groups_kept": len(kept),
                                "sampling/groups_filtered": rounds * rollout.prompts_per_step - len(kept)})
            metrics.update(rollout_metrics(episodes, weights))
            metrics["reward/errors_total"] = budget.run_errors
            # The first episodes as they came (no draw), for a look at what the policy writes.
            run_log.log_samples(step, "train", [sample_record(e, tokenizer, weights).to_json()
                                                for e in (episodes or new)[: cfg.logging.samples_per_step]])
            if not episodes:
                run_log.message(f"step {step}: every group of {rounds} sampling round(s) had equal rewards; "
                                "no update this step")
                if evaluation.is_due(step):
                    metrics.update(evaluation.run(step, generator, run_log))
                log_and_save(run_log, step, metrics, cfg, policy, output_dir, sampler,
                             rl_state(budget, next_group_id, reward_norm))
                continue
            penalties = [overlong_penalty(e.last_turn_length, e.truncated, rollout.max_new_tokens,
                                          rollout.overlong_buffer_length, rollout.overlong_penalty_factor)
                         for e in episodes]
            batch = to_batch(episodes, tokenizer.pad_token_id, weights, rollout.overlong_filtering, penalties)
            batch = normalize_batch_rewards(batch, reward_norm, metrics)

            # 3. Advantages, per episode.
            advantages = compute_advantages(cfg, batch)

            # 4. Logprobs of π_old and π_ref. On-policy (one update per batch) π_old is the current policy:
            # the loss then uses the training pass's own detached logprobs and the ratio is exactly 1.
            started = time.perf_counter()
            on_policy = updates_per_step == 1
            old_logprobs = None if on_policy else policy.logprobs(batch, rollout.temperature)
            reference_logprobs = reference.logprobs(batch, rollout.temperature) if reference is not None else None
            logprob_seconds = time.perf_counter() - started

            # 5. Train: ppo_epochs passes, num_minibatches optimizer steps each.
            started = time.perf_counter()
            update_metrics = []
            for _ in range(cfg.update.ppo_epochs):
                order = torch.randperm(len(batch))
                for minibatch in torch.tensor_split(order, cfg.update.num_minibatches):
                    stats = accumulate_policy_gradients(policy, batch, minibatch, advantages, old_logprobs,
                                                        reference_logprobs, loss_cfg, cfg)
                    update_metrics.append({**stats, **policy.optim_step()})
            train_seconds = time.perf_counter() - started

            # 6. Weight sync: a no-op for the transformers backend, which samples from the policy's own module.
            sync_generator(generator, policy)

            # 7. Metrics, validation, checkpoint.
            step_seconds = time.perf_counter() - step_started
            metrics.update(mean_over_updates(update_metrics))
            guard.check(step, metrics)
            metrics.update(step_timings(generate=generate_seconds, score=score_seconds, logprobs=logprob_seconds,
                                        train=train_seconds, step=step_seconds,
                                        tokens=float(batch.attention_mask.sum()), generated_tokens=generated_tokens,
                                        epoch=sampler.epochs_completed))
            metrics.update(due_evaluations(step, cfg, data, generator, greedy, weights, evaluation, run_log))
            log_and_save(run_log, step, metrics, cfg, policy, output_dir, sampler,
                         rl_state(budget, next_group_id, reward_norm))

        final_dir = export_policy(output_dir, policy, run_log)
    return RLResult(output_dir, final_dir, trainer.max_steps, metrics)


# ---- pieces of the loop ----------------------------------------------------------------------------------


def reference_worker(policy: PolicyWorker, cfg: GRPOConfig, device: torch.device) -> ScoringWorker:
    """π_ref, the starting model: a frozen copy, or for a LoRA policy the policy with its adapters switched off."""
    return base_model_scorer(policy) if policy.is_lora else build_scorer(cfg.model, cfg.trainer, device)


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


def policy_gradient_objective(advantages: torch.Tensor, old_logprobs: torch.Tensor | None,
                              reference_logprobs: torch.Tensor | None, loss_cfg: PolicyLossConfig) -> LossFn:
    """The clipped policy-gradient loss of one micro-batch of episodes (their advantages, π_old and π_ref
    logprobs given, [n] and [n, T]); None for `old_logprobs` means on-policy: π_old is the training pass itself.
    Metrics are token-weighted means, except minima and maxima (`*_min`, `*_max`: the ratio, the IS weight)."""

    def loss_fn(scores: TargetScores, batch: RolloutBatch, normalizer: float) -> tuple[torch.Tensor, MetricDict]:
        logprobs = scores.logprobs  # under the sampling temperature (the worker call's)
        device = logprobs.device
        mask = batch.loss_mask
        old = logprobs.detach() if old_logprobs is None else old_logprobs.to(device)
        loss, metrics = policy_gradient_loss(
            logprobs, old, advantages.to(device), mask, loss_cfg, normalizer,
            generator_logprobs=batch.generator_logprobs,
            reference_logprobs=None if reference_logprobs is None else reference_logprobs.to(device),
        )
        valid = mask.bool()
        metrics["entropy"] = torch.where(valid, scores.entropy, 0.0).sum() / valid.sum().clamp(min=1)
        tokens = mask.sum()
        return loss, {name: Metric.min(value) if name.endswith("_min") else Metric.max(value) if name.endswith("_max")
                      else Metric.mean(value, tokens) for name, value in metrics.items()}

    return loss_fn


def accumulate_policy_gradients(policy: PolicyWorker, batch: RolloutBatch, minibatch: torch.Tensor,
                                advantages: torch.Tensor, old_logprobs: torch.Tensor | None,
                                reference_logprobs: torch.Tensor | None, loss_cfg: PolicyLossConfig,
                                cfg: GRPOConfig) -> MetricDict:
    """Forward/backward the minibatch in micro-batches of at most trainer.micro_batch_size episodes, as many on
    every data-parallel rank; the loss is normalized over the whole minibatch."""
    normalizer = loss_normalizer(batch.loss_mask[minibatch], loss_cfg)
    if normalizer == 0:  # every sample masked (all filtered or failed): nothing to learn from
        return {"loss": Metric.sum(0.0)}
    ranks = world_size()
    pieces = ranks * math.ceil(len(minibatch) / (cfg.trainer.micro_batch_size * ranks))
    records = []
    for index in policy.shard(list(torch.tensor_split(minibatch, pieces))):
        objective = policy_gradient_objective(
            advantages[index], None if old_logprobs is None else old_logprobs[index],
            None if reference_logprobs is None else reference_logprobs[index], loss_cfg,
        )
        records.append(policy.forward_backward(batch.select(index), objective, normalizer, outputs="target_scores",
                                               temperature=cfg.rollout.temperature))
    return policy.all_reduce(reduce_metrics(records))


def log_and_save(run_log: RunLogger, step: int, metrics: dict[str, float], cfg: GRPOConfig, policy: PolicyWorker,
                 output_dir: Path, sampler: EpochSampler, state: dict) -> None:
    log_step(run_log, step, metrics, cfg.trainer)
    save_if_due(output_dir, step, cfg.trainer, {POLICY: policy}, sampler, state)
