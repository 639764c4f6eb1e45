"""AdamW with decoupled weight decay and the warm-up + decay learning-rate schedules."""

from __future__ import annotations

import math

import torch

from posttrain.config.schema import TrainerConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainerConfig) -> torch.optim.AdamW:
    """AdamW over trainable parameters; biases and norm weights (1-D tensors) get no weight decay."""
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (decay if parameter.ndim >= 2 else no_decay).append(parameter)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        # One fused kernel over all parameters: measurably cheaper per step than foreach on CPU and GPU.
        fused=True,
    )


def lr_multiplier(step: int, cfg: TrainerConfig) -> float:
    """Learning-rate factor for optimizer step `step` (0-based: the first update uses step 0).

    Linear warm-up over warmup_steps (the first update already gets 1/warmup_steps of the peak, never 0),
    then cosine or linear decay from 1 to min_lr_ratio at the last step, or constant.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_scheduler == "constant":
        return 1.0
    decay_steps = max(1, cfg.max_steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.lr_scheduler == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainerConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
