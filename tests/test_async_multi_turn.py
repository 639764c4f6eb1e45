"""Asynchronous rounds (rollout.asynchronous) beyond single-turn, unchunked sampling, with stand-in generators and
environments in this process (no Ray): stop strings found across the chunks of in-flight updates where an unchunked
call ends the completion; multi-turn rounds filtered by dynamic sampling; multi-turn groups that straggle past
rollout.group_timeout_s dropped and counted; later turns sampled in chunks with every span's version recorded."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from posttrain.algorithms.rollout import PromptRow
from posttrain.algorithms.rollout_source import AsynchronousRolloutSource, ChunkedGeneration
from posttrain.config import load_config
from posttrain.config.schema import GRPOConfig
from posttrain.data.sampler import EpochSampler
from posttrain.envs.base import EnvStep
from posttrain.envs.rewards import RewardErrorBudget
from posttrain.generation.base import Completion, GenerationOutput, SamplingParams
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
