"""The scalar head on architectures without a sequence classifier in transformers (Granite): reward-model training,
saving, and scoring through RewardModel; architectures with one keep AutoModelForSequenceClassification."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, GraniteConfig, GraniteForCausalLM

from posttrain.algorithms.rm import train_rm
from posttrain.config import RMConfig, load_config
from posttrain.config.schema import ModelConfig
from posttrain.logging import read_metrics
from posttrain.workers import RewardModel
from posttrain.models.loading import load_reward_backbone, load_tokenizer
from posttrain.models.tiny import build_tokenizer
from posttrain.models.value_head import scalar_head_model_class, token_scores


@pytest.fixture(scope="module")
def tiny_granite_dir(tmp_path_factory) -> Path:
    """A randomly initialized ~100k-parameter Granite causal LM with the embedded byte-level tokenizer."""
    tokenizer = build_tokenizer()
    config = GraniteConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GraniteForCausalLM(config)
    directory = tmp_path_factory.mktemp("tiny-granite")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def loud_pairs(n: int) -> list[dict]:
    return [{"prompt": f"{i}+{i}=", "chosen": f"{2 * i}!", "rejected": f"{2 * i}?"} for i in range(n)]


def write_pairs(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_llama_keeps_the_transformers_sequence_classifier(tiny_model_dir):
    assert scalar_head_model_class(tiny_model_dir) is AutoModelForSequenceClassification


def test_granite_gets_a_scalar_head_that_reads_the_last_non_pad_token(tiny_granite_dir):
    with pytest.raises(ValueError, match="Unrecognized configuration class"):  # what `posttrain rm` hit before
        AutoModelForSequenceClassification.from_pretrained(tiny_granite_dir, num_labels=1)
    cls = scalar_head_model_class(tiny_granite_dir)
    assert cls.__name__ == "GraniteForScalarHead" and scalar_head_model_class(tiny_granite_dir) is cls
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_granite_dir)))
    torch.manual_seed(0)
    model = load_reward_backbone(ModelConfig(name_or_path=str(tiny_granite_dir)), tokenizer.pad_token_id).eval()
    assert model.score.weight.shape == (1, 32) and model.score.bias is None
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[5, 6, 7, pad, pad], [8, 9, 10, 11, 12]])
    attention = (ids != pad).long()
    with torch.no_grad():
        pooled = model(input_ids=ids, attention_mask=attention).logits
        per_token = token_scores(model, ids, attention)
        alone = model(input_ids=ids[:1, :3]).logits  # the first row without its padding
    assert pooled.shape == (2, 1) and per_token.shape == (2, 5, 1)
    torch.testing.assert_close(pooled, torch.stack([per_token[0, 2], per_token[1, 4]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(pooled[:1], alone, rtol=0, atol=1e-5)


def test_token_scores_match_the_builtin_sequence_classifier(tiny_model_dir):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    torch.manual_seed(0)
    model = load_reward_backbone(ModelConfig(name_or_path=str(tiny_model_dir)), tokenizer.pad_token_id).eval()
    ids = torch.tensor([[5, 6, 7, tokenizer.pad_token_id], [8, 9, 10, 11]])
    with torch.no_grad():
        pooled = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits
        per_token = token_scores(model, ids, (ids != tokenizer.pad_token_id).long())
    torch.testing.assert_close(pooled, torch.stack([per_token[0, 2], per_token[1, 3]]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_rm_on_granite_trains_saves_and_scores_through_reward_model(tmp_path, tiny_granite_dir, lora):
    train = write_pairs(tmp_path / "train.jsonl", loud_pairs(16))
    heldout = write_pairs(tmp_path / "heldout.jsonl", loud_pairs(24)[16:])
    cfg = load_config(RMConfig, None, [
        f"model.name_or_path={tiny_granite_dir}", f"output_dir={tmp_path / 'run'}", f"data.train_files=['{train}']",
        f"data.eval_files=['{heldout}']", "data.max_length=32", "trainer.micro_batch_size=8", "trainer.max_steps=3",
        "trainer.learning_rate=1e-3", "trainer.lr_scheduler=constant", "logging.progress=none", "logging.plot=false",
        f"lora.enabled={str(lora).lower()}",
    ])
    result = train_rm(cfg)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)

    config = json.loads((result.final_dir / "config.json").read_text())
    assert config["architectures"] == ["GraniteForScalarHead"] and config["model_type"] == "granite"
    scorer = RewardModel.from_pretrained(result.final_dir)
    assert type(scorer.model).__name__ == "GraniteForScalarHead" and scorer.model.config.num_labels == 1
    held = loud_pairs(24)[16:]
    chosen = scorer.score([r["prompt"] for r in held], [r["chosen"] for r in held])
    rejected = scorer.score([r["prompt"] for r in held], [r["rejected"] for r in held])
    # The saved model scores the held-out pairs exactly as the run's final evaluation did.
    margin = sum(c - r for c, r in zip(chosen, rejected)) / len(held)
    assert margin == pytest.approx(records[-1]["eval_margin"], abs=1e-4)
    assert len(set(chosen + rejected)) > 1  # the head reads each text, not a constant
