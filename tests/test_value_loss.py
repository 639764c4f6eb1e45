"""The clipped value loss and explained variance against values derived by hand."""

import math

import pytest
import torch

from posttrain.losses.value import explained_variance, value_loss, value_loss_normalizer

NAN = float("nan")

# One row of 4 valid tokens and a masked fifth (junk there, nan included, must never be read). ε = 0.2.
OLD = torch.tensor([[0.0, 0.0, 1.0, 1.0, NAN]])
NEW = torch.tensor([[0.5, 0.1, 1.5, 0.7, NAN]])
RETURNS = torch.tensor([[1.0, -1.0, 1.0, 0.0, 1e9]])
MASK = torch.tensor([[1, 1, 1, 1, 0]])


def _run(values, old_values, returns, mask, clip, normalizer=None):
    values = values.clone().requires_grad_()
    loss, metrics = value_loss(values, old_values, returns, mask, clip,
                               value_loss_normalizer(mask) if normalizer is None else normalizer)
    loss.backward()
    return loss, metrics, values.grad


def test_clipped_value_loss_by_hand():
    # Per token, V_c = V_old + clamp(V − V_old, −0.2, 0.2), ℓ = ½ max((V − R)², (V_c − R)²):
    #   t0: V 0.5, V_c 0.2, R 1:   (−0.5)² = 0.25 vs (−0.8)² = 0.64 -> 0.64, clipped larger, gradient 0
    #   t1: V 0.1, V_c 0.1, R −1:  1.21 vs 1.21 (inside the clip: equal)  -> 1.21, not strictly, gradient V − R = 1.1
    #   t2: V 1.5, V_c 1.2, R 1:   0.25 vs 0.04 -> 0.25, unclipped larger, gradient 0.5
    #   t3: V 0.7, V_c 0.8, R 0:   0.49 vs 0.64 -> 0.64, clipped larger, gradient 0
    # Σℓ = ½ (0.64 + 1.21 + 0.25 + 0.64) = 1.37; normalizer 4 (valid tokens): loss 0.3425.
    loss, metrics, grad = _run(NEW, OLD, RETURNS, MASK, clip=0.2)
    assert loss.item() == pytest.approx(1.37 / 4, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 1.1 / 4, 0.5 / 4, 0.0, 0.0]]), rtol=0, atol=1e-6)
    assert metrics["value_loss"].item() == pytest.approx(1.37 / 4, abs=1e-6)
    assert metrics["value_clip_fraction"].item() == 0.5  # t0 and t3
    assert metrics["value_mean"].item() == pytest.approx((0.5 + 0.1 + 1.5 + 0.7) / 4, abs=1e-6)
    assert all(m.dim() == 0 and not m.requires_grad for m in metrics.values())


def test_unclipped_value_loss_by_hand():
    # ℓ = ½ (V − R)²: ½ (0.25 + 1.21 + 0.25 + 0.49) = 1.1 over 4 tokens; gradient (V − R) / 4.
    loss, metrics, grad = _run(NEW, None, RETURNS, MASK, clip=None)
    assert loss.item() == pytest.approx(1.1 / 4, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 1.1, 0.5, 0.7, 0.0]]) / 4, rtol=0, atol=1e-6)
    assert metrics["value_clip_fraction"].item() == 0.0


def test_micro_batches_sum_to_the_full_batch_loss_with_the_step_normalizer():
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 1, 3, 4])[:, None]).long()
    old = torch.randn(4, 6, generator=g)
    new = (old + 0.5 * torch.randn(4, 6, generator=g)).requires_grad_()
    returns = torch.randn(4, 6, generator=g)
    full, _ = value_loss(new, old, returns, mask, 0.2, value_loss_normalizer(mask))
    (full_grad,) = torch.autograd.grad(full, new)
    step = value_loss_normalizer(mask[:1]) + value_loss_normalizer(mask[1:])
    split = sum(value_loss(new[s], old[s], returns[s], mask[s], 0.2, step)[0] for s in (slice(0, 1), slice(1, 4)))
    (split_grad,) = torch.autograd.grad(split, new)
    assert split.item() == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(split_grad, full_grad, rtol=0, atol=1e-6)
    # Averaging per micro-batch instead weighs the one-row micro-batch as much as the three-row one.
    naive = sum(value_loss(new[s], old[s], returns[s], mask[s], 0.2, value_loss_normalizer(mask[s]))[0]
                for s in (slice(0, 1), slice(1, 4))) / 2
    assert abs(naive.item() - full.item()) > 1e-3


def test_value_loss_rejects_bad_inputs_naming_them():
    x, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="needs old_values"):
        value_loss(x, None, x, mask, 0.2, 6.0)
    with pytest.raises(ValueError, match="returns has shape"):
        value_loss(x, x, torch.zeros(2, 4), mask, 0.2, 6.0)
    with pytest.raises(ValueError, match="clip must be positive"):
        value_loss(x, x, x, mask, 0.0, 6.0)
    with pytest.raises(ValueError, match="normalizer"):
        value_loss(x, x, x, mask, None, 0.0)


def test_explained_variance_by_hand():
    # R = 1, 2, 3, 4: mean 2.5, Var = (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25.
    # V = 1, 2, 3, 3: R − V = 0, 0, 0, 1, mean 0.25, Var = (3·0.0625 + 0.5625) / 4 = 0.1875 -> 1 − 0.15 = 0.85.
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert explained_variance(torch.tensor([[1.0, 2.0, 3.0, 3.0, 0.0]]), returns, mask).item() == pytest.approx(0.85)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)  # a perfect critic
    assert explained_variance(torch.full((1, 5), 2.5), returns, mask).item() == pytest.approx(0.0, abs=1e-7)
    # Nothing varies: undefined, nan (not a score of the critic).
    assert math.isnan(explained_variance(torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3)).item())
    assert math.isnan(explained_variance(torch.zeros(1, 3), returns[:, :3], torch.tensor([[1, 0, 0]])).item())


def test_values_inside_the_clip_range_are_never_counted_as_clipped():
    # V_old + (V − V_old) equals V only up to float rounding; inside the range that must not read as clipping.
    # Small old values and new ones up to 0.19 away (inside clip 0.2), returns 0: about 1% of tokens round so that
    # the "clipped" term comes out larger than the unclipped one.
    g = torch.Generator().manual_seed(0)
    old = 1e-3 * torch.randn(1, 4096, generator=g)
    new = 0.19 * torch.rand(1, 4096, generator=g)
    returns = torch.zeros(1, 4096)
    rounded = (old + (new - old) - returns).square() > (new - returns).square()
    assert rounded.any()  # the rounding this guards against does occur here
    _, metrics, _ = _run(new, old, returns, torch.ones(1, 4096), clip=0.2)
    assert metrics["value_clip_fraction"].item() == 0.0
