"""Recipe loops (sft, dpo, rm, grpo), evaluation and the quickstart.

Importing this package registers the builder of the trained embedded models (posttrain/tiny-arithmetic-sft and
-small): models/ cannot import a recipe, so the recipe announces itself here.
"""

from pathlib import Path

from posttrain.algorithms.sft import train_sft
from posttrain.config import SFTConfig, load_config
from posttrain.config.presets import preset_path
from posttrain.models.trained import register_builder


def _train_embedded_model(sft_preset: str, run_dir: Path) -> Path:
    cfg = load_config(SFTConfig, preset_path(sft_preset), [
        f"output_dir={run_dir}", "logging.progress=plain", "logging.plot=false",
    ])
    return train_sft(cfg).final_dir


register_builder(_train_embedded_model)
