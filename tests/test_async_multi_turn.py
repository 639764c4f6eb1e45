"""Asynchronous rounds (rollout.asynchronous) beyond single-turn, unchunked sampling, with stand-in generators and
environments in this process (no Ray): stop strings found across the chunks of in-flight updates where an unchunked
call ends the completion; multi-turn rounds filtered by dynamic sampling; multi-turn groups that straggle past
rollout.group_timeout_s dropped and counted; later turns sampled in chunks with every span's version recorded."""

from __future__ import annotations

import threading
from dataclasses import replace

from posttrain.algorithms.rollout import PromptRow
from posttrain.algorithms.rollout_source import AsynchronousRolloutSource, ChunkedGeneration
from posttrain.config import load_config
from posttrain.config.schema import GRPOConfig
from posttrain.data.sampler import EpochSampler
from posttrain.envs.base import EnvStep
from posttrain.envs.rewards import RewardErrorBudget
from posttrain.generation.base import Completion, GenerationOutput, SamplingParams, SubmittedBlock
from posttrain.models.tiny import build_tokenizer

from rl_configs import TINY_RL

TOKENIZER = build_tokenizer()  # the embedded byte-level tokenizer: one token per byte
EOS = TOKENIZER.eos_token_id


class ScriptedSampler:
    """A generator whose prompt [k, ...] samples SCRIPT[k] from where the prompt leaves off (the tokens after its first
    two ids are the script's tokens so far), each token with log-probability -(its position + 1) / 64. It ends a
    completion as the transformers generator does: at eos, or after the token whose decoded completion (from the first
    token of this call) contains a stop string; at max_new_tokens otherwise. `submit` as the Ray generator has it."""

    weights_version = 0

    def __init__(self, scripts: list[list[int]]):
        self.scripts, self.calls = scripts, []

    def submit(self, prompts, params, num_samples=1):
        self.calls.append(params)
        completions = [[self._sample(prompt, params)] * num_samples for prompt in prompts]
        output = GenerationOutput(completions, num_generated_tokens=sum(len(c[0].token_ids) for c in completions),
                                  extra={"weights_versions": [self.weights_version]})
        return lambda: output

    def _sample(self, prompt, params) -> Completion:
        script, done = self.scripts[prompt[0]], len(prompt) - 2
        tokens, reason = [], "length"
        for position in range(done, min(done + params.max_new_tokens, len(script))):
            tokens.append(script[position])
            text = TOKENIZER.decode(tokens, skip_special_tokens=True)
            if script[position] == EOS or any(stop in text for stop in params.stop_strings):
                reason = "stop"
                break
        logprobs = [-(done + k + 1) / 64 for k in range(len(tokens))]
        return Completion(list(prompt), tokens, logprobs, TOKENIZER.decode(tokens, skip_special_tokens=True), reason)


def encoded(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


# Chunks of 4 tokens; max_new_tokens 12. The stop strings are "ANS" and "é" (two bytes, so two tokens).
SCRIPTS = [encoded("abcANSdefghij"),         # "ANS" spans the first two chunks (tokens 3-5)
           encoded("abcdeANSfghij"),         # within the second chunk (tokens 5-7)
           encoded("aANSbcdefghij"),         # ends on the first chunk's last token
           encoded("abcdefg\u00e9hijk"),     # "é" (tokens 7-8) spans the second and third chunks: each half decodes "\ufffd"
           encoded("abcdefghijklmnop"),      # no stop string: max_new_tokens
           encoded("ab") + [EOS] + encoded("ANS")]  # eos first
STOPS = ("ANS", "\u00e9")


def test_a_stop_string_spanning_two_chunks_ends_the_completion_where_an_unchunked_call_ends_it():
    prompts = [[k, 0] for k in range(len(SCRIPTS))]
    params = SamplingParams(max_new_tokens=12, stop_strings=STOPS, seed=5)
    unchunked = ScriptedSampler(SCRIPTS).submit(prompts, params, 2)()
    sampler = ScriptedSampler(SCRIPTS)
    chunked = ChunkedGeneration(sampler, prompts, params, 2, chunk_tokens=4, first_group_id=0,
                                tokenizer=TOKENIZER).generate(prompts, params, 2)
    expected_lengths = [6, 8, 4, 9, 12, 3]  # where an unchunked call stops each script
    for k, (reference, samples) in enumerate(zip(unchunked.completions, chunked.completions, strict=True)):
        assert len(reference[0].token_ids) == expected_lengths[k], k
        for sample in samples:
            assert sample.token_ids == reference[0].token_ids, k
            assert sample.logprobs == reference[0].logprobs and sample.text == reference[0].text, k
            assert sample.finish_reason == reference[0].finish_reason, k
    assert [c[0].finish_reason for c in chunked.completions] == ["stop"] * 4 + ["length", "stop"]
    # The stop strings of scripts 0 and 3 lie in no single chunk's decoded text: a chunk call that looked for them
    # in its own tokens (as each call of the backend does) would have gone on past them.
    for k in (0, 3):
        chunk_texts = [TOKENIZER.decode(SCRIPTS[k][i:i + 4]) for i in range(0, 12, 4)]
        assert not any(stop in text for text in chunk_texts for stop in STOPS), chunk_texts
    assert all(call.stop_strings == () for call in sampler.calls)  # looked for by ChunkedGeneration, over chunks


def test_a_stop_string_in_a_later_turn_sampled_in_chunks_ends_it_as_unchunked_and_records_its_versions():
    # The later turns of a multi-turn round are sampled in chunks too (their first chunk sent when asked for).
    prompts = [[0, 0]]
    params = SamplingParams(max_new_tokens=12, stop_strings=STOPS, seed=5)
    sampler = ScriptedSampler(SCRIPTS)
    chunked = ChunkedGeneration(sampler, prompts, params, 1, chunk_tokens=4, first_group_id=0, tokenizer=TOKENIZER)
    chunked.generate(prompts, params, 1)
    sampler.weights_version = 3  # a push between the first turn and the next
    later = [[3, 0], [1, 0]]
    turn = replace(params, seed=None, seeds=(11, 12))
    output = chunked.generate(later, turn, 1)
    reference = ScriptedSampler(SCRIPTS).submit(later, params, 1)()
    assert [c[0].token_ids for c in output.completions] == [c[0].token_ids for c in reference.completions]
    assert output.extra["version_spans"] == [[(0, 3)], [(0, 3)]] and output.extra["weights_versions"] == [3]
    # Later chunks of a later turn draw from streams of each episode's own turn seed: one per sample and chunk.
    chunk_seeds = [call.seeds for call in sampler.calls[-2:]]
    assert all(seeds is not None and len(set(seeds)) == len(seeds) for seeds in chunk_seeds)
    assert not set(chunk_seeds[0]) & set(chunk_seeds[1])


ROWS = 16
PROMPTS = [PromptRow(f"prompt {i}", [10 + i, 3], {"row": i}) for i in range(ROWS)]


class TurnSampler:
    """Samples `tokens` tokens (2, or max_new_tokens when None) of id 100 + v with weights of version v, each with
    log-probability -0.125 (v + 1); the j-th sample of a prompt replies "s{j}". `submit` as the Ray generator has it;
    `push_after` maps a count of calls sent to the version a weight push right after that call installs. A later
    turn (a prompt longer than its row's two ids) of row `held_row` is not answered until `release` is set."""

    def __init__(self, push_after: dict[int, int] | None = None, tokens: int | None = 2, held_row: int = -1):
        self.weights_version, self.push_after, self.tokens, self.held_row = 0, push_after or {}, tokens, held_row
        self.calls, self.lock, self.release = 0, threading.Lock(), threading.Event()

    def submit(self, prompts, params, num_samples=1):
        if any(p[0] == 10 + self.held_row and len(p) > 2 for p in prompts):
            assert self.release.wait(timeout=120), "the test never released the straggling generation call"
        with self.lock:
            version = self.weights_version
            self.calls += 1
            self.weights_version = self.push_after.get(self.calls, version)
        count = params.max_new_tokens if self.tokens is None else min(self.tokens, params.max_new_tokens)
        reason = "length" if count == params.max_new_tokens else "stop"
        output = GenerationOutput([[Completion(list(p), [100 + version] * count, [-0.125 * (version + 1)] * count,
                                               f"s{j}", reason) for j in range(num_samples)] for p in prompts],
                                  num_generated_tokens=count * num_samples * len(prompts),
                                  extra={"weights_versions": [version]})
        return lambda: output


class TwoTurns:
    """Every episode's first reply is answered with an observation (reward 1), its second ends it: reward 1 for even
    rows, and for odd rows the parity of the first reply's sample number (s0, s1, ...), so that only odd rows' groups
    carry reward variance. The second turn of row `slow_row`'s first episode to get there is not answered until
    `release` is set (a straggling tool)."""

    def __init__(self, slow_row: int = -1):
        self.slow_row, self.release, self.straggled = slow_row, threading.Event(), False
        self.lock = threading.Lock()

    def step(self, message_logs, metadata):
        (messages,), (meta,) = message_logs, metadata
        if len(messages) < 4:
            return EnvStep([1.0], [False], [{"role": "user", "content": "go on"}], [None], [dict(meta)])
        with self.lock:
            straggles = meta["row"] == self.slow_row and not self.straggled
            self.straggled |= straggles
        if straggles:
            assert self.release.wait(timeout=120), "the test never released the straggling episode"
        first_reply = messages[1]["content"]  # "s{j}" (a chunked reply decodes its tokens instead: sample 0)
        sample = int(first_reply[1:]) if first_reply[1:].isdigit() else 0
        reward = float(sample % 2) if meta["row"] % 2 else 1.0
        return EnvStep([reward], [True], [None], [None], [dict(meta)])


def multi_turn_config(tmp_path, *overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, None, [*TINY_RL, f"output_dir={tmp_path}", "cluster.backend=ray",
                                          "rollout.asynchronous=true", "loss.importance_correction=tis",
                                          "rollout.max_turns=2", *overrides])


def multi_turn_source(cfg: GRPOConfig, generator, environment, max_new_tokens: int = 2) -> AsynchronousRolloutSource:
    return AsynchronousRolloutSource(cfg, PROMPTS, EpochSampler(ROWS, seed=cfg.seed, shuffle=True), generator,
                                     environment, TOKENIZER, SamplingParams(max_new_tokens=max_new_tokens), {},
                                     RewardErrorBudget(1.0), deadline_s=120,
                                     dynamic_sampling=cfg.rollout.dynamic_sampling)


def trained(sampled) -> list[tuple[int, int]]:
    """(group id, row) of every group a step trains on."""
    return [(group[0].group_id, group[0].metadata["row"]) for group in sampled.groups]


def test_dynamic_sampling_keeps_only_multi_turn_groups_with_reward_variance_and_resumes_exactly(tmp_path):
    cfg = multi_turn_config(tmp_path, "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=3")
    generator = TurnSampler()
    running = multi_turn_source(cfg, generator, TwoTurns())
    seen, restored = [], None
    try:
        for step in range(1, 5):
            if step == 3:  # a checkpoint after step 2: the restored source goes on exactly as this one
                restored = multi_turn_source(cfg, TurnSampler(), TwoTurns())
                restored.load_state_dict(running.state_dict())
                restored.sampler.load_state_dict(running.sampler.state_dict())
                restored.generator.weights_version = generator.weights_version
            sampled = running.next_groups(step)
            if restored is not None:
                again = restored.next_groups(step)
                assert trained(again) == trained(sampled), step
                assert again.metrics["sampling/rounds"] == sampled.metrics["sampling/rounds"]
                restored.generator.weights_version = step
            # Only odd rows' groups, whose variance appears at the second turn; every episode ran both turns.
            assert trained(sampled) and all(row % 2 for _, row in trained(sampled)), trained(sampled)
            assert all(len(group) == 4 for group in sampled.groups)
            assert all(e.num_turns == 2 and e.num_observation_tokens > 0 for e in sampled.episodes)
            assert all(sorted(e.reward for e in group) == [0.0, 0.0, 1.0, 1.0] for group in sampled.groups)
            rounds = sampled.metrics["sampling/rounds"]
            assert 2 <= rounds <= 3 and sampled.metrics["sampling/groups_kept"] == len(sampled.groups)
            assert sampled.metrics["sampling/groups_filtered"] == 8 * rounds - len(sampled.groups)
            ages = [step - 1 - e.policy_version for e in sampled.episodes]
            assert max(ages) <= 1 and sampled.metrics["rollout/stale_groups_dropped"] == 0
            seen += trained(sampled)
            generator.weights_version = step  # the weight push that ends the step
    finally:
        running.close()
        if restored is not None:
            restored.close()
    ids = [g for g, _ in seen]
    assert ids == sorted(set(ids))  # no group trained twice, in draw order


def test_a_multi_turn_group_whose_tool_straggles_past_the_group_timeout_is_dropped_and_counted(tmp_path):
    cfg = multi_turn_config(tmp_path, "rollout.group_timeout_s=3")
    first_round = EpochSampler(ROWS, seed=cfg.seed, shuffle=True).next_indices(8)
    slow_row = first_round[5]
    environment = TwoTurns(slow_row)
    running = multi_turn_source(cfg, TurnSampler(), environment)
    try:
        step_1 = running.next_groups(1)
        # The straggling episode's whole group is dropped; the others ran both turns and are trained.
        assert trained(step_1) == [(g, row) for g, row in enumerate(first_round) if row != slow_row]
        assert all(len(group) == 4 and all(e.num_turns == 2 for e in group) for group in step_1.groups)
        assert step_1.metrics["rollout/timed_out_groups"] == 1 == step_1.metrics["rollout/timed_out_groups_total"]
        assert step_1.metrics["rollout/generation_timed_out_groups"] == 0
        environment.release.set()
        step_2 = running.next_groups(2)
        assert len(step_2.groups) == 8 and step_2.metrics["rollout/timed_out_groups"] == 0
        assert step_2.metrics["rollout/timed_out_groups_total"] == 1
        assert running.state_dict()["timed_out_groups"] == 1
    finally:
        environment.release.set()
        running.close()
    assert [g for g, _ in trained(step_1) + trained(step_2)] == [g for g in range(16) if g != 5]  # none again


def test_a_multi_turn_group_whose_later_turn_generation_straggles_is_dropped_and_counted(tmp_path):
    cfg = multi_turn_config(tmp_path, "rollout.group_timeout_s=3")
    first_round = EpochSampler(ROWS, seed=cfg.seed, shuffle=True).next_indices(8)
    slow_row = first_round[2]
    generator = TurnSampler(held_row=slow_row)
    running = multi_turn_source(cfg, generator, TwoTurns())
    try:
        step_1 = running.next_groups(1)
        generation_late = step_1.metrics["rollout/generation_timed_out_groups"]
        # The held call's groups (the slow row's among them) are dropped as generation stragglers; groups that
        # ended in time are trained whole; every group of the round is one or the other.
        assert 2 not in [g for g, _ in trained(step_1)] and generation_late >= 1
        assert len(step_1.groups) + step_1.metrics["rollout/timed_out_groups"] == 8
        assert all(len(group) == 4 and all(e.num_turns == 2 for e in group) for group in step_1.groups)
        assert running.state_dict()["generation_timed_out_groups"] == generation_late
    finally:
        generator.release.set()
        running.close()


class TwoActorSampler(TurnSampler):
    """TurnSampler as two generation actors (`submit_blocks`, as the Ray generator has it): a call with per-prompt
    seeds is cut in two blocks, its first half of prompts and its second (a call seeded as a whole is one block);
    the second block of the run's first call is not answered until `release` is set (a straggling actor)."""

    def __init__(self):
        super().__init__()
        self.held = False

    def submit_blocks(self, prompts, params, num_samples=1):
        assert params.seed is None and params.seeds is not None  # rollout.seed_per_group: per-group streams
        half = (len(prompts) + 1) // 2
        blocks = []
        for start, stop in ((0, half), (half, len(prompts))):
            answer = self.submit(prompts[start:stop], params, num_samples)
            hold = start > 0 and not self.held

            def wait(answer=answer, hold=hold):
                if hold:
                    assert self.release.wait(timeout=120), "the test never released the straggling block"
                return answer()
            blocks.append(SubmittedBlock(start, stop, wait))
        self.held = True
        return blocks


def test_the_groups_of_a_multi_turn_rounds_straggling_first_turn_block_are_dropped_as_generation_stragglers(
        tmp_path):
    """A multi-turn round's first turns are sent one block per generation actor: the groups of the block that
    answers first run both turns and are trained while the other block straggles past the group timeout, and its
    groups are dropped and counted as generation stragglers, never trained."""
    cfg = multi_turn_config(tmp_path, "rollout.group_timeout_s=3", "rollout.seed_per_group=true")
    first_round = EpochSampler(ROWS, seed=cfg.seed, shuffle=True).next_indices(8)
    generator = TwoActorSampler()
    running = multi_turn_source(cfg, generator, TwoTurns())
    try:
        step_1 = running.next_groups(1)
        assert trained(step_1) == [(g, row) for g, row in enumerate(first_round[:4])]  # the first block's groups
        assert all(len(group) == 4 and all(e.num_turns == 2 for e in group) for group in step_1.groups)
        assert step_1.metrics["rollout/timed_out_groups"] == 4 == step_1.metrics["rollout/generation_timed_out_groups"]
        generator.release.set()
        step_2 = running.next_groups(2)  # round 2's blocks both answer: nothing dropped
        assert len(step_2.groups) == 8 and step_2.metrics["rollout/timed_out_groups"] == 0
        assert running.state_dict()["generation_timed_out_groups"] == 4
    finally:
        generator.release.set()
        running.close()
    assert [g for g, _ in trained(step_1) + trained(step_2)] == [0, 1, 2, 3, *range(8, 16)]  # none again


def test_a_first_turn_block_that_arrives_within_the_group_timeout_starts_its_episodes_and_drops_nothing(tmp_path):
    """The second block of round 1's first turns comes 0.5 s after the first, whose episodes are already at their
    environment calls: its episodes start when it arrives, and every group of the round runs both turns."""
    cfg = multi_turn_config(tmp_path, "rollout.group_timeout_s=20", "rollout.seed_per_group=true")
    generator = TwoActorSampler()
    threading.Timer(0.5, generator.release.set).start()
    running = multi_turn_source(cfg, generator, TwoTurns())
    try:
        step_1 = running.next_groups(1)
        assert len(step_1.groups) == 8 and step_1.metrics["rollout/timed_out_groups"] == 0
        assert all(len(group) == 4 and all(e.num_turns == 2 for e in group) for group in step_1.groups)
    finally:
        generator.release.set()
        running.close()


def test_later_turns_of_in_flight_rounds_are_sampled_in_chunks_and_record_each_spans_version(tmp_path):
    cfg = multi_turn_config(tmp_path, "rollout.in_flight_updates=true", "rollout.in_flight_chunk_tokens=2")
    # A weight push after every call: each chunk of a turn (6 tokens, 3 chunks) samples from newer weights.
    generator = TurnSampler(push_after={n: n for n in range(1, 1000)}, tokens=None)
    running = multi_turn_source(cfg, generator, TwoTurns(), max_new_tokens=6)
    try:
        sampled = running.next_groups(1)
        for episode in sampled.episodes:
            completion = episode.token_ids[episode.prompt_length:]
            spans = episode.version_spans
            ends = [start for start, _ in spans[1:]] + [len(completion)]
            assert len(spans) == 6 and spans[0][0] == 0, spans  # 3 chunks of each of 2 turns, each a new version
            for (start, version), end in zip(spans, ends):
                sampled_tokens = [t for t, s in zip(completion[start:end], episode.sampled[start:end]) if s]
                assert sampled_tokens == [100 + version] * 2, (spans, completion)
            assert episode.policy_version == spans[0][1] == min(v for _, v in spans)
            assert spans[3][0] > 6  # the later turn's spans start past the first turn and its observation
        assert sampled.metrics["rollout/in_flight_updated_fraction"] == 1
    finally:
        running.close()


class TwoActorChunks:
    """Two generation actors, each sampling a contiguous half of a call's prompts (`submit_blocks`); token 100 + v
    from weights of version v. A prompt [target, row, ...] ends (an eos) once `target` tokens follow its two ids.
    The second actor's half of the first call that continues samples of `rows` (a later chunk of the round that
    drew them) does not answer until `release` is set; the rows of its prompts are `held_rows`."""

    def __init__(self, rows: set[int]):
        self.weights_version, self.calls, self.release, self.held_rows = 0, 0, threading.Event(), set()
        self.rows = rows

    def _output(self, prompts, params, num_samples):
        completions = []
        for prompt in prompts:
            target, so_far = prompt[0], len(prompt) - 2
            count = min(params.max_new_tokens, target - so_far)
            reason = "stop" if so_far + count == target else "length"
            completions.append([Completion(list(prompt), [100] * count, [-0.5] * count, "x" * count, reason)]
                               * num_samples)
        return GenerationOutput(completions, num_generated_tokens=sum(len(c[0].token_ids) for c in completions),
                                extra={"weights_versions": [self.weights_version]})

    def submit_blocks(self, prompts, params, num_samples=1):
        from posttrain.generation.base import SubmittedBlock

        continued = len(prompts[0]) > 2 and prompts[0][1] in self.rows
        self.calls += continued
        half = len(prompts) // 2
        first, second = (self._output(part, params, num_samples) for part in (prompts[:half], prompts[half:]))
        held = continued and self.calls == 1
        if held:
            self.held_rows = {prompt[1] for prompt in prompts[half:]}

        def late():
            if held:
                assert self.release.wait(timeout=120), "the test never released the straggling actor"
            return second

        return [SubmittedBlock(0, half, lambda: first), SubmittedBlock(half, len(prompts), late)]


class Decoder:
    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


class Constant:
    def step(self, message_logs, metadata):
        count = len(metadata)
        return EnvStep([1.0] * count, [True] * count, [None] * count, [None] * count, [dict(m) for m in metadata])


def test_the_groups_of_a_chunk_that_straggles_past_the_group_timeout_are_dropped_as_generation_stragglers(tmp_path):
    cfg = load_config(GRPOConfig, None, [*TINY_RL, f"output_dir={tmp_path}", "cluster.backend=ray",
                                         "rollout.asynchronous=true", "loss.importance_correction=tis",
                                         "rollout.in_flight_updates=true", "rollout.in_flight_chunk_tokens=2",
                                         "rollout.group_timeout_s=2"])
    prompts = [PromptRow(f"prompt {i}", [3 + i % 4, i], {"row": i}) for i in range(ROWS)]  # 3 to 6 tokens each
    first_round = EpochSampler(ROWS, seed=cfg.seed, shuffle=True).next_indices(8)
    generator = TwoActorChunks(set(first_round))
    running = AsynchronousRolloutSource(cfg, prompts, EpochSampler(ROWS, seed=cfg.seed, shuffle=True), generator,
                                        Constant(), Decoder(), SamplingParams(max_new_tokens=6), {},
                                        RewardErrorBudget(1.0), deadline_s=120)
    try:
        step_1 = running.next_groups(1)
        held = generator.held_rows
        # The held block's groups (every sample of a group has the same length, so a group's unfinished samples
        # share a block) missed the deadline, and so did every group needing a third chunk, which is sent only once
        # the whole second chunk has answered: generation stragglers. The groups that ended within two chunks,
        # outside the held block, were sampled to their end; those scored in what was left of the timeout (the
        # second chunk's wait took it all) were trained, the others counted as scoring stragglers.
        expected = [(g, row) for g, row in enumerate(first_round) if row not in held and 3 + row % 4 <= 4]
        assert held and expected and set(trained(step_1)) <= set(expected)
        for group in step_1.groups:
            assert all(e.num_sampled_tokens == 3 + e.metadata["row"] % 4 and not e.truncated for e in group)
        dropped = 8 - len(expected)
        assert step_1.metrics["rollout/generation_timed_out_groups"] == dropped
        assert step_1.metrics["rollout/timed_out_groups"] == 8 - len(step_1.groups)
        assert running.state_dict()["generation_timed_out_groups"] == dropped
    finally:
        generator.release.set()
        running.close()
