"""The chunked LM-head log-probabilities against the full log_softmax: values and gradients, every chunking."""

import pytest
import torch

from posttrain.losses.chunked import chunked_token_logprobs


def full_logprobs(hidden, weight, bias, targets, temperature):
    logits = hidden @ weight.T + (0 if bias is None else bias)
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def inputs(dtype=torch.float32, n=(3, 7), hidden_size=16, vocab=53, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*n, hidden_size, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(vocab, generator=g, dtype=dtype, requires_grad=True) if bias else None
    targets = torch.randint(0, vocab, n, generator=g)
    return hidden, weight, b, targets


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 21, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_match_the_full_computation(chunk_size, temperature, bias):
    hidden, weight, b, targets = inputs(bias=bias)
    upstream = torch.randn(targets.shape, generator=torch.Generator().manual_seed(1))
    params = [hidden, weight] + ([b] if bias else [])

    expected = full_logprobs(hidden, weight, b, targets, temperature)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), params)
    got = chunked_token_logprobs(hidden, weight, targets, bias=b, temperature=temperature, chunk_size=chunk_size)
    got_grads = torch.autograd.grad((got * upstream).sum(), params)

    assert got.shape == targets.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_gradcheck_in_float64():
    hidden, weight, b, targets = inputs(torch.float64, n=(5,), hidden_size=4, vocab=7)
    assert torch.autograd.gradcheck(
        lambda h, w, bb: chunked_token_logprobs(h, w, targets, bias=bb, temperature=0.8, chunk_size=2),
        (hidden, weight, b))


def test_bfloat16_inputs_are_scored_in_float32():
    hidden, weight, _, targets = inputs(bias=False)
    got = chunked_token_logprobs(hidden.detach().bfloat16(), weight.detach().bfloat16(), targets, chunk_size=4)
    expected = full_logprobs(hidden.detach().bfloat16().float(), weight.detach().bfloat16().float(), None, targets, 1.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_the_right_one():
    hidden, weight, _, targets = inputs(bias=False)
    frozen = weight.detach()
    chunked_token_logprobs(hidden, frozen, targets, chunk_size=4).sum().backward()
    got = hidden.grad.clone()
    hidden.grad = None
    full_logprobs(hidden, frozen, None, targets, 1.0).sum().backward()
    assert frozen.grad is None
    torch.testing.assert_close(got, hidden.grad, rtol=1e-5, atol=1e-5)


def test_float32_under_bf16_autocast():
    hidden, weight, _, targets = inputs(bias=False)
    expected = full_logprobs(hidden.detach(), weight.detach(), None, targets, 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_token_logprobs(hidden.detach(), weight.detach(), targets, chunk_size=4)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    ({"targets": torch.zeros(2, dtype=torch.long)}, "disagree on the positions"),
    ({"weight": torch.zeros(5, 3)}, "weight must be"),
    ({"chunk_size": 0}, "chunk_size must be at least 1"),
    ({"temperature": 0.0}, "temperature must be positive"),
])
def test_bad_arguments_are_clear_errors(kwargs, message):
    args = {"hidden": torch.zeros(3, 4), "weight": torch.zeros(5, 4), "targets": torch.zeros(3, dtype=torch.long),
            **kwargs}
    with pytest.raises(ValueError, match=message):
        chunked_token_logprobs(args.pop("hidden"), args.pop("weight"), args.pop("targets"), **args)
