"""The trained embedded models: each is a shipped SFT preset run from an embedded model, built once on first use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.config import DistillConfig, SFTConfig, load_config
from posttrain.config.presets import preset_path
from posttrain.models import trained
from posttrain.models.tiny import EMBEDDED_MODELS, TOKENIZER_BUILDERS, build_model, cache_dir
from posttrain.models.trained import TRAINED_MODELS, ensure_trained_model


def parameter_count(embedded: str) -> int:
    spec = EMBEDDED_MODELS[embedded]
    with torch.device("meta"):  # shapes only
        model = build_model(spec, TOKENIZER_BUILDERS[spec.tokenizer]())
    return sum(p.numel() for p in model.parameters())


def test_every_trained_model_is_a_shipped_sft_preset_run_from_an_embedded_model():
    assert "posttrain/tiny-2m-arithmetic-sft" in TRAINED_MODELS
    for name, spec in TRAINED_MODELS.items():
        start = load_config(SFTConfig, preset_path(spec.sft_preset)).model.name_or_path
        assert start in EMBEDDED_MODELS or start in TRAINED_MODELS, (name, start)
        assert start != name


def test_the_kd_preset_distils_a_larger_teacher_trained_longer_into_the_untrained_tiny_model():
    kd = load_config(DistillConfig, preset_path("distill_kd_arithmetic.yaml"))
    (teacher,) = kd.teachers
    assert kd.model.name_or_path == "posttrain/tiny" and teacher.name_or_path == "posttrain/tiny-2m-arithmetic-sft"
    large = load_config(SFTConfig, preset_path(TRAINED_MODELS[teacher.name_or_path].sft_preset))
    small = load_config(SFTConfig, preset_path(TRAINED_MODELS["posttrain/tiny-arithmetic-sft"].sft_preset))
    assert large.model.name_or_path == "posttrain/tiny-2m"
    assert large.trainer.max_steps > small.trainer.max_steps
    assert large.data.train_files == small.data.train_files
    # One tokenizer (plain top-k KD, no aligner), and a teacher of 2.2x the student's parameters (2.41M, 1.08M).
    assert EMBEDDED_MODELS["posttrain/tiny-2m"].tokenizer == EMBEDDED_MODELS["posttrain/tiny"].tokenizer
    assert parameter_count("posttrain/tiny-2m") > 2 * parameter_count("posttrain/tiny")


def test_a_trained_model_is_built_once_on_first_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # A stand-in for the SFT run (a copy of the untrained model), in a cache of its own: the session's cache must
    # never hold a fake of the real model.
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fake_sft_run(sft_preset: str, run_dir: Path) -> Path:
        calls.append((sft_preset, run_dir))
        spec = EMBEDDED_MODELS["posttrain/tiny"]
        tokenizer = TOKENIZER_BUILDERS[spec.tokenizer]()
        build_model(spec, tokenizer).save_pretrained(run_dir / "final")
        tokenizer.save_pretrained(run_dir / "final")
        return run_dir / "final"

    monkeypatch.setattr(trained, "_builder", fake_sft_run)
    first = ensure_trained_model("posttrain/tiny-2m-arithmetic-sft")
    version = trained.TRAINED_MODELS["posttrain/tiny-2m-arithmetic-sft"].version
    assert first == cache_dir() / "models" / f"posttrain--tiny-2m-arithmetic-sft-v{version}"
    assert [preset for preset, _ in calls] == ["sft_arithmetic_large.yaml"]
    assert json.loads((first / "posttrain_embedded.json").read_text()) == {
        "name": "posttrain/tiny-2m-arithmetic-sft", "version": version, "sft_preset": "sft_arithmetic_large.yaml"}
    assert ensure_trained_model("posttrain/tiny-2m-arithmetic-sft") == first and len(calls) == 1  # cached
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # the staging folder is gone

    monkeypatch.setattr(trained, "_builder", None)
    with pytest.raises(RuntimeError, match="no builder is registered"):
        ensure_trained_model("posttrain/tiny-arithmetic-sft")


@pytest.mark.slow
def test_the_large_teacher_builds_and_adds():
    import posttrain.algorithms  # noqa: F401  (registers the SFT builder)
    from posttrain.algorithms.evaluate import evaluate_arithmetic
    from posttrain.config.schema import ModelConfig
    from posttrain.models.loading import load_causal_lm, load_tokenizer

    # configs/sft_arithmetic_large.yaml, ~5 minutes on one CPU core. Measured with benchmarks/seeds.py on seed 0
    # (the embedded model) x both CPU code paths: 100% of 800 held-out additions.
    model = ModelConfig(name_or_path="posttrain/tiny-2m-arithmetic-sft")
    result = evaluate_arithmetic(load_causal_lm(model), load_tokenizer(model), num_examples=800)
    assert result.accuracy >= 0.99
