"""Policy-gradient losses and KL estimators against values derived by hand, and their invariances."""

import math

import pytest
import torch

from posttrain.losses.policy_gradient import (
    PolicyLossConfig,
    importance_weights,
    kl_estimate,
    loss_normalizer,
    policy_gradient_loss,
)

LN2 = math.log(2.0)
E = math.exp


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _leaf(values: torch.Tensor) -> torch.Tensor:
    return values.clone().requires_grad_()


def _assert_close(actual: torch.Tensor, expected, atol: float = 1e-12) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=atol)


def _run(cfg, logprobs, old_logprobs, advantages, mask, normalizer=None, **kwargs):
    """Loss, metrics and d loss / d logprobs."""
    logprobs = _leaf(logprobs)
    if normalizer is None:
        normalizer = loss_normalizer(mask, cfg)
    loss, metrics = policy_gradient_loss(logprobs, old_logprobs, advantages, mask, cfg, normalizer, **kwargs)
    loss.backward()
    return loss, metrics, logprobs.grad


# ---- PPO clipping ---------------------------------------------------------------------------------------


def test_ppo_clips_each_side_for_each_advantage_sign():
    # One sequence, 4 tokens, token-mean over 4. eps_low = 0.2, eps_high = 0.28 (DAPO): r in [0.8, 1.28].
    # log r = +-0.5: r = e^0.5 = 1.6487, e^-0.5 = 0.6065. Loss per token -min(r A, clip(r) A):
    #   t0: A = +1, r = 1.6487: min(1.6487, 1.28) = 1.28 -> -1.28, clip high binds, gradient 0
    #   t1: A = +1, r = 0.6065: min(0.6065, 0.8) = 0.6065 -> -0.6065, unclipped, d/dlogpi = -r A = -0.6065
    #   t2: A = -1, r = 1.6487: min(-1.6487, -1.28) = -1.6487 -> +1.6487, unclipped, gradient -r A = +1.6487
    #   t3: A = -1, r = 0.6065: min(-0.6065, -0.8) = -0.8 -> +0.8, clip low binds, gradient 0
    cfg = PolicyLossConfig(ratio_clip_low=0.2, ratio_clip_high=0.28)
    old = t([-1.0, -2.0, -1.0, -2.0])
    logprobs = old + t([0.5, -0.5, 0.5, -0.5])
    advantages = t([1.0, 1.0, -1.0, -1.0])
    loss, metrics, grad = _run(cfg, logprobs, old, advantages, torch.ones(1, 4))
    assert loss.item() == pytest.approx((-1.28 - E(-0.5) + E(0.5) + 0.8) / 4, abs=1e-12)
    _assert_close(grad, [[0.0, -E(-0.5) / 4, E(0.5) / 4, 0.0]])
    assert metrics["clip_fraction_high"].item() == 0.25
    assert metrics["clip_fraction_low"].item() == 0.25
    assert metrics["dual_clip_fraction"].item() == 0.0
    assert metrics["ratio_mean"].item() == pytest.approx(math.cosh(0.5), abs=1e-12)
    assert metrics["ratio_min"].item() == pytest.approx(E(-0.5), abs=1e-12)
    assert metrics["ratio_max"].item() == pytest.approx(E(0.5), abs=1e-12)


def test_dual_clip_floors_negative_advantage_terms():
    # c = 3, eps = 0.2. Three tokens, token-mean over 3.
    #   t0: A = -1, r = 4: ppo min(-4, -1.2) = -4, dual max(-4, 3 * -1) = -3 -> loss 3, gradient 0
    #   t1: A = -1, r = 2: ppo min(-2, -1.2) = -2, max(-2, -3) = -2 -> loss 2, gradient -r A = 2
    #   t2: A = +1, r = 4: min(4, 1.2) = 1.2 (the dual clip leaves A > 0 alone) -> loss -1.2, gradient 0
    # Without the dual clip t0 would give loss 4 and gradient 4.
    old = t([-3.0, -3.0, -3.0])
    logprobs = old + torch.log(t([4.0, 2.0, 4.0]))
    advantages = t([-1.0, -1.0, 1.0])
    mask = torch.ones(1, 3)
    loss, metrics, grad = _run(PolicyLossConfig(ratio_clip_c=3.0), logprobs, old, advantages, mask)
    assert loss.item() == pytest.approx((3 + 2 - 1.2) / 3, abs=1e-12)
    _assert_close(grad, [[0.0, 2 / 3, 0.0]])
    assert metrics["dual_clip_fraction"].item() == pytest.approx(1 / 3)
    assert metrics["clip_fraction_high"].item() == pytest.approx(1 / 3)
    plain, _, plain_grad = _run(PolicyLossConfig(), logprobs, old, advantages, mask)
    assert plain.item() == pytest.approx((4 + 2 - 1.2) / 3, abs=1e-12)
    _assert_close(plain_grad, [[4 / 3, 2 / 3, 0.0]])


# ---- GSPO -----------------------------------------------------------------------------------------------


def test_gspo_sequence_ratio_value_and_per_token_gradient():
    # seq-mean-token-mean, normalizer = 3 sequences, eps = 0.2, per-sequence advantages.
    # Row 0: 2 valid tokens, log ratios 0.3, -0.1: log s = 0.1, s = e^0.1 = 1.1052 in [0.8, 1.2]; A = +1.
    #   term -s = -1.1052; each token's gradient -A s / |y| / 3 = -e^0.1 / 6, the SAME for both tokens
    #   (a token-level ratio would give e^0.3 and e^-0.1).
    # Row 1: 3 valid tokens + padding, log ratios 0.6, 0.9, 0.0: log s = 0.5, s = 1.6487; A = -1:
    #   min(-1.6487, -1.2) = -1.6487 (unclipped) -> +1.6487; gradient -A s / 3 / 3 = e^0.5 / 9 on each.
    # Row 2: 1 valid token, log ratio 0.5, A = +1: min(1.6487, 1.2) = 1.2 -> -1.2, clipped, gradient 0.
    cfg = PolicyLossConfig(ratio_level="sequence", aggregation="seq-mean-token-mean")
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 0, 0]])
    old = t([-1.0, -2.0, -3.0, -4.0], [-0.5, -1.5, -2.5, -3.5], [-1.0, -1.0, -1.0, -1.0])
    log_ratio = t([0.3, -0.1, 7.0, 7.0], [0.6, 0.9, 0.0, 7.0], [7.0, 0.5, 7.0, 7.0])  # 7.0: padding, ignored
    loss, metrics, grad = _run(cfg, old + log_ratio, old, t(1.0, -1.0, 1.0), mask)
    assert loss_normalizer(mask, cfg) == 3.0
    assert loss.item() == pytest.approx((-E(0.1) + E(0.5) - 1.2) / 3, abs=1e-12)
    expected = [[-E(0.1) / 6, -E(0.1) / 6, 0, 0], [E(0.5) / 9] * 3 + [0], [0, 0, 0, 0]]
    _assert_close(grad, expected)
    # ratio metrics are over tokens, each carrying its sequence's ratio: (2 e^0.1 + 3 e^0.5 + e^0.5) / 6
    assert metrics["ratio_mean"].item() == pytest.approx((2 * E(0.1) + 4 * E(0.5)) / 6, abs=1e-12)
    assert metrics["clip_fraction_high"].item() == pytest.approx(1 / 6)


# ---- CISPO ----------------------------------------------------------------------------------------------


def test_cispo_gradient_is_clipped_weight_times_advantage():
    # eps_low = 0.2, eps_high = 0.28; logpi = -1 for all three tokens, token-mean over 3.
    #   t0: log r = 0.5, r = 1.6487 -> weight 1.28, A = +1 (PPO would give this token no gradient)
    #   t1: log r = -0.5, r = 0.6065 -> weight 0.8, A = -1 (PPO would give no gradient either)
    #   t2: log r = 0.1, r = 1.1052 -> weight 1.1052, A = +2
    # gradient -w A / 3 = [-1.28, +0.8, -2.2103] / 3; value -sum w A logpi / 3 = -(-1.28 + 0.8 - 2.2103) / 3.
    cfg = PolicyLossConfig(clip_mode="cispo", ratio_clip_low=0.2, ratio_clip_high=0.28)
    logprobs = t([-1.0, -1.0, -1.0])
    old = logprobs - t([0.5, -0.5, 0.1])
    advantages = t([1.0, -1.0, 2.0])
    loss, metrics, grad = _run(cfg, logprobs, old, advantages, torch.ones(1, 3))
    _assert_close(grad, [[-1.28 / 3, 0.8 / 3, -2 * E(0.1) / 3]])
    assert loss.item() == pytest.approx((1.28 - 0.8 + 2 * E(0.1)) / 3, abs=1e-12)
    # CISPO counts clipped IS weights, whatever the sign of A
    assert metrics["clip_fraction_high"].item() == pytest.approx(1 / 3)
    assert metrics["clip_fraction_low"].item() == pytest.approx(1 / 3)


# ---- REINFORCE ------------------------------------------------------------------------------------------


def test_reinforce_gradient_is_minus_advantage_over_normalizer():
    # ratio_level none: loss -A logpi, no ratio and no clip even though pi_old is far away.
    # logpi = -1, -2 with A = 0.5, -1.5 (one token each, token-mean over 2):
    # loss = -(0.5 * -1 + -1.5 * -2) / 2 = -(-0.5 + 3) / 2 = -1.25; gradient -A / 2 = [-0.25, 0.75].
    cfg = PolicyLossConfig(ratio_level="none")
    logprobs, old = t([-1.0], [-2.0]), t([-4.0], [0.0])
    loss, metrics, grad = _run(cfg, logprobs, old, t(0.5, -1.5), torch.ones(2, 1))
    assert loss.item() == pytest.approx(-1.25, abs=1e-12)
    _assert_close(grad, [[-0.25], [0.75]])
    assert metrics["clip_fraction_low"].item() == metrics["clip_fraction_high"].item() == 0.0
    # the ratio metrics still report how far off-policy the batch is: e^3 and e^-2
    assert metrics["ratio_max"].item() == pytest.approx(E(3.0), abs=1e-12)
    assert metrics["ratio_min"].item() == pytest.approx(E(-2.0), abs=1e-12)


# ---- on-policy limit ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        PolicyLossConfig(),
        PolicyLossConfig(ratio_clip_c=3.0, ratio_clip_high=0.28),
        PolicyLossConfig(clip_mode="cispo"),
        PolicyLossConfig(ratio_level="sequence", aggregation="seq-mean-token-mean"),
        PolicyLossConfig(aggregation="seq-mean-token-sum-norm", aggregation_constant=7.0),
    ],
    ids=["ppo", "dual-clip", "cispo", "gspo", "dr-grpo"],
)
def test_on_policy_ratio_is_one_and_gradient_is_reinforce(cfg):
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 0]])
    advantages = torch.randn(3, generator=g, dtype=torch.float64)
    _, metrics, grad = _run(cfg, logprobs, logprobs.clone(), advantages, mask)
    assert metrics["ratio_mean"].item() == metrics["ratio_min"].item() == metrics["ratio_max"].item() == 1.0
    assert metrics["clip_fraction_low"].item() == metrics["clip_fraction_high"].item() == 0.0
    assert metrics["dual_clip_fraction"].item() == 0.0
    reinforce = PolicyLossConfig(ratio_level="none", aggregation=cfg.aggregation,
                                 aggregation_constant=cfg.aggregation_constant)
    _, _, reinforce_grad = _run(reinforce, logprobs, logprobs.clone(), advantages, mask)
    assert torch.allclose(grad, reinforce_grad, rtol=0, atol=1e-12)
    # and the REINFORCE gradient is -A / normalizer on valid tokens (token-mean), or -A / |y_i| / #seqs
    if cfg.aggregation == "token-mean":
        assert torch.allclose(grad, -advantages[:, None] * mask / 10, rtol=0, atol=1e-12)


# ---- KL estimators --------------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    # d = logpi_ref - logpi = ln 2, -ln 2, 0, and 20 (clamped to 10):
    #   k1 = -d:            -ln 2, ln 2, 0, -10
    #   k2 = d^2 / 2:       (ln 2)^2 / 2, (ln 2)^2 / 2, 0, 50
    #   k3 = e^d - 1 - d:   2 - 1 - ln 2 = 0.3069, 1/2 - 1 + ln 2 = 0.1931, 0, e^10 - 11
    # d/dlogpi: k1 -> 1; k2 -> -d; k3 -> 1 - e^d (0 where the clamp is active).
    logprobs = _leaf(t(-1.0, -1.0, -1.0, -25.0))
    reference = t(-1.0 + LN2, -1.0 - LN2, -1.0, -5.0)
    expected = {
        "k1": ([-LN2, LN2, 0.0, -10.0], [1.0, 1.0, 1.0, 0.0]),
        "k2": ([LN2**2 / 2, LN2**2 / 2, 0.0, 50.0], [-LN2, LN2, 0.0, 0.0]),
        "k3": ([1 - LN2, LN2 - 0.5, 0.0, E(10) - 11], [-1.0, 0.5, 0.0, 0.0]),
    }
    for estimator, (values, grads) in expected.items():
        logprobs.grad = None
        kl = kl_estimate(logprobs, reference, estimator, clamp=10.0)
        kl.sum().backward()
        assert kl.tolist() == pytest.approx(values, abs=1e-9), estimator
        _assert_close(logprobs.grad, grads)
    unclamped = kl_estimate(logprobs.detach(), reference, "k3", clamp=None)
    assert unclamped[3].item() == pytest.approx(E(20) - 21, rel=1e-12)


def test_kl_estimator_gradients_in_expectation_match_the_docstring():
    # Exact expectation over a 4-token vocabulary (no sampling): sum_x pi(x) * grad k(x), pi(x) held fixed as
    # the sampled tokens are. k1 -> 0; k2 -> grad KL(pi || ref); k3 -> grad KL(ref || pi). Values: E[k1] and
    # E[k3] equal KL(pi || ref), E[k2] does not.
    theta = _leaf(t(0.3, -1.0, 0.8, 0.1))
    log_ref = torch.log_softmax(t(-0.5, 0.4, 0.2, -0.3), 0)

    def grad_of(fn):
        theta.grad = None
        fn(torch.log_softmax(theta, 0)).backward()
        return theta.grad.clone()

    def expected(estimator):
        return lambda logp: (logp.exp().detach() * kl_estimate(logp, log_ref, estimator, None)).sum()

    reverse = grad_of(lambda logp: (logp.exp() * (logp - log_ref)).sum())
    forward = grad_of(lambda logp: (log_ref.exp() * (log_ref - logp)).sum())
    assert torch.allclose(grad_of(expected("k1")), torch.zeros(4, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(grad_of(expected("k2")), reverse, atol=1e-12)
    assert torch.allclose(grad_of(expected("k3")), forward, atol=1e-12)
    assert not torch.allclose(forward, reverse, atol=1e-3)  # the two KLs differ here, so the test can fail

    logp = torch.log_softmax(theta.detach(), 0)
    kl = (logp.exp() * (logp - log_ref)).sum()
    mean = {k: (logp.exp() * kl_estimate(logp, log_ref, k, None)).sum() for k in ("k1", "k2", "k3")}
    assert mean["k1"].item() == pytest.approx(kl.item(), abs=1e-12)
    assert mean["k3"].item() == pytest.approx(kl.item(), abs=1e-12)
    assert abs(mean["k2"].item() - kl.item()) > 1e-4


def test_kl_penalty_adds_beta_times_estimate_per_token():
    # On-policy with A = 0: the policy term is 0, the loss is beta * mean k3. d = ln 2 and -ln 2 on the two
    # valid tokens: k3 = 1 - ln 2 and ln 2 - 1/2, mean (1/2) (1/2) = 0.25; beta = 0.1 -> loss 0.025.
    cfg = PolicyLossConfig(reference_kl_penalty=0.1)
    logprobs = t([-1.0, -1.0, -1.0])
    reference = t([-1.0 + LN2, -1.0 - LN2, 5.0])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics, grad = _run(cfg, logprobs, logprobs.clone(), t(0.0), mask, reference_logprobs=reference)
    assert loss.item() == pytest.approx(0.1 * 0.25, abs=1e-12)
    assert metrics["kl"].item() == pytest.approx(0.25, abs=1e-12)
    # d k3 / dlogpi = 1 - e^d = -1, +1/2; times beta / 2 tokens
    _assert_close(grad, [[-0.05, 0.025, 0.0]])


# ---- aggregation ----------------------------------------------------------------------------------------

AGGREGATION_MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "aggregation, constant, normalizer, expected",
    [
        # On-policy, per-token A, so each valid token's loss is -A. Valid losses per row:
        # row 0: -1, -3 (sum -4, mean -2); row 1: -2, -2, -2, -6 (sum -12, mean -3); row 2: -4; row 3: none.
        ("token-mean", None, 7, -20 / 7),  # (-4 - 12 - 4) / 7 tokens
        ("seq-mean-token-mean", None, 3, -3.0),  # (-2 - 3 - 4) / 3 sequences (row 3 has no valid token)
        ("seq-mean-token-sum", None, 3, -20 / 3),  # (-4 - 12 - 4) / 3
        ("seq-mean-token-sum-norm", 8.0, 3, -5 / 6),  # (-4 - 12 - 4) / 8 / 3
    ],
)
def test_aggregation_by_hand_with_ragged_masks(aggregation, constant, normalizer, expected):
    cfg = PolicyLossConfig(aggregation=aggregation, aggregation_constant=constant)
    nan = float("nan")
    advantages = t([1.0, 3.0, nan, nan], [2.0, 2.0, 2.0, 6.0], [nan, 4.0, nan, nan], [nan, nan, nan, nan])
    logprobs = torch.full((4, 4), -1.0, dtype=torch.float64)
    old = logprobs.clone()
    logprobs[AGGREGATION_MASK == 0] = nan  # padding may hold anything
    old[AGGREGATION_MASK == 0] = float("inf")
    assert loss_normalizer(AGGREGATION_MASK, cfg) == normalizer
    loss, _, grad = _run(cfg, logprobs, old, advantages, AGGREGATION_MASK)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert torch.isfinite(grad).all() and (grad[AGGREGATION_MASK == 0] == 0).all()


# ---- generator/trainer mismatch correction --------------------------------------------------------------

# Mismatch weights w = exp(logpi_old - logpi_gen), 4 sequences of 2 tokens; band [0.5, 2].
MISMATCH = t([3.0, 1.5], [4.0, 0.25], [0.25, 0.6], [1.5, 1.5])


@pytest.mark.parametrize(
    "correction, weights, masked_fraction",
    [
        # tis: min(w, 2) everywhere: sum 2 + 1.5 + 2 + 0.25 + 0.25 + 0.6 + 1.5 + 1.5 = 9.6
        ("tis", [[2.0, 1.5], [2.0, 0.25], [0.25, 0.6], [1.5, 1.5]], 0.0),
        # icepop: w kept inside [0.5, 2], else 0: 3, 4, 0.25, 0.25 are dropped. Sum 1.5 + 0.6 + 3 = 5.1
        ("icepop", [[0.0, 1.5], [0.0, 0.0], [0.0, 0.6], [1.5, 1.5]], 0.5),
        # seq-mask-tis: geometric means sqrt(3 * 1.5) = 2.12 (out), sqrt(4 * 0.25) = 1 (in),
        # sqrt(0.25 * 0.6) = 0.39 (out), 1.5 (in; the product 2.25 would be out). Kept rows get min(w, 2).
        ("seq-mask-tis", [[0.0, 0.0], [2.0, 0.25], [0.0, 0.0], [1.5, 1.5]], 0.5),
    ],
)
def test_importance_corrections_by_hand(correction, weights, masked_fraction):
    # On-policy trainer (logpi = logpi_old), A = +1, token-mean over 8: each token's loss is -weight,
    # its gradient -weight / 8.
    cfg = PolicyLossConfig(importance_correction=correction, is_threshold_low=0.5, is_threshold_high=2.0)
    logprobs = torch.full((4, 2), -2.0, dtype=torch.float64)
    generator = logprobs - torch.log(MISMATCH)
    mask = torch.ones(4, 2)
    loss, metrics, grad = _run(cfg, logprobs, logprobs.clone(), t(1.0, 1.0, 1.0, 1.0), mask,
                               generator_logprobs=generator)
    total = sum(map(sum, weights))
    assert loss.item() == pytest.approx(-total / 8, abs=1e-12)
    _assert_close(grad, -torch.tensor(weights, dtype=torch.float64) / 8)
    assert metrics["is_weight_mean"].item() == pytest.approx(total / 8, abs=1e-12)
    assert metrics["is_masked_fraction"].item() == masked_fraction
    assert metrics["generator_logprob_error"].item() == pytest.approx(torch.log(MISMATCH).abs().mean().item())
    assert metrics["generator_logprob_error_max"].item() == pytest.approx(torch.log(MISMATCH).abs().max().item())


def test_mismatch_metrics_mean_max_and_fraction_past_the_threshold_over_valid_tokens_only():
    # |log w| per token: row 0 [ln 3 = 1.10, ln 1.5 = 0.41], row 1 [ln 4 = 1.39, padding (w = 1000: ignored)],
    # row 2 [ln 4 = 1.39, ln 0.6 = 0.51]; with threshold 0.5 four of the five valid tokens are past it.
    cfg = PolicyLossConfig(logprob_mismatch_threshold=0.5)
    logprobs = torch.full((3, 2), -2.0, dtype=torch.float64)
    generator = logprobs - torch.log(t([3.0, 1.5], [4.0, 1000.0], [0.25, 0.6]))
    mask = t([1, 1], [1, 0], [1, 1])
    _, metrics, _ = _run(cfg, logprobs, logprobs.clone(), t(1.0, 1.0, 1.0), mask, generator_logprobs=generator)
    errors = [math.log(3), math.log(1.5), math.log(4), math.log(4), -math.log(0.6)]
    assert metrics["generator_logprob_error"].item() == pytest.approx(sum(errors) / 5)
    assert metrics["generator_logprob_error_max"].item() == pytest.approx(math.log(4))
    assert metrics["generator_logprob_error_fraction"].item() == pytest.approx(4 / 5)


def test_importance_weights_ignore_padding_and_do_not_reweight_the_kl():
    # seq-mask-tis with padding: row [w = 1.5, padding with w = 1000] has geometric mean 1.5 over its valid
    # token, so it is kept; the padding neither masks it nor reports as masked.
    cfg = PolicyLossConfig(importance_correction="seq-mask-tis", reference_kl_penalty=0.5)
    mask = torch.tensor([[1, 0]])
    old = t([-1.0, -1.0])
    generator = old - torch.log(t([1.5, 1000.0]))
    weights, masked, truncated = importance_weights(old, generator, mask, cfg)
    _assert_close(weights, [[1.5, 1.0]], atol=1e-12)
    assert not masked.any() and not truncated.any()
    # A token the correction masks still feels the KL penalty: icepop drops w = 3, loss = beta * k3 only.
    cfg = PolicyLossConfig(importance_correction="icepop", reference_kl_penalty=0.5)
    reference = t([-1.0 + LN2])  # k3 = 1 - ln 2
    loss, metrics, _ = _run(cfg, t([-1.0]), t([-1.0]), t(1.0), torch.ones(1, 1),
                            generator_logprobs=t([-1.0 - math.log(3.0)]), reference_logprobs=reference)
    assert metrics["is_masked_fraction"].item() == 1.0
    assert loss.item() == pytest.approx(0.5 * (1 - LN2), abs=1e-12)


@pytest.mark.parametrize(
    "correction, lower, weights, truncated_fraction",
    [
        # tis, no lower bound (today's): min(w, 2); truncated where w > 2: 3 and 4, 2 of 8 tokens.
        ("tis", None, [[2.0, 1.5], [2.0, 0.25], [0.25, 0.6], [1.5, 1.5]], 0.25),
        # tis with lower bound 0.5: also max(w, 0.5): the two 0.25 move up to 0.5; 4 of 8 truncated.
        ("tis", 0.5, [[2.0, 1.5], [2.0, 0.5], [0.5, 0.6], [1.5, 1.5]], 0.5),
        # seq-tis: one weight per sequence, the product of its token weights: 3·1.5 = 4.5 -> 2, 4·0.25 = 1,
        # 0.25·0.6 = 0.15, 1.5·1.5 = 2.25 -> 2. Rows 0 and 3 truncated: 4 of 8 tokens.
        ("seq-tis", None, [[2.0, 2.0], [1.0, 1.0], [0.15, 0.15], [2.0, 2.0]], 0.5),
        # ... with lower bound 0.5: 0.15 -> 0.5 too; 6 of 8 tokens truncated.
        ("seq-tis", 0.5, [[2.0, 2.0], [1.0, 1.0], [0.5, 0.5], [2.0, 2.0]], 0.75),
    ],
)
def test_truncated_importance_weights_with_lower_bounds_and_per_sequence(correction, lower, weights,
                                                                         truncated_fraction):
    # On-policy, A = +1, token-mean over 8 tokens: the loss is −Σc/8 and each token's gradient −c/8.
    cfg = PolicyLossConfig(importance_correction=correction, tis_lower_bound=lower, is_threshold_high=2.0)
    logprobs = torch.full((4, 2), -2.0, dtype=torch.float64)
    generator = logprobs - torch.log(MISMATCH)
    loss, metrics, grad = _run(cfg, logprobs, logprobs.clone(), t(1.0, 1.0, 1.0, 1.0), torch.ones(4, 2),
                               generator_logprobs=generator)
    expected = torch.tensor(weights, dtype=torch.float64)
    assert loss.item() == pytest.approx(-expected.sum().item() / 8, abs=1e-12)
    _assert_close(grad, -expected / 8)
    assert metrics["is_truncated_fraction"].item() == truncated_fraction
    assert metrics["is_masked_fraction"].item() == 0.0
    # Effective sample size (Σc)² / (n·Σc²) of the applied weights; raw weights span 0.25 .. 4.
    ess = expected.sum() ** 2 / (8 * expected.square().sum())
    assert metrics["is_effective_sample_size"].item() == pytest.approx(ess.item(), abs=1e-12)
    assert metrics["is_raw_weight_min"].item() == pytest.approx(0.25, abs=1e-12)
    assert metrics["is_raw_weight_max"].item() == pytest.approx(4.0, abs=1e-12)


def test_importance_metrics_by_hand_for_icepop():
    # icepop weights (see test_importance_corrections_by_hand): [[0, 1.5], [0, 0], [0, 0.6], [1.5, 1.5]].
    # Σc = 5.1, Σc² = 2.25 + 0.36 + 2.25 + 2.25 = 7.11: ESS = 5.1² / (8 · 7.11) = 26.01 / 56.88. Nothing truncated.
    cfg = PolicyLossConfig(importance_correction="icepop")
    logprobs = torch.full((4, 2), -2.0, dtype=torch.float64)
    _, metrics, _ = _run(cfg, logprobs, logprobs.clone(), t(1.0, 1.0, 1.0, 1.0), torch.ones(4, 2),
                         generator_logprobs=logprobs - torch.log(MISMATCH))
    assert metrics["is_effective_sample_size"].item() == pytest.approx(26.01 / 56.88, abs=1e-12)
    assert metrics["is_truncated_fraction"].item() == 0.0 and metrics["is_masked_fraction"].item() == 0.5
    # Every token masked: ESS 0; no valid token: ESS 1 and raw min/max 1.
    _, dropped, _ = _run(cfg, t([-2.0]), t([-2.0]), t(1.0), torch.ones(1, 1),
                         generator_logprobs=t([-2.0 - math.log(3.0)]))
    assert dropped["is_effective_sample_size"].item() == 0.0
    _, empty, _ = _run(cfg, t([-2.0]), t([-2.0]), t(1.0), torch.zeros(1, 1), normalizer=1.0,
                       generator_logprobs=t([-9.0]))
    assert empty["is_effective_sample_size"].item() == 1.0 and empty["is_raw_weight_max"].item() == 1.0


def test_seq_tis_ignores_padding_and_survives_overflow():
    # Row 0: valid token w = 1.5, a padding token with w = 1000 that must not enter the product: weight 1.5.
    # Row 1: log-weights summing to 1000 (exp overflows to inf): truncated to 2, never nan.
    cfg = PolicyLossConfig(importance_correction="seq-tis")
    old = t([-1.0, -1.0], [-1.0, -1.0])
    generator = old - t([math.log(1.5), math.log(1000.0)], [500.0, 500.0])
    weights, masked, truncated = importance_weights(old, generator, torch.tensor([[1, 0], [1, 1]]), cfg)
    _assert_close(weights, [[1.5, 1.0], [2.0, 2.0]])
    assert truncated.tolist() == [[False, False], [True, True]] and not masked.any()


def test_kl_output_clamp_bounds_the_estimate_and_its_gradient():
    # k3 with d = 3: e^3 − 4 = 16.09 -> clamped to 5, no gradient; d = 0.5: e^0.5 − 1.5 = 0.1487, kept, gradient
    # d k3 / d logπ = 1 − e^d = 1 − e^0.5. k1 = −d: d = −7 gives 7 -> 5, d = 7 gives −7 -> −5.
    logprobs = _leaf(t([-4.0, -1.5]))
    reference = t([-1.0, -1.0])
    kl = kl_estimate(logprobs, reference, "k3", clamp=None, output_clamp=5.0)
    _assert_close(kl.detach(), [[5.0, E(0.5) - 1.5]])
    kl.sum().backward()
    _assert_close(logprobs.grad, [[0.0, 1 - E(0.5)]])
    k1 = kl_estimate(t([6.0, -8.0]), t([-1.0, -1.0]), "k1", clamp=None, output_clamp=5.0)
    _assert_close(k1, [[5.0, -5.0]])
    # Through the loss: β·clamped k3 on the one token: loss = 0.1 · 5 (on-policy, A = 0).
    cfg = PolicyLossConfig(reference_kl_penalty=0.1, kl_output_clamp=5.0)
    loss, metrics, _ = _run(cfg, t([-4.0]), t([-4.0]), t(0.0), torch.ones(1, 1), reference_logprobs=t([-1.0]))
    assert loss.item() == pytest.approx(0.5, abs=1e-12) and metrics["kl"].item() == pytest.approx(5.0)


# ---- gradient accumulation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        PolicyLossConfig(ratio_clip_high=0.28, reference_kl_penalty=0.05),
        PolicyLossConfig(aggregation="seq-mean-token-mean", importance_correction="tis"),
        PolicyLossConfig(ratio_level="sequence", aggregation="seq-mean-token-mean"),
        PolicyLossConfig(importance_correction="seq-tis", tis_lower_bound=0.5, kl_output_clamp=0.05,
                         reference_kl_penalty=0.1),
    ],
    ids=["token-mean", "seq-mean-token-mean", "gspo", "seq-tis"],
)
def test_micro_batch_split_gives_the_full_batch_loss_and_gradient(cfg):
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([2, 9, 4, 1, 7, 3])
    mask = (torch.arange(10)[None, :] < lengths[:, None]).float()
    old = -torch.rand(6, 10, generator=g) * 4
    generator = old + 0.3 * torch.randn(6, 10, generator=g)
    reference = old + 0.2 * torch.randn(6, 10, generator=g)
    advantages = torch.randn(6, generator=g)
    logprobs = _leaf(old + 0.5 * torch.randn(6, 10, generator=g))  # off-policy: both clips bind

    kwargs = {"generator_logprobs": generator, "reference_logprobs": reference}
    full, metrics = policy_gradient_loss(logprobs, old, advantages, mask, cfg, loss_normalizer(mask, cfg), **kwargs)
    assert metrics["clip_fraction_low"] > 0 and metrics["clip_fraction_high"] > 0
    (full_grad,) = torch.autograd.grad(full, logprobs)

    splits = [slice(0, 1), slice(1, 4), slice(4, 6)]
    step_normalizer = sum(loss_normalizer(mask[s], cfg) for s in splits)
    split_loss = 0.0
    for s in splits:
        part = {k: v[s] for k, v in kwargs.items()}
        loss, _ = policy_gradient_loss(logprobs[s], old[s], advantages[s], mask[s], cfg, step_normalizer, **part)
        split_loss = split_loss + loss
    (split_grad,) = torch.autograd.grad(split_loss, logprobs)
    assert split_loss.item() == pytest.approx(full.item(), abs=1e-5)
    assert torch.allclose(split_grad, full_grad, rtol=0, atol=1e-5)

    # Averaging per micro-batch and then over the micro-batches weighs them differently: a real difference.
    naive = sum(
        policy_gradient_loss(logprobs[s], old[s], advantages[s], mask[s], cfg, loss_normalizer(mask[s], cfg),
                             **{k: v[s] for k, v in kwargs.items()})[0]
        for s in splits
    ) / len(splits)
    assert abs(naive.item() - full.item()) > 1e-3


# ---- metrics, entropy, inputs ---------------------------------------------------------------------------


def test_metrics_are_detached_scalars_and_present_when_their_inputs_are():
    cfg = PolicyLossConfig(importance_correction="icepop", reference_kl_penalty=0.1)
    logprobs = _leaf(torch.full((2, 3), -1.0))
    _, metrics = policy_gradient_loss(logprobs, logprobs.detach(), torch.ones(2), torch.ones(2, 3), cfg, 6.0,
                                      generator_logprobs=logprobs.detach(), reference_logprobs=logprobs.detach())
    assert set(metrics) == {
        "clip_fraction_low", "clip_fraction_high", "dual_clip_fraction", "ratio_mean", "ratio_min", "ratio_max",
        "kl", "is_weight_mean", "is_masked_fraction", "generator_logprob_error", "generator_logprob_error_max",
        "generator_logprob_error_fraction", "is_truncated_fraction",
        "is_effective_sample_size", "is_raw_weight_min", "is_raw_weight_max",
    }
    assert all(m.dim() == 0 and not m.requires_grad for m in metrics.values())
    _, plain = policy_gradient_loss(logprobs, logprobs.detach(), torch.ones(2), torch.ones(2, 3),
                                    PolicyLossConfig(), 6.0)
    assert "kl" not in plain and "is_weight_mean" not in plain and "generator_logprob_error" not in plain


def test_micro_batch_without_valid_tokens_gives_zero_loss_and_finite_metrics():
    logprobs = _leaf(torch.full((2, 3), -1.0))
    loss, metrics = policy_gradient_loss(logprobs, logprobs.detach() - 1, torch.ones(2), torch.zeros(2, 3),
                                         PolicyLossConfig(), normalizer=5.0)
    loss.backward()
    assert loss.item() == 0.0 and (logprobs.grad == 0).all()
    assert all(torch.isfinite(m) for m in metrics.values())


def test_entropy_metric_is_that_of_the_distribution_each_token_was_drawn_from():
    # Sampled tokens 1 and 2 are drawn from the logits at positions 0 and 1. Position 0: uniform over 4 -> ln 4.
    # Position 1: one allowed token (others -inf) -> 0, not nan. Positions 2 and 3 (what follows the last sampled
    # token) are no sampled token's distribution and are ignored. Mean over the 2 sampled tokens: ln 4 / 2 = ln 2.
    from posttrain.data.types import RolloutBatch
    from posttrain.workers.forward import target_entropy

    inf = float("inf")
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [3.0, -inf, -inf, -inf], [9.0, 0.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]]],
                          dtype=torch.bfloat16, requires_grad=True)
    ids, ones = torch.tensor([[2, 1, 0, 0]]), torch.ones(1, 4)
    batch = RolloutBatch(ids, ones, torch.tensor([[0.0, 1.0, 1.0, 0.0]]), torch.zeros(1, 4), torch.zeros(1), {},
                         torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
                         torch.zeros(1, dtype=torch.bool), torch.tensor([2]))
    entropy = target_entropy(logits, batch)
    assert entropy.dtype == torch.float32 and not entropy.requires_grad
    assert entropy[0, 1].item() == pytest.approx(2 * LN2, abs=1e-6) and entropy[0, 2].item() == 0.0
    assert entropy[0, [0, 3]].tolist() == [0.0, 0.0]
    assert entropy[batch.loss_mask.bool()].mean().item() == pytest.approx(LN2, abs=1e-6)


def test_missing_or_misshapen_inputs_name_the_argument():
    x, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="generator_logprobs"):
        policy_gradient_loss(x, x, torch.ones(2), mask, PolicyLossConfig(importance_correction="tis"), 6.0)
    with pytest.raises(ValueError, match="reference_logprobs"):
        policy_gradient_loss(x, x, torch.ones(2), mask, PolicyLossConfig(reference_kl_penalty=0.1), 6.0)
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        policy_gradient_loss(x, torch.zeros(2, 4), torch.ones(2), mask, PolicyLossConfig(), 6.0)
    with pytest.raises(ValueError, match="advantages"):
        policy_gradient_loss(x, x, torch.ones(3), mask, PolicyLossConfig(), 6.0)
    with pytest.raises(ValueError, match="normalizer"):
        policy_gradient_loss(x, x, torch.ones(2), mask, PolicyLossConfig(), 0.0)


@pytest.mark.parametrize(
    "kwargs, fields",
    [
        ({"clip_mode": "cispo", "ratio_clip_c": 3.0}, "cispo.*ratio_clip_c"),
        ({"ratio_level": "none", "clip_mode": "cispo"}, "cispo.*ratio_level='none'"),
        ({"ratio_level": "none", "ratio_clip_c": 3.0}, "ratio_clip_c.*ratio_level='none'"),
        ({"ratio_clip_c": 1.0}, "ratio_clip_c"),
        ({"ratio_level": "sequence"}, "ratio_level='sequence'.*aggregation='token-mean'"),
        ({"ratio_clip_low": -0.1}, "ratio_clip_low"),
        ({"ratio_clip_high": -0.1}, "ratio_clip_high"),
        ({"is_threshold_low": 2.0, "is_threshold_high": 2.0}, "is_threshold_low.*is_threshold_high"),
        ({"reference_kl_penalty": -1.0}, "reference_kl_penalty"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"aggregation": "seq-mean-token-sum-norm", "aggregation_constant": 0.0}, "aggregation_constant"),
        ({"clip_mode": "cispo", "ratio_level": "sequence", "aggregation": "seq-mean-token-mean"},
         "cispo.*ratio_level='sequence' is not defined"),
        ({"importance_correction": "icepop", "tis_lower_bound": 0.5}, "tis_lower_bound.*'icepop'"),
        ({"tis_lower_bound": 0.5}, "tis_lower_bound.*'none'"),
        ({"importance_correction": "tis", "tis_lower_bound": 2.0}, "tis_lower_bound.*below is_threshold_high"),
        ({"importance_correction": "seq-tis", "tis_lower_bound": -0.1}, "tis_lower_bound.*non-negative"),
        ({"kl_output_clamp": 0.0}, "kl_output_clamp"),
        ({"importance_correction": "seq-tiss"}, "importance_correction"),
    ],
)
def test_config_rejects_incompatible_knobs_naming_the_fields(kwargs, fields):
    with pytest.raises(ValueError, match=fields):
        PolicyLossConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [{"is_threshold_high": True}, {"ratio_clip_low": False},
                                    {"aggregation_constant": True}, {"ratio_clip_c": True}])
def test_config_from_python_refuses_a_boolean_for_a_number_as_the_yaml_path_does(kwargs):
    # A dataclass would read True as 1.0; the loss config is the recipe's loss section and is validated alike.
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))}.*\\n.*expected a number, got the boolean"):
        PolicyLossConfig(**kwargs)


def test_config_is_a_frozen_picklable_value():
    import pickle

    cfg = PolicyLossConfig(ratio_clip_high=0.28, importance_correction="tis")
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert hash(cfg) == hash(PolicyLossConfig(ratio_clip_high=0.28, importance_correction="tis"))
    with pytest.raises(ValueError, match="frozen"):
        cfg.ratio_clip_high = 0.3


def test_resolved_fills_dr_grpo_constant_only_when_unset():
    cfg = PolicyLossConfig(aggregation="seq-mean-token-sum-norm")
    resolved = cfg.resolved(max_completion_tokens=12)
    assert (cfg.aggregation_constant, resolved.aggregation_constant) == (None, 12.0)
    given = PolicyLossConfig(aggregation="seq-mean-token-sum-norm", aggregation_constant=7.0)
    assert given.resolved(max_completion_tokens=12).aggregation_constant == 7.0
    assert PolicyLossConfig().resolved(max_completion_tokens=12) == PolicyLossConfig()
    # Unresolved, the loss itself refuses to divide by a constant it does not have.
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm.*aggregation_constant"):
        policy_gradient_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), mask, cfg, 2.0)
