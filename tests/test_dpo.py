"""The DPO recipe on the embedded tiny model: pairs and batches, the loop's numerics, learning, resume."""

import math
from pathlib import Path

import pytest
import torch

from posttrain.algorithms import dpo
from posttrain.algorithms.dpo import train_dpo
from posttrain.workers.forward import forward_logits, token_logprobs_of
from posttrain.config import ConfigError, DPOConfig, load_config
from posttrain.config.schema import ModelConfig
from posttrain.data.embedded import iter_embedded
from posttrain.data.errors import DataError
from posttrain.errors import RunError
from posttrain.data.formats import PreferenceRow
from posttrain.data.preference import (
    collate_preference,
    collate_shared_prompt,
    rejected_through_first_difference,
    tokenize_preference_row,
)
from posttrain.data.types import PreferenceExample
from posttrain.data.types import CHOSEN, PADDING, PROMPT, REJECTED
from posttrain.envs.arithmetic import (
    Problem,
    preference_rng,
    wrong_answer,
    wrong_answers,
)
from posttrain.logging import read_metrics
from posttrain.models.loading import load_causal_lm, load_tokenizer

BASE = [
    "model.name_or_path=posttrain/tiny",
    "data.train_files=['posttrain/arithmetic-preference[:128]']",
    "data.max_length=32",
    "trainer.micro_batch_size=16",
    "trainer.learning_rate=1e-3",
    "trainer.lr_scheduler=constant",
    "loss.beta=0.5",
    "logging.progress=none",
    "logging.plot=false",
]


def config(output_dir: Path, *overrides: str) -> DPOConfig:
    return load_config(DPOConfig, None, [*BASE, f"output_dir={output_dir}", *overrides])


def losses(output_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir / "metrics.jsonl")]


def test_arithmetic_preference_rows_are_fixed_per_problem():
    rows = [row for _, row in iter_embedded("posttrain/arithmetic-preference[:200]")]
    assert rows[:50] == [row for _, row in iter_embedded("posttrain/arithmetic-preference[:50]")]
    for row in rows:
        a, b = map(int, row["prompt"].rstrip("=").split("+"))
        assert row["chosen"] == str(a + b) and row["rejected"] != row["chosen"] and int(row["rejected"]) >= 0
    # The wrong answers are the plausible kinds: off by one or ten, or a digit swap.
    problem = Problem(47, 38)
    seen = {wrong_answer(problem, preference_rng(Problem(a, 1))) for a in range(40)}
    assert seen <= {"84", "86", "75", "95", "58"} and len(seen) >= 3


def test_dense_arithmetic_preferences_pair_every_problem_with_every_plausible_wrong_sum():
    assert wrong_answers(Problem(47, 38)) == ["58", "75", "84", "86", "95"]
    dense = wrong_answers(Problem(47, 38), every_digit=True)
    # 85: tens digit 1-9 (not 0: no leading zero), units digit 0-9, less the sum itself; plus the swap 58.
    assert dense == sorted({"58", *(f"{t}5" for t in range(1, 10)), *(f"8{u}" for u in range(10))} - {"85"}, key=int)
    assert wrong_answers(Problem(1, 2), every_digit=True) == ["0", "1", "2", "4", "5", "6", "7", "8", "9", "13"]
    rows = [row for _, row in iter_embedded("posttrain/arithmetic-preference-dense:heldout[:60]")]
    problems = list(dict.fromkeys(row["prompt"] for row in rows))
    assert len(rows) == 60 and len(problems) == 3  # consecutive pairs of each problem, ~24 each
    for prompt in problems[:2]:
        a, b = map(int, prompt.rstrip("=").split("+"))
        assert [r["rejected"] for r in rows if r["prompt"] == prompt] == wrong_answers(Problem(a, b), every_digit=True)
        assert {r["chosen"] for r in rows if r["prompt"] == prompt} == {str(a + b)}
    heldout = {row["prompt"] for _, row in iter_embedded("posttrain/arithmetic-preference:heldout")}
    train = {row["prompt"] for _, row in iter_embedded("posttrain/arithmetic-preference-dense:train[:5000]")}
    assert set(problems) <= heldout and not train & heldout
    with pytest.raises(DataError, match="asked for 99999 rows"):
        list(iter_embedded("posttrain/arithmetic-preference-dense:heldout[:99999]"))


def test_collate_puts_chosen_rows_then_rejected_rows(tiny_model_dir):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    pairs = [
        tokenize_preference_row(PreferenceRow("12+30=", "42", "41"), tokenizer, 32, "truncate"),
        tokenize_preference_row(PreferenceRow("99+99=", "198", "98"), tokenizer, 32, "truncate"),
    ]
    eos = tokenizer.eos_token_id
    assert pairs[0].chosen_ids == (*tokenizer("42", add_special_tokens=False)["input_ids"], eos)
    batch = collate_preference(pairs, tokenizer.pad_token_id)
    assert batch.input_ids.shape[0] == 4 and batch.num_examples == 4
    texts = [tokenizer.decode(row[mask.bool()]) for row, mask in zip(batch.input_ids, batch.attention_mask)]
    end = tokenizer.eos_token
    assert texts == [f"12+30=42{end}", f"99+99=198{end}", f"12+30=41{end}", f"99+99=98{end}"]
    completions = [tokenizer.decode(row[mask.bool()]) for row, mask in zip(batch.input_ids, batch.loss_mask)]
    assert completions == [f"42{end}", f"198{end}", f"41{end}", f"98{end}"]
    assert batch.loss_mask.sum(-1).tolist() == [3, 4, 3, 3]
    assert batch.attention_mask.sum(-1).tolist() == [9, 10, 9, 9]
    # Truncation keeps the prompt and cuts both completions; drop drops the pair.
    cut = tokenize_preference_row(PreferenceRow("99+99=", "198", "98"), tokenizer, 8, "truncate")
    assert len(cut.prompt_ids) == 6 and len(cut.chosen_ids) == 2 and len(cut.rejected_ids) == 2
    assert tokenize_preference_row(PreferenceRow("99+99=", "198", "98"), tokenizer, 8, "drop") is None


def test_shared_prompt_rows_hold_the_prompt_once_then_both_completions(tiny_model_dir):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    pairs = [
        tokenize_preference_row(PreferenceRow("12+30=", "42", "41"), tokenizer, 32, "truncate"),
        tokenize_preference_row(PreferenceRow("9+9=", "18", "198"), tokenizer, 32, "truncate"),
    ]
    batch = collate_shared_prompt(pairs, tokenizer.pad_token_id)
    end = tokenizer.eos_token
    assert batch.input_ids.shape == (2, 12) and batch.num_examples == 2 and batch.num_tokens == 12 + 11
    assert tokenizer.decode(batch.input_ids[0]) == f"12+30=42{end}41{end}"
    assert tokenizer.decode(batch.input_ids[1][batch.segments[1] != PADDING]) == f"9+9=18{end}198{end}"
    P, C, R, X = PROMPT, CHOSEN, REJECTED, PADDING
    assert batch.segments.tolist() == [[P] * 6 + [C] * 3 + [R] * 3, [P] * 4 + [C] * 3 + [R] * 4 + [X]]
    # The rejected tokens sit where they would in prompt + rejected alone.
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 6, 7, 8]
    assert batch.position_ids[1].tolist()[:11] == [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7]
    assert batch.prompt_ends.tolist() == [5, 3] and batch.rejected_starts.tolist() == [9, 7]
    assert batch.chosen_mask.sum(-1).tolist() == [3, 3] and batch.rejected_mask.sum(-1).tolist() == [3, 4]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_scores_equal_separate_rows(tiny_model_dir, attention):
    # The same log-probabilities and gradients from one shared-prompt row per pair as from a chosen row and a
    # rejected row: the mask keeps the completions apart, the positions restart, the first rejected token is
    # scored from the prompt's last position.
    cfg = ModelConfig(name_or_path=str(tiny_model_dir), attn_implementation=attention)
    tokenizer, model = load_tokenizer(cfg), load_causal_lm(cfg)
    rows = [PreferenceRow("12+30=", "42", "41"), PreferenceRow("9+9=", "18", "198"),
            PreferenceRow("1+2+3+4+5=", "15 is the sum", "14"), PreferenceRow("7=", "7", "seven")]
    pairs = [tokenize_preference_row(row, tokenizer, 32, "truncate") for row in rows]
    scores, grads = {}, {}
    for name, collate in (("rows", collate_preference), ("shared", collate_shared_prompt)):
        model.zero_grad()
        for average in (False, True):
            batch = collate(pairs, tokenizer.pad_token_id)
            scores[name, average] = dpo.completion_logps(token_logprobs_of(forward_logits(model, batch), batch),
                                                         batch, average)
        total = scores[name, False]
        (total.chosen.sum() - 2 * total.rejected.sum() + total.chosen_nll.sum()).backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
    for average in (False, True):
        rows_, shared = scores["rows", average], scores["shared", average]
        for field in ("chosen", "rejected", "chosen_lengths", "rejected_lengths", "chosen_nll"):
            torch.testing.assert_close(getattr(shared, field), getattr(rows_, field), atol=1e-5, rtol=0)
    assert scores["rows", False].chosen_lengths.tolist() == [3, 3, 14, 2]
    torch.testing.assert_close(grads["shared"], grads["rows"], atol=1e-5, rtol=1e-4)
    assert grads["rows"].abs().max() > 1e-3


def test_shared_and_separate_rows_train_alike(tmp_path, tiny_model_dir):
    train_dpo(config(tmp_path / "shared", "trainer.max_steps=5", "share_prompt=true"))
    train_dpo(config(tmp_path / "rows", "trainer.max_steps=5", "share_prompt=false"))
    assert losses(tmp_path / "shared") == pytest.approx(losses(tmp_path / "rows"), abs=1e-5)
    assert config(tmp_path).shares_prompt
    assert not config(tmp_path, "model.attn_implementation=flash_attention_2").shares_prompt
    with pytest.raises(ConfigError, match="share_prompt"):
        config(tmp_path, "model.attn_implementation=flash_attention_2", "share_prompt=true")


def test_conversational_pairs_use_the_chat_template(tiny_model_dir):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    row = PreferenceRow([{"role": "user", "content": "1+2="}], [{"role": "assistant", "content": "3"}],
                        [{"role": "assistant", "content": "4"}])
    pair = tokenize_preference_row(row, tokenizer, 64, "truncate")
    assert tokenizer.decode(pair.prompt_ids) == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(pair.chosen_ids) == "3<|im_end|>"
    assert tokenizer.decode(pair.rejected_ids) == "4<|im_end|>"


def test_short_dpo_run_learns_the_preferences_and_leaves_the_reference_alone(tmp_path, tiny_model_dir, monkeypatch):
    references = []

    def capture(cfg, device):
        references.append(load_reference(cfg, device))
        return references[-1]

    load_reference = dpo.load_reference_model
    monkeypatch.setattr(dpo, "load_reference_model", capture)
    result = train_dpo(config(tmp_path, "trainer.max_steps=60",
                              "data.eval_files=['posttrain/arithmetic-preference:heldout[:32]']"))

    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 60
    # Policy == reference at step 1: every implicit reward is 0, so the DPO loss is log 2 exactly.
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert records[0]["margin"] == 0.0 and records[0]["reward_accuracy"] == 0.0
    last = records[-10:]
    assert sum(r["reward_accuracy"] for r in last) / 10 > 0.8  # measured 0.93-0.97 over seeds
    assert sum(r["margin"] for r in last) / 10 > 1.0  # measured 1.8-2.4
    assert sum(r["loss"] for r in last) / 10 < 0.4
    assert {"loss", "reward_accuracy", "chosen_reward", "rejected_reward", "margin", "learning_rate", "grad_norm",
            "tokens_per_second", "step_seconds", "eval_loss", "eval_reward_accuracy"} <= set(records[-1])
    assert result.eval_reward_accuracy == records[-1]["eval_reward_accuracy"]

    (reference,) = references
    assert not any(p.requires_grad for p in reference.model.parameters())
    untouched = load_causal_lm(ModelConfig(name_or_path="posttrain/tiny")).state_dict()
    for name, tensor in reference.model.state_dict().items():
        assert torch.equal(tensor, untouched[name]), name
    trained = load_causal_lm(ModelConfig(name_or_path=str(result.final_dir))).state_dict()
    assert any(not torch.equal(trained[name], untouched[name]) for name in untouched)


def test_precomputed_reference_equals_the_frozen_copy(tmp_path, tiny_model_dir):
    # Unshuffled data and eval_batch_size == micro_batch_size: each precomputed chunk is exactly the
    # batch the frozen copy scores, so the losses agree exactly.
    same = ["trainer.max_steps=3", "data.shuffle=false", "trainer.eval_batch_size=16"]
    train_dpo(config(tmp_path / "frozen", *same, "reference=frozen_copy"))
    train_dpo(config(tmp_path / "precomputed", *same, "reference=precomputed"))
    assert losses(tmp_path / "precomputed") == losses(tmp_path / "frozen")
    assert losses(tmp_path / "frozen")[0] == pytest.approx(math.log(2), abs=1e-6)


def test_gradient_accumulation_gives_the_same_update(tmp_path, tiny_model_dir):
    train_dpo(config(tmp_path / "whole", "trainer.max_steps=2"))
    train_dpo(config(tmp_path / "split", "trainer.max_steps=2", "trainer.micro_batch_size=8",
                     "trainer.gradient_accumulation_steps=2"))
    whole, split = losses(tmp_path / "whole"), losses(tmp_path / "split")
    assert split == pytest.approx(whole, abs=1e-5)
    assert whole[1] != pytest.approx(whole[0], abs=1e-4)  # step 2 saw the update of step 1


def test_truncated_rejected_keeps_the_shared_tokens_and_the_first_wrong_one():
    def cut(chosen, rejected):
        return rejected_through_first_difference(PreferenceExample((1,), chosen, rejected)).rejected_ids

    assert cut((5, 6, 2), (5, 7, 2)) == (5, 7)  # "56" vs "57": the wrong units digit, not the EOS after it
    assert cut((5, 6, 2), (8, 6, 2)) == (8,)  # wrong from the first token: the rest continues a wrong prefix
    assert cut((5, 6, 2), (5, 6, 7, 2)) == (5, 6, 7)  # one digit too many: the extra digit is the wrong step
    assert cut((5, 6, 2), (5, 2)) == (5, 2)  # stopping early: EOS is the first wrong token
    assert cut((5, 6, 2), (5,)) == (5,)  # the beginning of chosen: kept whole


def test_truncate_rejected_cuts_the_training_pairs_and_scores_evaluation_pairs_whole(tmp_path, tiny_model_dir,
                                                                                    monkeypatch):
    seen = []
    train_on_pairs = dpo.train_on_pairs
    monkeypatch.setattr(dpo, "train_on_pairs", lambda run, *args, **kwargs: seen.append(run) or
                        train_on_pairs(run, *args, **kwargs))
    evaluated = ["data.eval_files=['posttrain/arithmetic-preference:heldout[:32]']", "trainer.max_steps=3"]
    train_dpo(config(tmp_path / "whole", *evaluated))
    train_dpo(config(tmp_path / "cut", *evaluated, "loss.truncate_rejected=true"))
    whole, cut = seen
    assert [p.chosen_ids for p in cut.train_examples] == [p.chosen_ids for p in whole.train_examples]
    assert [p.rejected_ids for p in cut.train_examples] == [
        rejected_through_first_difference(p).rejected_ids for p in whole.train_examples]
    shortened = sum(len(c.rejected_ids) < len(w.rejected_ids) for c, w in zip(cut.train_examples, whole.train_examples))
    assert shortened > len(whole.train_examples) // 2  # most wrong sums differ before their last token (EOS)
    assert cut.eval_examples == whole.eval_examples
    assert losses(tmp_path / "cut")[0] == pytest.approx(math.log(2), abs=1e-6)
    assert losses(tmp_path / "cut")[1:] != pytest.approx(losses(tmp_path / "whole")[1:], abs=1e-4)


def test_resume_equals_an_uninterrupted_run(tmp_path, tiny_model_dir):
    train_dpo(config(tmp_path / "straight", "trainer.max_steps=20", "trainer.save_every=10"))
    train_dpo(config(tmp_path / "resumed", "trainer.max_steps=10", "trainer.save_every=10"))
    train_dpo(config(tmp_path / "resumed", "trainer.max_steps=20", "trainer.save_every=10"))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_causal_lm(ModelConfig(name_or_path=str(path))).state_dict()


@pytest.mark.parametrize("lora", [None, "all-linear", "[embed_tokens,q_proj]"])
def test_final_interpolation_keeps_that_share_of_the_update(tmp_path, tiny_model_dir, lora):
    # The same run with weight 1 and 0.5: the second's final weights are start + 0.5·(first's − start) for every
    # tensor, the tied embedding and LM head included (moved once, not twice), and its last evaluation and last
    # checkpoint are of the interpolated weights. With LoRA the start is the base model (the adapters are scaled).
    run = ["trainer.max_steps=4", "trainer.save_every=4", "data.eval_files=['posttrain/arithmetic-preference:heldout[:32]']",
           *(["lora.enabled=true", "lora.r=4", "lora.alpha=8", f"lora.target_modules={lora}"] if lora else [])]
    train_dpo(config(tmp_path / "full", *run))
    train_dpo(config(tmp_path / "half", *run, "final_interpolation=0.5"))
    start, full, half = _weights(tiny_model_dir), _weights(tmp_path / "full" / "final"), _weights(tmp_path / "half" / "final")
    moved = 0
    for name in start:
        torch.testing.assert_close(half[name], start[name] + 0.5 * (full[name] - start[name]), atol=1e-6, rtol=0, msg=name)
        moved += not torch.equal(full[name], start[name])
    assert moved >= (2 if lora == "[embed_tokens,q_proj]" else 20)
    if lora != "all-linear":  # the embedding (tied to the LM head) moved, and by half: once, not twice
        assert not torch.equal(full["model.embed_tokens.weight"], start["model.embed_tokens.weight"])
    last_full, last_half = read_metrics(tmp_path / "full" / "metrics.jsonl")[-1], read_metrics(tmp_path / "half" / "metrics.jsonl")[-1]
    assert last_half["loss"] == last_full["loss"]  # the training steps are the same
    # Same steps, so an evaluation before the interpolation would repeat the other run's to the bit.
    assert last_half["eval_loss"] != last_full["eval_loss"] and last_half["eval_margin"] != last_full["eval_margin"]
    # Re-running the finished run resumes from its last checkpoint, which holds the interpolated weights: the
    # interpolation is not applied a second time.
    train_dpo(config(tmp_path / "half", *run, "final_interpolation=0.5"))
    for name, tensor in _weights(tmp_path / "half" / "final").items():
        torch.testing.assert_close(tensor, half[name], atol=0, rtol=0, msg=name)
    # Another weight on the finished run would be applied to nothing: refused before any file changes.
    config_before = (tmp_path / "half" / "config.yaml").read_text()
    with pytest.raises(RunError, match="finished with final_interpolation 0.5"):
        train_dpo(config(tmp_path / "half", *run, "final_interpolation=0.25"))
    assert (tmp_path / "half" / "config.yaml").read_text() == config_before


def test_reference_free_losses_load_no_reference(tmp_path, tiny_model_dir, monkeypatch):
    def forbidden(cfg, device):
        raise AssertionError("simpo must not load a reference model")

    monkeypatch.setattr(dpo, "load_reference_model", forbidden)
    result = train_dpo(config(tmp_path, "trainer.max_steps=2", "loss.type=simpo", "reference=precomputed"))
    assert result.final_loss is not None and math.isfinite(result.final_loss)


@pytest.mark.parametrize("override, message", [
    ("loss.average_logprobs=true", "average_logprobs"),
    ("data.packing=true", "packing"),
    ("data.format=prompt_completion", "format"),
    ("loss.beta=0", "beta"),
    ("final_interpolation=0", "final_interpolation"),
])
def test_incompatible_settings_fail_at_load(tmp_path, override, message):
    overrides = [override, "loss.type=simpo"] if message == "average_logprobs" else [override]
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, *overrides)


@pytest.mark.slow
def test_embedded_dpo_config_beats_90_percent_reward_accuracy_without_losing_exact_match(tmp_path):
    # configs/dpo_arithmetic.yaml as shipped (it builds posttrain/tiny-arithmetic-sft on first use, ~2 minutes).
    # Measured over seeds 0-14 x both CPU code paths (BENCHMARKS.md, final_interpolation 0.25): eval_reward_accuracy
    # 0.914 or more; exact match on 800 held-out problems 100% -> 100% on all 30 runs (seed 0 is asserted).
    from posttrain.algorithms.evaluate import evaluate_arithmetic
    from posttrain.config.presets import preset_path

    def accuracy(path) -> float:
        cfg = ModelConfig(name_or_path=str(path))
        return evaluate_arithmetic(load_causal_lm(cfg), load_tokenizer(cfg), num_examples=800).accuracy

    cfg = load_config(DPOConfig, preset_path("dpo_arithmetic.yaml"),
                      [f"output_dir={tmp_path}", "logging.progress=none", "logging.plot=false"])
    result = train_dpo(cfg)
    assert result.eval_reward_accuracy > 0.9
    assert accuracy(result.final_dir) >= accuracy("posttrain/tiny-arithmetic-sft")
