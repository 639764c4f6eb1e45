"""Preference and reward-model losses against values derived by hand, their limits, and invariances."""

import math
import typing

import pytest
import torch

from posttrain.losses.preference import (
    PreferenceLossConfig,
    PreferenceLossType,
    _VARIANTS,
    preference_loss,
    sequence_logps,
)
from posttrain.losses.reward_model import bradley_terry_loss

LN2, LN3 = math.log(2.0), math.log(3.0)
ALL_TYPES = typing.get_args(PreferenceLossType)


def loss_config(loss_type: str, **knobs) -> PreferenceLossConfig:
    """The config of `loss_type` with its defaults; rdpo with α = 0.1 (α = 0, plain DPO, is refused at load)."""
    return PreferenceLossConfig(type=loss_type, **({"rdpo_alpha": 0.1} if loss_type == "rdpo" else {}), **knobs)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _random_batch(n: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """Summed logps of plausible size and integer lengths, every input every variant might want."""
    g = torch.Generator().manual_seed(seed)
    chosen_lengths = torch.randint(3, 30, (n,), generator=g)
    rejected_lengths = torch.randint(3, 30, (n,), generator=g)
    return {
        "policy_chosen_logps": -torch.rand(n, generator=g, dtype=torch.float64) * chosen_lengths,
        "policy_rejected_logps": -torch.rand(n, generator=g, dtype=torch.float64) * rejected_lengths,
        "reference_chosen_logps": -torch.rand(n, generator=g, dtype=torch.float64) * chosen_lengths,
        "reference_rejected_logps": -torch.rand(n, generator=g, dtype=torch.float64) * rejected_lengths,
        "chosen_lengths": chosen_lengths,
        "rejected_lengths": rejected_lengths,
    }


def test_every_literal_type_has_a_variant():
    assert set(ALL_TYPES) == set(_VARIANTS)


def test_sequence_logps_sums_or_averages_masked_tokens():
    token_logps = t(-1.0, -2.0, -3.0, -4.0).view(1, 4).repeat(2, 1)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 1]])
    # Row 0: -2 - 3 = -5 over 2 tokens (mean -2.5); row 1: -4 over 1 token.
    assert torch.equal(sequence_logps(token_logps, mask, average=False), t(-5.0, -4.0))
    assert torch.equal(sequence_logps(token_logps, mask, average=True), t(-2.5, -4.0))


# ---- DPO ------------------------------------------------------------------------------------------------


def test_dpo_by_hand():
    # beta = 0.5. Pair 0: chosen log-ratio +ln 3, rejected log-ratio -ln 3, so h = 2 ln 3 and
    # beta*h = ln 3: sigma(ln 3) = 3/4, loss = ln(4/3). Rewards 0.5 ln 3 and -0.5 ln 3.
    # Pair 1: every logp equal, h = 0: loss = -ln sigma(0) = ln 2, both rewards 0 (a tie, not accurate).
    cfg = PreferenceLossConfig(type="dpo", beta=0.5)
    loss, metrics = preference_loss(
        cfg, t(-1.0, -2.0), t(-5.0 - LN3, -2.0), t(-1.0 - LN3, -2.0), t(-5.0, -2.0)
    )
    assert loss.item() == pytest.approx((math.log(4 / 3) + LN2) / 2, abs=1e-12)
    assert metrics == {
        "loss": pytest.approx((math.log(4 / 3) + LN2) / 2, abs=1e-12),
        "reward_accuracy": 0.5,
        "chosen_reward": pytest.approx(0.25 * LN3, abs=1e-12),
        "rejected_reward": pytest.approx(-0.25 * LN3, abs=1e-12),
        "margin": pytest.approx(0.5 * LN3, abs=1e-12),
    }


@pytest.mark.parametrize("loss_type", ["dpo", "cdpo", "dpop", "rdpo"])
def test_equal_logprobs_give_log_2(loss_type):
    # h = 0 and (DPOP) pi_c = ref_c so no penalty, (R-DPO) |y_w| = |y_l| so no length offset:
    # -ln sigma(0) = ln 2; cDPO: (1 - eps) ln 2 + eps ln 2 = ln 2.
    cfg = PreferenceLossConfig(type=loss_type, beta=0.3, label_smoothing=0.2, dpop_lambda=5.0, rdpo_alpha=0.7)
    x = t(-3.0, -7.0, -1.5)
    loss, metrics = preference_loss(cfg, x, x, x, x, chosen_lengths=torch.tensor([4, 9, 2]),
                                    rejected_lengths=torch.tensor([4, 9, 2]))
    assert loss.item() == pytest.approx(LN2, abs=1e-12)
    assert metrics["margin"].item() == 0.0 and metrics["reward_accuracy"].item() == 0.0


# ---- cDPO -----------------------------------------------------------------------------------------------


def test_cdpo_by_hand():
    # beta = 1, h = ln 3, eps = 1/4: -(3/4) ln sigma(ln 3) - (1/4) ln sigma(-ln 3)
    # = (3/4) ln(4/3) + (1/4) ln 4, since sigma(ln 3) = 3/4 and sigma(-ln 3) = 1/4.
    cfg = PreferenceLossConfig(type="cdpo", beta=1.0, label_smoothing=0.25)
    loss, _ = preference_loss(cfg, t(LN3), t(0.0), t(0.0), t(0.0))
    assert loss.item() == pytest.approx(0.75 * math.log(4 / 3) + 0.25 * math.log(4), abs=1e-12)


def test_cdpo_without_label_smoothing_is_dpo_exactly():
    batch = _random_batch()
    cdpo, _ = preference_loss(PreferenceLossConfig(type="cdpo", label_smoothing=0.0), **batch)
    dpo, _ = preference_loss(PreferenceLossConfig(type="dpo"), **batch)
    assert torch.equal(cdpo, dpo)


# ---- DPOP -----------------------------------------------------------------------------------------------


def test_dpop_equals_dpo_while_chosen_is_above_reference():
    batch = _random_batch()
    batch["policy_chosen_logps"] = batch["reference_chosen_logps"] + t(0.0, 0.1, 2.0, 5.0)
    dpop, metrics = preference_loss(PreferenceLossConfig(type="dpop", dpop_lambda=50.0), **batch)
    dpo, _ = preference_loss(PreferenceLossConfig(type="dpo"), **batch)
    assert torch.equal(dpop, dpo)
    assert metrics["dpop_penalty"].item() == 0.0


def test_dpop_by_hand_when_chosen_falls_below_reference():
    # beta = 1, lambda = 2. pi_c - ref_c = -0.5, pi_r - ref_r = -1.5, so h = 1 and the penalty is
    # max(0, ref_c - pi_c) = 0.5: -ln sigma(1 * (1 - 2 * 0.5)) = -ln sigma(0) = ln 2, where DPO
    # would give -ln sigma(1) = ln(1 + e^-1).
    args = (t(-2.5), t(-3.5), t(-2.0), t(-2.0))
    dpop, metrics = preference_loss(PreferenceLossConfig(type="dpop", beta=1.0, dpop_lambda=2.0), *args)
    dpo, _ = preference_loss(PreferenceLossConfig(type="dpo", beta=1.0), *args)
    assert dpop.item() == pytest.approx(LN2, abs=1e-12)
    assert dpo.item() == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-12)
    assert metrics["dpop_penalty"].item() == pytest.approx(0.5)


# ---- R-DPO ----------------------------------------------------------------------------------------------


def test_rdpo_by_hand():
    # beta = 1, h = 0, alpha = ln(3)/10, |y_w| = 20, |y_l| = 10: the offset +alpha*(20 - 10) = ln 3,
    # so -ln sigma(ln 3) = ln(4/3). (With the opposite sign it would be -ln sigma(-ln 3) = ln 4.)
    cfg = PreferenceLossConfig(type="rdpo", beta=1.0, rdpo_alpha=LN3 / 10)
    x = t(-4.0)
    loss, metrics = preference_loss(cfg, x, x, x, x, torch.tensor([20]), torch.tensor([10]))
    assert loss.item() == pytest.approx(math.log(4 / 3), abs=1e-12)
    assert metrics["length_offset"].item() == pytest.approx(LN3)
    assert metrics["margin"].item() == 0.0  # the rewards are DPO's; the length offset is not part of them


# ---- IPO ------------------------------------------------------------------------------------------------


def test_ipo_by_hand_and_minimum_at_half_inverse_beta():
    # beta = 0.5, so the target is 1/(2 beta) = 1. Loss (h - 1)^2 at h = 0, 0.5, 1, 1.5: 1, 0.25, 0, 0.25.
    cfg = PreferenceLossConfig(type="ipo", beta=0.5)
    values = []
    for h in (0.0, 0.5, 1.0, 1.5):
        loss, _ = preference_loss(cfg, t(h - 3.0), t(-3.0), t(-3.0), t(-3.0))
        values.append(loss.item())
    assert values == pytest.approx([1.0, 0.25, 0.0, 0.25], abs=1e-12)
    # and the gradient vanishes at the minimum
    policy_chosen = t(-2.0).requires_grad_()
    loss, _ = preference_loss(cfg, policy_chosen, t(-3.0), t(-3.0), t(-3.0))
    loss.backward()
    assert policy_chosen.grad.item() == pytest.approx(0.0, abs=1e-12)


# ---- SimPO ----------------------------------------------------------------------------------------------


def test_simpo_by_hand():
    # beta = 2. Chosen: summed logp -4 over 4 tokens (mean -1), reward 2 * -1 = -2. Rejected: -12 over 6
    # tokens (mean -2), reward -4. gamma = 2 - ln 3: -ln sigma(-2 + 4 - (2 - ln 3)) = -ln sigma(ln 3) = ln(4/3).
    cfg = PreferenceLossConfig(type="simpo", beta=2.0, simpo_gamma=2.0 - LN3)
    loss, metrics = preference_loss(cfg, t(-4.0), t(-12.0), chosen_lengths=torch.tensor([4]),
                                    rejected_lengths=torch.tensor([6]))
    assert loss.item() == pytest.approx(math.log(4 / 3), abs=1e-12)
    assert metrics["chosen_reward"].item() == pytest.approx(-2.0)
    assert metrics["rejected_reward"].item() == pytest.approx(-4.0)
    assert metrics["margin"].item() == pytest.approx(2.0)
    assert metrics["reward_accuracy"].item() == 1.0


def test_simpo_ignores_the_reference():
    batch = _random_batch()
    cfg = PreferenceLossConfig(type="simpo", beta=2.0)
    with_reference, _ = preference_loss(cfg, **batch)
    other_reference = dict(batch, reference_chosen_logps=batch["reference_chosen_logps"] - 10.0,
                           reference_rejected_logps=batch["reference_rejected_logps"] + 3.0)
    without_reference = dict(batch, reference_chosen_logps=None, reference_rejected_logps=None)
    assert torch.equal(preference_loss(cfg, **other_reference)[0], with_reference)
    assert torch.equal(preference_loss(cfg, **without_reference)[0], with_reference)


# ---- ORPO -----------------------------------------------------------------------------------------------


def test_orpo_by_hand():
    # Chosen: 2 tokens, summed logp 2 ln(1/2): mean ln(1/2), p = 1/2, odds 1, log odds 0.
    # Rejected: 3 tokens, summed 3 ln(1/4): p = 1/4, odds (1/4)/(3/4) = 1/3, log odds -ln 3.
    # Log odds ratio ln 3, -ln sigma(ln 3) = ln(4/3). NLL of chosen (per token) = ln 2.
    # lambda = 0.1: loss = ln 2 + 0.1 ln(4/3). Rewards: beta * mean logp = 0.1 ln(1/2), 0.1 ln(1/4).
    cfg = PreferenceLossConfig(type="orpo", beta=0.1, orpo_lambda=0.1)
    loss, metrics = preference_loss(cfg, t(-2 * LN2), t(-3 * math.log(4)), chosen_lengths=torch.tensor([2]),
                                    rejected_lengths=torch.tensor([3]))
    assert loss.item() == pytest.approx(LN2 + 0.1 * math.log(4 / 3), abs=1e-12)
    assert metrics["log_odds_ratio"].item() == pytest.approx(LN3, abs=1e-12)
    assert metrics["nll"].item() == pytest.approx(LN2, abs=1e-12)
    assert metrics["chosen_reward"].item() == pytest.approx(-0.1 * LN2, abs=1e-12)
    assert metrics["rejected_reward"].item() == pytest.approx(-0.1 * math.log(4), abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orpo_is_finite_at_probability_one_and_near_zero(dtype):
    # Mean logp 0 (p = 1: log(1 - p) = -inf without the clamp) and -60 (p ~ 1e-26: 1 - p rounds to 1).
    policy_chosen = torch.tensor([0.0, -60.0], dtype=dtype, requires_grad=True)
    policy_rejected = torch.tensor([-60.0, 0.0], dtype=dtype, requires_grad=True)
    lengths = torch.tensor([1, 1])
    loss, _ = preference_loss(PreferenceLossConfig(type="orpo"), policy_chosen, policy_rejected,
                              chosen_lengths=lengths, rejected_lengths=lengths)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(policy_chosen.grad).all() and torch.isfinite(policy_rejected.grad).all()


# ---- SFT term -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ALL_TYPES)
def test_sft_term_adds_exactly_weight_times_nll(loss_type):
    batch = _random_batch()
    nll = t(0.5, 1.0, 1.5, 2.0)  # mean 1.25
    base, _ = preference_loss(loss_config(loss_type), **batch, chosen_nll=nll)
    with_sft, metrics = preference_loss(loss_config(loss_type, sft_weight=0.4), **batch,
                                        chosen_nll=nll)
    assert (with_sft - base).item() == pytest.approx(0.4 * 1.25, abs=1e-12)
    assert metrics["sft_nll"].item() == pytest.approx(1.25)


def test_sft_nll_defaults_to_summed_chosen_logps_over_length():
    # Chosen summed logp -6 over 3 tokens: mean NLL 2. DPO with all-equal logps is ln 2; + 0.5 * 2 = ln 2 + 1.
    x = t(-6.0)
    loss, metrics = preference_loss(PreferenceLossConfig(type="dpo", sft_weight=0.5), x, x, x, x,
                                    chosen_lengths=torch.tensor([3]))
    assert loss.item() == pytest.approx(LN2 + 1.0, abs=1e-12)
    assert metrics["sft_nll"].item() == pytest.approx(2.0)


# ---- gradient direction ---------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["dpo", "simpo", "ipo", "cdpo", "dpop", "rdpo", "orpo"])
def test_minimizing_raises_chosen_and_lowers_rejected(loss_type):
    # IPO only below its target: h = 0 < 1/(2 beta) here. cDPO with eps < 1/2.
    batch = _random_batch(n=1)
    batch["reference_chosen_logps"] = batch["policy_chosen_logps"].clone()
    batch["reference_rejected_logps"] = batch["policy_rejected_logps"].clone()
    policy_chosen = batch.pop("policy_chosen_logps").requires_grad_()
    policy_rejected = batch.pop("policy_rejected_logps").requires_grad_()
    cfg = PreferenceLossConfig(type=loss_type, label_smoothing=0.1, rdpo_alpha=0.01)
    loss, _ = preference_loss(cfg, policy_chosen, policy_rejected, **batch)
    loss.backward()
    assert policy_chosen.grad.item() < 0
    assert policy_rejected.grad.item() > 0


def test_ipo_pushes_back_above_its_target():
    # h = 2 > 1/(2 beta) = 1: the squared loss lowers the chosen logp, unlike DPO.
    policy_chosen = t(-1.0).requires_grad_()
    loss, _ = preference_loss(PreferenceLossConfig(type="ipo", beta=0.5), policy_chosen, t(-3.0), t(-3.0), t(-3.0))
    loss.backward()
    assert policy_chosen.grad.item() > 0


# ---- normalization over the optimizer step --------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ALL_TYPES)
def test_micro_batch_split_with_step_count_equals_full_batch_mean(loss_type):
    batch = _random_batch(n=4)
    cfg = PreferenceLossConfig(type=loss_type, label_smoothing=0.1, rdpo_alpha=0.05, sft_weight=0.3)
    full, _ = preference_loss(cfg, **batch)
    halves = [{k: v[s] for k, v in batch.items()} for s in (slice(0, 2), slice(2, 4))]
    split = sum(preference_loss(cfg, **half, num_pairs_in_step=4)[0] for half in halves)
    assert split.item() == pytest.approx(full.item(), abs=1e-12)
    # a split that normalized each micro-batch by its own size would double it
    assert sum(preference_loss(cfg, **half)[0] for half in halves).item() == pytest.approx(2 * full.item())


@pytest.mark.parametrize("loss_type", ALL_TYPES)
def test_every_variant_reports_the_common_metrics_as_detached_scalars(loss_type):
    # 0-dim tensors without a graph: read back to Python once per step, not per micro-batch.
    _, metrics = preference_loss(loss_config(loss_type), **_random_batch())
    assert {"loss", "reward_accuracy", "chosen_reward", "rejected_reward", "margin"} <= set(metrics)
    assert all(isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad
               for value in metrics.values())


# ---- errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["dpo", "ipo", "cdpo", "dpop", "rdpo"])
def test_reference_based_loss_without_reference_names_the_loss(loss_type):
    batch = dict(_random_batch(), reference_rejected_logps=None)
    with pytest.raises(ValueError, match=f"'{loss_type}'.*reference"):
        preference_loss(loss_config(loss_type), **batch)


@pytest.mark.parametrize("loss_type", ["rdpo", "simpo", "orpo"])
def test_length_normalized_loss_without_lengths_names_the_loss(loss_type):
    batch = dict(_random_batch(), rejected_lengths=None)
    with pytest.raises(ValueError, match=f"'{loss_type}'.*lengths"):
        preference_loss(loss_config(loss_type), **batch)


def test_shape_mismatch_and_missing_nll_are_errors():
    batch = _random_batch()
    with pytest.raises(ValueError, match="reference_chosen_logps has shape"):
        preference_loss(PreferenceLossConfig(), **dict(batch, reference_chosen_logps=t(0.0, 0.0)))
    with pytest.raises(ValueError, match=r"must be \[B\]"):
        preference_loss(PreferenceLossConfig(), *(v.view(2, 2) for k, v in batch.items() if "logps" in k))
    with pytest.raises(ValueError, match="sft_weight"):
        preference_loss(PreferenceLossConfig(sft_weight=1.0), *(v for k, v in batch.items() if "logps" in k))


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="type"):
        PreferenceLossConfig(type="kto")
    with pytest.raises(ValueError, match="beta"):
        PreferenceLossConfig(beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        PreferenceLossConfig(type="cdpo", label_smoothing=0.6)


# ---- Bradley-Terry reward model -------------------------------------------------------------------------


def test_bradley_terry_by_hand():
    # Pair 0: r_c - r_r = ln 3, -ln sigma(ln 3) = ln(4/3). Pair 1: r_c = r_r, ln 2 (a tie: not accurate).
    loss, metrics = bradley_terry_loss(t(LN3, 1.0), t(0.0, 1.0))
    assert loss.item() == pytest.approx((math.log(4 / 3) + LN2) / 2, abs=1e-12)
    assert metrics == {
        "loss": pytest.approx((math.log(4 / 3) + LN2) / 2, abs=1e-12),
        "accuracy": 0.5,
        "margin": pytest.approx(LN3 / 2),
        "chosen_reward": pytest.approx((LN3 + 1) / 2),
        "rejected_reward": 0.5,
    }


def test_bradley_terry_margin_shifts_the_difference():
    # r_c - r_r = ln 3 with a required margin ln 3: -ln sigma(0) = ln 2; margin 2 ln 3: -ln sigma(-ln 3) = ln 4.
    assert bradley_terry_loss(t(LN3), t(0.0), margin=t(LN3))[0].item() == pytest.approx(LN2, abs=1e-12)
    assert bradley_terry_loss(t(LN3), t(0.0), margin=t(2 * LN3))[0].item() == pytest.approx(math.log(4), abs=1e-12)


def test_bradley_terry_accuracy_and_centering_term():
    # Differences 0, 4, 1, -2: two of four strictly right. Centering: (r_c + r_r)^2 = 4, 0, 0, 0 -> mean 1,
    # times 0.01. Changing the first rejected reward to 0 makes three of four right.
    chosen, rejected = t(1.0, 2.0, 0.5, -1.0), t(1.0, -2.0, -0.5, 1.0)
    plain, metrics = bradley_terry_loss(chosen, rejected)
    centered, _ = bradley_terry_loss(chosen, rejected, center_rewards_coefficient=0.01)
    assert metrics["accuracy"].item() == 0.5  # pair 0 is a tie
    assert bradley_terry_loss(t(1.0, 2.0, 0.5, -1.0), t(0.0, -2.0, -0.5, 0.0))[1]["accuracy"] == 0.75
    assert (centered - plain).item() == pytest.approx(0.01, abs=1e-12)


def test_bradley_terry_step_normalization_and_gradient():
    chosen = t(0.3, -1.2, 2.0, 0.1).requires_grad_()
    rejected = t(-0.4, 0.5, 1.0, 0.1)
    full, _ = bradley_terry_loss(chosen, rejected)
    split = sum(bradley_terry_loss(chosen[s], rejected[s], num_pairs_in_step=4)[0] for s in (slice(0, 2), slice(2, 4)))
    assert split.item() == pytest.approx(full.item(), abs=1e-12)
    full.backward()
    assert (chosen.grad < 0).all()


def test_config_from_python_refuses_a_boolean_for_a_number_and_is_frozen():
    import pickle

    with pytest.raises(ValueError, match="beta.*\\n.*expected a number, got the boolean"):
        PreferenceLossConfig(beta=True)
    with pytest.raises(ValueError, match="average_logprobs=true does not apply"):
        PreferenceLossConfig(type="simpo", average_logprobs=True)
    cfg = PreferenceLossConfig(type="ipo", beta=0.5)
    assert pickle.loads(pickle.dumps(cfg)) == cfg and not cfg.reference_free
    assert PreferenceLossConfig(type="orpo").reference_free
