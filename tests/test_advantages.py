"""Advantage estimators against values derived by hand, with ragged, shuffled and partly invalid groups."""

import math

import pytest
import torch

from posttrain.advantages import (
    gdpo_advantages,
    grpo_advantages,
    raw_reward_advantages,
    reinforce_plus_plus_advantages,
    RunningRewardNorm,
    rloo_advantages,
    to_token_advantages,
)

SQRT2, SQRT3 = math.sqrt(2.0), math.sqrt(3.0)
NAN = float("nan")


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def _assert_close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), rtol=0, atol=atol)


# Three groups, shuffled, of sizes 3, 2 and 1:
#   group 5 (samples 0, 2, 4): rewards 1, 0, 0. Mean 1/3; unbiased variance ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3,
#       std 1/sqrt 3. Centered 2/3, -1/3, -1/3; standardized 2/sqrt 3, -1/sqrt 3, -1/sqrt 3.
#   group 2 (samples 1, 3): rewards 0, 1. Mean 1/2; variance (1/4 + 1/4) / 1 = 1/2, std 1/sqrt 2.
#       Centered -1/2, 1/2; standardized -1/sqrt 2, 1/sqrt 2.
#   group 9 (sample 5): alone, advantage 0 whatever its reward.
GROUP_IDS = ids(5, 2, 5, 2, 5, 9)
REWARDS = t(1.0, 0.0, 0.0, 1.0, 0.0, 3.0)


def test_grpo_by_hand_with_shuffled_groups_of_different_sizes():
    advantages = grpo_advantages(REWARDS, GROUP_IDS, epsilon=0.0)
    _assert_close(advantages, [2 / SQRT3, -1 / SQRT2, -1 / SQRT3, 1 / SQRT2, -1 / SQRT3, 0.0])
    # epsilon = 1e-6 only shifts the divisor
    default = grpo_advantages(REWARDS, GROUP_IDS)
    _assert_close(default, [2 / 3 / (1 / SQRT3 + 1e-6), -0.5 / (1 / SQRT2 + 1e-6), -1 / 3 / (1 / SQRT3 + 1e-6),
                            0.5 / (1 / SQRT2 + 1e-6), -1 / 3 / (1 / SQRT3 + 1e-6), 0.0])


def test_grpo_without_std_is_centered_rewards():
    # Dr. GRPO: the centered rewards of the comment above.
    _assert_close(grpo_advantages(REWARDS, GROUP_IDS, normalize_std=False), [2 / 3, -0.5, -1 / 3, 0.5, -1 / 3, 0.0])


def test_grpo_leave_one_out_baseline():
    # Baseline = mean of the OTHER samples of the group.
    #   group 5: 1 - (0 + 0)/2 = 1; 0 - (1 + 0)/2 = -1/2 (twice). group 2: 0 - 1 = -1; 1 - 0 = 1. group 9: 0.
    # With std: divided by the group std, 1/sqrt 3 and 1/sqrt 2.
    loo = grpo_advantages(REWARDS, GROUP_IDS, normalize_std=False, leave_one_out=True)
    _assert_close(loo, [1.0, -1.0, -0.5, 1.0, -0.5, 0.0])
    loo_std = grpo_advantages(REWARDS, GROUP_IDS, leave_one_out=True, epsilon=0.0)
    _assert_close(loo_std, [SQRT3, -SQRT2, -0.5 * SQRT3, SQRT2, -0.5 * SQRT3, 0.0])
    # = n/(n - 1) times the centered rewards
    centered = grpo_advantages(REWARDS, GROUP_IDS, normalize_std=False)
    _assert_close(loo, centered * t(1.5, 2.0, 1.5, 2.0, 1.5, 1.0))


def test_grpo_is_equivariant_to_sample_order():
    permutation = torch.tensor([3, 0, 5, 1, 4, 2])
    shuffled = grpo_advantages(REWARDS[permutation], GROUP_IDS[permutation])
    _assert_close(shuffled, grpo_advantages(REWARDS, GROUP_IDS)[permutation].tolist())


def test_identical_prompts_in_different_groups_stay_apart():
    # The same prompt sampled in two rows of the batch: ids 0 and 1. Group 0 rewards 1, 0 -> +-1/sqrt 2;
    # group 1 rewards 1, 1 -> 0. Merged into one group (mean 3/4) sample 2 would get a positive advantage.
    advantages = grpo_advantages(t(1.0, 0.0, 1.0, 1.0), ids(0, 0, 1, 1), epsilon=0.0)
    _assert_close(advantages, [1 / SQRT2, -1 / SQRT2, 0.0, 0.0])
    assert grpo_advantages(t(1.0, 0.0, 1.0, 1.0), ids(0, 0, 0, 0))[2] > 0


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("normalize_std", [False, True])
def test_equal_rewards_and_singletons_give_exact_zeros(leave_one_out, normalize_std):
    # 0.1 three times: 0.1 + 0.1 + 0.1 != 0.3 in floating point, so r - mean rounds to ~1e-17, not 0; the
    # group has std 0 and must come out exactly 0 (and never nan from 0/0). Sample 3 is alone in its group.
    rewards, group_ids = t(0.1, 0.1, 0.1, 0.7), ids(4, 4, 4, 1)
    advantages = grpo_advantages(rewards, group_ids, normalize_std=normalize_std, leave_one_out=leave_one_out)
    assert advantages.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_invalid_samples_are_excluded_and_get_zero():
    # Group 0: sample 2 is invalid (its reward 100 must not enter the statistics): rewards 1, 0 -> +-1/sqrt 2.
    # Group 1: sample 3 has a nan reward (invalid even without `valid`), so sample 4 is alone: 0.
    # Group 2: every sample invalid: 0, and no nan.
    rewards = t(1.0, 0.0, 100.0, NAN, 2.0, NAN, 7.0)
    group_ids = ids(0, 0, 0, 1, 1, 2, 2)
    valid = torch.tensor([True, True, False, True, True, False, False])
    expected = [1 / SQRT2, -1 / SQRT2, 0.0, 0.0, 0.0, 0.0, 0.0]
    _assert_close(grpo_advantages(rewards, group_ids, valid=valid, epsilon=0.0), expected)
    loo = rloo_advantages(rewards, group_ids, valid=valid)
    _assert_close(loo, [1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    everything_invalid = grpo_advantages(rewards, group_ids, valid=torch.zeros(7, dtype=torch.bool))
    assert everything_invalid.tolist() == [0.0] * 7


def test_rloo_by_hand():
    # Group 3: rewards 1, 0, 0, 1. r_i - mean of the other three: 1 - 1/3 = 2/3, 0 - 2/3 = -2/3, -2/3, 2/3.
    # Group 8: a single sample: 0.
    advantages = rloo_advantages(t(1.0, 0.0, 0.0, 1.0, 5.0), ids(3, 3, 3, 3, 8))
    _assert_close(advantages, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0])


# ---- GDPO -----------------------------------------------------------------------------------------------


def test_gdpo_by_hand():
    # Groups 0 = samples 0, 1 and 1 = samples 2, 3. correctness 1, 0 | 1, 1; format 1, 1 | 0, 1; weights 1, 0.5.
    #   correctness, group-normalized: +-1/sqrt 2 | 0, 0. format: 0, 0 | -1/sqrt 2, +1/sqrt 2.
    #   S = [1/sqrt 2, -1/sqrt 2, -0.5/sqrt 2, 0.5/sqrt 2]: mean 0, sum of squares 1/2 + 1/2 + 1/8 + 1/8 = 5/4,
    #   unbiased std sqrt(5/12). Whitened: (1/sqrt 2) / sqrt(5/12) = sqrt(6/5) = sqrt 1.2; half of it sqrt 0.3.
    rewards = {"correctness": t(1.0, 0.0, 1.0, 1.0), "format": t(1.0, 1.0, 0.0, 1.0)}
    weights = {"correctness": 1.0, "format": 0.5}
    advantages = gdpo_advantages(rewards, ids(0, 0, 1, 1), weights, epsilon=0.0)
    _assert_close(advantages, [math.sqrt(1.2), -math.sqrt(1.2), -math.sqrt(0.3), math.sqrt(0.3)])
    # GRPO on the weighted sum 1.5, 1 | 0.5, 1.5 gives +-1/sqrt 2 in both groups: the two reward sources are
    # no longer told apart, which is what GDPO's decoupling avoids.
    summed = grpo_advantages(t(1.5, 1.0, 0.5, 1.5), ids(0, 0, 1, 1), epsilon=0.0)
    _assert_close(summed, [1 / SQRT2, -1 / SQRT2, -1 / SQRT2, 1 / SQRT2])


def test_gdpo_masks_a_sample_if_any_component_failed():
    # Sample 3's format reward is nan: it is invalid for every component. Group 1 then holds only sample 2 (0
    # in both components), so S = [1/sqrt 2, -1/sqrt 2, 0] over the valid samples: mean 0, unbiased std
    # sqrt(1/2) -> 1, -1, 0; sample 3 gets 0.
    rewards = {"correctness": t(1.0, 0.0, 1.0, 1.0), "format": t(1.0, 1.0, 0.0, NAN)}
    advantages = gdpo_advantages(rewards, ids(0, 0, 1, 1), {"correctness": 1.0, "format": 0.5}, epsilon=0.0)
    _assert_close(advantages, [1.0, -1.0, 0.0, 0.0])


def test_gdpo_rejects_weights_that_do_not_name_the_components():
    with pytest.raises(ValueError, match="weights"):
        gdpo_advantages({"a": t(1.0, 0.0)}, ids(0, 0), {"b": 1.0})


# ---- REINFORCE++ ----------------------------------------------------------------------------------------


def test_reinforce_plus_plus_by_hand():
    # r - 0.5 kl = 1 - 0, 2 - 0.5, 3 - 0, 4 - 1 = 1, 1.5, 3, 3. Mean 2.125; deviations -1.125, -0.625, 0.875,
    # 0.875; sum of squares 3.1875, unbiased variance 1.0625, std 1.03078. Sample 4 is invalid: 0, not counted.
    rewards, kl = t(1.0, 2.0, 3.0, 4.0, 100.0), t(0.0, 1.0, 0.0, 2.0, 0.0)
    valid = torch.tensor([True, True, True, True, False])
    advantages = reinforce_plus_plus_advantages(rewards, kl=kl, kl_coef=0.5, valid=valid, epsilon=0.0)
    std = math.sqrt(1.0625)
    _assert_close(advantages, [-1.125 / std, -0.625 / std, 0.875 / std, 0.875 / std, 0.0])
    with pytest.raises(ValueError, match="kl"):
        reinforce_plus_plus_advantages(rewards, kl_coef=0.5)


def test_batch_whitening_of_equal_or_invalid_rewards_is_zero():
    assert reinforce_plus_plus_advantages(t(0.1, 0.1, 0.1)).tolist() == [0.0, 0.0, 0.0]
    assert reinforce_plus_plus_advantages(t(NAN, NAN)).tolist() == [0.0, 0.0]
    assert reinforce_plus_plus_advantages(t(2.0)).tolist() == [0.0]
    equal = {"a": t(1.0, 1.0, 0.0, 0.0)}
    assert gdpo_advantages(equal, ids(0, 0, 1, 1), {"a": 1.0}).tolist() == [0.0] * 4


# ---- raw rewards and broadcasting -----------------------------------------------------------------------


def test_raw_reward_advantages_and_token_broadcast():
    raw = raw_reward_advantages(torch.tensor([1.5, NAN, -2.0], dtype=torch.float64))
    assert raw.dtype == torch.float32 and raw.tolist() == [1.5, 0.0, -2.0]
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    assert to_token_advantages(t(2.0, -1.0), mask).tolist() == [[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]


def test_bad_inputs_are_errors():
    with pytest.raises(ValueError, match="group_ids must be an integer"):
        grpo_advantages(t(1.0, 0.0), torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match="group_ids has shape"):
        grpo_advantages(t(1.0, 0.0), ids(0, 0, 0))
    with pytest.raises(ValueError, match="valid"):
        grpo_advantages(t(1.0, 0.0), ids(0, 0), valid=torch.tensor([1, 0]))


def test_running_reward_norm_matches_the_statistics_of_everything_seen():
    norm = RunningRewardNorm()
    first, second = torch.tensor([1.0, 2.0, 99.0, 3.0]), torch.tensor([10.0, 4.0])
    valid = torch.tensor([True, True, False, True])
    out = norm.normalize(first, valid)
    # After the first batch: the valid 1, 2, 3 -> mean 2, population std sqrt(2/3).
    assert norm.count == 3 and norm.mean == pytest.approx(2.0) and norm.std == pytest.approx(math.sqrt(2 / 3))
    assert out.tolist() == pytest.approx([-1 / math.sqrt(2 / 3), 0.0, 0.0, 1 / math.sqrt(2 / 3)])
    assert out[2] == 0.0  # invalid: left out of the statistics, normalized to 0
    out = norm.normalize(second, torch.tensor([True, True]))
    seen = torch.tensor([1.0, 2.0, 3.0, 10.0, 4.0], dtype=torch.float64)
    mean, std = float(seen.mean()), float(seen.std(unbiased=False))
    assert norm.mean == pytest.approx(mean) and norm.std == pytest.approx(std)
    assert out.tolist() == pytest.approx([(10 - mean) / std, (4 - mean) / std])

    restored = RunningRewardNorm()
    restored.load_state_dict(norm.state_dict())
    assert restored.state_dict() == norm.state_dict()
    # One reward has no spread: it is only centered (std 1), never divided by zero.
    single = RunningRewardNorm()
    assert single.normalize(torch.tensor([5.0]), torch.tensor([True])).tolist() == [0.0]
    # Equal rewards: std 0 is floored, the result stays finite.
    equal = RunningRewardNorm()
    assert equal.normalize(torch.tensor([2.0, 2.0]), torch.tensor([True, True])).tolist() == [0.0, 0.0]



def test_opd_advantages_are_the_per_token_log_ratio_plus_the_weighted_reward_advantage():
    from posttrain.advantages import opd_advantages

    # Two episodes, four positions; the first position is the prompt, the last of episode 1 is padding.
    teacher = torch.tensor([[0.0, -0.5, -1.0, -2.0], [0.0, -0.1, -3.0, 0.0]])
    student = torch.tensor([[0.0, -1.5, -0.25, -2.0], [0.0, -0.4, -1.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])
    # log-ratios by hand: episode 0: -0.5 - -1.5 = 1.0, -1.0 - -0.25 = -0.75, -2 - -2 = 0; episode 1: 0.3, -2.0
    expected = [[0.0, 1.0, -0.75, 0.0], [0.0, 0.3, -2.0, 0.0]]
    torch.testing.assert_close(opd_advantages(teacher, student, mask), torch.tensor(expected))
    # with a reward advantage of +1 and -0.5 weighted by 0.2 on each episode's sampled tokens
    mixed = opd_advantages(teacher, student, mask, torch.tensor([1.0, -0.5]), reward_weight=0.2)
    torch.testing.assert_close(mixed, torch.tensor([[0.0, 1.2, -0.55, 0.2], [0.0, 0.2, -2.1, 0.0]]))
    # control: the sign matters (the student's minus the teacher's would be the negation)
    assert not torch.allclose(opd_advantages(student, teacher, mask), torch.tensor(expected))
    with pytest.raises(ValueError, match="reward_advantages"):
        opd_advantages(teacher, student, mask, reward_weight=0.5)
    with pytest.raises(ValueError, match="not finite"):
        opd_advantages(teacher.index_put((torch.tensor([0]), torch.tensor([1])), torch.tensor(float("nan"))),
                       student, mask)
