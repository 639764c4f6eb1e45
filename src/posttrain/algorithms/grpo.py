"""Online RL from verifiable rewards: GRPO and its family in one loop.

Each step, top to bottom:
  1. sample   — draw prompts, sample `num_generations_per_prompt` episodes each (DAPO dynamic sampling
                draws more prompts until enough groups have reward variance)
  2. score    — the environment rewards every episode; failed scores are masked and counted
  3. advantages — group-relative (or RLOO, GDPO, REINFORCE++, raw) from the rewards
  4. logprobs — π_old (skipped when the update is on-policy: then π_old is the current policy itself)
                and π_ref (only when the KL penalty is on); with advantage.estimator=opd the teacher's and the
                student's log-probabilities of the sampled tokens make per-token advantages (on-policy
                distillation), plus opd_reward_weight × the grpo advantage
  5. train    — `ppo_epochs` passes over the batch in `num_minibatches` minibatches, one optimizer step each,
                with the clipped policy-gradient loss normalized over the minibatch
  6. sync     — push the new weights to the generator (nothing to do when it samples from the trained model)
  7. log, validate, checkpoint

Which knob makes which algorithm is in docs/rl.md; the presets configs/*_arithmetic.yaml differ from
configs/grpo_arithmetic.yaml only in those knobs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import torch

from posttrain.advantages import (
    gdpo_advantages,
    grpo_advantages,
    opd_advantages,
    raw_reward_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from posttrain.algorithms.common import (
    NonFiniteGuard,
    announce_run,
    check_same_tokenizer,
    export_policy,
    log_step,
    run_logger,
    save_if_due,
)
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
from posttrain.config.schema import GRPOConfig
from posttrain.data.types import RolloutBatch
from posttrain.distributed.builders import build_policy, build_teacher, check_teacher_backend
from posttrain.models.loading import load_tokenizer
from posttrain.distributed.cluster import stops_clusters
from posttrain.rundir import one_run_per_output_dir
from posttrain.workers.objectives import PolicyGradientObjective

PROGRESS_METRICS = ("reward/mean", "accuracy", "val/accuracy", "kl", "response_length/mean")


@one_run_per_output_dir
@stops_clusters  # a Ray instance started for the run stops with it, also when it fails
def train_grpo(cfg: GRPOConfig) -> RLResult:
    run = start_rl_run(cfg)  # output directory, seed, data and environment (before any model), resume
    trainer, rollout, tokenizer, environment = cfg.trainer, cfg.rollout, run.data.tokenizer, run.data.environment
    weights = {**reward_weights(environment), **cfg.advantage.component_weights}
    evaluation = TrainingEvaluation(cfg.evaluation, tokenizer, trainer.max_steps)
    loss = PolicyGradientObjective(cfg.loss.resolved(max_completion_tokens=rollout.max_new_tokens * rollout.max_turns),
                                   temperature=rollout.temperature, top_k=rollout.top_k, top_p=rollout.top_p)

    updates_per_step = cfg.update.ppo_epochs * cfg.update.num_minibatches
    if cfg.teacher is not None:
        check_teacher_backend(cfg.teacher)  # before any model loads
    policy = build_policy(cfg.model, cfg.lora, trainer, tokenizer, run.device,
                          schedule=per_update_schedule(trainer, updates_per_step), resume_dir=run.worker_dir(POLICY),
                          cluster=run.cluster)  # FSDP2 ranks as Ray actors with cluster.policy_workers > 0
    # The reference is the starting model, also when resuming; loaded only when the KL penalty needs it. With LoRA
    # it is the policy itself with its adapters switched off (no second copy).
    reference = (reference_worker(policy, cfg, run.device, run.cluster) if loss.config.reference_kl_penalty > 0
                 else None)
    # On-policy distillation's teacher: frozen, with the student's tokenizer, scoring the sampled tokens each step.
    teacher = None
    if cfg.teacher is not None:
        check_same_tokenizer(tokenizer, load_tokenizer(cfg.teacher.as_model()), cfg.teacher.name_or_path)
        teacher = build_teacher(cfg.teacher, trainer, run.device, cluster=run.cluster)
    generator = policy_generator(cfg, tokenizer, policy, run.cluster)  # Ray actors with cluster.backend=ray
    source, start_step = run.rollout_source(cfg, generator, weights, dynamic_sampling=rollout.dynamic_sampling)

    # closing(): reward worker processes stop with the run, also when it fails.
    with run_logger(run.output_dir, cfg.logging, recipe="grpo", total_steps=trainer.max_steps, start_step=start_step,
                    run_config=cfg.model_dump(mode="json"), progress_metrics=PROGRESS_METRICS) as run_log, \
            contextlib.closing(environment), contextlib.closing(evaluation), contextlib.closing(source):
        announce_run(run_log, run.data.data_summary, run.resume, run.changed_keys, policy,
                     f"{rollout.prompts_per_step} prompts x {rollout.num_generations_per_prompt} samples per step, "
                     f"{updates_per_step} optimizer step(s) per rollout batch")
        metrics: dict[str, float] = {}
        guard = NonFiniteGuard(trainer, run.output_dir)
        for step in range(start_step + 1, trainer.max_steps + 1):
            step_started = time.perf_counter()

            # 1-2. Sample and score (dynamic sampling: until enough groups carry signal).
            sampled = source.next_groups(step)
            episodes, metrics = sampled.episodes, dict(sampled.metrics)
            # The first episodes as they came (no draw), for a look at what the policy writes.
            run_log.log_samples(step, "train", [train_sample(e, tokenizer, weights)
                                                for e in (episodes or sampled.last_round)[: cfg.logging.samples_per_step]])
            if not episodes:
                run_log.message(f"step {step}: every group was dropped (timed out or too stale); no update this step"
                                if rollout.asynchronous else f"step {step}: every group of "
                                f"{metrics.get('sampling/rounds', 1)} sampling round(s) had equal rewards; no update "
                                "this step")
                if evaluation.is_due(step):
                    metrics.update(evaluation.run(step, generator, run_log))
                log_step(run_log, step, metrics, trainer)
                save_if_due(run.output_dir, step, trainer, {POLICY: policy}, source.sampler,
                            lambda: run.trainer_state(source), run_log=run_log)
                continue
            batch = rollout_batch(episodes, cfg, run, weights, metrics)

            # 3. Advantages, per episode.
            batch = replace(batch, advantages=compute_advantages(cfg, batch))

            # 4. Logprobs of π_old and π_ref. On-policy (one update per batch) π_old is the current policy:
            # the loss then uses the training pass's own detached logprobs and the ratio is exactly 1.
            started = time.perf_counter()
            batch = replace(
                batch, old_logprobs=None if updates_per_step == 1 else policy.logprobs(batch, rollout.temperature),
                reference_logprobs=None if reference is None else reference.logprobs(batch, rollout.temperature))
            if teacher is not None:  # OPD: per-token advantages from the teacher's log-ratio to the student
                student = batch.old_logprobs if batch.old_logprobs is not None else policy.logprobs(
                    batch, rollout.temperature)
                batch = replace(batch, advantages=opd_advantages(
                    teacher.logprobs(batch, rollout.temperature), student, batch.loss_mask, batch.advantages,
                    cfg.advantage.opd_reward_weight))
                metrics.update(opd_metrics(batch))
            logprob_seconds = time.perf_counter() - started

            # 5. Train: ppo_epochs passes, num_minibatches optimizer steps each; the policy splits each minibatch
            # into micro-batches and normalizes the loss over all of it.
            started = time.perf_counter()
            update_metrics = []
            for _ in range(cfg.update.ppo_epochs):
                order = torch.randperm(len(batch))
                for minibatch in torch.tensor_split(order, cfg.update.num_minibatches):
                    stats = policy.forward_backward(batch.select(minibatch), loss)
                    update_metrics.append({**stats, **policy.optim_step()})
            train_seconds = time.perf_counter() - started

            # 6. Weight sync: versioned; the transformers backend sampling from the policy's own module reads nothing.
            metrics.update(policy.push_weights(generator))

            # 7. Metrics, validation, checkpoint.
            step_seconds = time.perf_counter() - step_started
            metrics.update(mean_over_updates(update_metrics))
            guard.check(step, metrics)
            metrics.update(step_timings(sampled, source, batch, logprobs=logprob_seconds, train=train_seconds,
                                        step=step_seconds))
            metrics.update(due_evaluations(step, cfg, run.data, generator, run.greedy, weights, evaluation, run_log))
            metrics.update(run.cluster_metrics())  # Ray worker groups: heartbeats, restarts
            log_step(run_log, step, metrics, trainer)
            save_if_due(run.output_dir, step, trainer, {POLICY: policy}, source.sampler,
                        lambda: run.trainer_state(source), run_log=run_log)

        final_dir = export_policy(run.output_dir, policy, run_log, cfg.hub)
    return RLResult(run.output_dir, final_dir, trainer.max_steps, metrics)


# ---- pieces of the loop ----------------------------------------------------------------------------------


def opd_metrics(batch: RolloutBatch) -> dict[str, float]:
    """opd/advantage_mean (the token-mean advantage: with no reward term, the mean log π_teacher − log π_student
    of the sampled tokens, an estimate of −KL(student ‖ teacher) per token), opd/advantage_min and _max."""
    valid = batch.loss_mask.bool()
    values = batch.advantages[valid]
    if values.numel() == 0:
        return {}
    return {"opd/advantage_mean": float(values.mean()), "opd/advantage_min": float(values.min()),
            "opd/advantage_max": float(values.max())}


def compute_advantages(cfg: GRPOConfig, batch: RolloutBatch) -> torch.Tensor:
    """[N] advantages from the batch's rewards, with the configured estimator (posttrain.advantages). For opd
    these are the reward's grpo advantages, which the teacher's per-token log-ratio is added to later."""
    a = cfg.advantage
    if a.estimator in ("grpo", "opd"):
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
