"""Reward-model training on the embedded tiny model: pooling, the loop's numerics, learning, resume, scoring
with RewardModel and as an RL environment."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from posttrain.algorithms.rm import train_rm
from posttrain.workers.local import LocalScoringWorker
from posttrain.config import ConfigError, RMConfig, load_config
from posttrain.config.presets import preset_path
from posttrain.config.schema import ModelConfig, TrainerConfig
from posttrain.data.errors import DataError
from posttrain.data.formats import PreferenceRow
from posttrain.data.preference import collate_preference, tokenize_preference_row
from posttrain.algorithms.environments import build_recipe_environment
from posttrain.logging import read_metrics
from posttrain.workers import RewardModel
from posttrain.models.loading import load_reward_backbone, load_tokenizer

BASE = [
    "model.name_or_path=posttrain/tiny",
    "data.max_length=32",
    "trainer.micro_batch_size=16",
    "trainer.learning_rate=1e-3",
    "trainer.lr_scheduler=constant",
    "logging.progress=none",
    "logging.plot=false",
]


def write_pairs(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def loud_pairs(n: int) -> list[dict]:
    """Pairs that differ in a feature any model can pick up: the chosen answer ends with '!', the rejected with '?'."""
    return [{"prompt": f"{i}+{i}=", "chosen": f"{2 * i}!", "rejected": f"{2 * i}?"} for i in range(n)]


def config(output_dir: Path, train_file: Path, *overrides: str) -> RMConfig:
    return load_config(RMConfig, None, [*BASE, f"output_dir={output_dir}", f"data.train_files=['{train_file}']",
                                        *overrides])


def losses(output_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir / "metrics.jsonl")]


def test_batched_pair_rewards_equal_scoring_each_text_alone(tiny_model_dir):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    torch.manual_seed(0)
    model = load_reward_backbone(ModelConfig(name_or_path=str(tiny_model_dir)), tokenizer.pad_token_id).eval()
    rows = [PreferenceRow("1+2=", "3", "4"), PreferenceRow("99+99=", "198", "18"), PreferenceRow("5+50=", "55", "5")]
    pairs = [tokenize_preference_row(row, tokenizer, 32, "truncate") for row in rows]
    batch = collate_preference(pairs, tokenizer.pad_token_id)  # 6 rows of different lengths, right-padded
    with torch.no_grad():
        batched = LocalScoringWorker(model, TrainerConfig(), role="reward").sequence_scores(batch)
    scorer = RewardModel(model, tokenizer, batch_size=1)  # one row per forward: no padding at all
    alone = scorer.score([r.prompt for r in rows] * 2, [r.chosen for r in rows] + [r.rejected for r in rows])
    assert batched.tolist() == pytest.approx(alone, abs=1e-5)
    assert len(set(alone)) == 6  # the head reads each row's own last token, not padding


def test_reward_model_max_length_cuts_the_completion_and_names_a_prompt_too_long(tiny_model_dir):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    torch.manual_seed(0)
    model = load_reward_backbone(ModelConfig(name_or_path=str(tiny_model_dir)), tokenizer.pad_token_id)
    whole = RewardModel(model, tokenizer)
    cut = RewardModel(model, tokenizer, max_length=8)  # "12+34=" is 6 tokens: 2 completion tokens fit
    # Cutting "4699" + EOS to its first 2 tokens scores exactly the text "46" without its EOS.
    manual = whole.model(input_ids=torch.tensor([tokenizer("12+34=46")["input_ids"]])).logits.item()
    assert cut.score(["12+34="], ["4699"]) == pytest.approx([manual], abs=1e-5)
    with pytest.raises(DataError, match=r"pair 1: field 'prompt'.*max_length=8"):
        cut.score(["1+1=", "123456789+1="], ["2", "123456790"])


def test_short_rm_run_learns_a_clear_preference_and_scores_through_reward_model(tmp_path, tiny_model_dir):
    train = write_pairs(tmp_path / "train.jsonl", loud_pairs(64))
    heldout = write_pairs(tmp_path / "heldout.jsonl", loud_pairs(96)[64:])
    result = train_rm(config(tmp_path / "run", train, "trainer.max_steps=30", f"data.eval_files=['{heldout}']",
                             "trainer.eval_every=10"))
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(records) == 30
    assert {"loss", "accuracy", "margin", "chosen_reward", "rejected_reward", "eval_loss", "eval_accuracy",
            "eval_margin", "learning_rate", "grad_norm", "step_seconds"} <= set(records[-1])
    first_eval = next(r for r in records if "eval_accuracy" in r)
    assert result.eval_accuracy == 1.0 and records[-1]["eval_margin"] > 2.0  # measured: margin ~5
    assert records[-1]["loss"] < 0.1 < records[0]["loss"]
    assert first_eval["step"] == 10

    # OUTPUT/final is a one-label sequence classifier that RewardModel scores exactly as training did.
    final = AutoModelForSequenceClassification.from_pretrained(result.final_dir)
    assert final.config.num_labels == 1
    scorer = RewardModel.from_pretrained(result.final_dir)
    held = loud_pairs(96)[64:]
    chosen = scorer.score([r["prompt"] for r in held], [r["chosen"] for r in held])
    rejected = scorer.score([r["prompt"] for r in held], [r["rejected"] for r in held])
    assert all(c > r for c, r in zip(chosen, rejected))
    margin = sum(c - r for c, r in zip(chosen, rejected)) / len(held)
    assert margin == pytest.approx(records[-1]["eval_margin"], abs=1e-4)

    # The same model as an RL environment: reward = its score of (prompt, reply).
    environment = build_recipe_environment({"kind": "reward_model", "options": {"path": str(result.final_dir)}})
    logs = [[{"role": "user", "content": "70+70="}, {"role": "assistant", "content": reply}] for reply in ("140!", "140?")]
    step = environment.step(logs, [{}, {}])
    assert step.done == [True, True] and step.errors == [None, None]
    assert step.rewards == pytest.approx(scorer.score(["70+70="] * 2, ["140!", "140?"]), abs=1e-6)
    assert step.rewards[0] > step.rewards[1]


def test_gradient_accumulation_gives_the_same_update(tmp_path, tiny_model_dir):
    train = write_pairs(tmp_path / "train.jsonl", loud_pairs(32))
    train_rm(config(tmp_path / "whole", train, "trainer.max_steps=2"))
    train_rm(config(tmp_path / "split", train, "trainer.max_steps=2", "trainer.micro_batch_size=4",
                    "trainer.gradient_accumulation_steps=4"))
    whole, split = losses(tmp_path / "whole"), losses(tmp_path / "split")
    assert split == pytest.approx(whole, abs=1e-5)
    assert whole[1] != pytest.approx(whole[0], abs=1e-4)


def test_resume_equals_an_uninterrupted_run(tmp_path, tiny_model_dir):
    train = write_pairs(tmp_path / "train.jsonl", loud_pairs(48))
    train_rm(config(tmp_path / "straight", train, "trainer.max_steps=8", "trainer.save_every=4"))
    train_rm(config(tmp_path / "resumed", train, "trainer.max_steps=4", "trainer.save_every=4"))
    train_rm(config(tmp_path / "resumed", train, "trainer.max_steps=8", "trainer.save_every=4"))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")


def test_margins_come_from_the_data(tmp_path, tiny_model_dir):
    rows = loud_pairs(16)
    with_margin = write_pairs(tmp_path / "margin.jsonl", [{**row, "margin": 2.0} for row in rows])
    # At step 1 both runs score the same pairs with the same fresh head; the margin only shifts the loss:
    # -log σ(d - 2) instead of -log σ(d), with d = r_c - r_r (reported as `margin`).
    train_rm(config(tmp_path / "plain", with_margin, "trainer.max_steps=1", "data.shuffle=false"))
    train_rm(config(tmp_path / "margin", with_margin, "trainer.max_steps=1", "data.shuffle=false",
                    "loss.use_margin=true"))
    plain, margin = (read_metrics(tmp_path / name / "metrics.jsonl")[0] for name in ("plain", "margin"))
    assert plain["margin"] == pytest.approx(margin["margin"], abs=1e-6)
    # Every pair's d is near 0 at init (a fresh head), so each loss is close to its value at d = mean d.
    softplus = lambda x: math.log1p(math.exp(x))  # noqa: E731  -log σ(z) = softplus(-z)
    assert plain["loss"] == pytest.approx(softplus(-plain["margin"]), abs=1e-3)
    assert margin["loss"] == pytest.approx(softplus(2.0 - plain["margin"]), abs=1e-3)

    missing = write_pairs(tmp_path / "missing.jsonl", [*[{**row, "margin": 1.0} for row in rows[:3]], rows[3]])
    with pytest.raises(DataError, match=r"missing\.jsonl:4.*margin"):
        train_rm(config(tmp_path / "bad", missing, "trainer.max_steps=1", "loss.use_margin=true"))
    wrong = write_pairs(tmp_path / "wrong.jsonl", [{**rows[0], "margin": "high"}])
    with pytest.raises(DataError, match=r"wrong\.jsonl:1.*margin.*finite number"):
        train_rm(config(tmp_path / "bad2", wrong, "trainer.max_steps=1"))


@pytest.mark.parametrize("override, message", [
    ("data.packing=true", "packing"),
    ("data.format=prompt_completion", "format"),
    ("loss.center_rewards_coefficient=-1", "center_rewards_coefficient"),
    ("loss.beta=0.1", "beta"),  # a DPO key: unknown here
])
def test_bad_settings_fail_at_load(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, tmp_path / "x.jsonl", override)


@pytest.mark.slow
def test_embedded_rm_config_learns_the_arithmetic_preferences(tmp_path):
    # configs/rm_arithmetic.yaml as shipped: 8,000 steps on the dense pairs (~8 minutes on 2 cores, plus building the
    # SFT'd model on first use). Measured: held-out pairwise accuracy 0.978 on all 819 held-out pairs (wrong units
    # digits 94%, wrong tens digits 99.5%, digit swaps 100%); a fresh head starts at chance.
    cfg = load_config(RMConfig, preset_path("rm_arithmetic.yaml"), [f"output_dir={tmp_path}", "logging.progress=none",
                                                                     "logging.plot=false"])
    result = train_rm(cfg)
    assert result.eval_accuracy >= 0.95
    # RewardModel scores held-out pairs as the run's evaluation did.
    from posttrain.data.embedded import iter_embedded

    rows = [row for _, row in iter_embedded("posttrain/arithmetic-preference:heldout")]
    assert len(rows) == 819  # all of them: max_eval_examples is 1,000
    scorer = RewardModel.from_pretrained(result.final_dir, batch_size=128)
    chosen = scorer.score([r["prompt"] for r in rows], [r["chosen"] for r in rows])
    rejected = scorer.score([r["prompt"] for r in rows], [r["rejected"] for r in rows])
    assert sum(c > r for c, r in zip(chosen, rejected)) / len(rows) == pytest.approx(result.eval_accuracy, abs=1e-3)
