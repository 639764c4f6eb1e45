"""Models: loading, the embedded tiny models, LoRA, and reward-model scoring (`RewardModel`)."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # lazy: importing posttrain.models must not import transformers
    if name == "RewardModel":
        from posttrain.models.reward import RewardModel

        return RewardModel
    raise AttributeError(f"module 'posttrain.models' has no attribute {name!r}")


__all__ = ["RewardModel"]
