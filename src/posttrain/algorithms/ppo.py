"""Online RL with a learned critic: PPO as the PPO paper, GAE and InstructGPT describe it, in GRPO's loop family.

Each step, top to bottom:
  1. sample   — draw rollout.prompts_per_step prompts, sample num_generations_per_prompt completions each
  2. score    — the environment rewards every completion; failed scores are masked and counted
  3. values   — π_old's log-probabilities, the critic's V(s_t) before every sampled token, π_ref's log-probabilities
                when a KL term is on
  4. advantages — the sequence reward on its last token (minus gae.kl_coef·KL per token), then GAE backwards over
                the sampled tokens: advantages for the policy, return targets for the critic
  5. train    — update.ppo_epochs passes in update.num_minibatches minibatches; each minibatch one policy step
                (clipped policy-gradient loss, per-token advantages) and one critic step (clipped value loss);
                the policy waits critic.warmup_steps steps
  6. sync, log, validate, checkpoint (policy/ and critic/ folders)

Under torchrun the policy and the critic are both FSDP2-sharded; every rank samples and scores the whole step
(as data-parallel GRPO does) and the ranks split each minibatch's micro-batches, so N processes make the update one
process makes from the same config.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from posttrain.advantages import gae_advantages, token_level_rewards, whiten
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
from posttrain.algorithms.grpo import accumulate_policy_gradients, reference_worker
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
from posttrain.algorithms.rollout import overlong_penalty, to_batch
from posttrain.checkpoint import POLICY, checkpoint_to_resume
from posttrain.config.schema import PPOConfig
from posttrain.data.sampler import EpochSampler
from posttrain.data.types import RolloutBatch
from posttrain.distributed import build_critic, build_policy
from posttrain.process_group import world_size
from posttrain.envs.rewards import RewardErrorBudget
from posttrain.losses.policy_gradient import kl_estimate
from posttrain.losses.value import explained_variance, value_loss, value_loss_normalizer
from posttrain.models.loading import default_device
from posttrain.rundir import one_run_per_output_dir
from posttrain.workers import LossFn, Metric, MetricDict, reduce_metrics
from posttrain.workers.value import CRITIC, ValueWorker

PROGRESS_METRICS = ("reward/mean", "accuracy", "val/accuracy", "value/explained_variance", "kl")


@one_run_per_output_dir
def train_ppo(cfg: PPOConfig) -> RLResult:
    configure_torch(cfg.trainer)
    output_dir, changed_keys = prepare_output_dir(cfg, cfg.output_dir)
    seed_everything(cfg.seed)
    device = default_device()
    trainer, rollout = cfg.trainer, cfg.rollout

    # Data and environment first: a malformed row or reward path should fail before a model loads.
    data = load_rl_data(cfg)
    tokenizer, prompts, environment = data.tokenizer, data.prompts, data.environment
    weights = reward_weights(environment)
    evaluation = TrainingEvaluation(cfg.evaluation, tokenizer, trainer.max_steps)
    loss_cfg = cfg.loss.resolved(max_completion_tokens=rollout.max_new_tokens * rollout.max_turns)

    resume = checkpoint_to_resume(output_dir)
    updates_per_step = cfg.update.ppo_epochs * cfg.update.num_minibatches
    policy_steps = trainer.model_copy(update={"max_steps": trainer.max_steps - cfg.critic.warmup_steps})
    policy = build_policy(cfg.model, cfg.lora, trainer, tokenizer, device,
                          schedule=per_update_schedule(policy_steps, updates_per_step),
                          resume_dir=resume.worker_dir(POLICY) if resume else None)
    critic_trainer = trainer.model_copy(update={"learning_rate": cfg.critic.learning_rate})
    critic = build_critic(cfg.critic.init_from, cfg.model, critic_trainer, tokenizer, device,
                          schedule=per_update_schedule(critic_trainer, updates_per_step),
                          resume_dir=resume.worker_dir(CRITIC) if resume else None)
    # The reference is the starting model, also when resuming; loaded only when a KL term needs it.
    needs_reference = loss_cfg.reference_kl_penalty > 0 or cfg.gae.kl_coef > 0
    reference = reference_worker(policy, cfg, device) if needs_reference else None
    generator = policy_generator(cfg, tokenizer, policy)
    sampler = EpochSampler(len(prompts), seed=cfg.seed, shuffle=cfg.data.shuffle)
    budget = RewardErrorBudget(cfg.environment.max_error_fraction)
    sampling, greedy = rollout_sampling(rollout)
    start_step, state = resume_trainer_state(resume, sampler)
    reward_norm = reward_normalizer(cfg)
    next_group_id = restore_rl_state(state, budget, reward_norm)

    with run_logger(output_dir, cfg.logging, recipe="ppo", total_steps=trainer.max_steps, start_step=start_step,
                    run_config=cfg.model_dump(mode="json"), progress_metrics=PROGRESS_METRICS) as run_log, \
            contextlib.closing(environment), contextlib.closing(evaluation):
        announce_run(run_log, data.data_summary, resume, changed_keys, policy,
                     f"a critic of {critic.num_parameters() / 1e6:.2f}M parameters, {rollout.prompts_per_step} "
                     f"prompts x {rollout.num_generations_per_prompt} samples per step, {updates_per_step} "
                     f"optimizer step(s) each per rollout batch")
        metrics: dict[str, float] = {}
        guard = NonFiniteGuard(trainer, output_dir)
        for step in range(start_step + 1, trainer.max_steps + 1):
            step_started = time.perf_counter()

            # 1-2. Sample and score.
            rows = [prompts[i] for i in sampler.next_indices(rollout.prompts_per_step)]
            episodes, times = sample_round(rows, next_group_id, cfg, generator, environment, tokenizer, sampling)
            next_group_id += len(rows)
            metrics = {"reward/errors": budget.record([e.error for e in episodes]).step_errors,
                       **rollout_metrics(episodes, weights), "reward/errors_total": budget.run_errors}
            run_log.log_samples(step, "train", [sample_record(e, tokenizer, weights).to_json()
                                                for e in episodes[: cfg.logging.samples_per_step]])
            penalties = [overlong_penalty(e.last_turn_length, e.truncated, rollout.max_new_tokens,
                                          rollout.overlong_buffer_length, rollout.overlong_penalty_factor)
                         for e in episodes]
            batch = to_batch(episodes, tokenizer.pad_token_id, weights, rollout.overlong_filtering, penalties)
            batch = normalize_batch_rewards(batch, reward_norm, metrics)

            # 3. π_old, V_old and π_ref on the sampled tokens.
            started = time.perf_counter()
            old_logprobs = policy.logprobs(batch, rollout.temperature)
            old_values = critic.values(batch)
            reference_logprobs = reference.logprobs(batch, rollout.temperature) if reference is not None else None
            logprob_seconds = time.perf_counter() - started

            # 4. Token rewards and GAE.
            advantages, returns, kl_metrics = ppo_advantages(cfg, batch, old_logprobs, old_values, reference_logprobs)
            metrics.update(kl_metrics)
            metrics["value/explained_variance"] = float(explained_variance(old_values, returns, batch.loss_mask))

            # 5. Train: the critic every minibatch; the policy once the critic's warm-up is over.
            started = time.perf_counter()
            train_policy = step > cfg.critic.warmup_steps
            update_metrics = []
            for _ in range(cfg.update.ppo_epochs):
                order = torch.randperm(len(batch))
                for minibatch in torch.tensor_split(order, cfg.update.num_minibatches):
                    stats: MetricDict = {}
                    if train_policy:
                        stats.update(accumulate_policy_gradients(policy, batch, minibatch, advantages, old_logprobs,
                                                                 reference_logprobs, loss_cfg, cfg))
                        stats.update(policy.optim_step())
                    stats.update(accumulate_value_gradients(critic, batch, minibatch, old_values, returns, cfg))
                    stats.update({f"value/{k}": v for k, v in critic.optim_step().items()})
                    update_metrics.append(stats)
            train_seconds = time.perf_counter() - started

            # 6. Weight sync (a no-op for the transformers backend), metrics, validation, checkpoint.
            if train_policy:
                sync_generator(generator, policy)
            step_seconds = time.perf_counter() - step_started
            metrics.update(mean_over_updates(update_metrics))
            # The critic's update is guarded like the policy's: a non-finite one was not applied either.
            critic_checked = {"loss": metrics["value/loss"], "grad_norm": metrics["value/grad_norm"]}
            critic_failed = not all(math.isfinite(value) for value in critic_checked.values())
            checked = {**metrics, **critic_checked} if critic_failed or not train_policy else metrics
            guard.check(step, checked)
            if "nonfinite_skipped_steps" in checked:
                metrics["nonfinite_skipped_steps"] = checked["nonfinite_skipped_steps"]
            metrics.update(step_timings(generate=times.generate, score=times.score, logprobs=logprob_seconds,
                                        train=train_seconds, step=step_seconds,
                                        tokens=float(batch.attention_mask.sum()),
                                        generated_tokens=times.generated_tokens, epoch=sampler.epochs_completed))
            metrics.update(due_evaluations(step, cfg, data, generator, greedy, weights, evaluation, run_log))
            log_step(run_log, step, metrics, trainer)
            save_if_due(output_dir, step, trainer, {POLICY: policy, CRITIC: critic}, sampler,
                        rl_state(budget, next_group_id, reward_norm))

        final_dir = export_policy(output_dir, policy, run_log)
    return RLResult(output_dir, final_dir, trainer.max_steps, metrics)


# ---- pieces of the loop ----------------------------------------------------------------------------------


def ppo_advantages(cfg: PPOConfig, batch: RolloutBatch, old_logprobs: torch.Tensor, old_values: torch.Tensor,
                   reference_logprobs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Per-token advantages [N, T] (whitened if asked), the critic's return targets [N, T], and the KL-in-reward
    metrics, from the batch's sequence rewards and the critic's values before the update."""
    mask = batch.loss_mask
    kl = None
    metrics: dict[str, float] = {}
    if cfg.gae.kl_coef > 0:
        assert reference_logprobs is not None
        kl = kl_estimate(old_logprobs, reference_logprobs, cfg.loss.kl_estimator, cfg.loss.kl_clamp, cfg.loss.kl_output_clamp)
        tokens = float(mask.sum())
        metrics["kl_in_reward"] = float((kl * mask).sum()) / tokens if tokens else 0.0
    rewards = torch.where(batch.valid, batch.rewards, 0.0)
    token_rewards = token_level_rewards(rewards, mask, kl, cfg.gae.kl_coef)
    advantages, returns = gae_advantages(token_rewards, old_values, mask, cfg.gae.gamma, cfg.gae.lam,
                                         cfg.gae.value_lam)
    if cfg.gae.whiten_advantages:
        advantages = whiten(advantages, mask)
    return advantages, returns, metrics


def value_objective(old_values: torch.Tensor, returns: torch.Tensor, clip: float | None) -> LossFn:
    """The clipped value loss of one micro-batch (its V_old and return targets given, [n, T])."""

    def loss_fn(values: torch.Tensor, batch: RolloutBatch, normalizer: float) -> tuple[torch.Tensor, MetricDict]:
        loss, metrics = value_loss(values, old_values.to(values.device), returns.to(values.device),
                                   batch.loss_mask, clip, normalizer)
        tokens = batch.loss_mask.sum()
        # value_loss itself is the worker's `loss` (summed over micro-batches), logged as value/loss.
        return loss, {f"value/{name.removeprefix('value_')}": Metric.mean(value, tokens)
                      for name, value in metrics.items() if name != "value_loss"}

    return loss_fn


def accumulate_value_gradients(critic: ValueWorker, batch: RolloutBatch, minibatch: torch.Tensor,
                               old_values: torch.Tensor, returns: torch.Tensor, cfg: PPOConfig) -> MetricDict:
    """Forward/backward the critic on the minibatch in micro-batches of at most trainer.micro_batch_size episodes,
    as many on every data-parallel rank (as the policy's), the value loss normalized over the minibatch's valid
    tokens."""
    normalizer = value_loss_normalizer(batch.loss_mask[minibatch])
    if normalizer == 0:
        return {"value/loss": Metric.sum(0.0)}
    records = []
    ranks = world_size()
    pieces = ranks * math.ceil(len(minibatch) / (cfg.trainer.micro_batch_size * ranks))
    for index in critic.shard(list(torch.tensor_split(minibatch, pieces))):
        objective = value_objective(old_values[index], returns[index], cfg.critic.value_clip)
        record = critic.forward_backward(batch.select(index), objective, normalizer)
        record["value/loss"] = record.pop("loss")
        records.append(record)
    return critic.all_reduce(reduce_metrics(records))
