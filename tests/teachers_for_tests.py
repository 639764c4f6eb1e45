"""A teacher for the distillation tests: the embedded tiny model with every weight perturbed (seeded), saved with
the student's tokenizer, so it is another model that can serve the same student."""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.config.schema import ModelConfig
from posttrain.models.loading import load_causal_lm, load_tokenizer


def perturbed_tiny_teacher(folder: Path, scale: float = 0.5, seed: int = 0) -> Path:
    model = load_causal_lm(ModelConfig(name_or_path="posttrain/tiny"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    model.save_pretrained(folder)
    load_tokenizer(ModelConfig(name_or_path="posttrain/tiny")).save_pretrained(folder)
    return folder
