"""The top-k distillation loss (posttrain.losses.distillation) against values worked out by hand on small
distributions, for every divergence, several GKD β, a temperature and every outside-top-k mode; micro-batch split
invariance under the step normalizer, with a control that shows the invariance check can fail; the config's
cross-field checks.

The hand cases share one position: the teacher's full distribution over 4 tokens is p = (0.5, 0.3, 0.15, 0.05), its
top-2 are tokens 0 and 1; the student's is q = (0.4, 0.2, 0.2, 0.2).
    renormalize:  P = (0.5/0.8, 0.3/0.8) = (0.625, 0.375),  Q = (0.4/0.6, 0.2/0.6) = (2/3, 1/3)
    tail:         P = (0.5, 0.3, 0.2),                       Q = (0.4, 0.2, 0.4)
    zero_outside: P = (0.5, 0.3, 0, 0),                      Q = (0.4, 0.2, 0.2, 0.2)
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from posttrain.config.losses import DistillationLossConfig
from posttrain.losses.distillation import distillation_loss

TEACHER = (0.5, 0.3, 0.15, 0.05)
STUDENT = (0.4, 0.2, 0.2, 0.2)
ln = math.log


def one_position(config: DistillationLossConfig, teacher=TEACHER, student=STUDENT, temperature_probs=None):
    """The loss at one target position: row (token 2, token 0), the second token the target, predicted from
    position 0. `temperature_probs`: the teacher's top-2 probabilities as given (already at the temperature)."""
    top = temperature_probs or teacher[:2]
    logits = torch.tensor([[[ln(x) for x in student], [0.0] * 4]])
    teacher_logp = torch.tensor([[[ln(x) for x in top], [0.0, 0.0]]])
    ids = torch.tensor([[[0, 1], [0, 1]]])
    input_ids = torch.tensor([[2, 0]])
    loss_mask = torch.tensor([[0.0, 1.0]])
    loss, metrics = distillation_loss(logits, teacher_logp, ids, input_ids, loss_mask, config, normalizer=1.0)
    return loss.item(), metrics


def config(**knobs) -> DistillationLossConfig:
    return DistillationLossConfig(**knobs)


# ---- renormalize: P = (0.625, 0.375), Q = (2/3, 1/3) -------------------------------------------------------

RENORM_FORWARD = 0.625 * ln(0.625 / (2 / 3)) + 0.375 * ln(0.375 / (1 / 3))
RENORM_REVERSE = (2 / 3) * ln((2 / 3) / 0.625) + (1 / 3) * ln((1 / 3) / 0.375)


def renorm_jsd(beta: float) -> float:
    m0, m1 = beta * 0.625 + (1 - beta) * 2 / 3, beta * 0.375 + (1 - beta) / 3
    return (beta * (0.625 * ln(0.625 / m0) + 0.375 * ln(0.375 / m1))
            + (1 - beta) * ((2 / 3) * ln((2 / 3) / m0) + (1 / 3) * ln((1 / 3) / m1)))


def test_renormalize_forward_and_reverse_kl():
    assert one_position(config(kl_type="forward"))[0] == pytest.approx(RENORM_FORWARD, rel=1e-5, abs=2e-7)  # 0.0038320
    assert one_position(config(kl_type="reverse"))[0] == pytest.approx(RENORM_REVERSE, rel=1e-5, abs=2e-7)


def test_renormalize_mixed_weights_the_forward_kl():
    assert one_position(config(kl_type="mixed", mixed_kl_weight=0.3))[0] == pytest.approx(
        0.3 * RENORM_FORWARD + 0.7 * RENORM_REVERSE, rel=1e-5, abs=2e-7)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_renormalize_generalized_jsd(beta):
    # beta = 0.5: M = (0.645833, 0.354167)
    assert one_position(config(jsd_beta=beta))[0] == pytest.approx(renorm_jsd(beta), rel=1e-5, abs=2e-7)


def test_jsd_beta_ends_are_the_forward_and_reverse_kl_as_in_trl():
    assert one_position(config(jsd_beta=0.0))[0] == pytest.approx(RENORM_FORWARD, rel=1e-5, abs=2e-7)
    assert one_position(config(jsd_beta=1.0))[0] == pytest.approx(RENORM_REVERSE, rel=1e-5, abs=2e-7)


def test_temperature_divides_the_student_logits():
    # At τ = 2 the student's distribution is ∝ sqrt(q): on tokens {0, 1}, Q = (√.4, √.2) / (√.4 + √.2).
    # The teacher's top-2 are given at τ = 2 too: ∝ sqrt(p), normalized over all 4 tokens by S = Σ √p.
    s = sum(math.sqrt(x) for x in TEACHER)
    teacher_at_2 = (math.sqrt(0.5) / s, math.sqrt(0.3) / s)
    p0 = math.sqrt(0.5) / (math.sqrt(0.5) + math.sqrt(0.3))  # 0.563508
    q0 = math.sqrt(0.4) / (math.sqrt(0.4) + math.sqrt(0.2))  # 0.585786
    expected = p0 * ln(p0 / q0) + (1 - p0) * ln((1 - p0) / (1 - q0))
    value = one_position(config(temperature=2.0), temperature_probs=teacher_at_2)[0]
    assert value == pytest.approx(expected, rel=1e-5, abs=2e-7)
    assert value != pytest.approx(RENORM_FORWARD, rel=1e-2)  # the temperature changed something


# ---- tail: P = (0.5, 0.3, 0.2), Q = (0.4, 0.2, 0.4) --------------------------------------------------------

TAIL_FORWARD = 0.5 * ln(0.5 / 0.4) + 0.3 * ln(0.3 / 0.2) + 0.2 * ln(0.2 / 0.4)
TAIL_REVERSE = 0.4 * ln(0.4 / 0.5) + 0.2 * ln(0.2 / 0.3) + 0.4 * ln(0.4 / 0.2)


def test_tail_bucket_holds_the_rest_of_each_sides_mass():
    assert one_position(config(outside_topk="tail"))[0] == pytest.approx(TAIL_FORWARD, rel=1e-5, abs=2e-7)
    assert one_position(config(outside_topk="tail", kl_type="reverse"))[0] == pytest.approx(TAIL_REVERSE, rel=1e-5, abs=2e-7)
    m = (0.45, 0.25, 0.3)  # β = 0.5: M = (P + Q) / 2
    expected = (0.5 * (0.5 * ln(0.5 / m[0]) + 0.3 * ln(0.3 / m[1]) + 0.2 * ln(0.2 / m[2]))
                + 0.5 * (0.4 * ln(0.4 / m[0]) + 0.2 * ln(0.2 / m[1]) + 0.4 * ln(0.4 / m[2])))
    assert one_position(config(outside_topk="tail", jsd_beta=0.5))[0] == pytest.approx(expected, rel=1e-5, abs=2e-7)


# ---- zero_outside: P = (0.5, 0.3, 0, 0), Q = (0.4, 0.2, 0.2, 0.2) ------------------------------------------

ZERO_FORWARD = 0.5 * ln(0.5 / 0.4) + 0.3 * ln(0.3 / 0.2)  # P is 0 outside the top-k: nothing more
# reverse: Σ_K q log(q/p) + NeMo-RL's correction Σ_rest q (log q − log ε), log ε = −100: 2 × 0.2 (ln 0.2 + 100)
ZERO_REVERSE = 0.4 * ln(0.4 / 0.5) + 0.2 * ln(0.2 / 0.3) + 2 * 0.2 * (ln(0.2) + 100)


def test_zero_outside_forward_and_reverse_with_nemo_rl_correction():
    assert one_position(config(outside_topk="zero_outside"))[0] == pytest.approx(ZERO_FORWARD, rel=1e-5, abs=2e-7)
    assert one_position(config(outside_topk="zero_outside", kl_type="reverse"))[0] == pytest.approx(
        ZERO_REVERSE, rel=1e-5, abs=2e-7)  # 39.51...
    assert one_position(config(outside_topk="zero_outside", kl_type="mixed", mixed_kl_weight=0.25))[0] == (
        pytest.approx(0.25 * ZERO_FORWARD + 0.75 * ZERO_REVERSE, rel=1e-5, abs=2e-7))


@pytest.mark.parametrize("beta", [0.2, 0.5])
def test_zero_outside_jsd_counts_the_students_mass_outside_exactly(beta):
    # On K: M = β P + (1 − β) Q. Outside: P = 0, M = (1 − β) q, so only (1 − β) Σ_rest q ln(1 / (1 − β)) remains.
    m = [beta * p + (1 - beta) * q for p, q in zip((0.5, 0.3), (0.4, 0.2))]
    on_k = (beta * (0.5 * ln(0.5 / m[0]) + 0.3 * ln(0.3 / m[1]))
            + (1 - beta) * (0.4 * ln(0.4 / m[0]) + 0.2 * ln(0.2 / m[1])))
    expected = on_k + (1 - beta) * 0.4 * ln(1 / (1 - beta))
    assert one_position(config(outside_topk="zero_outside", jsd_beta=beta))[0] == pytest.approx(expected, rel=1e-5, abs=2e-7)


# ---- the NLL term, metrics, student == teacher ---------------------------------------------------------------

def test_nll_term_adds_the_data_tokens_nll_at_temperature_one():
    # the target is token 0, q_0 = 0.4 (temperature 2 changes the divergence's distributions, not the NLL's)
    with_nll = one_position(config(nll_weight=0.5))[0]
    assert with_nll == pytest.approx(RENORM_FORWARD + 0.5 * -ln(0.4), rel=1e-5, abs=2e-7)
    _, metrics = one_position(config(nll_weight=0.5))
    assert metrics["nll_sum"].item() == pytest.approx(-ln(0.4), rel=1e-5, abs=2e-7)
    assert metrics["teacher_topk_mass_sum"].item() == pytest.approx(0.8, rel=1e-5, abs=2e-7)
    assert metrics["student_topk_mass_sum"].item() == pytest.approx(0.6, rel=1e-5, abs=2e-7)
    assert metrics["top1_agreement_sum"].item() == 1.0 and metrics["target_tokens"].item() == 1.0


@pytest.mark.parametrize("outside", ["renormalize", "tail"])
@pytest.mark.parametrize("divergence", [{"kl_type": "forward"}, {"kl_type": "reverse"}, {"jsd_beta": 0.5}])
def test_a_student_equal_to_the_teacher_has_zero_divergence(outside, divergence):
    assert one_position(config(outside_topk=outside, **divergence), student=TEACHER)[0] == pytest.approx(0, abs=1e-6)


def test_control_the_hand_values_tell_the_forms_apart():
    """The hand-derived checks can fail: each form's value is far from the others'."""
    values = [RENORM_FORWARD, RENORM_REVERSE, TAIL_FORWARD, TAIL_REVERSE, ZERO_FORWARD, renorm_jsd(0.5)]
    for i, a in enumerate(values):
        for b in values[i + 1:]:
            assert a != pytest.approx(b, rel=1e-3)
    assert one_position(config(kl_type="reverse"))[0] != pytest.approx(RENORM_FORWARD, rel=1e-3)


# ---- micro-batch split invariance --------------------------------------------------------------------------

def random_batch(seed: int = 0, rows: int = 4, length: int = 7, vocab: int = 11, k: int = 3):
    generator = torch.Generator().manual_seed(seed)
    teacher_logits = torch.randn(rows, length, vocab, generator=generator) * 2
    top = torch.log_softmax(teacher_logits, -1).topk(k, dim=-1)
    student_logits = torch.randn(rows, length, vocab, generator=generator)
    input_ids = torch.randint(0, vocab, (rows, length), generator=generator)
    loss_mask = torch.zeros(rows, length)
    for row, start in enumerate((2, 1, 5, 3)):  # different completion lengths per row
        loss_mask[row, start:] = 1.0
    return student_logits, top.values, top.indices, input_ids, loss_mask


@pytest.mark.parametrize("knobs", [{"kl_type": "forward"}, {"kl_type": "reverse", "outside_topk": "zero_outside"},
                                   {"jsd_beta": 0.3, "outside_topk": "tail", "nll_weight": 0.5}])
def test_micro_batch_split_with_the_step_normalizer_gives_the_same_loss_and_gradient(knobs):
    cfg = config(**knobs)
    logits, values, ids, input_ids, mask = random_batch()
    normalizer = float(mask[:, 1:].sum())

    whole = logits.clone().requires_grad_(True)
    loss, _ = distillation_loss(whole, values, ids, input_ids, mask, cfg, normalizer)
    loss.backward()

    split = logits.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4)):
        part, _ = distillation_loss(split[rows], values[rows], ids[rows], input_ids[rows], mask[rows], cfg, normalizer)
        part.backward()
        total += part.item()
    assert total == pytest.approx(loss.item(), rel=1e-5, abs=2e-7)
    torch.testing.assert_close(split.grad, whole.grad, rtol=1e-5, atol=1e-7)


def test_control_a_per_micro_batch_mean_breaks_the_invariance():
    """The invariance check can fail: averaging each micro-batch over its own tokens, then over micro-batches,
    weights the short micro-batch's tokens more (the TRL #3021 pitfall)."""
    cfg = config()
    logits, values, ids, input_ids, mask = random_batch()
    loss, _ = distillation_loss(logits, values, ids, input_ids, mask, cfg, float(mask[:, 1:].sum()))
    per_micro_batch = [distillation_loss(logits[r], values[r], ids[r], input_ids[r], mask[r], cfg,
                                         float(mask[r][:, 1:].sum()))[0].item() for r in (slice(0, 1), slice(1, 4))]
    assert sum(per_micro_batch) / 2 != pytest.approx(loss.item(), rel=1e-3)


# ---- config ------------------------------------------------------------------------------------------------

def test_config_refuses_two_choices_of_divergence_and_stray_weights():
    with pytest.raises(ValidationError, match="jsd_beta"):
        DistillationLossConfig(kl_type="reverse", jsd_beta=0.5)
    with pytest.raises(ValidationError, match="mixed_kl_weight"):
        DistillationLossConfig(kl_type="forward", mixed_kl_weight=0.2)
    with pytest.raises(ValidationError, match="boolean"):
        DistillationLossConfig(topk=True)
    with pytest.raises(ValidationError):
        DistillationLossConfig(outside_topk="drop")
    assert DistillationLossConfig(jsd_beta=0.0).divergence == "forward"
    assert DistillationLossConfig(jsd_beta=0.4).divergence == "jsd"
    assert DistillationLossConfig(kl_type="mixed", mixed_kl_weight=0.2).divergence == "mixed"
