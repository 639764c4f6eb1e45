"""Configs shipped with posttrain (the repository's configs/ folder is this package folder)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml


def preset_path(name: str) -> Path:
    return Path(str(resources.files("posttrain") / "configs" / name))


def quickstart_base_config() -> dict[str, Any]:
    """The quickstart's SFT stage defaults: configs/sft_arithmetic.yaml."""
    return {"sft": yaml.safe_load(preset_path("sft_arithmetic.yaml").read_text())}
