"""Loss values by hand, and the invariances the loss-normalization contract promises."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.algorithms.sft import accumulate_gradients
from posttrain.config.schema import TrainerConfig
from posttrain.data.collate import collate_packed, collate_padded, pack_rows
from posttrain.data.types import TokenizedExample
from posttrain.workers.forward import forward_logits
from posttrain.workers.local import LocalPolicyWorker
from posttrain.losses.nll import nll_loss, token_logprobs

from pickled_workers import PickledCalls


def test_nll_matches_hand_computation():
    # Vocabulary of 2, one sequence [0, 1, 1]. Logits at t=0 are (0, 0): p(1) = 1/2.
    # Logits at t=1 are (0, ln 3): p(1) = 3/4. The last position predicts nothing.
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)], [5.0, -5.0]]])
    input_ids = torch.tensor([[0, 1, 1]])
    expected_logprobs = torch.tensor([[0.0, math.log(0.5), math.log(0.75)]])
    assert torch.allclose(token_logprobs(logits, input_ids), expected_logprobs, atol=1e-6)
    # Only the last token is a target, and the step has 4 targets in total (others in other micro-batches):
    # loss = -ln(3/4) / 4.
    loss, metrics = nll_loss(logits, input_ids, torch.tensor([[0.0, 0.0, 1.0]]), num_target_tokens_in_step=4)
    assert loss.item() == pytest.approx(-math.log(0.75) / 4, abs=1e-7)
    assert metrics == {"nll_sum": pytest.approx(-math.log(0.75), abs=1e-6), "target_tokens": 1.0}


def _examples(seed: int = 0) -> list[TokenizedExample]:
    """Eight examples of very different lengths (3..40 tokens) and prompt lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 40, 7, 25, 12, 4, 33, 9]
    out = []
    for n in lengths:
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        prompt = max(1, n // 3)
        out.append(TokenizedExample(tuple(ids), tuple([0] * prompt + [1] * (n - prompt))))
    return out


def _grads_for_split(model, examples, micro_batch_size: int, packing: bool = False, pickled: bool = False):
    model.zero_grad(set_to_none=True)
    trainer = TrainerConfig(micro_batch_size=micro_batch_size, gradient_accumulation_steps=len(examples) // micro_batch_size)
    collate = (lambda ex: collate_packed(ex, 257, 64)) if packing else (lambda ex: collate_padded(ex, 257))
    micro_batches = [collate(examples[i : i + micro_batch_size]) for i in range(0, len(examples), micro_batch_size)]
    worker = LocalPolicyWorker(model, None, trainer)
    # pickled: every call's arguments and result cross pickle, as for a worker in another process
    loss, targets = accumulate_gradients(PickledCalls(worker, []) if pickled else worker, micro_batches)
    return loss, targets, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("pickled", [False, True], ids=["local", "pickled"])
@pytest.mark.parametrize("micro_batch_size", [1, 4])
def test_gradient_accumulation_invariance(tiny_model_dir, micro_batch_size, pickled):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    examples = _examples()
    full_loss, full_targets, full_grads = _grads_for_split(model, examples, 8)
    loss, targets, grads = _grads_for_split(model, examples, micro_batch_size, pickled=pickled)
    assert targets == full_targets
    assert loss == pytest.approx(full_loss, abs=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, full_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_per_micro_batch_averaging_would_differ(tiny_model_dir):
    """The check above can fail: averaging per micro-batch gives a different loss on these lengths."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    examples = _examples()
    full_loss, _, _ = _grads_for_split(model, examples, 8)
    per_micro = []
    with torch.no_grad():
        for e in examples:
            batch = collate_padded([e], 257)
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            per_micro.append(nll_loss(logits, batch.input_ids, batch.loss_mask, batch.num_target_tokens)[0].item())
    assert abs(sum(per_micro) / len(per_micro) - full_loss) > 1e-3


def test_packing_gives_the_same_per_token_losses(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    examples = _examples(seed=1)
    padded, packed = collate_padded(examples, 257), collate_packed(examples, 257, 64)
    assert packed.input_ids.shape[0] < padded.input_ids.shape[0]  # several examples share rows
    with torch.no_grad():
        padded_lp = token_logprobs(model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits,
                                   padded.input_ids)
        packed_lp = token_logprobs(forward_logits(model, packed), packed.input_ids)
    # Gather the target-token logprobs of each example in example order from both layouts.
    padded_targets = [padded_lp[i][padded.loss_mask[i] > 0] for i in range(len(examples))]
    rows = pack_rows([len(e) for e in examples], 64)
    packed_targets = [None] * len(examples)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            n = len(examples[i])
            segment_mask = packed.loss_mask[r, start : start + n] > 0
            packed_targets[i] = packed_lp[r, start : start + n][segment_mask]
            start += n
    for i in range(len(examples)):
        torch.testing.assert_close(packed_targets[i], padded_targets[i], atol=1e-5, rtol=1e-5)


def test_packing_without_position_resets_would_leak(tiny_model_dir):
    """Control: the same packed rows with plain positions let examples attend to each other."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    examples = _examples(seed=1)
    packed = collate_packed(examples, 257, 64)
    with torch.no_grad():
        separated = forward_logits(model, packed)
        # What transformers' own detection of packed position ids gives (see models/packing.py).
        leaking = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits
    mask = packed.loss_mask > 0
    assert (separated[mask] - leaking[mask]).abs().max() > 1e-3


def test_packed_gradients_equal_padded(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    examples = _examples(seed=2)
    loss_padded, _, grads_padded = _grads_for_split(model, examples, 4, packing=False)
    loss_packed, _, grads_packed = _grads_for_split(model, examples, 4, packing=True)
    assert loss_packed == pytest.approx(loss_padded, abs=1e-5)
    for name, grad in grads_packed.items():
        torch.testing.assert_close(grad, grads_padded[name], atol=1e-5, rtol=1e-4, msg=name)


def test_pack_rows_first_fit_decreasing():
    assert pack_rows([5, 3, 4, 2], 8) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="exceeds the packing length"):
        pack_rows([9], 8)
