"""Rollouts for online RL: sample episodes from a generator, score them with an environment, and pack
them into the typed batch the trainer reads.

An episode starts from one prompt row and runs up to `max_turns` assistant turns: each turn the
generator continues the episode's tokens, the environment scores the reply and either ends the
episode or returns an observation, whose chat-template tokens are appended before the next turn.
Only tokens the model sampled carry loss; prompt and observation tokens never do.

Every reward an environment returns is checked again here (`rewards.validate_reward`), whatever the
environment: a reward that is not a finite number float32 can hold (NaN, inf, 1e308) would crash
`to_batch` or poison the advantages, so it masks its episode with an error, which the loop counts
like any other failed reward.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from posttrain.data.formats import Message, Messages
from posttrain.data.types import RolloutBatch
from posttrain.data.tokenize import tokenize_next_turn
from posttrain.envs.base import Environment, EnvStep, EpisodeLost, Reward, ToolUse, tool_use_of
from posttrain.errors import RunError
from posttrain.envs.rewards import combine_components, validate_reward
from posttrain.generation.base import GenerationOutput, Generator, SamplingParams
from posttrain.metrics import calibration_error


@dataclass(frozen=True)
class PromptRow:
    """One RL prompt and its row's other columns (answers, tests), passed to the environment."""

    prompt: str | Messages
    prompt_ids: list[int]
    metadata: dict[str, Any]


@dataclass
class Episode:
    """One sampled episode, filled in turn by turn."""

    group_id: int
    """Samples of the same prompt row in the same step share it (advantages compare within a group)."""
    messages: list[Message]
    """The conversation as the environment sees it: the prompt, then assistant replies and observations."""
    metadata: dict[str, Any]
    token_ids: list[int]
    """Prompt, then every turn's sampled tokens and observation tokens, as the model saw them."""
    prompt_length: int
    sampled: list[bool] = field(default_factory=list)
    """Per token after the prompt: True where the model sampled it (gets loss), False for observations."""
    generator_logprobs: list[float] = field(default_factory=list)
    """Per token after the prompt: the sampler's logprob (0 for observation tokens)."""
    reward: Reward = None
    error: str | None = None
    truncated: bool = False
    """The last turn ran out of max_new_tokens."""
    last_turn_length: int = 0
    num_turns: int = 0
    budget_exhausted: bool = False
    """The episode ended because its next observation would not fit its token budget (tools' max_episode_tokens);
    it is marked truncated too."""
    done: bool = False
    policy_version: int = 0
    """The policy version (optimizer steps taken) whose weights the generator held when it sampled this episode; with
    in-flight weight updates, or later turns of an asynchronous round sampled after a weight push, the oldest version
    that sampled any of its tokens."""
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    """Where the weights that sampled its tokens changed (rollout.in_flight_updates; later turns of an asynchronous
    multi-turn round): (index among the tokens after the prompt, version); a token was sampled by the version of the
    last span starting at or before it. Empty: every token was sampled by `policy_version`."""
    restarts: int = 0
    """Times the episode was restarted from its first turn because the environment lost its state (`EpisodeLost`:
    the Ray environment actor holding it died); everything else it holds is of the last attempt."""

    @property
    def reply(self) -> str:
        return self.messages[-1]["content"] if self.messages and self.messages[-1]["role"] == "assistant" else ""

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.sampled)

    @property
    def num_observation_tokens(self) -> int:
        """Tokens the environment appended (observations, tool results), which carry no loss."""
        return len(self.sampled) - self.num_sampled_tokens


@dataclass(frozen=True)
class RolloutTimes:
    generate: float
    score: float
    generated_tokens: int


CALIBRATION_BIN_SIZE = 100
"""Answers per bin of the calibration error, HLE's own (its reference script's beta)."""
ENVIRONMENT_STEP_DEADLINE_SECONDS = 900.0
"""How long a multi-turn rollout waits for any one of its episodes' environment calls before it gives up, naming
the episode (reward functions and judges have shorter limits of their own; this catches an environment that has
none)."""
EPISODE_THREADS = 32
"""Multi-turn episodes whose environment calls run at once (one thread each); an environment that holds episodes'
state in another process (a Ray environment actor) answers this many calls at once too."""
GATHER_SECONDS = 0.02
"""After an episode's environment call answers, how long the rollout waits for others to answer too before sampling
their next turns: the episodes that answered within it share one generate call instead of one call each (a turn of
fast tools, such as the calculator's, otherwise cost a batch of calls of one episode each). Later turns draw from
per-episode seed streams, so the grouping never changes what is sampled; a slow call delays the others by this at
most."""


def run_episodes(rows: list[PromptRow], first_group_id: int, num_samples: int, generator: Generator,
                 environment: Environment, tokenizer, params: SamplingParams, max_turns: int,
                 group_seed: int | None = None, step_deadline: float = ENVIRONMENT_STEP_DEADLINE_SECONDS,
                 group_timeout_s: float | None = None) -> tuple[list[Episode], RolloutTimes]:
    """`num_samples` episodes per row (group ids first_group_id, first_group_id + 1, ...), run to the end: the
    episodes and times of `run_episodes_within` (below), without saying which groups a group timeout dropped."""
    within = run_episodes_within(rows, first_group_id, num_samples, generator, environment, tokenizer, params,
                                 max_turns, group_seed, step_deadline, group_timeout_s)
    return within.episodes, within.times


def run_episodes_within(rows: list[PromptRow], first_group_id: int, num_samples: int, generator: Generator,
                        environment: Environment, tokenizer, params: SamplingParams, max_turns: int,
                        group_seed: int | None = None, step_deadline: float = ENVIRONMENT_STEP_DEADLINE_SECONDS,
                        group_timeout_s: float | None = None) -> GroupsWithin:
    """`num_samples` episodes per row (group ids first_group_id, first_group_id + 1, ...), run to the end, or with
    `group_timeout_s` kept to the groups that ended in time.

    The first turn samples every episode in one generation call (each prompt prefilled once), or, for a multi-turn
    round under `group_timeout_s` whose generator sent it in blocks (`first_turn_blocks`: one per generation actor),
    in those blocks, each block's episodes starting as soon as it arrives. With one turn the
    environment then scores them all in one call, or with `group_timeout_s` each group in a call of its own: the
    episodes of a group not scored within group_timeout_s of the completions' arrival are left out of the result
    (dropped; the caller counts the group ids missing). With several, every episode advances on its own: its
    environment call runs in a thread as soon as its reply is sampled, and the episodes whose observations have
    arrived are sampled together while the others' calls are still running, so one slow environment call holds
    back only its own episode. `environment.step` is then called with one episode at a time, from worker threads.
    With `group_timeout_s` a multi-turn group whose episodes have not all ended within group_timeout_s of the first
    turn's completions (of its first block, when sent in blocks), because a first-turn block, an environment call or
    a later turn's generation call straggled, is dropped: the rollout stops waiting then, and the groups with an
    episode still running are left out of the result. The episodes waiting for a straggling generation call are its
    groups' and those sampled after it; such groups are `generation_timed_out`, the others `scoring_timed_out`. The
    late calls are not waited for (their answers, if any, are never read; a Ray call still ends within its own
    deadline).

    Sampling is seeded by `params.seed` (the first turn's whole call), or with `group_seed` per group: each episode
    draws from a stream of its own, seeded from `group_seed`, its group id, its index in the group and the turn
    (`episode_stream_seed`), so a group samples the same episodes whichever groups share the call. Later turns
    always draw from per-episode streams (seeded from `group_seed`, else `params.seed`), since which episodes share
    a call depends on when their environment calls return.

    An environment that offers tools (`envs.base.tool_use_of`) has its tools rendered into every observation's
    tokens (the prompts were rendered with them when loaded), and its token budget bounds each episode: a turn
    samples at most the tokens left, and an observation that would not fit ends the episode (truncated).

    An environment call of a multi-turn episode that raises `EpisodeLost` (the process holding the episode's state
    died) restarts that episode from its first turn: its turns are dropped and its first turn is sampled again
    from its per-episode stream (with `group_seed` the stream of its original first turn, so it samples what it did
    before), and counted in `Episode.restarts`."""
    tool_use = tool_use_of(environment)
    episodes = [
        Episode(group_id=first_group_id + i, messages=_initial_messages(row.prompt), metadata=dict(row.metadata),
                token_ids=list(row.prompt_ids), prompt_length=len(row.prompt_ids),
                policy_version=generator.weights_version)
        for i, row in enumerate(rows) for _ in range(num_samples)
    ]
    row_of = {id(e): rows[k // num_samples] for k, e in enumerate(episodes)}
    sample_index = {id(e): k % num_samples for k, e in enumerate(episodes)}
    times = _Times()

    # Turn 1: all samples of a prompt start alike, so the generator prefills each prompt once.
    if group_seed is not None:  # vLLM's convention: the j-th sample of a prompt seeded `seeds[i] + j`
        first_params = replace(params, seed=None, seeds=tuple(
            episode_stream_seed(group_seed, e.group_id, 0) for e in episodes[::num_samples]))
    else:
        first_params = params
    if tool_use is not None and tool_use.max_episode_tokens is not None:
        first_params = replace(first_params, max_new_tokens=min(params.max_new_tokens, tool_use.max_episode_tokens))
    first_prompts = [row.prompt_ids for row in rows]
    # A multi-turn round under a group timeout whose first turn was sent in blocks (one per generation actor,
    # `SubmittedGeneration` in blocks): each block's episodes start as soon as it arrives, and the clock with the
    # first block, so a straggling actor's first turns are dropped like its later ones.
    take_blocks = getattr(generator, "first_turn_blocks", None) if max_turns > 1 and group_timeout_s else None
    blocks = take_blocks(first_prompts, first_params, num_samples) if take_blocks is not None else None
    if blocks is None:
        first = times.sample(generator, first_prompts, first_params, num_samples, episodes)
    group_ids = list(range(first_group_id, first_group_id + len(rows)))
    if max_turns == 1 and group_timeout_s is not None:
        # A generator that sampled in chunks under the timeout (rollout_source.ChunkedGeneration) names the samples
        # not generated in time and the deadline, which then bounds the scoring too.
        late = sorted({episodes[i].group_id for i in first.extra.get("late_samples", [])})
        deadline = first.extra.get("group_deadline") or time.monotonic() + group_timeout_s
        started = time.perf_counter()
        kept = _score_groups_within([e for e in episodes if e.group_id not in late], num_samples, environment,
                                    tokenizer, max(deadline - time.monotonic(), 0.0))
        times.score += time.perf_counter() - started
        scored = {e.group_id for e in kept}
        return GroupsWithin(kept, times.rollout_times(), late,
                            [g for g in group_ids if g not in scored and g not in late])
    if max_turns == 1:
        started = time.perf_counter()
        _score_sampled(episodes, environment, tokenizer)
        times.score += time.perf_counter() - started
        return GroupsWithin(episodes, times.rollout_times(), [], [])

    stream_base = group_seed if group_seed is not None else params.seed
    waiting_on_generation: list[Episode] = []
    pool = ThreadPoolExecutor(max_workers=min(len(episodes), EPISODE_THREADS), thread_name_prefix="environment-step")
    sampler = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="turn-sample") if group_timeout_s is not None
               else None)
    arrivals = ThreadPoolExecutor(max_workers=len(blocks), thread_name_prefix="first-turn") if blocks else None
    try:
        pending: dict[Future, Episode] = {}
        arriving: dict[Future, Any] = {}
        if arrivals is None:
            pending = {pool.submit(environment.step, [e.messages], [e.metadata]): e for e in episodes}
        else:
            arriving = {arrivals.submit(block.wait): block for block in blocks}
            started = time.perf_counter()
            # No timeout here: every block's wait has a deadline of its own (a Ray generator's cluster.timeout_s),
            # past which it raises, and the first to end starts the group clock.
            wait(arriving, return_when=FIRST_COMPLETED)
            times.generate += time.perf_counter() - started
        # The clock of the group timeout starts when the first turn's completions (its first block) have arrived.
        deadline = time.monotonic() + group_timeout_s if group_timeout_s is not None else math.inf
        while pending or arriving:
            for future in [f for f in arriving if f.done()]:
                block = arriving.pop(future)
                output = future.result()  # raises what the block raised
                arrived = episodes[block.start * num_samples:block.stop * num_samples]
                times.tokens += output.num_generated_tokens
                _append_completions(arrived, output)
                pending.update({pool.submit(environment.step, [e.messages], [e.metadata]): e for e in arrived})
            if not pending:
                if time.monotonic() >= deadline:
                    break  # the blocks still out are dropped below, as generation stragglers
                started = time.perf_counter()
                wait(arriving, timeout=max(deadline - time.monotonic(), 0.0), return_when=FIRST_COMPLETED)
                times.generate += time.perf_counter() - started
                continue
            started = time.perf_counter()
            finished, _ = wait([*pending, *arriving],
                               timeout=min(step_deadline, max(deadline - time.monotonic(), 0.0)),
                               return_when=FIRST_COMPLETED)
            finished = {future for future in finished if future in pending}
            if finished and len(finished) < len(pending):
                finished, _ = wait(pending, timeout=GATHER_SECONDS, return_when=ALL_COMPLETED)
            times.score += time.perf_counter() - started
            if not finished and time.monotonic() >= deadline:
                break  # the groups still running are dropped below
            if not finished and any(future.done() for future in arriving):
                continue  # a block of first turns arrived: its episodes start above
            if not finished:
                waiting = sorted((e.group_id, sample_index[id(e)]) for e in pending.values())
                raise RunError(f"{type(environment).__name__}.step returned nothing within {step_deadline:g} s for "
                               f"{len(waiting)} episode(s) (group, sample) {waiting[:5]}; the rollout is abandoned")
            ready = []
            for future in finished:
                episode = pending.pop(future)
                try:
                    result = future.result()
                except EpisodeLost:
                    _restart(episode, row_of[id(episode)], generator.weights_version)
                    ready.append(episode)
                    continue
                _apply_step([episode], result, environment, tokenizer, max_turns, tool_use)
                if not episode.done:
                    ready.append(episode)
            if not ready:
                continue
            # Episodes with less of their token budget left than max_new_tokens sample in calls of their own, capped;
            # per-episode seed streams make that split invisible in what they sample.
            turn_calls = list(_by_token_cap(ready, params.max_new_tokens, tool_use).items())
            for call, (cap, capped) in enumerate(turn_calls):
                turn_params = replace(params, max_new_tokens=cap)
                if stream_base is not None:
                    turn_params = replace(turn_params, seed=None, seeds=tuple(
                        episode_stream_seed(stream_base, e.group_id, e.num_turns) + sample_index[id(e)]
                        for e in capped))
                if sampler is None:
                    times.sample(generator, [e.token_ids for e in capped], turn_params, 1, capped)
                elif not times.sample_within(sampler, generator, [e.token_ids for e in capped], turn_params, capped,
                                             deadline):
                    waiting_on_generation = [e for _, behind in turn_calls[call:] for e in behind]
                    break
            if waiting_on_generation:
                break
            pending.update({pool.submit(environment.step, [e.messages], [e.metadata]): e for e in ready})
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for executor in (sampler, arrivals):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
    # With a group timeout: the groups with an episode still running (its environment call, its first turn's block
    # or its next turn's generation call unanswered) are dropped, whole.
    running = {e.group_id for e in episodes if not e.done}
    waiting_on_generation += [e for block in arriving.values()
                              for e in episodes[block.start * num_samples:block.stop * num_samples]]
    late = sorted({e.group_id for e in waiting_on_generation})
    kept = [e for e in episodes if e.group_id not in running]
    return GroupsWithin(kept, times.rollout_times(), late, sorted(running - set(late)))


def _score_groups_within(episodes: list[Episode], num_samples: int, environment: Environment, tokenizer,
                         timeout_s: float) -> list[Episode]:
    """The single-turn `episodes` (consecutive groups of `num_samples`) of the groups the environment scored within
    `timeout_s`, each group in a call of its own, sent together from worker threads. A call still running then is
    not waited for (its thread ends when it answers or its own deadline passes: a Ray worker's cluster.timeout_s)
    and its answer, if any, is never read; an error raised by a call answered in time propagates."""
    groups = [episodes[i:i + num_samples] for i in range(0, len(episodes), num_samples)]
    if not groups:  # every group of the round was dropped before scoring
        return []
    pool = ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="group-score")
    try:  # masked episodes (a dead generation worker) are not scored
        calls = {pool.submit(_score_sampled, group, environment, tokenizer): group for group in groups}
        scored, _ = wait(calls, timeout=timeout_s)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    kept = []
    for future, group in calls.items():  # in group order
        if future in scored:
            future.result()  # raises what the call raised
            kept += group
    return kept


def _score_sampled(episodes: list[Episode], environment: Environment, tokenizer) -> None:
    """Score the single-turn episodes that were sampled (not those masked for a dead generation worker)."""
    sampled = [e for e in episodes if not e.done]
    if sampled:
        result = environment.step([e.messages for e in sampled], [e.metadata for e in sampled])
        _apply_step(sampled, result, environment, tokenizer, max_turns=1)


@dataclass
class _Times:
    """Generation and scoring seconds and sampled tokens of one `run_episodes` call."""

    generate: float = 0.0
    score: float = 0.0
    tokens: int = 0

    def sample(self, generator: Generator, prompts: list[list[int]], params: SamplingParams, num_samples: int,
               episodes: list[Episode]) -> GenerationOutput:
        """Sample the next turn of `episodes` (prompts in their order, `num_samples` episodes each) and append each
        completion to its episode; the generator's output."""
        started = time.perf_counter()
        output = generator.generate(prompts, params, num_samples=num_samples)
        self.generate += time.perf_counter() - started
        self.tokens += output.num_generated_tokens
        _append_completions(episodes, output)
        return output

    def sample_within(self, sampler: ThreadPoolExecutor, generator: Generator, prompts: list[list[int]],
                      params: SamplingParams, episodes: list[Episode], deadline: float) -> bool:
        """`sample` for one later turn (one sample per prompt), in `sampler`'s thread, waited for until `deadline`
        (time.monotonic()); False when it had not answered by then (its answer, if any, is never read)."""
        started = time.perf_counter()
        call = sampler.submit(generator.generate, prompts, params, 1)
        done, _ = wait([call], timeout=max(deadline - time.monotonic(), 0.0))
        self.generate += time.perf_counter() - started
        if not done:
            return False
        output = call.result()  # raises what the call raised
        self.tokens += output.num_generated_tokens
        _append_completions(episodes, output)
        return True

    def rollout_times(self) -> RolloutTimes:
        return RolloutTimes(self.generate, self.score, self.tokens)


def _append_completions(episodes: list[Episode], output: GenerationOutput) -> None:
    """Append each completion of `output` (prompt-major) to its episode as the next assistant turn, noting the
    weights' version that sampled it when the generator says (Ray generation actors do)."""
    completions = [completion for samples in output.completions for completion in samples]
    versions = output.extra.get("weights_versions")
    # A call sampled in chunks (rollout.in_flight_updates) says which version sampled each span of each completion.
    spans = output.extra.get("version_spans") or [[(0, min(versions))] if versions else [] for _ in completions]
    for episode, completion, completion_spans in zip(episodes, completions, spans, strict=True):
        for start, version in completion_spans:
            _record_version(episode, version, len(episode.sampled) + start)
        episode.token_ids += completion.token_ids
        episode.sampled += [True] * len(completion.token_ids)
        episode.generator_logprobs += completion.logprobs
        episode.messages.append({"role": "assistant", "content": completion.text})
        episode.truncated = completion.truncated
        episode.last_turn_length = len(completion.token_ids)
        episode.num_turns += 1
        if completion.error is not None:  # its generation worker died (cluster.on_actor_failure=mask)
            episode.error, episode.done = completion.error, True


@dataclass(frozen=True)
class GroupsWithin:
    """What `sample_and_score_within` kept and dropped of a round."""

    episodes: list[Episode]
    """The episodes of the groups generated and scored in time, in group order."""
    times: RolloutTimes
    generation_timed_out: list[int]
    """Group ids whose completions had not arrived by the deadline."""
    scoring_timed_out: list[int]
    """Group ids generated in time whose scoring had not answered by the deadline."""


def sample_and_score_within(rows: list[PromptRow], first_group_id: int, num_samples: int, blocks: list,
                            environment: Environment, tokenizer, timeout_s: float) -> GroupsWithin:
    """A single-turn round whose generation was sent in `blocks` (each with `start`, `stop`: the rows it samples,
    and `wait()`: its `GenerationOutput`, within a deadline of its own), kept to the groups generated and scored
    within `timeout_s` of the first block's arrival (rollout.group_timeout_s).

    Each block's groups are scored as soon as the block arrives, each group in an environment call of its own; a
    block or a scoring call still running at the deadline is not waited for (its answer, if any, is never read)
    and its groups are dropped. The clock starts when the first block answers, so a round that is slow as a whole
    (every actor busy with earlier rounds) drops nothing: the timeout is for the groups that straggle behind the
    others. Each kept episode's policy_version is the version that sampled its block. An error raised by a block
    or a call answered in time propagates."""
    episodes = [Episode(group_id=first_group_id + i, messages=_initial_messages(row.prompt),
                        metadata=dict(row.metadata), token_ids=list(row.prompt_ids), prompt_length=len(row.prompt_ids))
                for i, row in enumerate(rows) for _ in range(num_samples)]
    groups = [episodes[i * num_samples:(i + 1) * num_samples] for i in range(len(rows))]
    started = time.perf_counter()
    generate_seconds, tokens = 0.0, 0
    pool = ThreadPoolExecutor(max_workers=len(blocks) + len(rows), thread_name_prefix="round-within")
    try:
        arriving = {pool.submit(block.wait): block for block in blocks}
        # Bounded: every block's wait has a deadline of its own (a Ray generator's cluster.timeout_s).
        wait(arriving, return_when=FIRST_COMPLETED)
        deadline = time.monotonic() + timeout_s
        scoring: dict[Future, int] = {}
        while True:
            for future in [f for f in arriving if f.done()]:
                block = arriving.pop(future)
                output = future.result()  # raises what the block raised
                generate_seconds, tokens = time.perf_counter() - started, tokens + output.num_generated_tokens
                arrived = episodes[block.start * num_samples:block.stop * num_samples]
                _append_completions(arrived, output)  # a first turn: its version is the episode's policy_version
                scoring |= {pool.submit(_score_sampled, groups[row], environment, tokenizer): row
                            for row in range(block.start, block.stop)}
            outstanding = [*arriving, *(f for f in scoring if not f.done())]
            if not outstanding or time.monotonic() >= deadline:
                break
            wait(outstanding, timeout=deadline - time.monotonic(), return_when=FIRST_COMPLETED)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    late = sorted(first_group_id + row for block in arriving.values() for row in range(block.start, block.stop))
    scored, unscored = set(), []
    for future, row in scoring.items():
        if future.done():
            future.result()  # raises what the call raised
            scored.add(row)
        else:
            unscored.append(first_group_id + row)
    kept = [episode for row in sorted(scored) for episode in groups[row]]
    score_seconds = max(time.perf_counter() - started - generate_seconds, 0.0)
    return GroupsWithin(kept, RolloutTimes(generate_seconds, score_seconds, tokens), late, sorted(unscored))


def _apply_step(episodes: list[Episode], result: EnvStep, environment: Environment, tokenizer, max_turns: int,
                tool_use: ToolUse | None = None) -> None:
    """The environment's answer for `episodes` (their last turns): rewards checked, metadata carried, and for the
    episodes that continue the observation's chat-template tokens appended (no loss on them), with the tools
    rendered; an observation that would overrun the token budget ends its episode instead."""
    if len(result.rewards) != len(episodes):
        raise ValueError(f"the environment returned {len(result.rewards)} rewards for {len(episodes)} episodes")
    tools = tool_use.tools if tool_use is not None else None
    budget = tool_use.max_episode_tokens if tool_use is not None else None
    for i, episode in enumerate(episodes):
        episode.reward, episode.error = _checked_reward(result.rewards[i], result.errors[i], environment)
        episode.metadata = result.metadata[i]
        observation = result.observations[i]
        episode.done = result.done[i] or observation is None or episode.num_turns == max_turns
        if episode.done:
            continue
        next_ids = tokenize_next_turn(episode.messages, observation, tokenizer, tools)
        if budget is not None and len(episode.sampled) + len(next_ids) >= budget:
            episode.done = episode.truncated = episode.budget_exhausted = True
            continue
        episode.token_ids += next_ids
        episode.sampled += [False] * len(next_ids)
        episode.generator_logprobs += [0.0] * len(next_ids)
        episode.messages += [observation] if isinstance(observation, dict) else list(observation)


def _record_version(episode: Episode, version: int, start: int) -> None:
    """Note that policy `version` sampled the episode's tokens from `start` on (indexed by the tokens after the
    prompt): the version of its first tokens is its policy_version; tokens sampled by another version (an
    asynchronous round's later turns or later chunks, sampled after a weight push) open a span
    (`Episode.version_spans`), and the episode's age counts from the oldest version of any of its tokens."""
    if start == 0:
        episode.policy_version = version
        return
    current = episode.version_spans[-1][1] if episode.version_spans else episode.policy_version
    if version == current:
        return
    if not episode.version_spans:
        episode.version_spans.append((0, episode.policy_version))
    episode.version_spans.append((start, version))
    episode.policy_version = min(episode.policy_version, version)


def _restart(episode: Episode, row: PromptRow, version: int) -> None:
    """Put `episode` back at its prompt (`row`), as before its first turn, sampled next by weights `version`."""
    fresh = Episode(group_id=episode.group_id, messages=_initial_messages(row.prompt), metadata=dict(row.metadata),
                    token_ids=list(row.prompt_ids), prompt_length=len(row.prompt_ids), policy_version=version,
                    restarts=episode.restarts + 1)
    episode.__dict__.update(fresh.__dict__)


def _by_token_cap(episodes: list[Episode], max_new_tokens: int, tool_use: ToolUse | None) -> dict[int, list[Episode]]:
    """The episodes grouped by how many tokens their next turn may sample: max_new_tokens, or less where the
    episode's token budget has less left (the observation that opened the turn left at least one)."""
    budget = tool_use.max_episode_tokens if tool_use is not None else None
    groups: dict[int, list[Episode]] = {}
    for episode in episodes:
        cap = max_new_tokens if budget is None else min(max_new_tokens, budget - len(episode.sampled))
        groups.setdefault(cap, []).append(episode)
    return groups


def episode_stream_seed(group_seed: int, group_id: int, turn: int) -> int:
    """The seed of a group's turn-`turn` sampling streams (its j-th episode adds j): a hash of the three, so no
    two groups or turns of a run share streams; below 2**62, room to add any sample index."""
    digest = hashlib.blake2b(f"{group_seed}/{group_id}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _checked_reward(reward: Reward, error: str | None, environment: Environment) -> tuple[Reward, str | None]:
    """`(reward, error)` as the environment gave them, or `(None, why)` when the reward is not valid."""
    if reward is None:
        return None, error
    checked, problem = validate_reward(reward)
    if problem is not None:
        return None, f"{type(environment).__name__}: the reward {problem}"
    return checked, error


def _initial_messages(prompt: str | Messages) -> list[Message]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


def scalar_reward(reward: Reward, weights: dict[str, float]) -> float | None:
    """A dict of components as their weighted sum (weight 1 for components without one)."""
    if isinstance(reward, dict):
        return combine_components(reward, {name: weights.get(name, 1.0) for name in reward})
    return reward


def overlong_penalty(length: int, truncated: bool, max_new_tokens: int, buffer_length: int, factor: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by `factor`.

    0 up to max_new_tokens − buffer_length tokens, then falling linearly to −factor at max_new_tokens; a truncated
    completion (the model had not finished) gets −factor.
    """
    if buffer_length == 0:
        return 0.0
    if truncated:
        return -factor
    free = max_new_tokens - buffer_length
    return -factor * max(0, length - free) / buffer_length


def has_reward_variance(group: list[Episode], weights: dict[str, float]) -> bool:
    """True when the group's valid rewards are not all equal (DAPO dynamic sampling keeps only such groups)."""
    rewards = [scalar_reward(e.reward, weights) for e in group if e.reward is not None]
    return len(rewards) > 1 and max(rewards) > min(rewards)


def groups_of(episodes: list[Episode]) -> list[list[Episode]]:
    groups: dict[int, list[Episode]] = {}
    for episode in episodes:
        groups.setdefault(episode.group_id, []).append(episode)
    return list(groups.values())


def to_batch(episodes: list[Episode], pad_token_id: int, weights: dict[str, float], overlong_filtering: bool,
             penalties: list[float]) -> RolloutBatch:
    """Pack episodes into a RolloutBatch.

    penalties: [N] added to each valid scalar reward (the soft overlong punishment; zeros when off).
    overlong_filtering: truncated episodes keep their reward (for the group baseline) but get no loss.
    """
    n, width = len(episodes), max(len(e.token_ids) for e in episodes)
    ids_rows, attention_rows, loss_rows, logprob_rows = [], [], [], []
    for episode in episodes:
        padding = [0] * (width - len(episode.token_ids))
        prompt = [0] * episode.prompt_length
        ids_rows.append(episode.token_ids + [pad_token_id] * len(padding))
        attention_rows.append([1] * len(episode.token_ids) + padding)
        logprob_rows.append(prompt + episode.generator_logprobs + padding)
        gets_loss = episode.reward is not None and not (overlong_filtering and episode.truncated)
        loss_rows.append(prompt + (episode.sampled if gets_loss else [0] * len(episode.sampled)) + padding)
    input_ids = torch.tensor(ids_rows, dtype=torch.long)
    attention_mask = torch.tensor(attention_rows, dtype=torch.long)
    loss_mask = torch.tensor(loss_rows, dtype=torch.float)
    generator_logprobs = torch.tensor(logprob_rows, dtype=torch.float)
    component_names = sorted({name for e in episodes if isinstance(e.reward, dict) for name in e.reward})
    components = {name: torch.zeros(n) for name in component_names}
    rewards = torch.zeros(n)
    valid = torch.tensor([e.reward is not None for e in episodes])
    for i, episode in enumerate(episodes):
        if episode.reward is None:
            continue
        rewards[i] = scalar_reward(episode.reward, weights) + penalties[i]
        if isinstance(episode.reward, dict):
            for name in component_names:
                components[name][i] = episode.reward[name]
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        generator_logprobs=generator_logprobs,
        rewards=rewards,
        reward_components=components,
        valid=valid,
        group_ids=torch.tensor([e.group_id for e in episodes], dtype=torch.long),
        truncated=torch.tensor([e.truncated for e in episodes]),
        response_lengths=torch.tensor([e.num_sampled_tokens for e in episodes], dtype=torch.float),
        policy_versions=torch.tensor([e.policy_version for e in episodes], dtype=torch.long),
    )


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
    metrics.update(tool_metrics(episodes))
    if restarts := sum(e.restarts for e in episodes):  # episodes whose environment state was lost (EpisodeLost)
        metrics["faults/restarted_episodes"] = restarts
    correct = [e.metadata["correct"] for e in episodes if e.reward is not None and "correct" in e.metadata]
    if correct:
        metrics["accuracy"] = sum(map(float, correct)) / len(correct)
    metrics.update(judged_task_metrics(episodes))
    components = sorted({name for e in episodes if isinstance(e.reward, dict) for name in e.reward})
    for name in components:
        values = [e.reward[name] for e in episodes if isinstance(e.reward, dict)]
        metrics[f"reward/{name}"] = sum(values) / len(values)
    return metrics


def judged_task_metrics(episodes: list[Episode]) -> dict[str, float]:
    """What the judged task environments (posttrain.envs.judged) report, over the episodes whose reward did not
    fail: where episodes carry `stated_confidence` (hle), HLE's RMS calibration error (`calibration_error`, in
    [0, 1], over bins of CALIBRATION_BIN_SIZE answers sorted by confidence) over those that state a confidence,
    with `calibration/stated` and `calibration/missing` counting the episodes that do and do not; where they carry
    `rubric_score` (gdpval), its mean. Empty for other environments."""
    scored = [e for e in episodes if e.reward is not None]
    metrics: dict[str, float] = {}
    with_confidence = [e for e in scored if "stated_confidence" in e.metadata and "correct" in e.metadata]
    if with_confidence:
        stated = [e for e in with_confidence if e.metadata["stated_confidence"] is not None]
        metrics["calibration/stated"] = len(stated)
        metrics["calibration/missing"] = len(with_confidence) - len(stated)
        if stated:
            metrics["calibration_error"] = calibration_error([e.metadata["stated_confidence"] for e in stated],
                                                             [bool(e.metadata["correct"]) for e in stated],
                                                             CALIBRATION_BIN_SIZE)
    rubric = [e.metadata["rubric_score"] for e in scored if e.metadata.get("rubric_score") is not None]
    if rubric:
        metrics["rubric_score/mean"] = sum(rubric) / len(rubric)
    return metrics


def tool_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Per-episode means of what a multi-turn or tool-using step did: tokens by role (sampled by the model,
    appended by the environment), turns (max too), and where the environment calls tools (its metadata has
    tool_calls): tool calls, tool errors, each error kind, calls per turn, and the share of episodes stopped by
    their token budget; where the environment is computer use (its metadata has cua_actions): actions, invalid
    actions and each kind of them. Empty for single-turn steps without tools."""
    if not any(e.num_turns > 1 or "tool_calls" in e.metadata for e in episodes):
        return {}
    n = len(episodes)
    metrics = {"turns/max": max(e.num_turns for e in episodes),
               "tokens/model_mean": sum(e.num_sampled_tokens for e in episodes) / n,
               "tokens/observation_mean": sum(e.num_observation_tokens for e in episodes) / n}
    with_tools = [e for e in episodes if "tool_calls" in e.metadata]
    if with_tools:
        calls = sum(e.metadata["tool_calls"] for e in with_tools)
        metrics.update({
            "tools/calls_mean": calls / len(with_tools),
            "tools/errors_mean": sum(e.metadata["tool_errors"] for e in with_tools) / len(with_tools),
            "tools/calls_per_turn": calls / sum(e.num_turns for e in with_tools),
            "tools/budget_stop_rate": sum(e.budget_exhausted for e in with_tools) / len(with_tools),
        })
        kinds = sorted({kind for e in with_tools for kind in e.metadata.get("tool_error_kinds", {})})
        for kind in kinds:
            metrics[f"tools/errors/{kind}"] = sum(e.metadata["tool_error_kinds"].get(kind, 0)
                                                  for e in with_tools) / len(with_tools)
    with_actions = [e for e in episodes if "cua_actions" in e.metadata]
    if with_actions:
        metrics["cua/actions_mean"] = sum(e.metadata["cua_actions"] for e in with_actions) / len(with_actions)
        metrics["cua/action_errors_mean"] = sum(e.metadata["cua_errors"] for e in with_actions) / len(with_actions)
        for kind in sorted({kind for e in with_actions for kind in e.metadata["cua_error_kinds"]}):
            metrics[f"cua/action_errors/{kind}"] = sum(e.metadata["cua_error_kinds"].get(kind, 0)
                                                       for e in with_actions) / len(with_actions)
    return metrics
