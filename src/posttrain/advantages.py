"""Advantage estimators: the rewards of N sampled completions in, one advantage per completion out.

Every function is pure and returns float32 [N], 0 for invalid samples and never nan. The exception is the token-level
family for PPO with a critic (`gae_advantages`, `token_level_rewards`, `whiten`, at the end of the module), which
works on [N, T] tensors with a validity mask over the tokens; see their docstrings. `RunningRewardNorm`, last,
scales rewards by a run's running statistics before any estimator sees them (environment.normalize_rewards).

Groups are the samples of one prompt and are keyed by an explicit `group_ids` [N] (integer), never by prompt text:
the same prompt drawn twice in a batch makes two groups (PITFALLS). Groups may have different sizes and their
samples may come in any order.

`valid` [N] bool marks the samples whose reward is usable. Invalid samples (a reward function that raised or
timed out) are left out of every baseline and statistic and get advantage 0. A non-finite reward (nan, inf) is
treated as invalid too, so one broken score cannot turn a whole batch of advantages into nan.

Choices the papers leave open:
- Standard deviations are the unbiased (Bessel-corrected, divisor n − 1) ones, as `torch.std` computes them in
  the GRPO implementations of TRL and verl, so advantages match theirs exactly. A group (or batch) with fewer than
  two valid samples has no spread and is only centered.
- Where a group's rewards are all equal its std is 0; dividing is skipped, and its advantages are exactly 0 (the
  centered rewards, computed exactly rather than as r − mean rounded). Such groups carry no signal; DAPO's
  dynamic sampling drops them upstream.
- Statistics are computed in float64 and the result is cast to float32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    normalize_std: bool = True,
    leave_one_out: bool = False,
    epsilon: float = 1e-6,
    valid: Tensor | None = None,
) -> Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024, DeepSeekMath §4.1.2): A_i = (r_i − b_i) / (std_g + ε).

    rewards: [N] one scalar reward per completion. group_ids: [N] integer, equal for the samples of one prompt.
    normalize_std: divide by the group's unbiased std (plus `epsilon`) where it is positive. False gives Dr. GRPO's
        centered rewards (Liu et al. 2025): the division favours questions of middling difficulty.
    leave_one_out: the baseline b_i is the mean of the OTHER valid samples of the group (RLOO's), which equals
        n/(n − 1)·(r_i − mean); else the group mean including r_i. A sample alone in its group gets 0.
    valid: [N] bool, the samples with a usable reward (default: all with a finite reward).
    Returns float32 [N].
    """
    valid = _valid_samples(rewards, valid, group_ids)
    r = torch.where(valid, rewards.double(), 0.0)
    inverse, num_groups = _group_index(group_ids)
    count = _group_sum(valid.double(), inverse, num_groups)
    total = _group_sum(r, inverse, num_groups)
    mean = total / count.clamp(min=1)
    if leave_one_out:
        others = (count[inverse] - 1).clamp(min=1)
        centered = r - (total[inverse] - r) / others
    else:
        centered = r - mean[inverse]
    squared = _group_sum(torch.where(valid, (r - mean[inverse]).square(), 0.0), inverse, num_groups)
    std = (squared / (count - 1).clamp(min=1)).sqrt()
    constant = _constant_groups(r, valid, inverse, num_groups)  # all equal, or fewer than two valid samples
    centered = torch.where(constant[inverse], 0.0, centered)
    if normalize_std:
        centered = torch.where(constant[inverse], 0.0, centered / (std[inverse] + epsilon))
    return torch.where(valid, centered, 0.0).float()


def rloo_advantages(rewards: Tensor, group_ids: Tensor, valid: Tensor | None = None) -> Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, eq. 6): A_i = r_i − mean_{j≠i} r_j.

    The mean is over the other valid samples of i's group; a sample alone in its group gets 0.
    rewards, group_ids, valid: [N] as in `grpo_advantages`. Returns float32 [N].
    """
    return grpo_advantages(rewards, group_ids, normalize_std=False, leave_one_out=True, valid=valid)


def gdpo_advantages(
    rewards: dict[str, Tensor],
    group_ids: Tensor,
    weights: dict[str, float],
    *,
    normalize_std: bool = True,
    valid: Tensor | None = None,
    epsilon: float = 1e-6,
) -> Tensor:
    """Multi-reward advantages of GDPO (Liu et al. 2026, NVIDIA, "GDPO: Group reward-Decoupled Normalization Policy
    Optimization for Multi-reward RL Optimization", arXiv 2601.05242).

    Each reward component k is group-normalized on its own (`grpo_advantages`), the results are summed with
    `weights`, and the sum is re-whitened over the batch's valid samples: A = (S − mean(S)) / (std(S) + ε),
    S_i = Σ_k w_k·A_i^k. Normalizing the weighted SUM of rewards per group instead (plain GRPO) maps different
    reward combinations to the same advantage; the batch whitening keeps the scale independent of the number of
    components.

    rewards: component name -> [N] rewards. weights: the same names -> their weight.
    group_ids, valid: [N] as in `grpo_advantages`; a sample is invalid if any of its components is non-finite.
    Returns float32 [N].
    """
    if set(rewards) != set(weights):
        raise ValueError(f"weights name {sorted(weights)} but rewards name {sorted(rewards)}: give one per component")
    if not rewards:
        raise ValueError("gdpo_advantages needs at least one reward component")
    for name, component in rewards.items():
        if component.shape != group_ids.shape:
            raise ValueError(
                f"rewards[{name!r}] has shape {tuple(component.shape)}, group_ids {tuple(group_ids.shape)}"
            )
    for component in rewards.values():
        valid = _valid_samples(component, valid, group_ids)
    combined = sum(
        weights[name] * grpo_advantages(
            component, group_ids, normalize_std=normalize_std, epsilon=epsilon, valid=valid
        ).double()
        for name, component in rewards.items()
    )
    return _whiten(combined, valid, epsilon).float()


def reinforce_plus_plus_advantages(
    rewards: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    valid: Tensor | None = None,
    epsilon: float = 1e-6,
) -> Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models").

    The KL-shaped return r − kl_coef·kl, whitened over the batch's valid samples (global, not per-group,
    normalization): A = (x − mean(x)) / (std(x) + ε).
    rewards: [N]. kl: [N] per-sample KL(π‖π_ref) summed over the completion's tokens; required when kl_coef > 0.
    valid: [N] bool (default: all with finite reward and kl).
    Departure: the paper subtracts the KL per token and sums it from each token to the end (γ = 1), so early tokens
    see more of the penalty; here the whole sequence's KL shapes one advantage shared by all its tokens.
    Returns float32 [N].
    """
    valid = _valid_samples(rewards, valid)
    shaped = rewards.double()
    if kl_coef != 0:
        if kl is None:
            raise ValueError(f"kl_coef={kl_coef} needs kl (the per-sample summed KL)")
        if kl.shape != rewards.shape:
            raise ValueError(f"kl has shape {tuple(kl.shape)}, rewards {tuple(rewards.shape)}")
        valid = valid & torch.isfinite(kl)
        shaped = shaped - kl_coef * kl.double()
    return _whiten(torch.where(valid, shaped, 0.0), valid, epsilon).float()


def raw_reward_advantages(rewards: Tensor, valid: Tensor | None = None) -> Tensor:
    """A = r (no baseline), e.g. for rewards already centered upstream. rewards, valid: [N]. Returns float32 [N]."""
    valid = _valid_samples(rewards, valid)
    return torch.where(valid, rewards.double(), 0.0).float()


def to_token_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """Broadcast per-sequence advantages [N] to the completion tokens: float32 [N, T], 0 where mask is 0."""
    if advantages.dim() != 1 or mask.dim() != 2 or mask.shape[0] != advantages.shape[0]:
        raise ValueError(f"advantages must be [N] and mask [N, T], got {tuple(advantages.shape)}, {tuple(mask.shape)}")
    return torch.where(mask.bool(), advantages.float()[:, None], 0.0)


def opd_advantages(
    teacher_logprobs: Tensor,
    student_logprobs: Tensor,
    mask: Tensor,
    reward_advantages: Tensor | None = None,
    reward_weight: float = 0.0,
) -> Tensor:
    """On-policy distillation's per-token advantage (Agarwal et al. 2024 with a reverse-KL reward, as in
    Thinking Machines' "On-Policy Distillation", 2025, and NeMo-RL's OPD): A_t = sg[log π_teacher(y_t) −
    log π_student(y_t)] on each sampled token y_t, plus reward_weight × the episode's reward advantage. With the
    policy-gradient loss this is a per-token estimate of −∇ KL(π_student ‖ π_teacher) along the student's own
    samples: tokens the teacher finds likelier than the student are pushed up.

    teacher_logprobs, student_logprobs: [N, T] log-probabilities of the sampled tokens under the sampling
        temperature (the student's from the trainer, not the sampler, so the ratio compares like with like).
    mask: [N, T] 1 on the sampled tokens that get loss (see the section below); 0 elsewhere, and 0 in the result.
    reward_advantages: [N] optional per-episode advantages (e.g. grpo_advantages of an environment reward), added
        to every token of the episode times reward_weight.
    Returns float32 [N, T], detached. A non-finite log-probability at a masked-in token is a ValueError.
    """
    valid = _token_mask(mask)
    if teacher_logprobs.shape != valid.shape or student_logprobs.shape != valid.shape:
        raise ValueError(f"teacher_logprobs {tuple(teacher_logprobs.shape)} and student_logprobs "
                         f"{tuple(student_logprobs.shape)} must have the mask's shape {tuple(valid.shape)}")
    ratio = torch.where(valid, teacher_logprobs.detach().double() - student_logprobs.detach().double(), 0.0)
    if not torch.isfinite(ratio).all():
        raise ValueError("a teacher or student log-probability is not finite at a sampled token")
    if reward_weight:
        if reward_advantages is None:
            raise ValueError(f"reward_weight={reward_weight} needs reward_advantages")
        ratio = ratio + reward_weight * torch.where(valid, reward_advantages.double()[:, None], 0.0)
    return ratio.float()


# ---- token-level advantages: PPO with a critic ----------------------------------------------------------------
#
# Shapes: N completions, T token positions. `mask` [N, T] is 1 on the tokens the policy sampled (its actions) and
# 0 on everything else: prompt, padding, and the tool or user observations appended in the middle of a multi-turn
# episode. The time index of the recursions below counts the valid tokens only, so an observation of any length
# between two of the model's tokens is neither a step of discount nor the end of the episode.


def token_level_rewards(
    sequence_rewards: Tensor, mask: Tensor, kl_per_token: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """Per-token rewards of PPO for language models (Ziegler et al. 2019; Ouyang et al. 2022, eq. 2): the
    sequence's reward on its last valid token, minus kl_coef·KL on every valid token. This is the KL folded into
    the reward ("kl_in_reward"), which the critic then learns to predict, as opposed to the loss's
    `reference_kl_penalty`, which is added to the policy loss per token and never reaches the returns.

    sequence_rewards: [N] one scalar per completion.
    mask: [N, T] 1 on valid response tokens (see the section comment above).
    kl_per_token: [N, T] a per-token KL estimate, e.g. `losses.policy_gradient.kl_estimate` of the sampled
        tokens; required when kl_coef != 0, read at valid tokens only (detached).
    Returns float32 [N, T], 0 at masked positions. A row with no valid token carries no reward (it has no token to
    put it on), so a failed sample whose row is masked out may hold any reward, nan included; a non-finite reward
    or KL where it would be used is a ValueError.
    """
    valid = _token_mask(mask)
    if sequence_rewards.shape != valid.shape[:1]:
        raise ValueError(f"sequence_rewards must be [N] = [{valid.shape[0]}], got shape {tuple(sequence_rewards.shape)}")
    rows = valid.any(-1)
    rewards = sequence_rewards.detach().double()
    if not torch.isfinite(rewards[rows]).all():
        raise ValueError("sequence_rewards is not finite on a row with valid tokens; mask out the row of a sample "
                         "whose reward failed")
    positions = torch.arange(valid.shape[1], device=valid.device)
    last = torch.where(valid, positions, -1).amax(-1)  # the last valid token of each row (-1: none)
    out = torch.zeros(valid.shape, dtype=torch.float64, device=valid.device)
    out[rows, last[rows]] = rewards[rows]
    if kl_coef != 0:
        if kl_per_token is None:
            raise ValueError(f"kl_coef={kl_coef} needs kl_per_token")
        if kl_per_token.shape != valid.shape:
            raise ValueError(f"kl_per_token has shape {tuple(kl_per_token.shape)}, mask {tuple(valid.shape)}")
        kl = torch.where(valid, kl_per_token.detach().double(), 0.0)
        if not torch.isfinite(kl).all():
            raise ValueError("kl_per_token is not finite at a valid token")
        out = out - kl_coef * kl
    return out.float()


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    value_lam: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", eqs. 11-16) over each row's valid tokens, and the critic's targets.

    token_rewards: [N, T] reward of each token's action (e.g. `token_level_rewards`); read at valid tokens only.
    values: [N, T] the critic's V(s_t) before each valid token (detached); read at valid tokens only.
    mask: [N, T] 1 on valid response tokens (see the section comment above).
    gamma: discount γ in [0, 1]. lam: λ in [0, 1] of the policy's advantages.
    value_lam: λ of the returns the critic regresses on; None uses `lam` (standard PPO).

    Backward over the valid tokens of each row, with t' the next valid token after t:
        δ_t = r_t + γ·V_{t'} − V_t        A_t = δ_t + γλ·A_{t'}
    and V_{t'} = A_{t'} = 0 after the last valid token (the episode ends there: no bootstrap). Masked tokens in
    between are skipped, not discounted: the recursion jumps from t' straight back to t.
    λ = 1 gives the Monte-Carlo advantage Σ_{k≥t} γ^(k−t)·r_k − V_t; γ = 0 gives r_t − V_t.

    Returns (advantages, returns), float32 [N, T], 0 at masked positions: advantages = A(lam); returns =
    A(value_lam) + V. A separate value_lam decouples the two bias/variance trade-offs: VC-PPO (Yuan et al. 2025,
    "What's Behind PPO's Collapse in Long-CoT? Value Optimization Holds the Secret") and VAPO (Yue et al. 2025)
    train the critic on unbiased λ = 1 returns, since with a sparse end-of-sequence reward any λ < 1 shrinks
    the reward's signal geometrically toward the first tokens, while the policy keeps λ < 1 for lower variance.
    Computed in float64; a non-finite reward or value at a valid token is a ValueError.
    """
    valid = _token_mask(mask)
    for name, tensor in (("token_rewards", token_rewards), ("values", values)):
        if tensor.shape != valid.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, mask {tuple(valid.shape)}")
    for name, value in (("gamma", gamma), ("lam", lam), ("value_lam", value_lam)):
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    rewards = torch.where(valid, token_rewards.detach().double(), 0.0)
    baseline = torch.where(valid, values.detach().double(), 0.0)
    for name, tensor in (("token_rewards", rewards), ("values", baseline)):
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{name} is not finite at a valid token")
    advantages = _gae_recursion(rewards, baseline, valid, gamma, lam)
    value_advantages = advantages if value_lam is None or value_lam == lam else _gae_recursion(
        rewards, baseline, valid, gamma, value_lam)
    returns = torch.where(valid, value_advantages + baseline, 0.0)
    return advantages.float(), returns.float()


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, epsilon: float = 1e-8) -> Tensor:
    """(x − mean) / sqrt(var + ε) over the entries where `mask` is 1, e.g. advantages [N, T] over the valid response
    tokens of a batch; with shift_mean=False the mean is added back (only scaled, as for rewards).

    x, mask: the same shape. The mean and the unbiased (divisor n − 1) variance are over the valid entries, in
    float64, as TRL's `masked_whiten` computes them. With fewer than two valid entries there is no variance and
    x is only centered (or returned as is with shift_mean=False). Returns float32, same shape, 0 where mask is 0.
    The statistics are of this tensor alone; a data-parallel run would all-reduce count, sum and sum of squared
    deviations first.
    """
    if x.shape != mask.shape:
        raise ValueError(f"x has shape {tuple(x.shape)}, mask {tuple(mask.shape)}")
    valid = mask.bool()
    values = torch.where(valid, x.detach().double(), 0.0)
    count = valid.sum()
    mean = values.sum() / count.clamp(min=1)
    out = values - mean
    if count > 1:
        variance = torch.where(valid, out, 0.0).square().sum() / (count - 1)
        out = out * torch.rsqrt(variance + epsilon)
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, 0.0).float()


def _gae_recursion(rewards: Tensor, values: Tensor, valid: Tensor, gamma: float, lam: float) -> Tensor:
    """A_t of `gae_advantages` for one λ, float64 [N, T], 0 at masked positions."""
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])  # V and A at each row's next valid token (0 past the last)
    next_advantage = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        here = valid[:, t]
        advantage = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_advantage
        advantages[:, t] = torch.where(here, advantage, 0.0)
        next_value = torch.where(here, values[:, t], next_value)
        next_advantage = torch.where(here, advantage, next_advantage)
    return advantages


def _token_mask(mask: Tensor) -> Tensor:
    if mask.dim() != 2:
        raise ValueError(f"mask must be [N, T], got shape {tuple(mask.shape)}")
    return mask.bool()


# ---- helpers ------------------------------------------------------------------------------------------------


def _valid_samples(rewards: Tensor, valid: Tensor | None, group_ids: Tensor | None = None) -> Tensor:
    """Check shapes and dtypes; return the given `valid` (default all True) AND finite(rewards), bool [N]."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got shape {tuple(rewards.shape)}")
    if group_ids is not None:
        if group_ids.shape != rewards.shape:
            raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, rewards {tuple(rewards.shape)}")
        if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
            raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    finite = torch.isfinite(rewards)
    if valid is None:
        return finite
    if valid.shape != rewards.shape or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor shaped like rewards {tuple(rewards.shape)}")
    return valid & finite


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Each sample's group as an index in [0, G), and G."""
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, unique.numel()


def _group_sum(values: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    return values.new_zeros(num_groups).index_add_(0, inverse, values)


def _constant_groups(r: Tensor, valid: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """[G] bool: True where the group's valid rewards are all equal (a group of 0 or 1 valid samples included)."""
    index, values = inverse[valid], r[valid]
    high = r.new_zeros(num_groups).scatter_reduce(0, index, values, "amax", include_self=False)
    low = r.new_zeros(num_groups).scatter_reduce(0, index, values, "amin", include_self=False)
    return high == low


def _whiten(x: Tensor, valid: Tensor, epsilon: float) -> Tensor:
    """(x − mean) / (std + ε) over the valid entries (unbiased std); only centered where std is 0; 0 if invalid."""
    count = valid.sum()
    values = x[valid]
    if count == 0:
        return torch.zeros_like(x)
    centered = x - values.mean()
    if count > 1 and values.max() > values.min():
        centered = centered / (values.std() + epsilon)
    else:
        centered = torch.zeros_like(x)  # every valid value equal: exactly zero, not rounding noise
    return torch.where(valid, centered, 0.0)


class RunningRewardNorm:
    """Running mean and standard deviation of the valid rewards of a run's training batches, for
    `environment.normalize_rewards`.

    `normalize(rewards, valid)` first adds the step's valid rewards to the statistics (Welford's update, in float64,
    batch-merged), then returns (r - mean) / std with std floored at `min_std`; invalid entries stay 0. A reward
    model's scores have no fixed scale or offset, and a critic regresses on them: normalized rewards keep its targets
    near unit scale as the scores drift. The statistics are part of the trainer state, so a resumed run normalizes
    as an uninterrupted one would.
    """

    def __init__(self, min_std: float = 1e-4):
        self.min_std = min_std
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def std(self) -> float:
        """The population standard deviation so far (1.0 before the second reward)."""
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 1.0

    def update(self, values: torch.Tensor) -> None:
        values = values.detach().to(torch.float64).flatten()
        n = values.numel()
        if n == 0:
            return
        batch_mean = float(values.mean())
        batch_m2 = float(((values - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    def normalize(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        self.update(rewards[valid])
        normalized = (rewards - self.mean) / max(self.std, self.min_std)
        return torch.where(valid, normalized, torch.zeros_like(rewards)).to(rewards.dtype)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])
