"""Models: loading, the embedded tiny models, LoRA. `RewardModel` (scoring text with a trained reward model) lives in
posttrain.workers and is importable from here too."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # lazy: importing posttrain.models must not import transformers
    if name == "RewardModel":
        from posttrain.workers.reward_model import RewardModel

        return RewardModel
    raise AttributeError(f"module 'posttrain.models' has no attribute {name!r}")


__all__ = ["RewardModel"]
