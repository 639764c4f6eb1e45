"""LoRA through peft for SFT, DPO and reward models: only adapters train, the adapter-disabled base is DPO's
reference, adapter and merged model are exported, resume repeats the uninterrupted run."""

import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from posttrain.algorithms import dpo
from posttrain.algorithms.dpo import train_dpo
from posttrain.algorithms.rm import train_rm
from posttrain.algorithms.sft import train_sft
from posttrain.config import ConfigError, DPOConfig, RMConfig, SFTConfig, load_config
from posttrain.config.schema import LoraSection, ModelConfig
from posttrain.logging import read_metrics
from posttrain.models.loading import load_causal_lm, load_trainable_model

COMMON = [
    "model.name_or_path=posttrain/tiny",
    "data.max_length=32",
    "trainer.micro_batch_size=16",
    "trainer.learning_rate=1e-3",
    "trainer.lr_scheduler=constant",
    "lora.enabled=true",
    "lora.r=4",
    "lora.alpha=8",
    "logging.progress=none",
    "logging.plot=false",
]
SFT = [*COMMON, "data.train_files=['posttrain/arithmetic[:128]']"]
PAIRS = [*COMMON, "data.train_files=['posttrain/arithmetic-preference[:128]']"]


def losses(output_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir / "metrics.jsonl")]


def test_only_adapter_parameters_get_gradients(tiny_model_dir):
    model = load_trainable_model(ModelConfig(name_or_path="posttrain/tiny"), LoraSection(enabled=True, r=4),
                                 None, torch.device("cpu"))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    model(input_ids=ids, labels=ids).loss.backward()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    nonzero = {name for name, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert trainable and all("lora_" in name for name in trainable)
    # all-linear: every projection of every layer, not the (tied) output head.
    assert {name.split(".lora_")[0].split(".")[-1] for name in trainable} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"}
    assert with_grad == trainable  # no base weight gets a gradient
    # B starts at zero, so at the first step only the B matrices get a nonzero gradient (A's is B^T times ...).
    assert nonzero == {name for name in trainable if "lora_B" in name}


def test_lora_sft_changes_only_adapters_and_exports_adapter_and_merged_model(tmp_path, tiny_model_dir):
    result = train_sft(load_config(SFTConfig, None, [*SFT, f"output_dir={tmp_path}", "trainer.max_steps=15"]))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[-1]["loss"] < records[0]["loss"] - 0.5  # measured 5.3 -> 2.9

    base = load_causal_lm(ModelConfig(name_or_path="posttrain/tiny"))
    original = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    # The adapter directory holds adapter weights only, a small fraction of the model.
    adapter_bytes = (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes < 0.25 * (result.final_dir / "model.safetensors").stat().st_size
    for name, tensor in adapted.get_base_model().state_dict().items():
        if "lora_" not in name:
            assert torch.equal(tensor, original[name.replace(".base_layer", "")]), name
    assert any(p.abs().sum() > 0 for name, p in adapted.named_parameters() if "lora_B" in name)

    merged = AutoModelForCausalLM.from_pretrained(result.final_dir)  # a plain HF model: no peft needed
    ids = torch.tensor([[49, 43, 50, 61, 51, 52]])
    with torch.no_grad():
        expected = adapted.eval()(input_ids=ids).logits
        got = merged.eval()(input_ids=ids).logits
        untouched = base_logits(ids)
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(got, untouched, atol=1e-3)


def base_logits(ids: torch.Tensor) -> torch.Tensor:
    return load_causal_lm(ModelConfig(name_or_path="posttrain/tiny")).eval()(input_ids=ids).logits


@pytest.mark.parametrize("train, schema, overrides", [
    (train_sft, SFTConfig, SFT),
    (train_dpo, DPOConfig, PAIRS),
    # The reward model's checkpoint also holds its trained score head (peft's modules_to_save); both come back.
    (train_rm, RMConfig, PAIRS),
], ids=["sft", "dpo", "rm"])
def test_lora_resume_equals_an_uninterrupted_run(tmp_path, tiny_model_dir, train, schema, overrides):
    def run(output_dir: Path, steps: int) -> None:
        train(load_config(schema, None, [*overrides, f"output_dir={output_dir}", f"trainer.max_steps={steps}",
                                         "trainer.save_every=4"]))

    run(tmp_path / "straight", 8)
    run(tmp_path / "resumed", 4)
    checkpoint = tmp_path / "resumed" / "checkpoints" / "step_4" / "policy"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    run(tmp_path / "resumed", 8)
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")


def test_lora_dpo_uses_the_adapter_disabled_base_as_reference(tmp_path, tiny_model_dir, monkeypatch):
    def forbidden(cfg, device):
        raise AssertionError("with LoRA no reference copy may be loaded")

    monkeypatch.setattr(dpo, "load_reference_model", forbidden)
    shared = [*PAIRS, "trainer.max_steps=12", "data.shuffle=false", "trainer.eval_batch_size=16", "loss.beta=0.5",
              "trainer.learning_rate=5e-3"]
    train_dpo(load_config(DPOConfig, None, [*shared, f"output_dir={tmp_path / 'live'}", "reference=frozen_copy"]))
    train_dpo(load_config(DPOConfig, None, [*shared, f"output_dir={tmp_path / 'table'}", "reference=precomputed"]))
    live, table = losses(tmp_path / "live"), losses(tmp_path / "table")
    # Step 1: the fresh adapter (B = 0) leaves the policy equal to the base, so every implicit reward is 0.
    assert live[0] == pytest.approx(math.log(2), abs=1e-6)
    # Scoring the base with adapters off every batch equals scoring it once up front: the reference stays the
    # base model while the adapters train.
    assert table == pytest.approx(live, abs=1e-5)
    assert live[-1] < live[0] - 0.05


def test_lora_reward_model_trains_adapters_and_head_only(tmp_path, tiny_model_dir):
    result = train_rm(load_config(RMConfig, None, [*PAIRS, f"output_dir={tmp_path}", "trainer.max_steps=3"]))
    model = load_trainable_model(ModelConfig(name_or_path="posttrain/tiny"), LoraSection(enabled=True, r=4),
                                 None, torch.device("cpu"), task="reward", pad_token_id=257)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name or ".score." in name for name in trainable)
    assert any(".score." in name for name in trainable)  # the fresh head trains in full
    final = AutoModelForSequenceClassification.from_pretrained(result.final_dir)
    assert final.config.num_labels == 1 and final.config.pad_token_id == 257
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


@pytest.mark.parametrize("schema, overrides, message", [
    (SFTConfig, ["data.train_files=['posttrain/arithmetic[:8]']", "lora.r=0"], "lora.r"),
    (SFTConfig, ["data.train_files=['posttrain/arithmetic[:8]']", "lora.dropout=1.5"], "lora.dropout"),
])
def test_bad_lora_settings_fail_at_load(schema, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(schema, None, overrides)


def test_lora_target_modules_that_match_nothing_name_the_key(tmp_path, tiny_model_dir):
    cfg = load_config(SFTConfig, None, [*SFT, f"output_dir={tmp_path}", "trainer.max_steps=1",
                                        "lora.target_modules=['no_such_proj']"])
    with pytest.raises(ValueError, match="lora.target_modules"):
        train_sft(cfg)
