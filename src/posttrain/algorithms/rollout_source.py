"""Where an online RL loop gets its episodes: a `RolloutSource`.

    sampled = source.next_groups(step)      # groups of scored episodes, with their sampling metrics

The loop neither draws prompts nor counts sampling rounds: the source does. `SynchronousRolloutSource` samples each
step's groups when asked, from the generator's current weights (every episode records the policy version that
sampled it), including DAPO's dynamic sampling (more rounds until enough groups carry reward variance). An
asynchronous producer (generation running ahead of training by a bounded number of versions) and agent loops
implement the same protocol; the loop does not change.

A source owns the prompt sampler's draws, the run's group counter (which seeds sampling, so a resumed run samples
what an uninterrupted one would) and the reward-error budget; `state_dict` / `load_state_dict` carry them through
checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from posttrain.algorithms.rollout import (
    Episode,
    PromptRow,
    RolloutTimes,
    groups_of,
    has_reward_variance,
    rollout_metrics,
    run_episodes,
)
from posttrain.config.schema import GRPOConfig
from posttrain.data.sampler import EpochSampler
from posttrain.process_group import gather_divided
from posttrain.envs.base import Environment
from posttrain.envs.rewards import RewardErrorBudget
from posttrain.generation.base import Generator, SamplingParams


@dataclass
class SampledGroups:
    """One step's episodes as a source hands them to the loop."""

    groups: list[list[Episode]]
    """The groups to train on (episodes of one prompt row share a group id), in sampling order."""
    last_round: list[Episode]
    """Every episode of the last sampling round, kept or not (for a look at what the policy writes when dynamic
    sampling kept nothing)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """reward/errors (this step), reward/errors_total (the run), sampling/* with dynamic sampling, and the rollout
    statistics of the kept episodes (reward, accuracy, lengths, truncation, turns)."""
    times: RolloutTimes = RolloutTimes(0.0, 0.0, 0)
    """Generation and scoring seconds and sampled tokens, over every round."""

    @property
    def episodes(self) -> list[Episode]:
        return [episode for group in self.groups for episode in group]


class RolloutSource(Protocol):
    """What an online RL loop asks for its episodes (see the module docstring)."""

    def next_groups(self, step: int) -> SampledGroups:
        """The groups of scored episodes step `step` trains on."""
        ...

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the source (counters, budgets; an asynchronous source's buffer)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        ...


class SynchronousRolloutSource:
    """Samples each step's groups when asked, from the generator's current weights.

    prompts: the training prompt rows; sampler: draws rollout.prompts_per_step of them per round (its position is
    checkpointed by the loop with the trainer state); weights: reward component weights (for the rollout statistics
    and dynamic sampling's variance test)."""

    def __init__(self, cfg: GRPOConfig, prompts: list[PromptRow], sampler: EpochSampler, generator: Generator,
                 environment: Environment, tokenizer, sampling: SamplingParams, weights: dict[str, float],
                 budget: RewardErrorBudget, dynamic_sampling: bool = False):
        self.cfg, self.prompts, self.sampler, self.generator = cfg, prompts, sampler, generator
        self.environment, self.tokenizer, self.sampling, self.weights = environment, tokenizer, sampling, weights
        self.budget, self.dynamic_sampling = budget, dynamic_sampling
        self.next_group_id = 0

    def next_groups(self, step: int) -> SampledGroups:
        rollout = self.cfg.rollout
        kept: list[list[Episode]] = []
        errors = rounds = 0
        generate_seconds = score_seconds = 0.0
        generated_tokens = 0
        while True:
            rows = [self.prompts[i] for i in self.sampler.next_indices(rollout.prompts_per_step)]
            new, times = sample_round(rows, self.next_group_id, self.cfg, self.generator, self.environment,
                                      self.tokenizer, self.sampling)
            self.next_group_id += len(rows)
            rounds += 1
            generate_seconds, score_seconds = generate_seconds + times.generate, score_seconds + times.score
            generated_tokens += times.generated_tokens
            errors += self.budget.record([e.error for e in new]).step_errors
            groups = groups_of(new)
            if not self.dynamic_sampling:
                kept = groups
                break
            kept += [g for g in groups if has_reward_variance(g, self.weights)]
            if len(kept) >= rollout.prompts_per_step or rounds == rollout.max_sampling_rounds:
                break
        kept = kept[: rollout.prompts_per_step]
        metrics: dict[str, float] = {"reward/errors": errors}
        if self.dynamic_sampling:
            metrics.update({"sampling/rounds": rounds, "sampling/groups_kept": len(kept),
                            "sampling/groups_filtered": rounds * rollout.prompts_per_step - len(kept)})
        sampled = SampledGroups(kept, new, metrics, RolloutTimes(generate_seconds, score_seconds, generated_tokens))
        metrics.update(rollout_metrics(sampled.episodes, self.weights))
        metrics["reward/errors_total"] = self.budget.run_errors
        return sampled

    def state_dict(self) -> dict:
        return {"reward_errors": self.budget.state_dict(), "next_group_id": self.next_group_id}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.budget.load_state_dict(state["reward_errors"])
            self.next_group_id = state.get("next_group_id", 0)


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

    def sample_share(start: int, stop: int) -> tuple[list[Episode], RolloutTimes]:
        if stop == start:
            return [], RolloutTimes(0.0, 0.0, 0)
        return run_episodes(rows[start:stop], first_group_id + start, num_samples, generator, environment, tokenizer,
                            sampling, rollout.max_turns, group_seed=cfg.seed)

    shares = gather_divided(len(rows), sample_share, "while sampling the round's groups")
    if len(shares) == 1:
        return shares[0]
    episodes = [episode for rank_episodes, _ in shares for episode in rank_episodes]
    times = [rank_times for _, rank_times in shares]
    # The round lasts as long as its slowest rank; every rank's sampled tokens count.
    return episodes, RolloutTimes(max(t.generate for t in times), max(t.score for t in times),
                                  sum(t.generated_tokens for t in times))
