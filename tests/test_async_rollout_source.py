"""The asynchronous rollout source (rollout.asynchronous) on its own, with stand-in generators and environments in
this process (no Ray): groups whose scoring straggles past rollout.group_timeout_s are dropped and counted, a source
restored from a checkpoint's state goes on exactly as the one that wrote it, in-flight weight updates record which
version sampled each span of tokens and stay within the staleness bound, and samples masked for a dead generation
worker (cluster.on_actor_failure=mask) are never scored."""

from __future__ import annotations

import threading

import pytest

from posttrain.algorithms.rollout import PromptRow
from posttrain.algorithms.rollout_source import AsynchronousRolloutSource, ChunkedGeneration
from posttrain.config import load_config
from posttrain.config.schema import GRPOConfig
from posttrain.data.sampler import EpochSampler
from posttrain.envs.base import EnvStep
from posttrain.envs.rewards import RewardErrorBudget
from posttrain.generation.base import Completion, GenerationOutput, SamplingParams, SubmittedBlock

from rl_configs import TINY_RL

ROWS = 16
PROMPTS = [PromptRow(f"prompt {i}", [10 + i, 3], {"row": i}) for i in range(ROWS)]


class InstantGenerator:
    """Two tokens per sample at once; `submit` as the Ray generator has it (sent now, read later)."""

    weights_version = 0

    def submit(self, prompts, params, num_samples=1):
        output = GenerationOutput([[Completion(list(p), [7, 8], [-0.5, -0.25], "78", "stop")] * num_samples
                                   for p in prompts], num_generated_tokens=2 * num_samples * len(prompts),
                                  extra={"weights_versions": [self.weights_version]})
        return lambda: output

    def submit_blocks(self, prompts, params, num_samples=1):
        return [SubmittedBlock(0, len(prompts), self.submit(prompts, params, num_samples))]


class TwoActorGenerator(InstantGenerator):
    """Two generation actors, each sampling a contiguous half of a call's prompts (`submit_blocks`); the second
    actor's half of the first call does not answer until `release` is set (a straggling actor)."""

    def __init__(self, straggles: bool = True):
        self.release, self.calls, self.straggles = threading.Event(), 0, straggles

    def submit_blocks(self, prompts, params, num_samples=1):
        self.calls += 1
        half = len(prompts) // 2
        first, second = (self.submit(part, params, num_samples) for part in (prompts[:half], prompts[half:]))
        straggles = self.straggles and self.calls == 1

        def late():
            if straggles:
                assert self.release.wait(timeout=120), "the test never released the straggling actor"
            return second()

        return [SubmittedBlock(0, half, first), SubmittedBlock(half, len(prompts), late)]


class StragglingEnvironment:
    """Rewards each episode with its row number; the group of row `slow_row` is not answered until `release` is set
    (a stuck judge), the first time it is asked."""

    def __init__(self, slow_row: int):
        self.slow_row, self.release, self.straggled = slow_row, threading.Event(), False

    def step(self, message_logs, metadata):
        if any(m["row"] == self.slow_row for m in metadata) and not self.straggled:
            self.straggled = True
            assert self.release.wait(timeout=120), "the test never released the straggling group"
        count = len(metadata)
        return EnvStep([float(m["row"]) for m in metadata], [True] * count, [None] * count, [None] * count,
                       [dict(m) for m in metadata])


def source(cfg: GRPOConfig, environment, generator=None) -> AsynchronousRolloutSource:
    sampler = EpochSampler(ROWS, seed=cfg.seed, shuffle=True)
    return AsynchronousRolloutSource(cfg, PROMPTS, sampler, generator or InstantGenerator(), environment, None,
                                     SamplingParams(max_new_tokens=2), {}, RewardErrorBudget(1.0), deadline_s=120)


def trained(sampled) -> list[tuple[int, int]]:
    """(group id, row) of every group a step trains on."""
    return [(group[0].group_id, group[0].metadata["row"]) for group in sampled.groups]


def test_a_group_scored_past_the_group_timeout_is_dropped_counted_and_not_sampled_again(tmp_path):
    cfg = load_config(GRPOConfig, None, [*TINY_RL, f"output_dir={tmp_path}", "cluster.backend=ray",
                                         "rollout.asynchronous=true", "loss.importance_correction=tis",
                                         "rollout.group_timeout_s=2"])
    first_round = EpochSampler(ROWS, seed=cfg.seed, shuffle=True).next_indices(8)
    slow_row = first_round[2]  # the third group of step 1
    environment = StragglingEnvironment(slow_row)
    running = source(cfg, environment)
    try:
        step_1 = running.next_groups(1)
        assert trained(step_1) == [(g, row) for g, row in enumerate(first_round) if row != slow_row]
        assert all(len(group) == 4 for group in step_1.groups)  # whole groups, never a part of one
        assert step_1.metrics["rollout/timed_out_groups"] == 1 == step_1.metrics["rollout/timed_out_groups_total"]

        # A checkpoint keeps step 2's round (in flight) and the count; the restored source goes on as this one.
        state = running.state_dict()
        assert state["timed_out_groups"] == 1 and state["next_group_id"] == 16
        restored = source(cfg, StragglingEnvironment(slow_row=-1))
        restored.load_state_dict(state)
        restored.sampler.load_state_dict(running.sampler.state_dict())  # the loop checkpoints the sampler itself
        later = []
        try:
            for step in (2, 3, 4):
                a, b = running.next_groups(step), restored.next_groups(step)
                assert trained(a) == trained(b), step
                assert a.metrics["rollout/timed_out_groups"] == b.metrics["rollout/timed_out_groups"] == 0
                assert b.metrics["rollout/timed_out_groups_total"] == 1
                later += trained(b)
        finally:
            restored.close()
    finally:
        environment.release.set()
        running.close()
    # The dropped prompt was not sampled again (group 2 is missing, nothing repeats): the first epoch's other 15 rows,
    # then the next epoch's 16, each once.
    groups = trained(step_1) + later
    assert [g for g, _ in groups] == [g for g in range(32) if g != 2]
    rows = [row for _, row in groups]
    assert sorted(rows[:15]) == sorted(set(range(ROWS)) - {slow_row}) and sorted(rows[15:]) == list(range(ROWS))


def test_the_groups_of_a_generation_actor_that_straggles_past_the_group_timeout_are_dropped_and_counted(tmp_path):
    cfg = load_config(GRPOConfig, None, [*TINY_RL, f"output_dir={tmp_path}", "cluster.backend=ray",
                                         "rollout.asynchronous=true", "loss.importance_correction=tis",
                                         "rollout.group_timeout_s=2"])
    first_round = EpochSampler(ROWS, seed=cfg.seed, shuffle=True).next_indices(8)
    generator = TwoActorGenerator()
    running = source(cfg, WordCount(), generator)
    try:
        step_1 = running.next_groups(1)
        # The first actor's four groups were scored and trained; the straggler's four were dropped and counted.
        assert trained(step_1) == [(g, row) for g, row in enumerate(first_round[:4])]
        assert all(len(group) == 4 for group in step_1.groups)
        assert step_1.metrics["rollout/generation_timed_out_groups"] == 4
        assert step_1.metrics["rollout/timed_out_groups"] == 4 == step_1.metrics["rollout/timed_out_groups_total"]
        state = running.state_dict()
        assert state["generation_timed_out_groups"] == 4 and state["timed_out_groups"] == 4
        assert state["next_group_id"] == 16
        restored = source(cfg, WordCount(), TwoActorGenerator(straggles=False))
        restored.load_state_dict(state)
        restored.sampler.load_state_dict(running.sampler.state_dict())
        generator.release.set()  # the late answer arrives now: it is never read
        later = []
        try:
            for step in (2, 3):
                a, b = running.next_groups(step), restored.next_groups(step)
                assert trained(a) == trained(b), step
                assert b.metrics["rollout/generation_timed_out_groups"] == 0
                assert b.metrics["rollout/generation_timed_out_groups_total"] == 4
                later += trained(b)
        finally:
            restored.close()
    finally:
        generator.release.set()
        running.close()
    # The dropped prompts were not sampled again and nothing repeats: group ids 4..7 are missing, 8..23 trained.
    assert [g for g, _ in trained(step_1) + later] == [0, 1, 2, 3, *range(8, 24)]


class VersionStampingGenerator:
    """Samples token 100 + v with weights of version v, so that every token says which weights sampled it. A prompt
    [t, 0, ...] ends (an eos) once t tokens follow its two ids; `push_after` maps a count of calls sent to the version
    a weight push sent right after that call installs (calls sent before it sample from the weights before it, as a
    Ray actor answers calls in order)."""

    def __init__(self, push_after: dict[int, int]):
        self.weights_version, self.push_after, self.calls = 0, push_after, []
        self.lock = threading.Lock()

    def submit(self, prompts, params, num_samples=1):
        with self.lock:
            version = self.weights_version
            self.calls.append((len(prompts) * num_samples, params.max_new_tokens, version))
            self.weights_version = self.push_after.get(len(self.calls), version)
        completions = []
        for prompt in prompts:
            target, so_far = prompt[0], len(prompt) - 2
            count = min(params.max_new_tokens, target - so_far)
            reason = "stop" if so_far + count == target else "length"
            completions.append([Completion(list(prompt), [100 + version] * count, [-0.125 * (version + 1)] * count,
                                           "x" * count, reason)] * num_samples)
        output = GenerationOutput(completions, num_generated_tokens=sum(len(c[0].token_ids) for c in completions),
                                  extra={"weights_versions": [version]})
        return lambda: output


class WordCount:
    def step(self, message_logs, metadata):
        count = len(metadata)
        return EnvStep([1.0] * count, [True] * count, [None] * count, [None] * count, [dict(m) for m in metadata])


def spans_match_tokens(episode) -> list[tuple[int, int]]:
    """Check that each recorded span's tokens (and log-probabilities) are those its version samples; the spans."""
    completion = episode.token_ids[episode.prompt_length:]
    spans = episode.version_spans
    assert spans[0][0] == 0 and all(start % 2 == 0 for start, _ in spans)  # at chunk boundaries
    ends = [start for start, _ in spans[1:]] + [len(completion)]
    for (start, version), end in zip(spans, ends):
        assert end > start and completion[start:end] == [100 + version] * (end - start), (spans, completion)
        assert episode.generator_logprobs[start:end] == [-0.125 * (version + 1)] * (end - start)
    assert episode.policy_version == min(v for _, v in spans)  # its age counts from the oldest token
    return spans


def test_chunked_generation_records_the_weights_version_of_each_span_of_tokens():
    # Completions of 1 to 8 tokens (6 at most): chunks of 2 tokens; a push after each of the first two calls.
    prompts = [[1, 0], [3, 0], [5, 0], [8, 0]]
    generator = VersionStampingGenerator(push_after={1: 1, 2: 2})
    chunked = ChunkedGeneration(generator, prompts, SamplingParams(max_new_tokens=6, seed=3), 2, chunk_tokens=2,
                                first_group_id=10, tokenizer=_Decoder())
    output = chunked.generate(prompts, SamplingParams(max_new_tokens=6, seed=3), 2)
    # The first chunk: every sample; then only those that have not ended, each from a stream of its own.
    assert [(count, budget) for count, budget, _ in generator.calls] == [(8, 2), (6, 2), (4, 2)]
    lengths = [len(c.token_ids) for samples in output.completions for c in samples]
    assert lengths == [1, 1, 3, 3, 5, 5, 6, 6]
    assert [c.finish_reason for samples in output.completions for c in samples] == ["stop"] * 6 + ["length"] * 2
    assert output.completions[3][0].token_ids == [100, 100, 101, 101, 102, 102]
    assert [chunked.version_spans(i) for i in range(8)] == [
        [(0, 0)], [(0, 0)], [(0, 0), (2, 1)], [(0, 0), (2, 1)]] + [[(0, 0), (2, 1), (4, 2)]] * 4
    assert chunked.oldest_version == 0 and output.extra["weights_versions"] == [0, 1, 2]


def test_a_chunk_masked_for_a_dead_generation_worker_masks_its_samples():
    class DiesOnTheSecondCall(VersionStampingGenerator):
        def submit(self, prompts, params, num_samples=1):
            answer = super().submit(prompts, params, num_samples)
            if len(self.calls) != 2:
                return answer
            masked = [[Completion(list(p), [], [], "", "stop", error="generation worker 0 of 1 died")] * num_samples
                      for p in prompts]
            return lambda: GenerationOutput(masked, extra=answer().extra)

    prompts = [[1, 0], [5, 0]]
    chunked = ChunkedGeneration(DiesOnTheSecondCall(push_after={}), prompts, SamplingParams(max_new_tokens=6, seed=3),
                                1, chunk_tokens=2, first_group_id=0, tokenizer=_Decoder())
    first, second = (samples[0] for samples in chunked.generate(prompts, SamplingParams(max_new_tokens=6, seed=3),
                                                                1).completions)
    assert first.error is None and first.token_ids == [100]  # ended in the first chunk
    assert second.error == "generation worker 0 of 1 died" and second.token_ids == [100, 100]  # not continued


def test_in_flight_rounds_record_their_spans_and_stay_within_the_staleness_bound(tmp_path):
    cfg = load_config(GRPOConfig, None, [*TINY_RL, f"output_dir={tmp_path}", "cluster.backend=ray",
                                         "rollout.asynchronous=true", "loss.importance_correction=tis",
                                         "rollout.in_flight_updates=true", "rollout.in_flight_chunk_tokens=2"])
    # Completions of 3 to 8 tokens (6 at most: rollout.max_new_tokens): 2 or 3 chunks of 2 tokens.
    prompts = [PromptRow(f"prompt {i}", [3 + i % 6, 0], {"row": i}) for i in range(ROWS)]
    generator = VersionStampingGenerator(push_after={})
    running = AsynchronousRolloutSource(cfg, prompts, EpochSampler(ROWS, seed=cfg.seed, shuffle=True), generator,
                                        WordCount(), _Decoder(), SamplingParams(max_new_tokens=6), {},
                                        RewardErrorBudget(1.0), deadline_s=120)
    try:
        for step in (1, 2, 3, 4):
            sampled = running.next_groups(step)
            assert len(sampled.groups) == 8 and sampled.metrics["rollout/stale_groups_dropped"] == 0
            for episode in sampled.episodes:
                spans_match_tokens(episode)
                # Sampled no earlier than the weights of step - 2 (the policy trains as version step - 1).
                assert step - 1 - episode.policy_version <= 1
            assert sampled.metrics["rollout/staleness_max"] <= 1
            with generator.lock:  # the weight push that ends the step, between two chunks of the rounds in flight
                generator.weights_version = step
    finally:
        running.close()
    assert all(budget <= 2 for _, budget, _ in generator.calls)


class _Decoder:
    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


class MaskingGenerator:
    """The answer a Ray generator gives for a call whose actor died under cluster.on_actor_failure=mask, for the
    samples of prompt 1; the others sampled."""

    weights_version = 0

    def generate(self, prompts, params, num_samples=1):
        return GenerationOutput([[Completion(list(p), [], [], "", "stop", error="generation worker 0 of 1 died")
                                  if i == 1 else Completion(list(p), [7], [-0.5], "7", "stop")] * num_samples
                                 for i, p in enumerate(prompts)])


class Recording(WordCount):
    def __init__(self):
        self.asked = []

    def step(self, message_logs, metadata):
        self.asked += [m["row"] for m in metadata]
        return super().step(message_logs, metadata)


@pytest.mark.parametrize("group_timeout_s", [None, 60.0])
def test_masked_samples_of_a_dead_generation_worker_are_not_scored_and_carry_their_error(group_timeout_s):
    from posttrain.algorithms.rollout import run_episodes

    environment = Recording()
    episodes, _ = run_episodes(PROMPTS[:3], 0, 2, MaskingGenerator(), environment, None,
                               SamplingParams(max_new_tokens=2), max_turns=1, group_timeout_s=group_timeout_s)
    assert sorted(environment.asked) == [0, 0, 2, 2]  # prompt 1's samples were never scored
    assert [e.reward for e in episodes] == [1.0, 1.0, None, None, 1.0, 1.0]
    assert [e.error for e in episodes[2:4]] == ["generation worker 0 of 1 died"] * 2
    assert all(e.num_sampled_tokens == 0 for e in episodes[2:4]) and episodes[0].num_sampled_tokens == 1


class OddRowsVary:
    """Rewards 0, 1, 0, 1, ... to the samples of odd rows and 1 to every sample of even rows: the groups of even rows
    carry no signal (dynamic sampling filters them)."""

    def step(self, message_logs, metadata):
        count = len(metadata)
        rewards = [float(k % 2) if m["row"] % 2 else 1.0 for k, m in enumerate(metadata)]
        return EnvStep(rewards, [True] * count, [None] * count, [None] * count, [dict(m) for m in metadata])


def dapo_source(cfg: GRPOConfig, generator: InstantGenerator) -> AsynchronousRolloutSource:
    return AsynchronousRolloutSource(cfg, PROMPTS, EpochSampler(ROWS, seed=cfg.seed, shuffle=True), generator,
                                     OddRowsVary(), None, SamplingParams(max_new_tokens=2), {}, RewardErrorBudget(1.0),
                                     deadline_s=120, dynamic_sampling=True)


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_dynamic_sampling_rounds_filter_equal_rewards_keep_the_staleness_bound_and_resume_exactly(tmp_path,
                                                                                                  max_staleness):
    cfg = load_config(GRPOConfig, None, [*TINY_RL, f"output_dir={tmp_path}", "cluster.backend=ray",
                                         "rollout.asynchronous=true", "loss.importance_correction=tis",
                                         "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=3",
                                         f"rollout.max_staleness={max_staleness}"])
    generator = InstantGenerator()
    running = dapo_source(cfg, generator)
    steps, seen, restored = 5, [], None
    try:
        for step in range(1, steps + 1):
            if step == 3:  # a checkpoint after step 2: the restored source must go on exactly as this one
                restored = dapo_source(cfg, InstantGenerator())
                restored.load_state_dict(running.state_dict())
                restored.sampler.load_state_dict(running.sampler.state_dict())
                restored.generator.weights_version = generator.weights_version
            sampled = running.next_groups(step)
            if restored is not None:
                again = restored.next_groups(step)
                assert trained(again) == trained(sampled) and again.metrics == pytest.approx(
                    {k: v for k, v in sampled.metrics.items() if k != "rollout/wait_seconds"} |
                    {"rollout/wait_seconds": again.metrics["rollout/wait_seconds"]}), step
                restored.generator.weights_version = step
            # Only groups with reward variance (odd rows), whole; a 16-row epoch holds 8 of them, so 8 groups take
            # two rounds of 8 prompts, or three when the rounds straddle epochs.
            assert all(row % 2 for _, row in trained(sampled)) and all(len(g) == 4 for g in sampled.groups)
            rounds = sampled.metrics["sampling/rounds"]
            assert 2 <= rounds <= 3 and sampled.metrics["sampling/groups_kept"] == len(sampled.groups)
            assert sampled.metrics["sampling/groups_filtered"] == 8 * rounds - len(sampled.groups)
            assert len(sampled.groups) == 8 or rounds == 3
            # Within the bound, counted from each group's oldest sample; none had to be dropped for it.
            ages = [step - 1 - e.policy_version for e in sampled.episodes]
            assert max(ages) <= max_staleness and sampled.metrics["rollout/staleness_max"] == max(ages)
            assert sampled.metrics["rollout/stale_groups_dropped"] == 0
            seen += trained(sampled)
            generator.weights_version = step  # the weight push that ends the step
    finally:
        running.close()
        if restored is not None:
            restored.close()
    ids = [g for g, _ in seen]
    assert ids == sorted(set(ids))  # no group trained twice, in draw order
    assert generator.weights_version == steps and max(ids) < 8 * 3 * steps
