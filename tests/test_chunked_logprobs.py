"""The chunked LM-head log-probabilities against the full log_softmax: values and gradients, every chunking."""

from dataclasses import dataclass, replace

import pytest
import torch

from posttrain.data.types import PairBatch
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


# ---- the chunked LM head in the workers (SFT's target log-probabilities) ----------------------------------------


def _sft_batches(tokenizer):
    from posttrain.data.collate import collate_packed, collate_padded
    from posttrain.data.types import TokenizedExample

    # Rows of very different lengths, prompts (mask 0) before the targets: padded rows and one packed row.
    rows = [TokenizedExample(tuple(range(3, 3 + n)), (0,) * p + (1,) * (n - p)) for n, p in ((5, 2), (19, 7), (11, 1))]
    return {"padded": collate_padded(rows, tokenizer.pad_token_id), "packed": collate_packed(rows, tokenizer.pad_token_id, 64)}


def _workers(model_dir, shared=None, **trainer):
    """(tokenizer, a policy with the full LM head, one with the chunked head and `trainer`), both with `shared`."""
    from posttrain.config.schema import LoraSection, ModelConfig, TrainerConfig
    from posttrain.models.loading import load_tokenizer
    from posttrain.workers.local import build_policy

    cfg = ModelConfig(name_or_path=str(model_dir))
    tokenizer = load_tokenizer(cfg)
    torch.manual_seed(0)
    build = lambda **kw: build_policy(cfg, LoraSection(), TrainerConfig(**kw), tokenizer, torch.device("cpu"))  # noqa: E731
    shared = shared or {}
    return tokenizer, build(lm_head="full", **shared), build(lm_head="chunked", **shared, **trainer)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_chunked_head_gives_the_full_heads_loss_and_gradients(tiny_model_dir, layout):
    from posttrain.workers.objectives import NLLObjective

    tokenizer, full, chunked = _workers(tiny_model_dir, lm_head_chunk_size=7)  # 7 divides no row's target count
    batch = _sft_batches(tokenizer)[layout]
    head_outputs = []
    chunked.model.get_output_embeddings().register_forward_hook(
        lambda module, args, output: head_outputs.append(output.shape[-1]))
    results = []
    for worker in (full, chunked):
        metrics = worker.forward_backward([batch], NLLObjective())
        grads = {name: p.grad.clone() for name, p in worker.model.named_parameters()}
        results.append((metrics["loss"].value, metrics["nll_sum"].value, grads))
    (loss_full, sum_full, grads_full), (loss_chunked, sum_chunked, grads_chunked) = results
    # In the chunked pass the head module multiplied nothing: what it returned was the hidden states, not logits.
    assert head_outputs == [chunked.model.config.hidden_size]
    assert loss_chunked == pytest.approx(loss_full, rel=1e-6) and sum_chunked == pytest.approx(sum_full, rel=1e-6)
    assert loss_full > 1.0  # an untrained model: a real loss, not a degenerate zero
    for name, grad in grads_full.items():
        torch.testing.assert_close(grads_chunked[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # The same per-token values, zero off the targets.
    with torch.no_grad():
        chunked_logps = chunked._outputs(batch, "target_logprobs")
        full_logps = full._outputs(batch, "target_logprobs") * batch.loss_mask
    torch.testing.assert_close(chunked_logps, full_logps, rtol=1e-5, atol=1e-6)
    assert torch.all(chunked_logps[batch.loss_mask == 0] == 0)


def _pairs():
    from posttrain.data.types import PreferenceExample

    # Prompts and completions of different lengths; the second pair's rejected reply is one token long.
    return [PreferenceExample((5, 6, 7), (8, 9, 10, 2), (11, 2)), PreferenceExample((5, 12), (13, 2), (14,)),
            PreferenceExample((5, 6, 7, 15, 16, 17), (18, 19, 20, 21, 22, 2), (23, 24, 2))]


@dataclass(frozen=True)
class _WeighedPairLoss:
    """A pair loss that weighs chosen and rejected tokens differently: -(chosen + 2·rejected) over the step's pairs."""

    outputs: str = "target_logprobs"
    temperature: float = 1.0

    def normalizer(self, micro_batches) -> float:
        return sum(batch.num_pairs for batch in micro_batches)

    def __call__(self, target_logps, batch, normalizer):
        from posttrain.algorithms.dpo import completion_logps

        scores = completion_logps(target_logps, batch.rows, average=False)
        return -(scores.chosen + 2 * scores.rejected).sum() / normalizer, {}


@pytest.mark.parametrize("layout", ["shared_prompt", "two_rows"])
def test_the_chunked_head_gives_the_full_heads_preference_loss_and_gradients(tiny_model_dir, layout):
    from posttrain.algorithms.dpo import completion_logps
    from posttrain.data.preference import collate_preference, collate_shared_prompt

    tokenizer, full, chunked = _workers(tiny_model_dir, lm_head_chunk_size=4)
    collate = collate_shared_prompt if layout == "shared_prompt" else collate_preference
    batch = collate(_pairs(), tokenizer.pad_token_id)

    results = []
    for worker in (full, chunked):
        metrics = worker.forward_backward([PairBatch(batch)], _WeighedPairLoss())
        results.append((metrics["loss"].value, {name: p.grad.clone() for name, p in worker.model.named_parameters()},
                        completion_logps(worker.logprobs(batch), batch, average=False)))
    (loss_full, grads_full, scores_full), (loss_chunked, grads_chunked, scores_chunked) = results
    assert abs(loss_full) > 1.0 and loss_chunked == pytest.approx(loss_full, rel=1e-6)
    for name, grad in grads_full.items():  # gradients up to ~5 in size: fp32 rounding is ~1e-6 of them
        torch.testing.assert_close(grads_chunked[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    # A frozen pass (a reference's) scores every completion alike, the first rejected token of a shared-prompt row
    # (predicted from the prompt's last position) included.
    torch.testing.assert_close(scores_chunked.chosen, scores_full.chosen, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores_chunked.rejected, scores_full.rejected, rtol=1e-5, atol=1e-5)


def _rollouts():
    from posttrain.data.types import RolloutBatch

    # Three episodes of different lengths, right-padded; the third is masked (a filtered episode) but real.
    ids = torch.tensor([[5, 6, 7, 8, 9, 2, 0], [5, 6, 10, 11, 12, 13, 2], [5, 14, 15, 2, 0, 0, 0]])
    attention = (torch.arange(7) < torch.tensor([[6], [7], [4]])).long()
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]]).float()
    return RolloutBatch(ids, attention, loss_mask, torch.zeros(3, 7), torch.tensor([1.0, 0.0, 1.0]), {},
                        torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.long),
                        torch.zeros(3, dtype=torch.bool), loss_mask.sum(-1).long())


def test_the_chunked_head_gives_the_full_heads_policy_loss_entropy_and_logprobs(tiny_model_dir):
    from posttrain.losses.policy_gradient import PolicyLossConfig
    from posttrain.workers.objectives import PolicyGradientObjective

    _, full, chunked = _workers(tiny_model_dir, lm_head_chunk_size=3)
    batch, temperature = _rollouts(), 0.7
    old = full.logprobs(batch, temperature)
    torch.testing.assert_close(chunked.logprobs(batch, temperature) * batch.loss_mask, old * batch.loss_mask,
                               rtol=1e-5, atol=1e-6)
    # Off-policy by a little, so the ratio and its clipping are exercised, not just 1.
    batch = replace(batch, advantages=torch.tensor([1.0, -0.5, 2.0]), old_logprobs=old + 0.05 * batch.loss_mask)
    objective = PolicyGradientObjective(PolicyLossConfig(), temperature=temperature)
    results = []
    for worker in (full, chunked):
        metrics = worker.forward_backward(batch, objective)
        results.append(({k: m.value for k, m in metrics.items()},
                        {name: p.grad.clone() for name, p in worker.model.named_parameters()}))
    (metrics_full, grads_full), (metrics_chunked, grads_chunked) = results
    assert metrics_full["entropy"] > 1.0  # an untrained model's distributions: far from one-hot
    for key, value in metrics_full.items():
        assert metrics_chunked[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name, grad in grads_full.items():
        torch.testing.assert_close(grads_chunked[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_auto_chunks_only_large_logits_on_a_plain_head():
    from posttrain.data.types import SFTBatch
    from posttrain.workers.forward import AUTO_CHUNKED_HEAD_BYTES, uses_chunked_head

    small = SFTBatch.__new__(SFTBatch)  # only the shape is read
    object.__setattr__(small, "input_ids", torch.zeros(64, 32, dtype=torch.long))  # the arithmetic presets' shape
    large = SFTBatch.__new__(SFTBatch)
    object.__setattr__(large, "input_ids", torch.zeros(4, 1024, dtype=torch.long))
    assert not uses_chunked_head("auto", small, 260, None)  # 2 MiB of logits: the embedded recipes stay as they were
    assert 4 * 1024 * 151_936 * 4 >= AUTO_CHUNKED_HEAD_BYTES and uses_chunked_head("auto", large, 151_936, None)
    assert not uses_chunked_head("auto", large, 151_936, "soft-capped logits")  # never an inexact head
    assert not uses_chunked_head("full", large, 151_936, None) and uses_chunked_head("chunked", small, 260, None)
    # A rollout piece of one row decides as the micro-batch it is cut from (rows=4), not as one row.
    piece = SFTBatch.__new__(SFTBatch)
    object.__setattr__(piece, "input_ids", torch.zeros(1, 256, dtype=torch.long))
    assert not uses_chunked_head("auto", piece, 151_936, None) and uses_chunked_head("auto", piece, 151_936, None, 4)


def test_chunked_head_on_an_architecture_it_would_not_match_is_refused(tmp_path):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from posttrain.config.schema import TrainerConfig
    from posttrain.errors import RunError
    from posttrain.workers.local import LocalPolicyWorker

    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              final_logit_softcapping=30.0)
    model = Gemma3ForCausalLM(config)
    with pytest.raises(RunError, match="trainer.lm_head=chunked: .*gemma3_text"):
        LocalPolicyWorker(model, None, TrainerConfig(lm_head="chunked"))
    LocalPolicyWorker(model, None, TrainerConfig(lm_head="auto"))  # auto keeps its full, exact head


def test_dpo_and_grpo_train_alike_with_the_chunked_head(tmp_path, tiny_model_dir):
    # The recipes hand their losses the chunked head's outputs (forced here on the tiny model, which auto leaves
    # on the full head): the same losses step by step, to float32 rounding.
    from posttrain.algorithms.dpo import train_dpo
    from posttrain.algorithms.grpo import train_grpo
    from posttrain.config import DPOConfig, load_config
    from posttrain.config.schema import GRPOConfig
    from posttrain.logging import read_metrics
    from rl_configs import DIGITS, TINY_RL
    from test_dpo import BASE

    def records(directory, key):
        return [r[key] for r in read_metrics(directory / "metrics.jsonl") if key in r]

    for head in ("full", "chunked"):
        train_dpo(load_config(DPOConfig, None, [*BASE, f"output_dir={tmp_path / 'dpo' / head}", "trainer.max_steps=4",
                                                f"trainer.lm_head={head}", "trainer.lm_head_chunk_size=5"]))
        train_grpo(load_config(GRPOConfig, None, [*TINY_RL, *DIGITS, f"output_dir={tmp_path / 'grpo' / head}",
                                                  "trainer.max_steps=3", f"trainer.lm_head={head}",
                                                  "trainer.lm_head_chunk_size=5", "rollout.temperature=0.8"]))
    dpo = {head: records(tmp_path / "dpo" / head, "loss") for head in ("full", "chunked")}
    assert len(dpo["full"]) == 4 and dpo["chunked"] == pytest.approx(dpo["full"], abs=1e-5)
    for key in ("reward/mean", "loss", "entropy", "grad_norm"):
        full, chunked = (records(tmp_path / "grpo" / head, key) for head in ("full", "chunked"))
        assert len(full) == 3 and chunked == pytest.approx(full, rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize("head", ["full", "chunked"])
def test_the_training_pass_scores_at_the_sampling_temperature(tiny_model_dir, head):
    # The GRPO/PPO update hands the worker rollout.temperature: against old log-probabilities computed at that
    # temperature the ratio is 1 to float32 rounding; at temperature 1 it would be far from 1.
    from posttrain.losses.policy_gradient import PolicyLossConfig
    from posttrain.workers.objectives import PolicyGradientObjective

    # Two rows per micro-batch: the three episodes train as two micro-batches.
    _, full, chunked = _workers(tiny_model_dir, {"micro_batch_size": 2}, lm_head_chunk_size=3)
    policy = full if head == "full" else chunked
    batch = replace(_rollouts(), advantages=torch.tensor([1.0, -0.5, 2.0]))
    # The recipes' loss, sampled at 0.7: its temperature is the one the worker's training pass scores under.
    loss = PolicyGradientObjective(PolicyLossConfig(), temperature=0.7)
    ratios = {}
    for temperature in (0.7, 1.0):
        old = policy.logprobs(batch, temperature)
        stats = policy.forward_backward(replace(batch, old_logprobs=old), loss)
        ratios[temperature] = (stats["ratio_min"].value, stats["ratio_max"].value)
        policy.optimizer.zero_grad(set_to_none=True)
    assert ratios[0.7] == pytest.approx((1.0, 1.0), abs=1e-5)
    assert max(abs(r - 1.0) for r in ratios[1.0]) > 1e-2
