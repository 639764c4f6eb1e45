"""The transformers sampling backend: greedy parity with `generate`, logprobs of the sampled tokens, top-k/top-p,
stop strings, finish reasons and seeding."""

import math

import pytest
import torch

from posttrain.algorithms.evaluate import generate_greedy
from posttrain.config.schema import ModelConfig
from posttrain.generation.base import Generator, SamplingParams
from posttrain.generation.transformers_backend import (
    TransformersGenerator,
    sample_next_token,
)
from posttrain.models.loading import load_causal_lm, load_tokenizer

PROMPTS = ["12+34=", "7+8=", "99+1=", "hello", "a"]


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    tokenizer, model = load_tokenizer(cfg), load_causal_lm(cfg)
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    return model, tokenizer, ids, TransformersGenerator(model, tokenizer, batch_size=3)


def test_is_a_generator(setup):
    assert isinstance(setup[3], Generator)


def test_greedy_matches_transformers_generate(setup):
    model, tokenizer, ids, generator = setup
    output = generator.generate(ids, SamplingParams(max_new_tokens=6, temperature=0.0))
    reference, _ = generate_greedy(model, tokenizer, PROMPTS, max_new_tokens=6, batch_size=5)
    assert [c[0].text for c in output.completions] == reference
    assert all(lp == 0.0 for c in output.completions for lp in c[0].logprobs)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_those_of_the_tempered_distribution(setup, temperature):
    model, _, ids, generator = setup
    output = generator.generate(ids, SamplingParams(max_new_tokens=6, temperature=temperature, seed=3), num_samples=4)
    checked = 0
    for prompt, samples in zip(ids, output.completions):
        for completion in samples:
            assert completion.prompt_ids == prompt and len(completion.logprobs) == len(completion.token_ids)
            full = torch.tensor([prompt + completion.token_ids])
            with torch.no_grad():
                logprobs = (model(full).logits[0].float() / temperature).log_softmax(-1)
            expected = [logprobs[len(prompt) - 1 + t, token].item() for t, token in enumerate(completion.token_ids)]
            assert completion.logprobs == pytest.approx(expected, abs=1e-4)
            checked += len(expected)
    assert checked > 50


def test_top_k_one_and_tiny_top_p_are_greedy(setup):
    _, _, ids, generator = setup
    greedy = generator.generate(ids, SamplingParams(max_new_tokens=5, temperature=0.0))
    for params in (SamplingParams(max_new_tokens=5, top_k=1, seed=0), SamplingParams(max_new_tokens=5, top_p=1e-6, seed=0)):
        sampled = generator.generate(ids, params)
        assert [c[0].token_ids for c in sampled.completions] == [c[0].token_ids for c in greedy.completions]
        # The sampling distribution is a point mass: every sampled token has logprob 0.
        assert all(lp == pytest.approx(0.0, abs=1e-6) for c in sampled.completions for lp in c[0].logprobs)


def test_top_p_keeps_the_smallest_set_reaching_p_and_renormalizes():
    # Probabilities 0.5, 0.3, 0.2: top_p=0.6 keeps {0, 1} (0.5 alone is short of 0.6), renormalized by 0.8.
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]]).repeat(2000, 1)
    tokens, logprobs = sample_next_token(logits, SamplingParams(top_p=0.6), torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}
    expected = torch.tensor([math.log(0.5 / 0.8), math.log(0.3 / 0.8)])[tokens]
    assert torch.allclose(logprobs, expected, atol=1e-6)
    assert abs((tokens == 0).float().mean().item() - 0.625) < 0.05
    # top_k=2 keeps the same two tokens.
    tokens, logprobs = sample_next_token(logits, SamplingParams(top_k=2), torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1} and torch.allclose(logprobs, expected.new_tensor(
        [math.log(0.5 / 0.8), math.log(0.3 / 0.8)])[tokens], atol=1e-6)


def test_stop_strings_end_the_completion_and_are_kept(setup):
    _, _, ids, generator = setup
    free = generator.generate(ids[:1], SamplingParams(max_new_tokens=8, temperature=0.0)).completions[0][0]
    assert len(free.text) >= 3
    stop = free.text[1:3]
    stopped = generator.generate(ids[:1], SamplingParams(max_new_tokens=8, temperature=0.0, stop_strings=(stop,)))
    completion = stopped.completions[0][0]
    assert completion.finish_reason == "stop" and not completion.truncated
    assert completion.text.endswith(stop) and completion.text == free.text[: free.text.index(stop) + len(stop)]


def test_finish_reasons_and_lengths(setup):
    _, tokenizer, ids, generator = setup
    output = generator.generate(ids, SamplingParams(max_new_tokens=3, seed=1), num_samples=8)
    assert output.num_generated_tokens == sum(len(c.token_ids) for row in output.completions for c in row)
    for row in output.completions:
        assert len(row) == 8
        for completion in row:
            ends_with_eos = bool(completion.token_ids) and completion.token_ids[-1] == tokenizer.eos_token_id
            assert completion.finish_reason == ("stop" if ends_with_eos else "length")
            assert len(completion.token_ids) == 3 or ends_with_eos


def test_seeded_sampling_repeats_and_differs_across_seeds(setup):
    _, _, ids, generator = setup
    first = generator.generate(ids, SamplingParams(max_new_tokens=6, seed=11), num_samples=2)
    again = generator.generate(ids, SamplingParams(max_new_tokens=6, seed=11), num_samples=2)
    other = generator.generate(ids, SamplingParams(max_new_tokens=6, seed=12), num_samples=2)
    tokens = lambda out: [c.token_ids for row in out.completions for c in row]
    assert tokens(first) == tokens(again) and tokens(first) != tokens(other)


def test_per_prompt_seeds_sample_a_prompt_alike_whatever_shares_its_call(setup):
    """With `seeds`, sample j of prompt i draws from a stream of its own seeded seeds[i] + j: a prompt sampled in
    one batch with four others (left-padded to their width) or alone, first or last, gives the same samples."""
    model, tokenizer, ids, _ = setup
    batched = TransformersGenerator(model, tokenizer, batch_size=64)
    seeds = (101, 202, 303, 404, 505)
    params = lambda s: SamplingParams(max_new_tokens=6, seeds=s)
    together = batched.generate(ids, params(seeds), num_samples=3)
    assert len({len(p) for p in ids}) > 1  # the batch really pads
    for i, prompt in enumerate(ids):
        alone = batched.generate([prompt], params((seeds[i],)), num_samples=3)
        for mine, theirs in zip(alone.completions[0], together.completions[i], strict=True):
            assert mine.token_ids == theirs.token_ids
            assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
    backwards = batched.generate(ids[::-1], params(seeds[::-1]), num_samples=3)
    tokens = lambda out: [[c.token_ids for c in row] for row in out.completions]
    assert tokens(backwards)[::-1] == tokens(together)
    # vLLM's convention: sample j of a prompt seeded s is sample 0 of the prompt seeded s + j.
    shifted = batched.generate([ids[0]], params((seeds[0] + 2,)), num_samples=1)
    assert shifted.completions[0][0].token_ids == together.completions[0][2].token_ids
    other = batched.generate(ids, params(tuple(s + 1000 for s in seeds)), num_samples=3)
    assert tokens(other) != tokens(together)


def test_per_prompt_seeds_are_checked(setup):
    _, _, ids, generator = setup
    with pytest.raises(ValueError, match="2 seeds for 5 prompts"):
        generator.generate(ids, SamplingParams(max_new_tokens=2, seeds=(1, 2)))
    with pytest.raises(ValueError, match="seed or seeds"):
        SamplingParams(seed=1, seeds=(1,))


def test_per_row_draws_follow_the_distribution_and_never_pick_a_zero():
    """Inverse-CDF draws, one stream per row: frequencies match the probabilities, a zero-probability token
    (first, middle, last) never comes up, and all the mass on the last token always draws it."""
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    logits = probs.log().expand(4000, -1)
    streams = [torch.Generator().manual_seed(s) for s in range(4000)]
    tokens, logprobs = sample_next_token(logits, SamplingParams(temperature=1.0), streams)
    counts = torch.bincount(tokens, minlength=5)
    assert counts[[0, 2, 4]].tolist() == [0, 0, 0]
    assert counts[3].item() / 4000 == pytest.approx(0.75, abs=0.03)  # 4.4 standard deviations
    assert torch.allclose(logprobs, probs.log()[tokens])
    last = torch.tensor([-math.inf, -math.inf, 0.0]).expand(50, -1)
    tokens, _ = sample_next_token(last, SamplingParams(temperature=1.0), [torch.Generator().manual_seed(s) for s in range(50)])
    assert tokens.tolist() == [2] * 50


def test_per_row_draws_refuse_nan_or_massless_rows():
    """A NaN row (or one with every token at -inf) is an error naming the cause, never an index past the
    vocabulary."""
    streams = [torch.Generator().manual_seed(s) for s in range(2)]
    nan = torch.tensor([[0.0, 1.0, 2.0], [0.0, math.nan, 1.0]])
    with pytest.raises(FloatingPointError, match="NaN or no mass"):
        sample_next_token(nan, SamplingParams(temperature=1.0), streams)
    massless = torch.tensor([[0.0, 1.0, 2.0], [-math.inf, -math.inf, -math.inf]])
    with pytest.raises(FloatingPointError, match="NaN or no mass"):
        sample_next_token(massless, SamplingParams(temperature=1.0), streams)
