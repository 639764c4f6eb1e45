"""Where an online RL loop gets its episodes: a `RolloutSource`.

    sampled = source.next_groups(step)      # groups of scored episodes, with their sampling metrics

The loop neither draws prompts nor counts sampling rounds: the source does. `SynchronousRolloutSource` samples each
step's groups when asked, from the generator's current weights (every episode records the policy version that
sampled it), including DAPO's dynamic sampling (more rounds until enough groups carry reward variance).
`AsynchronousRolloutSource` (rollout.asynchronous, Ray generation actors) keeps the rounds of the next
rollout.max_staleness steps in flight while the policy trains, with dynamic sampling too (a step takes further rounds
from the queue); agent loops will implement the same protocol. The loop does not change.

A source owns the prompt sampler's draws, the run's group counter (which seeds sampling, so a resumed run samples
what an uninterrupted one would) and the reward-error budget; `state_dict` / `load_state_dict` carry them through
checkpoints.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import asdict, dataclass, field, replace
from typing import Protocol

from posttrain.algorithms.rollout import (
    Episode,
    episode_stream_seed,
    PromptRow,
    RolloutTimes,
    groups_of,
    has_reward_variance,
    rollout_metrics,
    run_episodes,
    run_episodes_within,
    sample_and_score_within,
)
from posttrain.config.schema import GRPOConfig
from posttrain.data.sampler import EpochSampler
from posttrain.process_group import gather_divided
from posttrain.envs.base import Environment
from posttrain.envs.rewards import RewardErrorBudget
from posttrain.errors import RunError
from posttrain.generation.base import Completion, GenerationOutput, Generator, SamplingParams, SubmittedBlock


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

    def close(self) -> None:
        """Stop what the source runs in the background (an asynchronous source's rounds in flight)."""
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

    def close(self) -> None:
        """Nothing runs in the background."""


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


class AsynchronousRolloutSource:
    """Generation runs ahead of training by up to rollout.max_staleness policy versions (rollout.asynchronous,
    cluster.backend=ray).

    Each call of `next_groups(step)` first keeps `max_staleness + 1` sampling rounds submitted: the rounds of steps
    `step` to `step + max_staleness`, each drawn from the sampler and seeded from the group counter as the synchronous
    source draws them, and sent to the generation actors at once (`generator.submit`). A Ray actor answers its calls
    in the order they were sent, so a round submitted before the weight push that follows a step samples from the
    weights of before that push: round `step + k` samples from the policy of step `step - 1`, whatever the timing, and
    a run is as reproducible as a synchronous one. Scoring runs in a thread as soon as a round's completions arrive.
    The round of `step` is then taken; a group whose oldest episode is more than max_staleness versions behind the
    generator's weights is dropped and counted (by construction none is; a generation call re-sent to a replacement
    actor samples from newer weights, never older). With rollout.group_timeout_s each generation actor's share of a
    round is waited for on its own (`submit_blocks`), each group is scored by a call of its own as soon as its share
    arrives, and a group not generated and scored within that many seconds of the round's first share is dropped,
    counted (rollout/timed_out_groups, rollout/generation_timed_out_groups) and not sampled again: the sampler has
    moved past its prompt, as it has past every prompt of the round (`sample_and_score_within`).

    With dynamic sampling a step takes rounds from the queue until rollout.prompts_per_step groups with reward
    variance are kept or rollout.max_sampling_rounds were taken, each taken round replaced at once (sent with the
    current weights): every step sends at least one round, so the rounds in flight were all sent within the last
    max_staleness + 1 steps and the bound holds, whatever a step takes.

    `state_dict` waits for the rounds in flight and keeps their episodes (and which of their groups timed out), so
    a resumed run trains on exactly the episodes an uninterrupted one would (it is called only when a checkpoint is
    written). With rollout.in_flight_updates each round is a `ChunkedGeneration`, and every episode records the
    version of each span of its tokens (`Episode.version_spans`); its age counts from the oldest. In multi-turn rounds
    the later turns are generation calls of their own, sent when each episode's environment call answers and
    sampled by the weights the generators hold then; `run_episodes` records their versions the same way."""

    def __init__(self, cfg: GRPOConfig, prompts: list[PromptRow], sampler: EpochSampler, generator,
                 environment: Environment, tokenizer, sampling: SamplingParams, weights: dict[str, float],
                 budget: RewardErrorBudget, deadline_s: float, dynamic_sampling: bool = False):
        self.cfg, self.prompts, self.sampler, self.generator = cfg, prompts, sampler, generator
        self.environment, self.tokenizer, self.sampling, self.weights = environment, tokenizer, sampling, weights
        self.budget, self.deadline_s, self.dynamic_sampling = budget, deadline_s, dynamic_sampling
        self.max_staleness = cfg.rollout.max_staleness
        self.next_group_id = 0
        self.timed_out_groups = 0
        """Groups dropped over the run because their generation and scoring outlasted rollout.group_timeout_s."""
        self.generation_timed_out_groups = 0
        """Those of them whose generation had not answered by then."""
        self.in_flight: deque[Future] = deque()
        self.pool = ThreadPoolExecutor(max_workers=self.max_staleness + 1, thread_name_prefix="rollout")

    def _submit_round(self) -> None:
        rollout = self.cfg.rollout
        rows = [self.prompts[i] for i in self.sampler.next_indices(rollout.prompts_per_step)]
        first_group_id = self.next_group_id
        self.next_group_id += len(rows)
        if rollout.seed_per_group:  # each group its own streams (sample_round's): the blocks go to every actor
            seeded = replace(self.sampling, seed=None, seeds=tuple(
                episode_stream_seed(self.cfg.seed, first_group_id + i, 0) for i in range(len(rows))))
        else:  # one stream for the round: one generation actor samples it
            seeded = replace(self.sampling, seed=self.cfg.seed * 1_000_003 + first_group_id)
        prompts = [row.prompt_ids for row in rows]
        if rollout.group_timeout_s is not None and not rollout.in_flight_updates and rollout.max_turns == 1:
            # Each generation actor's share is waited for on its own: the groups of one that straggles are dropped.
            blocks = self.generator.submit_blocks(prompts, seeded, rollout.num_generations_per_prompt)
            self.in_flight.append(self.pool.submit(self._finish_round_within, rows, first_group_id, blocks))
            return
        if rollout.in_flight_updates:
            # A single-turn round's chunks are timed here; a multi-turn round's later turns by `run_episodes_within`.
            submitted = ChunkedGeneration(self.generator, prompts, seeded, rollout.num_generations_per_prompt,
                                          rollout.in_flight_chunk_tokens, first_group_id, self.tokenizer,
                                          rollout.group_timeout_s if rollout.max_turns == 1 else None)
        else:  # a multi-turn round's first turns under the group timeout: each actor's block waited for on its own
            submitted = SubmittedGeneration(self.generator, prompts, seeded, rollout.num_generations_per_prompt,
                                            in_blocks=rollout.group_timeout_s is not None)
        self.in_flight.append(self.pool.submit(self._finish_round, rows, first_group_id, submitted, seeded))

    def _finish_round(self, rows: list[PromptRow], first_group_id: int,
                      submitted: SubmittedGeneration | ChunkedGeneration, seeded: SamplingParams) -> Round:
        """The round's episodes, scored (in a worker thread; every wait inside has a deadline)."""
        rollout = self.cfg.rollout
        within = run_episodes_within(rows, first_group_id, rollout.num_generations_per_prompt, submitted,
                                     self.environment, self.tokenizer, seeded, max_turns=rollout.max_turns,
                                     group_seed=self.cfg.seed if rollout.seed_per_group else None,
                                     group_timeout_s=rollout.group_timeout_s)
        samples = rollout.num_generations_per_prompt
        for index, episode in enumerate(within.episodes if rollout.max_turns == 1 else []):  # whole groups, in order
            # (A multi-turn episode's versions are recorded turn by turn, and chunk by chunk, by `run_episodes`.)
            flat = (episode.group_id - first_group_id) * samples + index % samples
            # The oldest weights that sampled any of its tokens (a replacement actor holds newer ones).
            episode.version_spans = submitted.version_spans(flat)
            episode.policy_version = min((version for _, version in episode.version_spans),
                                         default=submitted.oldest_version)
        timed_out = sorted(within.generation_timed_out + within.scoring_timed_out)
        return Round(within.episodes, within.times, timed_out, within.generation_timed_out)

    def _finish_round_within(self, rows: list[PromptRow], first_group_id: int, blocks: list) -> Round:
        """The round's groups generated and scored within rollout.group_timeout_s of its first block's arrival (in a
        worker thread; every wait inside has a deadline)."""
        rollout = self.cfg.rollout
        within = sample_and_score_within(rows, first_group_id, rollout.num_generations_per_prompt, blocks,
                                         self.environment, self.tokenizer, rollout.group_timeout_s)
        timed_out = sorted(within.generation_timed_out + within.scoring_timed_out)
        return Round(within.episodes, within.times, timed_out, within.generation_timed_out)

    def next_groups(self, step: int) -> SampledGroups:
        rollout = self.cfg.rollout
        current = self.generator.weights_version
        kept: list[list[Episode]] = []
        rounds = dropped = errors = timed_out = generation_timed_out = tokens = 0
        waited = generate_seconds = score_seconds = 0.0
        while True:
            # Rounds are taken in the order they were sent and replaced at once: at every step at least one round is
            # sent, so the max_staleness + 1 in flight were all sent within the last max_staleness + 1 steps.
            while len(self.in_flight) < self.max_staleness + 1:
                self._submit_round()
            started = time.perf_counter()
            try:
                taken: Round = self.in_flight.popleft().result(timeout=3 * self.deadline_s)
            except FuturesTimeout:
                raise RunError(f"step {step}'s sampling round did not finish within 3 x cluster.timeout_s="
                               f"{3 * self.deadline_s:g} s (waiting for its generation and scoring)") from None
            waited += time.perf_counter() - started
            rounds += 1
            generate_seconds, score_seconds = generate_seconds + taken.times.generate, score_seconds + taken.times.score
            tokens += taken.times.generated_tokens
            errors += self.budget.record([e.error for e in taken.episodes]).step_errors
            timed_out += len(taken.timed_out_group_ids)
            generation_timed_out += len(taken.generation_timed_out_group_ids)
            for group in groups_of(taken.episodes):
                # A group's age counts from the oldest weights that sampled any of its tokens.
                if current - min(e.policy_version for e in group) > self.max_staleness:
                    dropped += 1
                elif not self.dynamic_sampling or has_reward_variance(group, self.weights):
                    kept.append(group)
            if (not self.dynamic_sampling or len(kept) >= rollout.prompts_per_step
                    or rounds == rollout.max_sampling_rounds):
                break
        kept = kept[: rollout.prompts_per_step]
        self.timed_out_groups += timed_out
        self.generation_timed_out_groups += generation_timed_out
        ages = [current - e.policy_version for group in kept for e in group]
        metrics: dict[str, float] = {"reward/errors": errors,
                                     "rollout/staleness_max": float(max(ages, default=0)),
                                     "rollout/staleness_mean": sum(ages) / max(len(ages), 1),
                                     "rollout/stale_groups_dropped": float(dropped),
                                     "rollout/timed_out_groups": float(timed_out),
                                     "rollout/timed_out_groups_total": float(self.timed_out_groups),
                                     "rollout/generation_timed_out_groups": float(generation_timed_out),
                                     "rollout/generation_timed_out_groups_total":
                                         float(self.generation_timed_out_groups),
                                     "rollout/wait_seconds": waited}
        if self.dynamic_sampling:  # as the synchronous source counts them (dropped groups are not kept either)
            metrics.update({"sampling/rounds": rounds, "sampling/groups_kept": len(kept),
                            "sampling/groups_filtered": rounds * rollout.prompts_per_step - len(kept)})
        sampled = SampledGroups(kept, taken.episodes, metrics, RolloutTimes(generate_seconds, score_seconds, tokens))
        if rollout.in_flight_updates or rollout.max_turns > 1:
            updated = [len(e.version_spans) > 1 for group in kept for e in group]
            metrics["rollout/in_flight_updated_fraction"] = sum(updated) / max(len(updated), 1)
        metrics.update(rollout_metrics(sampled.episodes, self.weights))
        metrics["reward/errors_total"] = self.budget.run_errors
        return sampled

    def state_dict(self) -> dict:
        """The counters, and the episodes of the rounds in flight (waited for: at most max_staleness rounds)."""
        rounds = []
        for future in self.in_flight:
            saved: Round = future.result(timeout=3 * self.deadline_s)
            rounds.append({"episodes": [asdict(e) for e in saved.episodes],
                           "times": [saved.times.generate, saved.times.score, saved.times.generated_tokens],
                           "timed_out_group_ids": saved.timed_out_group_ids,
                           "generation_timed_out_group_ids": saved.generation_timed_out_group_ids})
        return {"reward_errors": self.budget.state_dict(), "next_group_id": self.next_group_id,
                "timed_out_groups": self.timed_out_groups,
                "generation_timed_out_groups": self.generation_timed_out_groups, "rounds_in_flight": rounds}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.budget.load_state_dict(state["reward_errors"])
        self.next_group_id = state.get("next_group_id", 0)
        self.timed_out_groups = state.get("timed_out_groups", 0)
        self.generation_timed_out_groups = state.get("generation_timed_out_groups", 0)
        for saved in state.get("rounds_in_flight", []):
            done: Future = Future()
            done.set_result(Round([Episode(**e) for e in saved["episodes"]], RolloutTimes(*saved["times"]),
                                  saved.get("timed_out_group_ids", []),
                                  saved.get("generation_timed_out_group_ids", [])))
            self.in_flight.append(done)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class Round:
    """One asynchronous sampling round, generated and scored."""

    episodes: list[Episode]
    """The episodes of the groups scored in time, in group order."""
    times: RolloutTimes
    timed_out_group_ids: list[int]
    """The groups not generated and scored within rollout.group_timeout_s: dropped, their prompts not sampled
    again."""
    generation_timed_out_group_ids: list[int] = field(default_factory=list)
    """Those of them whose completions had not arrived by then (their generation actor straggled)."""


class SubmittedGeneration:
    """A generation call sent when it was made (`generator.submit`: queued on the actors before any later weight
    push), answered when `run_episodes` asks for it with the same prompts and parameters. The calls after it (the
    later turns of multi-turn episodes) go to the generator when they are made, sampled by the weights it then
    holds; their outputs say which version that was."""

    def __init__(self, generator, prompts: list[list[int]], params: SamplingParams, num_samples: int,
                 in_blocks: bool = False):
        """in_blocks: send it as one block per generation actor (`submit_blocks`, when the generator has it), for
        `first_turn_blocks` (a multi-turn round under rollout.group_timeout_s)."""
        self.generator = generator
        self.weights_version = generator.weights_version
        self.request = (prompts, params, num_samples)
        self.blocks = (generator.submit_blocks(prompts, params, num_samples)
                       if in_blocks and hasattr(generator, "submit_blocks") else None)
        self._answer = generator.submit(prompts, params, num_samples) if self.blocks is None else None
        self._answered = False
        self.oldest_version = self.weights_version

    def generate(self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1) -> GenerationOutput:
        if self._answered:  # a later turn
            return self.generator.submit(prompts, params, num_samples)()
        self._take(prompts, params, num_samples)
        if self.blocks is not None:
            raise ValueError("a generation sent in blocks is answered by first_turn_blocks, not generate")
        output = self._answer()
        self.oldest_version = min(output.extra.get("weights_versions", [self.weights_version]))
        return output

    def first_turn_blocks(self, prompts: list[list[int]], params: SamplingParams,
                          num_samples: int) -> list[SubmittedBlock] | None:
        """The blocks it was sent in (each waited for on its own), or None when it was sent whole (then `generate`
        answers it)."""
        if self.blocks is None:
            return None
        self._take(prompts, params, num_samples)
        return self.blocks

    def _take(self, prompts: list[list[int]], params: SamplingParams, num_samples: int) -> None:
        if (prompts, params, num_samples) != self.request:
            raise ValueError("a submitted generation was asked for other prompts or parameters than it was sent with")
        self._answered = True

    def version_spans(self, sample: int) -> list[tuple[int, int]]:
        """Every token of a sample was sampled by one version (`oldest_version`): no spans."""
        return []


class ChunkedGeneration:
    """A generation call sampled in chunks of `chunk_tokens` tokens (rollout.in_flight_updates), each chunk a call of
    its own: the first sent when the round is made (as `SubmittedGeneration` sends the whole call), each later one
    when the previous has answered, continuing the samples that have not finished. A weight push sent in between
    (the generator sends no call while a push is under way) reaches the next chunk, and each sample records the
    version that sampled each of its spans of tokens.

    Later chunks draw from per-sample streams seeded from the round's seed, the sample's group and index and the
    chunk number (`episode_stream_seed`): which samples share a chunk call then changes nothing. A sample ends at an
    eos token, at the round's max_new_tokens, or at a stop string. Stop strings are looked for here, not by the
    chunk calls (which see only their own chunk's tokens, so they would miss a stop string spanning two chunks):
    after each chunk, the decoded completion is checked token by token from the first new token on, as the
    transformers generator checks it after every token, and the completion is cut after the token that completed a
    stop string, where an unchunked call would have ended it.

    The later turns of multi-turn episodes (`run_episodes` asks for them after the first) are sampled in chunks
    too, their first chunk sent when asked for; their later chunks draw from streams seeded from each episode's turn
    seed (`params.seeds`) and the chunk number. Every output says in extra["version_spans"] which version sampled
    each span of each completion (the index of the span's first token within the completion, and the version)."""

    def __init__(self, generator, prompts: list[list[int]], params: SamplingParams, num_samples: int,
                 chunk_tokens: int, first_group_id: int, tokenizer, group_timeout_s: float | None = None):
        self.generator, self.chunk_tokens, self.first_group_id = generator, chunk_tokens, first_group_id
        self.tokenizer, self.group_timeout_s = tokenizer, group_timeout_s
        self.weights_version = self.oldest_version = generator.weights_version
        self.request = (prompts, params, num_samples)
        self._deadline: float | None = None
        self._first = self._send(prompts, self._chunk_params(params, params.max_new_tokens), num_samples, True)
        self._answered = False
        self._spans: list[list[tuple[int, int]]] = []

    def _chunk_params(self, params: SamplingParams, tokens_left: int) -> SamplingParams:
        """The parameters of a chunk call: at most chunk_tokens tokens, stop strings left to `_sample`."""
        return replace(params, max_new_tokens=min(self.chunk_tokens, tokens_left), stop_strings=())

    def _send(self, prompts: list[list[int]], params: SamplingParams, num_samples: int, timed: bool):
        """Send a chunk call now: with a group timeout over the first call (`timed`) as one block per generation
        actor (`submit_blocks`), each waited for on its own; else as one call."""
        if timed and self.group_timeout_s is not None:
            return self.generator.submit_blocks(prompts, params, num_samples)
        return [SubmittedBlock(0, len(prompts), self.generator.submit(prompts, params, num_samples))]

    def _receive(self, blocks: list[SubmittedBlock], timed: bool) -> list[tuple[SubmittedBlock, GenerationOutput | None]]:
        """Each block's output, or None for a block that had not answered by the group timeout's deadline (its
        answer, if any, is never read). The clock starts when the first call's first block answers."""
        if not timed or self.group_timeout_s is None:
            return [(block, block.wait()) for block in blocks]
        pool = ThreadPoolExecutor(max_workers=len(blocks), thread_name_prefix="chunk-blocks")
        try:
            arriving = {pool.submit(block.wait): block for block in blocks}
            if self._deadline is None:  # bounded: every block's wait has a deadline of its own (cluster.timeout_s)
                futures_wait(arriving, return_when=FIRST_COMPLETED)
                self._deadline = time.monotonic() + self.group_timeout_s
            futures_wait(arriving, timeout=max(self._deadline - time.monotonic(), 0.0))
        finally:
            pool.shutdown(wait=False)  # a late block's thread ends when its wait does (within its own deadline)
        return [(block, future.result() if future.done() else None) for future, block in arriving.items()]

    def generate(self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1) -> GenerationOutput:
        if self._answered:  # a later turn of multi-turn episodes: its first chunk sent now
            if params.seeds is None:
                raise ValueError("a later turn sampled in chunks needs per-episode seeds (SamplingParams.seeds)")
            first = self._send(prompts, self._chunk_params(params, params.max_new_tokens), num_samples, False)
            turn_seeds = params.seeds
            return self._sample(prompts, params, num_samples, first, False, lambda i, chunk: episode_stream_seed(
                turn_seeds[i // num_samples], 0, chunk) + i % num_samples)
        if (prompts, params, num_samples) != self.request:
            raise ValueError("a submitted generation was asked for other prompts or parameters than it was sent with")
        self._answered = True
        # The round's seed, or (per-group seeds) its first group's: later chunks' streams then share no group's turns'.
        round_seed = params.seed if params.seed is not None else params.seeds[0]
        output = self._sample(prompts, params, num_samples, self._first, True, lambda i, chunk: episode_stream_seed(
            round_seed, self.first_group_id + i // num_samples, chunk) + i % num_samples)
        self._spans = output.extra["version_spans"]
        self.oldest_version = min(output.extra["weights_versions"], default=self.weights_version)
        return output

    def _sample(self, prompts: list[list[int]], params: SamplingParams, num_samples: int,
                first_chunk: list[SubmittedBlock], timed: bool, seed_of) -> GenerationOutput:
        """Sample `num_samples` completions of each prompt, in chunks: `first_chunk` is the first chunk's call, sent,
        and `seed_of(sample, chunk)` seeds sample `sample`'s (flat: prompt-major) stream of a later chunk. With
        `timed` and a group timeout, the samples of a block that has not answered by the deadline are late: not
        continued, and listed in extra["late_samples"] (their groups are dropped). A chunk is sent when the whole
        previous chunk call has answered, so a straggling block holds back the next chunk of every sample: those
        still unfinished at the deadline are late too."""
        started = time.perf_counter()
        count = len(prompts) * num_samples
        prompt_of = [prompt for prompt in prompts for _ in range(num_samples)]
        tokens: list[list[int]] = [[] for _ in range(count)]
        logprobs: list[list[float]] = [[] for _ in range(count)]
        finish = ["length"] * count
        errors: list[str | None] = [None] * count  # a chunk masked for a dead generation worker masks its sample
        spans: list[list[tuple[int, int]]] = [[] for _ in range(count)]
        late: set[int] = set()
        generated = 0

        def take(members: list[int], per_prompt: int, answers) -> None:
            nonlocal generated
            for block, output in answers:
                samples = members[block.start * per_prompt:block.stop * per_prompt]
                if output is None:
                    late.update(samples)
                    continue
                version = min(output.extra["weights_versions"])
                generated += output.num_generated_tokens
                completions = [completion for answer in output.completions for completion in answer]
                for i, completion in zip(samples, completions, strict=True):
                    checked = len(tokens[i])
                    if not spans[i] or (completion.token_ids and version != spans[i][-1][1]):
                        spans[i].append((checked, version))
                    tokens[i] += completion.token_ids
                    logprobs[i] += completion.logprobs
                    finish[i], errors[i] = completion.finish_reason, completion.error
                    self._cut_at_stop_string(params, tokens, logprobs, finish, i, checked)

        take(list(range(count)), num_samples, self._receive(first_chunk, timed))
        chunk = 1
        while unfinished := [i for i, reason in enumerate(finish)
                             if reason == "length" and len(tokens[i]) < params.max_new_tokens and i not in late]:
            if timed and self._deadline is not None and time.monotonic() >= self._deadline:
                late.update(unfinished)  # past the group timeout: their groups are dropped, nothing more is sent
                break
            # Every unfinished sample has sampled the same number of tokens (chunk x chunk_tokens): one budget.
            tokens_left = params.max_new_tokens - len(tokens[unfinished[0]])
            seeds = tuple(seed_of(i, chunk) for i in unfinished)
            chunk_params = replace(self._chunk_params(params, tokens_left), seed=None, seeds=seeds)
            sent = self._send([prompt_of[i] + tokens[i] for i in unfinished], chunk_params, 1, timed)
            take(unfinished, 1, self._receive(sent, timed))
            chunk += 1
        completions = [Completion(prompt_of[i], tokens[i], logprobs[i],
                                  self.tokenizer.decode(tokens[i], skip_special_tokens=True), finish[i], errors[i])
                       for i in range(count)]
        grouped = [completions[i * num_samples:(i + 1) * num_samples] for i in range(len(prompts))]
        extra = {"weights_versions": sorted({v for sample in spans for _, v in sample}), "version_spans": spans}
        if timed and self.group_timeout_s is not None:
            extra |= {"late_samples": sorted(late), "group_deadline": self._deadline}
        return GenerationOutput(grouped, time.perf_counter() - started, generated, extra)

    def _cut_at_stop_string(self, params: SamplingParams, tokens: list[list[int]], logprobs: list[list[float]],
                            finish: list[str], i: int, checked: int) -> None:
        """End sample `i` after its first token past `checked` whose decoded completion (up to and including it)
        holds a stop string: the transformers generator's test after every token, over the whole completion, so a
        stop string that spans the previous chunk's last tokens and this chunk's first is found where an unchunked
        call finds it."""
        if not params.stop_strings:
            return
        for end in range(checked + 1, len(tokens[i]) + 1):
            text = self.tokenizer.decode(tokens[i][:end], skip_special_tokens=True)
            if any(stop in text for stop in params.stop_strings):
                del tokens[i][end:], logprobs[i][end:]
                finish[i] = "stop"
                return

    def version_spans(self, sample: int) -> list[tuple[int, int]]:
        """(index of the first token, version) of each span of sample `sample` (flat: prompt-major) of the first call
        that one version sampled."""
        return list(self._spans[sample])
