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
from dataclasses import replace

import torch

from posttrain.advantages import gae_advantages, token_level_rewards, whiten
from posttrain.algorithms.common import NonFiniteGuard, announce_run, export_policy, log_step, run_logger, save_if_due
from posttrain.algorithms.evaluate import TrainingEvaluation, reward_weights, train_sample
from posttrain.algorithms.rl import (
    RLResult,
    due_evaluations,
    mean_over_updates,
    per_update_schedule,
    policy_generator,
    reference_worker,
    rollout_batch,
    start_rl_run,
    step_timings,
)
from posttrain.checkpoint import POLICY
from posttrain.config.schema import PPOConfig
from posttrain.data.types import RolloutBatch
from posttrain.distributed.builders import build_critic, build_policy
from posttrain.losses.policy_gradient import kl_estimate
from posttrain.losses.value import explained_variance
from posttrain.distributed.cluster import stops_clusters
from posttrain.rundir import one_run_per_output_dir
from posttrain.workers.objectives import PolicyGradientObjective, ValueObjective
from posttrain.workers.value import CRITIC

PROGRESS_METRICS = ("reward/mean", "accuracy", "val/accuracy", "value/explained_variance", "kl")


@one_run_per_output_dir
@stops_clusters  # a Ray instance started for the run stops with it, also when it fails
def train_ppo(cfg: PPOConfig) -> RLResult:
    run = start_rl_run(cfg)  # output directory, seed, data and environment (before any model), resume
    trainer, rollout, tokenizer, environment = cfg.trainer, cfg.rollout, run.data.tokenizer, run.data.environment
    weights = reward_weights(environment)
    evaluation = TrainingEvaluation(cfg.evaluation, tokenizer, trainer.max_steps)
    loss = PolicyGradientObjective(cfg.loss.resolved(max_completion_tokens=rollout.max_new_tokens * rollout.max_turns),
                                   temperature=rollout.temperature, top_k=rollout.top_k, top_p=rollout.top_p)
    value_loss = ValueObjective(cfg.critic.value_clip)

    updates_per_step = cfg.update.ppo_epochs * cfg.update.num_minibatches
    policy_steps = trainer.model_copy(update={"max_steps": trainer.max_steps - cfg.critic.warmup_steps})
    policy = build_policy(cfg.model, cfg.lora, trainer, tokenizer, run.device,
                          schedule=per_update_schedule(policy_steps, updates_per_step), resume_dir=run.worker_dir(POLICY),
                          cluster=run.cluster)  # FSDP2 ranks as Ray actors with cluster.policy_workers > 0
    critic_trainer = trainer.model_copy(update={"learning_rate": cfg.critic.learning_rate})
    critic = build_critic(cfg.critic.init_from, cfg.model, critic_trainer, tokenizer, run.device,
                          schedule=per_update_schedule(critic_trainer, updates_per_step),
                          resume_dir=run.worker_dir(CRITIC), cluster=run.cluster)
    # The reference is the starting model, also when resuming; loaded only when a KL term needs it.
    needs_reference = loss.config.reference_kl_penalty > 0 or cfg.gae.kl_coef > 0
    reference = reference_worker(policy, cfg, run.device, run.cluster) if needs_reference else None
    generator = policy_generator(cfg, tokenizer, policy, run.cluster)  # Ray actors with cluster.backend=ray
    source, start_step = run.rollout_source(cfg, generator, weights)

    with run_logger(run.output_dir, cfg.logging, recipe="ppo", total_steps=trainer.max_steps, start_step=start_step,
                    run_config=cfg.model_dump(mode="json"), progress_metrics=PROGRESS_METRICS) as run_log, \
            contextlib.closing(environment), contextlib.closing(evaluation), contextlib.closing(source):
        announce_run(run_log, run.data.data_summary, run.resume, run.changed_keys, policy,
                     f"a critic of {critic.num_parameters() / 1e6:.2f}M parameters, {rollout.prompts_per_step} "
                     f"prompts x {rollout.num_generations_per_prompt} samples per step, {updates_per_step} "
                     f"optimizer step(s) each per rollout batch")
        metrics: dict[str, float] = {}
        guard = NonFiniteGuard(trainer, run.output_dir)
        for step in range(start_step + 1, trainer.max_steps + 1):
            step_started = time.perf_counter()

            # 1-2. Sample and score.
            sampled = source.next_groups(step)
            episodes, metrics = sampled.episodes, dict(sampled.metrics)
            run_log.log_samples(step, "train", [train_sample(e, tokenizer, weights)
                                                for e in episodes[: cfg.logging.samples_per_step]])
            if not episodes:  # asynchronous rollouts: every group of the round was dropped (docs/ray.md)
                run_log.message(f"step {step}: every group was dropped (timed out or too stale); no update this step")
                log_step(run_log, step, metrics, trainer)
                save_if_due(run.output_dir, step, trainer, {POLICY: policy, CRITIC: critic}, source.sampler,
                            lambda: run.trainer_state(source), run_log=run_log)
                continue
            batch = rollout_batch(episodes, cfg, run, weights, metrics)

            # 3. π_old, V_old and π_ref on the sampled tokens.
            started = time.perf_counter()
            batch = replace(
                batch, old_logprobs=policy.logprobs(batch, rollout.temperature), old_values=critic.values(batch),
                reference_logprobs=None if reference is None else reference.logprobs(batch, rollout.temperature))
            logprob_seconds = time.perf_counter() - started

            # 4. Token rewards and GAE: per-token advantages for the policy, return targets for the critic.
            advantages, returns, kl_metrics = ppo_advantages(cfg, batch)
            batch = replace(batch, advantages=advantages, returns=returns)
            metrics.update(kl_metrics)
            metrics["value/explained_variance"] = float(explained_variance(batch.old_values, returns, batch.loss_mask))

            # 5. Train: the critic every minibatch; the policy once the critic's warm-up is over.
            started = time.perf_counter()
            train_policy = step > cfg.critic.warmup_steps
            update_metrics = []
            for _ in range(cfg.update.ppo_epochs):
                order = torch.randperm(len(batch))
                for minibatch in torch.tensor_split(order, cfg.update.num_minibatches):
                    part = batch.select(minibatch)
                    stats = {}
                    if train_policy:
                        stats.update(policy.forward_backward(part, loss))
                        stats.update(policy.optim_step())
                    critic_stats = critic.forward_backward(part, value_loss)
                    stats.update({"value/loss": critic_stats.pop("loss"), **critic_stats})
                    stats.update({f"value/{k}": v for k, v in critic.optim_step().items()})
                    update_metrics.append(stats)
            train_seconds = time.perf_counter() - started

            # 6. Weight sync (versioned; nothing is read by a generator sampling from the policy's own module),
            # metrics, validation, checkpoint.
            if train_policy:
                metrics.update(policy.push_weights(generator))
            step_seconds = time.perf_counter() - step_started
            metrics.update(mean_over_updates(update_metrics))
            # The critic's update is guarded like the policy's: a non-finite one was not applied either.
            critic_checked = {"loss": metrics["value/loss"], "grad_norm": metrics["value/grad_norm"]}
            critic_failed = not all(math.isfinite(value) for value in critic_checked.values())
            checked = {**metrics, **critic_checked} if critic_failed or not train_policy else metrics
            guard.check(step, checked)
            if "nonfinite_skipped_steps" in checked:
                metrics["nonfinite_skipped_steps"] = checked["nonfinite_skipped_steps"]
            metrics.update(step_timings(sampled, source, batch, logprobs=logprob_seconds, train=train_seconds,
                                        step=step_seconds))
            metrics.update(due_evaluations(step, cfg, run.data, generator, run.greedy, weights, evaluation, run_log))
            metrics.update(run.cluster_metrics())  # Ray worker groups: heartbeats, restarts
            log_step(run_log, step, metrics, trainer)
            save_if_due(run.output_dir, step, trainer, {POLICY: policy, CRITIC: critic}, source.sampler,
                        lambda: run.trainer_state(source), run_log=run_log)

        final_dir = export_policy(run.output_dir, policy, run_log, cfg.hub)
    return RLResult(run.output_dir, final_dir, trainer.max_steps, metrics)


# ---- pieces of the loop ----------------------------------------------------------------------------------


def ppo_advantages(cfg: PPOConfig, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Per-token advantages [N, T] (whitened if asked), the critic's return targets [N, T], and the KL-in-reward
    metrics, from the batch's sequence rewards, π_old and π_ref log-probabilities and the critic's values before
    the update (batch.old_values)."""
    old_logprobs, old_values, reference_logprobs = batch.old_logprobs, batch.old_values, batch.reference_logprobs
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
