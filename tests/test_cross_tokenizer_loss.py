"""The cross-tokenizer chunk loss (posttrain.losses.cross_tokenizer) against values worked out by hand: the chunk
term under the forward and reverse KL, an exact chunk whose teacher top-k has a token with no student match, ULD;
a same-tokenizer alignment gives distillation_loss itself (1e-6, loss and gradient, every outside-top-k mode); the
loss is invariant to splitting the step into micro-batches (with a control that a per-micro-batch mean is not)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.config.losses import DistillationLossConfig
from posttrain.losses.cross_tokenizer import chunk_sums, cross_tokenizer_loss
from posttrain.losses.distillation import distillation_loss

LN = math.log


def config(**overrides) -> DistillationLossConfig:
    return DistillationLossConfig(**overrides)


def loss_of(logits, input_ids, loss_mask, chunks, cfg, normalizer):
    """chunks: (row, start, end, teacher chunk log-probability, exact, top-k log-probabilities, top-k ids)."""
    row, start, end, ll, exact, values, ids = zip(*chunks)
    return cross_tokenizer_loss(logits, input_ids, loss_mask, torch.tensor(row), torch.tensor(start),
                                torch.tensor(end), torch.tensor(ll), torch.tensor(exact),
                                torch.tensor(values, dtype=torch.float32), torch.tensor(ids), cfg, normalizer)


# Two positions, vocabulary {0, 1}: position 0 gives q = (0.5, 0.5), position 1 gives q = (0.75, 0.25).
LOGITS = torch.tensor([[[0.0, 0.0], [LN(3.0), 0.0], [0.0, 0.0]]])
IDS = torch.tensor([[0, 1, 0]])  # targets: token 1 (q = 0.5 at position 0), token 0 (q = 0.75 at position 1)
MASK = torch.tensor([[0.0, 1.0, 1.0]])


def test_a_two_token_chunk_compares_the_chunk_likelihoods_as_two_outcome_distributions():
    # One chunk over both targets: ℓ_S = ln 0.5 + ln 0.75 = ln 0.375; the teacher's one token has ℓ_T = ln 0.9.
    chunk = [(0, 1, 3, LN(0.9), False, [LN(0.9)], [-1])]
    loss, metrics = loss_of(LOGITS, IDS, MASK, chunk, config(kl_type="forward"), normalizer=2.0)
    forward = 0.9 * LN(0.9 / 0.375) + 0.1 * LN(0.1 / 0.625)  # = 0.604664
    assert forward == pytest.approx(0.604664, abs=1e-6)
    assert loss.item() == pytest.approx(forward / 2, abs=1e-6)
    assert metrics["chunk_divergence_sum"].item() == pytest.approx(forward, abs=1e-6)
    assert metrics["logprob_gap_sum"].item() == pytest.approx(abs(LN(0.375) - LN(0.9)), abs=1e-6)
    assert (metrics["exact_chunks"].item(), metrics["other_chunks"].item()) == (0, 1)

    loss, _ = loss_of(LOGITS, IDS, MASK, chunk, config(kl_type="reverse"), normalizer=2.0)
    reverse = 0.375 * LN(0.375 / 0.9) + 0.625 * LN(0.625 / 0.1)  # = 0.817062
    assert loss.item() == pytest.approx(reverse / 2, abs=1e-6)
    # chunk_weight scales the term
    cfg = config(kl_type="forward", cross_tokenizer={"chunk_weight": 0.5})
    loss, _ = loss_of(LOGITS, IDS, MASK, chunk, cfg, normalizer=2.0)
    assert loss.item() == pytest.approx(0.5 * forward / 2, abs=1e-6)


def test_an_exact_chunk_drops_teacher_tokens_without_a_student_match():
    # Chunk = the second target alone (predicted at position 1, q = (0.75, 0.25)). The teacher's top-3 there has
    # p = 0.5, 0.3, 0.1, projected onto student ids 1, none, 0. Renormalized on the matched ones:
    # P = (5/6, 1/6) on ids (1, 0), Q = (0.25, 0.75): KL(P ‖ Q) = 5/6 ln(10/3) + 1/6 ln(2/9) = 0.752631.
    chunk = [(0, 2, 3, 0.0, True, [LN(0.5), LN(0.3), LN(0.1)], [1, -1, 0])]
    loss, metrics = loss_of(LOGITS, IDS, MASK, chunk, config(), normalizer=2.0)
    expected = 5 / 6 * LN(10 / 3) + 1 / 6 * LN(2 / 9)
    assert expected == pytest.approx(0.752631, abs=1e-6)
    assert loss.item() == pytest.approx(expected / 2, abs=1e-6)
    assert metrics["divergence_sum"].item() == pytest.approx(expected, abs=1e-6)
    # Control: without the -1 the teacher's 0.3 lands on student token 0 and the value changes.
    loss, _ = loss_of(LOGITS, IDS, MASK, [(0, 2, 3, 0.0, True, [LN(0.5), LN(0.3), LN(0.1)], [1, 0, 0])], config(),
                      normalizer=2.0)
    assert abs(loss.item() - expected / 2) > 1e-2


def test_uld_is_the_l1_distance_of_the_sorted_top_k_probabilities():
    # Student at position 0 over three tokens: q = (0.2, 0.5, 0.3); its top-2 sorted (0.5, 0.3). Teacher top-2
    # (0.6, 0.3). ULD = |0.6 − 0.5| + |0.3 − 0.3| = 0.1, whatever the tokens are.
    logits = torch.log(torch.tensor([[[0.2, 0.5, 0.3], [1.0, 1.0, 1.0]]]))
    ids, mask = torch.tensor([[0, 2]]), torch.tensor([[0.0, 1.0]])
    chunk = [(0, 1, 2, LN(0.3), False, [LN(0.6), LN(0.3)], [-1, -1])]
    cfg = config(cross_tokenizer={"unmatched": "uld", "chunk_weight": 0.0})
    loss, metrics = loss_of(logits, ids, mask, chunk, cfg, normalizer=1.0)
    assert loss.item() == pytest.approx(0.1, abs=1e-6)
    assert metrics["uld_sum"].item() == pytest.approx(0.1, abs=1e-6)
    # unmatched=ignore leaves only the chunk term: the student's ℓ_S = ln 0.3 equals ℓ_T, so the loss is 0.
    loss, _ = loss_of(logits, ids, mask, chunk, config(), normalizer=1.0)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)


def same_tokenizer_case(seed: int, rows: int = 3, length: int = 7, vocab: int = 11, k: int = 4):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, length, vocab, generator=generator, dtype=torch.float64).float().requires_grad_()
    input_ids = torch.randint(vocab, (rows, length), generator=generator)
    loss_mask = (torch.rand(rows, length, generator=generator) > 0.3).float()
    loss_mask[:, 0] = 0
    teacher = torch.log_softmax(torch.randn(rows, length, vocab, generator=generator) * 2, -1)
    top = teacher.topk(k, -1)
    return logits, input_ids, loss_mask, top.values, top.indices


def one_token_chunks(loss_mask, topk_values, topk_ids, teacher_logp_of_targets=None):
    """The chunks a same-tokenizer alignment gives: one per target, exact, the top-k at its predicting position."""
    rows, positions = loss_mask.nonzero(as_tuple=True)
    return (rows, positions, positions + 1, torch.zeros(len(rows)), torch.ones(len(rows), dtype=torch.bool),
            topk_values[rows, positions - 1], topk_ids[rows, positions - 1])


@pytest.mark.parametrize("overrides", [
    {}, {"kl_type": "reverse", "outside_topk": "zero_outside"}, {"jsd_beta": 0.3, "outside_topk": "tail"},
    {"kl_type": "mixed", "mixed_kl_weight": 0.2, "temperature": 2.0, "nll_weight": 0.5},
    {"kl_type": "reverse", "outside_topk": "tail", "cross_tokenizer": {"unmatched": "uld"}},
])
def test_a_same_tokenizer_alignment_gives_the_plain_distillation_loss(overrides):
    cfg = config(**overrides)
    logits, input_ids, loss_mask, values, ids = same_tokenizer_case(seed=1)
    plain, plain_metrics = distillation_loss(logits, values, ids, input_ids, loss_mask, cfg, normalizer=9.0)
    (plain_grad,) = torch.autograd.grad(plain, logits)
    crossed, metrics = cross_tokenizer_loss(logits, input_ids, loss_mask, *one_token_chunks(loss_mask, values, ids),
                                            cfg, normalizer=9.0)
    (crossed_grad,) = torch.autograd.grad(crossed, logits)
    assert crossed.item() == pytest.approx(plain.item(), abs=1e-6)
    assert torch.allclose(crossed_grad, plain_grad, atol=1e-6)
    assert metrics["divergence_sum"].item() == pytest.approx(plain_metrics["divergence_sum"].item(), abs=1e-5)
    assert metrics["target_tokens"].item() == plain_metrics["target_tokens"].item()


def test_chunk_sums_add_each_chunks_token_logprobs():
    token_logq = torch.arange(12, dtype=torch.float32).reshape(2, 6)  # row b, position s: 6b + s
    rows, starts, ends = torch.tensor([0, 1, 1]), torch.tensor([1, 2, 5]), torch.tensor([3, 5, 6])
    # tokens 1..2 of row 0 read positions 0, 1 -> 0 + 1; tokens 2..4 of row 1 read 7, 8, 9; token 5 reads 10
    assert chunk_sums(token_logq, rows, starts, ends).tolist() == [1.0, 24.0, 10.0]


def mixed_chunks_case(seed: int):
    """Rows with exact chunks, two-token chunks and one-token chunks that are not exact, split by row."""
    logits, input_ids, loss_mask, values, ids = same_tokenizer_case(seed, rows=4, length=8)
    loss_mask = torch.zeros_like(loss_mask)
    loss_mask[:, 2:] = 1
    chunks = []
    for row in range(4):
        spans = [(2, 4), (4, 5), (5, 6), (6, 8)] if row % 2 else [(2, 3), (3, 5), (5, 8)]
        for start, end in spans:
            exact = end - start == 1 and start != 5
            chunks.append((row, start, end, -0.3 * (end - start), exact, values[row, start - 1].tolist(),
                           ids[row, start - 1].tolist() if exact else [-1] * ids.shape[-1]))
    return logits, input_ids, loss_mask, chunks


def test_splitting_the_step_into_micro_batches_leaves_loss_and_gradient_unchanged():
    cfg = config(kl_type="mixed", cross_tokenizer={"unmatched": "uld"}, nll_weight=0.1)
    logits, input_ids, loss_mask, chunks = mixed_chunks_case(seed=2)
    normalizer = loss_mask[:, 1:].sum().item()
    whole, _ = loss_of(logits, input_ids, loss_mask, chunks, cfg, normalizer)
    (whole_grad,) = torch.autograd.grad(whole, logits)

    def part(rows, step_normalizer):
        picked = [(row - rows[0],) + chunk[1:] for chunk in chunks for row in [chunk[0]] if row in rows]
        sub = slice(rows[0], rows[-1] + 1)
        return loss_of(logits[sub], input_ids[sub], loss_mask[sub], picked, cfg,
                       step_normalizer or loss_mask[sub][:, 1:].sum().item())[0]

    split = part([0], normalizer) + part([1, 2, 3], normalizer)
    (split_grad,) = torch.autograd.grad(split, logits)
    assert split.item() == pytest.approx(whole.item(), abs=1e-6)
    assert torch.allclose(split_grad, whole_grad, atol=1e-7)
    # Control: each micro-batch divided by its own target count, then averaged, is another loss.
    per_micro_batch = (part([0], None) + part([1, 2, 3], None)) / 2
    assert abs(per_micro_batch.item() - whole.item()) > 1e-3
