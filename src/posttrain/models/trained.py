"""Embedded models that are trained, not just built: built on first use by running a shipped recipe.

    posttrain/tiny-arithmetic-sft   posttrain/tiny after configs/sft_arithmetic.yaml (SFT on 2-digit
                                    addition, ~2 minutes on two CPU cores the first time; 100% held-out
                                    exact match on every seed and CPU code path measured)
    posttrain/tiny-arithmetic-sft-small   posttrain/tiny after configs/sft_arithmetic_small.yaml (SFT on only
                                    500 labelled additions, ~90 s; memorizes them, 22-30% held-out: the start for GRPO)
    posttrain/tiny-subtraction-sft  posttrain/tiny after configs/sft_subtraction.yaml (the same recipe on 2-digit
                                    subtraction: the second task's teacher for multi-teacher distillation)
    posttrain/tiny-arithmetic-judge  posttrain/tiny-arithmetic-sft after configs/sft_judge_arithmetic.yaml (a judge
                                    of sums: "12+34=47?" -> "46 vs 47. Score: 0"; the judge of
                                    configs/grpo_judge_arithmetic.yaml)
    posttrain/tiny-bpe-arithmetic-sft   posttrain/tiny-bpe (another tokenizer: a small BPE) after
                                    configs/sft_bpe_arithmetic.yaml; the teacher of cross-tokenizer distillation
                                    (configs/distill_xtoken_arithmetic.yaml)
    posttrain/tiny-2m-arithmetic-sft   posttrain/tiny-2m (2.4M parameters against posttrain/tiny's 1.1M) after
                                    configs/sft_arithmetic_large.yaml (the same SFT, 3000 steps; ~5 minutes on one
                                    CPU thread the first time; 100% held-out exact match on both CPU code paths):
                                    the larger teacher of configs/distill_kd_arithmetic.yaml
    posttrain/tiny-tools-sft        posttrain/tiny after configs/sft_tools_arithmetic.yaml (1,000 5-digit word
                                    problems, four in ten worked with the calculator, the rest answered directly;
                                    15-30 minutes on one CPU thread): the start of configs/grpo_tools_arithmetic.yaml

The starting point for recipes that need an already-competent policy (DPO, GRPO on arithmetic). The run
trains in a hidden temporary directory beside the cache entry and only its final/ model is renamed into
place, so an interrupted build leaves nothing that looks finished.

Layering: models/ never imports algorithms/. The recipe that builds these models is registered by
posttrain.algorithms when it is imported (every recipe, the CLI and the quickstart import it), through
`register_builder`; resolving such a name with no builder registered fails with a message saying so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from posttrain.models.tiny import build_into_cache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainedSpec:
    """A shipped SFT preset (posttrain.config.presets) and a version to bump whenever its result changes."""

    sft_preset: str
    version: int = 1


TRAINED_MODELS: dict[str, TrainedSpec] = {
    # Versions bumped together when the embedded base models' generation_config.json gained <|im_end|> (their
    # exports carry it).
    "posttrain/tiny-arithmetic-sft": TrainedSpec(sft_preset="sft_arithmetic.yaml", version=3),
    "posttrain/tiny-arithmetic-sft-small": TrainedSpec(sft_preset="sft_arithmetic_small.yaml", version=4),
    "posttrain/tiny-subtraction-sft": TrainedSpec(sft_preset="sft_subtraction.yaml", version=2),
    "posttrain/tiny-arithmetic-judge": TrainedSpec(sft_preset="sft_judge_arithmetic.yaml", version=3),
    "posttrain/tiny-bpe-arithmetic-sft": TrainedSpec(sft_preset="sft_bpe_arithmetic.yaml", version=2),
    "posttrain/tiny-2m-arithmetic-sft": TrainedSpec(sft_preset="sft_arithmetic_large.yaml", version=2),
    "posttrain/tiny-tools-sft": TrainedSpec(sft_preset="sft_tools_arithmetic.yaml", version=2),
}


TrainedBuilder = Callable[[str, Path], Path]
"""(SFT preset file name, an empty run directory) -> the trained model's directory (the run's final/)."""

_builder: TrainedBuilder | None = None


def register_builder(builder: TrainedBuilder) -> None:
    """Set the function that trains an embedded model from its preset (posttrain.algorithms registers train_sft)."""
    global _builder
    _builder = builder


def is_trained_embedded(name: str) -> bool:
    return name in TRAINED_MODELS


def ensure_trained_model(name: str) -> Path:
    """Directory of trained embedded model `name`, training it on first use."""
    spec = TRAINED_MODELS[name]

    def build(staging: Path) -> Path:
        if _builder is None:
            raise RuntimeError(f"{name} is trained on first use by running configs/{spec.sft_preset}, and no "
                               "builder is registered: import posttrain.algorithms first (the CLI does)")
        log.warning("building embedded model %s: running %s once (a few minutes on CPU)", name, spec.sft_preset)
        return _builder(spec.sft_preset, staging / "run")

    return build_into_cache(name, spec.version, build, sft_preset=spec.sft_preset)
