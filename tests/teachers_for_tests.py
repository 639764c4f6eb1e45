"""A teacher for the distillation tests: the embedded tiny model with every weight perturbed (seeded), saved with
the student's tokenizer, so it is another model that can serve the same student."""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.algorithms.sft import train_sft
from posttrain.config import SFTConfig, load_config
from posttrain.config.schema import ModelConfig
from posttrain.models.loading import load_causal_lm, load_tokenizer


TINY_DISTILL = [
    "model.name_or_path=posttrain/tiny",
    "data.max_length=32",
    "trainer.micro_batch_size=8",
    "trainer.gradient_accumulation_steps=2",
    "trainer.learning_rate=1e-3",
    "trainer.lr_scheduler=constant",
    "loss.topk=8",
    "logging.progress=none",
    "logging.plot=false",
    "logging.report=false",
]
"""The distillation tests' small run: the tiny student, 2 micro-batches of 8 per step, top-8, no progress or plots."""
ARITHMETIC_64 = "data.train_files=['posttrain/arithmetic[:64]']"


def perturbed_tiny_teacher(folder: Path, scale: float = 0.5, seed: int = 0, base: str = "posttrain/tiny") -> Path:
    """`base` (posttrain/tiny, or posttrain/tiny-bpe for a teacher with another tokenizer) with every weight
    perturbed by seeded noise of scale `scale`, saved with its tokenizer into `folder`."""
    model = load_causal_lm(ModelConfig(name_or_path=base))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    model.save_pretrained(folder)
    load_tokenizer(ModelConfig(name_or_path=base)).save_pretrained(folder)
    return folder


def sft_on_64_rows(model: str, folder: Path) -> Path:
    """`model` after 150 SFT steps on the 64 training rows of ARITHMETIC_64 (it has their completions nearly by
    heart); the final model's directory."""
    result = train_sft(load_config(SFTConfig, None, [
        f"model.name_or_path={model}", "data.train_files=['posttrain/arithmetic[:64]']",
        "data.max_length=32", "trainer.micro_batch_size=16", "trainer.max_steps=150", "trainer.learning_rate=3e-3",
        "trainer.lr_scheduler=constant", "logging.progress=none", "logging.plot=false", "logging.report=false",
        f"output_dir={folder}"]))
    return result.final_dir
