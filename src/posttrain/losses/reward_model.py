"""Bradley-Terry loss for training a scalar reward model on (chosen, rejected) pairs.

Departures: none from the papers; the optional margin is Llama 2's (Touvron et al. 2023, eq. 2) and the
centering term is TRL's `center_rewards_coefficient` (Eisenstein et al. 2023), summed per pair and
reduced like the main term so that micro-batch splits do not change it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.losses.preference import reduce_over_step


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | None = None,
    num_pairs_in_step: float | None = None,
    *,
    center_rewards_coefficient: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """−log σ(r_c − r_r − margin) + center_rewards_coefficient·(r_c + r_r)², reduced over pairs.

    chosen_rewards, rejected_rewards: [B] scalar rewards r_c, r_r of the two completions of each pair.
    margin: [B] how much r_c should exceed r_r (Llama 2's graded-preference margin), or None for 0.
    num_pairs_in_step: pairs in the whole optimizer step; the loss is then the sum over this batch's pairs
        divided by it (the step-wide normalization). None: the mean over this batch.
    center_rewards_coefficient: weight of (r_c + r_r)², which keeps rewards centred on zero without
        changing their differences.
    Returns (loss, metrics) with batch means as detached 0-dim tensors: `accuracy` (fraction with r_c > r_r, ties
    count as wrong), `margin` (r_c − r_r, the learned margin, not the target), `chosen_reward`, `rejected_reward`,
    `loss`.
    """
    if chosen_rewards.dim() != 1 or chosen_rewards.shape != rejected_rewards.shape:
        raise ValueError(
            f"chosen_rewards {tuple(chosen_rewards.shape)} and rejected_rewards {tuple(rejected_rewards.shape)} "
            "must both be [B]"
        )
    if margin is not None and margin.shape != chosen_rewards.shape:
        raise ValueError(f"margin has shape {tuple(margin.shape)}, chosen_rewards {tuple(chosen_rewards.shape)}")
    difference = chosen_rewards - rejected_rewards
    losses = -F.logsigmoid(difference if margin is None else difference - margin)
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (chosen_rewards + rejected_rewards) ** 2
    loss = reduce_over_step(losses, num_pairs_in_step)
    with torch.no_grad():
        metrics = {
            "loss": loss.detach(),
            "accuracy": (difference > 0).float().mean(),
            "margin": difference.mean(),
            "chosen_reward": chosen_rewards.mean(),
            "rejected_reward": rejected_rewards.mean(),
        }
    return loss, metrics
