"""GAE, token-level rewards and masked whitening against the textbook recursion written out in plain Python,
Monte-Carlo returns, and numbers derived by hand."""

import itertools

import pytest
import torch

from posttrain.advantages import gae_advantages, token_level_rewards, whiten

NAN = float("nan")


def reference_gae(rewards, values, mask, gamma, lam):
    """The textbook backward recursion, one row at a time, over the row's valid positions only: the next valid
    position's value is the bootstrap, 0 after the last one."""
    advantages = [[0.0] * len(row) for row in rewards]
    for i, row_mask in enumerate(mask):
        steps = [t for t, m in enumerate(row_mask) if m]
        following = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            next_value = values[i][steps[k + 1]] if k + 1 < len(steps) else 0.0
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            following = delta + gamma * lam * following
            advantages[i][t] = following
    return advantages


def monte_carlo_returns(rewards, mask):
    """Σ of the rewards at this and every later valid position (γ = 1)."""
    out = [[0.0] * len(row) for row in rewards]
    for i, row_mask in enumerate(mask):
        total = 0.0
        for t in reversed(range(len(row_mask))):
            if row_mask[t]:
                total += rewards[i][t]
                out[i][t] = total
    return out


# Four rows of 7 positions: prompt padding on the left, a gap of masked tokens (a tool observation) in the middle,
# padding on the right, a row with a single valid token and a row with none.
MASK = [
    [0, 0, 1, 1, 0, 0, 1],
    [1, 1, 1, 1, 1, 1, 0],
    [0, 0, 0, 1, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0],
]


def random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(4, 7, generator=g, dtype=torch.float64)
    values = torch.randn(4, 7, generator=g, dtype=torch.float64)
    mask = torch.tensor(MASK)
    # Junk where the mask is 0 must never be read.
    rewards = torch.where(mask.bool(), rewards, NAN)
    values = torch.where(mask.bool(), values, 1e6)
    return rewards, values, mask


def masked_list(x: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return torch.where(mask.bool(), x, 0.0).tolist()


@pytest.mark.parametrize("gamma, lam", list(itertools.product([1.0, 0.99, 0.5, 0.0], [1.0, 0.95, 0.3, 0.0])))
def test_gae_matches_the_textbook_recursion(gamma, lam):
    rewards, values, mask = random_case(0)
    advantages, returns = gae_advantages(rewards, values, mask, gamma, lam)
    expected = reference_gae(masked_list(rewards, mask), masked_list(values, mask), MASK, gamma, lam)
    assert advantages.dtype == torch.float32 and returns.dtype == torch.float32
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-6)
    expected_returns = torch.tensor(expected, dtype=torch.float64) + torch.where(mask.bool(), values, 0.0)
    torch.testing.assert_close(returns, expected_returns.float(), rtol=0, atol=1e-6)
    assert (advantages[~mask.bool()] == 0).all() and (returns[~mask.bool()] == 0).all()


def test_separate_value_lambda_gives_returns_of_that_lambda():
    rewards, values, mask = random_case(1)
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5, value_lam=1.0)
    policy_only, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    _, lambda_one_returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=1.0)
    torch.testing.assert_close(advantages, policy_only, rtol=0, atol=0)
    torch.testing.assert_close(returns, lambda_one_returns, rtol=0, atol=0)
    assert not torch.allclose(returns, gae_advantages(rewards, values, mask, 0.9, 0.5)[1])  # a real difference


def test_lambda_one_gamma_one_is_the_monte_carlo_return_minus_the_value():
    rewards, values, mask = random_case(2)
    advantages, returns = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    mc = torch.tensor(monte_carlo_returns(masked_list(rewards, mask), MASK), dtype=torch.float64)
    torch.testing.assert_close(returns, mc.float(), rtol=0, atol=1e-6)  # the returns do not depend on V at all
    torch.testing.assert_close(advantages, torch.where(mask.bool(), mc - values, 0.0).float(), rtol=0, atol=1e-6)


def test_gamma_zero_is_the_reward_minus_the_value():
    rewards, values, mask = random_case(3)
    for lam in (0.0, 0.7, 1.0):
        advantages, returns = gae_advantages(rewards, values, mask, gamma=0.0, lam=lam)
        expected = torch.where(mask.bool(), rewards - values, 0.0)
        torch.testing.assert_close(advantages, expected.float(), rtol=0, atol=1e-6)
        torch.testing.assert_close(returns, torch.where(mask.bool(), rewards, 0.0).float(), rtol=0, atol=1e-6)


def test_gae_by_hand_across_a_masked_gap():
    # One row, mask [0, 1, 1, 0, 1]: valid tokens at positions 1, 2, 4 (position 3 is a tool observation), a
    # terminal reward 1 on the last one. V = 0.5, 0.2, 0.8 there. γ = 0.9, λ = 0.5 (γλ = 0.45).
    #   t = 4: δ = 1 + 0.9·0 − 0.8 = 0.2                  A = 0.2                       (terminal: no bootstrap)
    #   t = 2: δ = 0 + 0.9·0.8 − 0.2 = 0.52               A = 0.52 + 0.45·0.2 = 0.61    (jumps over position 3)
    #   t = 1: δ = 0 + 0.9·0.2 − 0.5 = −0.32              A = −0.32 + 0.45·0.61 = −0.0455
    # Returns with value_lam = 1 (A(λ=1) + V): t = 4: 0.2 + 0.8 = 1; t = 2: (0.52 + 0.9·0.2) + 0.2 = 0.9;
    # t = 1: (−0.32 + 0.9·0.70) + 0.5 = 0.81 = γ²·1, the discounted Monte-Carlo return.
    mask = torch.tensor([[0, 1, 1, 0, 1]])
    rewards = torch.tensor([[5.0, 0.0, 0.0, 7.0, 1.0]])  # 5 and 7 sit on masked positions: ignored
    values = torch.tensor([[NAN, 0.5, 0.2, NAN, 0.8]])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5, value_lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[0.0, -0.0455, 0.61, 0.0, 0.2]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(returns, torch.tensor([[0.0, 0.81, 0.9, 0.0, 1.0]]), rtol=0, atol=1e-6)


def test_gae_rejects_bad_inputs_naming_them():
    mask = torch.ones(2, 3)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="values has shape"):
        gae_advantages(x, torch.zeros(2, 4), mask, 1.0, 1.0)
    with pytest.raises(ValueError, match="lam must be in"):
        gae_advantages(x, x, mask, 1.0, 1.5)
    with pytest.raises(ValueError, match="value_lam must be in"):
        gae_advantages(x, x, mask, 1.0, 1.0, value_lam=-0.1)
    with pytest.raises(ValueError, match="values is not finite"):
        gae_advantages(x, torch.tensor([[0.0, NAN, 0.0], [0.0, 0.0, 0.0]]), mask, 1.0, 1.0)
    with pytest.raises(ValueError, match="mask must be"):
        gae_advantages(x, x, torch.ones(6), 1.0, 1.0)


def test_token_level_rewards_put_the_reward_on_the_last_valid_token_and_subtract_the_kl():
    # Row 0: valid at 1, 2 (position 3 is padding) -> reward 2 at position 2. Row 1: valid everywhere -> -1 at 3.
    # Row 2: no valid token -> no reward (its nan is never read). KL 0.5 per token, coefficient 0.1: -0.05 on
    # every valid token, so row 0 reads [0, -0.05, 2 - 0.05, 0].
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    sequence_rewards = torch.tensor([2.0, -1.0, NAN])
    plain = token_level_rewards(sequence_rewards, mask)
    torch.testing.assert_close(plain, torch.tensor([[0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, -1.0], [0.0] * 4]))
    kl = torch.full((3, 4), 0.5)
    shaped = token_level_rewards(sequence_rewards, mask, kl, kl_coef=0.1)
    expected = torch.tensor([[0.0, -0.05, 1.95, 0.0], [-0.05, -0.05, -0.05, -1.05], [0.0] * 4])
    torch.testing.assert_close(shaped, expected, rtol=0, atol=1e-7)
    # A middle gap: valid at 0 and 3, the observation in between; the reward goes on position 3.
    gap = token_level_rewards(torch.tensor([1.0]), torch.tensor([[1, 0, 0, 1, 0]]))
    assert gap.tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="not finite"):
        token_level_rewards(torch.tensor([NAN]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="needs kl_per_token"):
        token_level_rewards(torch.tensor([1.0]), torch.ones(1, 2), kl_coef=0.1)


def test_whiten_by_hand():
    # Valid 1, 3, 5: mean 3, unbiased variance (4 + 0 + 4) / 2 = 4, std 2 -> -1, 0, 1; the masked 100 is ignored.
    x = torch.tensor([[1.0, 3.0], [5.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    torch.testing.assert_close(whiten(x, mask), torch.tensor([[-1.0, 0.0], [1.0, 0.0]]), rtol=0, atol=1e-6)
    # shift_mean=False adds the mean back: scaled only.
    torch.testing.assert_close(whiten(x, mask, shift_mean=False), torch.tensor([[2.0, 3.0], [4.0, 0.0]]),
                               rtol=0, atol=1e-6)
    # One valid entry: no variance, only centered.
    one = torch.tensor([[7.0, 1.0]])
    assert whiten(one, torch.tensor([[1, 0]])).tolist() == [[0.0, 0.0]]
    assert whiten(one, torch.tensor([[1, 0]]), shift_mean=False).tolist() == [[7.0, 0.0]]
    assert whiten(one, torch.zeros(1, 2)).tolist() == [[0.0, 0.0]]
