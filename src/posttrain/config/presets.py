"""Configs shipped with posttrain (the repository's configs/ folder is this package folder)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from posttrain.config.loader import read_yaml_with_defaults


def preset_path(name: str) -> Path:
    return Path(str(resources.files("posttrain") / "configs" / name))


def quickstart_base_config() -> dict[str, Any]:
    """The quickstart's stage defaults: configs/sft_arithmetic_small.yaml and configs/grpo_arithmetic.yaml."""
    return {"sft": read_yaml_with_defaults(preset_path("sft_arithmetic_small.yaml")),
            "grpo": read_yaml_with_defaults(preset_path("grpo_arithmetic.yaml"))}
