"""Evaluation: pass@k against hand-computed values, `posttrain eval` on prompt files with every environment kind
(exact metrics from a generator whose completions are known), failed rewards and malformed rows, the
`evaluation:` section of sft, dpo and grpo runs (eval/<name>/ metrics, samples.jsonl, unchanged training numbers,
resume), and `posttrain generate`."""

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from posttrain.algorithms import evaluate
from posttrain.algorithms.dpo import train_dpo
from posttrain.algorithms.evaluate import evaluate_prompts, generate_greedy
from posttrain.algorithms.grpo import train_grpo
from posttrain.algorithms.rollout import PromptRow
from posttrain.algorithms.sft import train_sft
from posttrain.cli import main
from posttrain.config import ConfigError, DPOConfig, SFTConfig, load_config
from posttrain.config.schema import GRPOConfig, ModelConfig
from posttrain.data.tokenize import tokenize_prompt
from posttrain.envs import sandbox
from posttrain.envs.arithmetic_env import ArithmeticEnvironment
from posttrain.generation.base import Completion, GenerationOutput, SamplingParams
from posttrain.logging import read_metrics, read_samples
from posttrain.metrics import mean_pass_at_k, pass_at_k
from posttrain.models.loading import load_causal_lm, load_reward_backbone, load_tokenizer
from posttrain.workers import RewardModel

REWARDS = str(Path(__file__).with_name("reward_fns_for_tests.py"))
SAMPLE_KEYS = {"step", "split", "prompt", "reference", "completion", "reward", "components", "correct", "error"}


# ---- pass@k -----------------------------------------------------------------------------------------------------


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """1 − C(n−c, k)/C(n, k) in exact rational arithmetic (math.comb is 0 when n − c < k)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.parametrize("n, c, k, expected", [
    (1, 0, 1, 0.0), (1, 1, 1, 1.0),
    (5, 0, 1, 0.0), (5, 0, 5, 0.0),          # nothing correct: never passes
    (5, 5, 1, 1.0), (5, 5, 5, 1.0),          # everything correct: always passes
    (5, 2, 1, 0.4),                          # c / n
    (5, 2, 2, 0.7),                          # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 3, 0.9),                          # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (5, 2, 4, 1.0), (5, 2, 5, 1.0),          # n - c = 3 < k: every draw of k holds a correct one
    (4, 1, 2, 0.5),                          # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (10, 3, 5, 11 / 12),                     # 1 - C(7,5)/C(10,5) = 1 - 21/252
    (8, 1, 8, 1.0), (8, 7, 1, 0.875),
])
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_over_a_grid_equals_the_binomial_formula_and_stays_finite_for_large_n():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)
            assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-12)
    # C(1000, 500) overflows a float; the product form does not.
    assert pass_at_k(1000, 10, 500) == pytest.approx(float(exact_pass_at_k(1000, 10, 500)), abs=1e-12)
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5), (0, 0, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_mean_pass_at_k_leaves_out_problems_with_fewer_than_k_samples():
    value, averaged = mean_pass_at_k([(4, 1), (4, 0), (2, 2)], k=2)  # the third has only 2 scored samples
    assert averaged == 3 and value == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    value, averaged = mean_pass_at_k([(4, 1), (4, 0), (3, 3)], k=4)
    assert averaged == 2 and value == pytest.approx(0.5)
    assert math.isnan(mean_pass_at_k([(1, 1)], k=2)[0])


# ---- a generator whose completions are known --------------------------------------------------------------------


class ScriptedGenerator:
    """A Generator that answers each prompt (by its decoded text) with fixed replies, sample j getting
    replies[j % len(replies)]; it records the sampling parameters it was called with."""

    def __init__(self, tokenizer, replies: dict[str, list[str]]):
        self.tokenizer, self.replies, self.params = tokenizer, replies, []
        self.weights_version = 0

    def generate(self, prompts, params, num_samples=1):
        self.params.append(params)
        groups = []
        for prompt_ids in prompts:
            texts = self.replies[self.tokenizer.decode(prompt_ids)]
            group = []
            for j in range(num_samples):
                ids = self.tokenizer(texts[j % len(texts)], add_special_tokens=False)["input_ids"]
                ids.append(self.tokenizer.eos_token_id)
                group.append(Completion(list(prompt_ids), ids, [0.0] * len(ids), texts[j % len(texts)], "stop"))
            groups.append(group)
        return GenerationOutput(groups, 0.0, sum(len(c.token_ids) for g in groups for c in g))

    def update_weights(self, version, weights):
        self.weights_version = version
        return 0


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def scripted(monkeypatch):
    """Make `posttrain eval` sample from a ScriptedGenerator with the given replies (no model is loaded)."""

    def install(replies: dict[str, list[str]]) -> list[ScriptedGenerator]:
        made = []

        def build(model, backend, tokenizer, policy=None, **kwargs):
            made.append(ScriptedGenerator(tokenizer, replies))
            return made[-1]

        monkeypatch.setattr(evaluate, "build_generator", build)
        return made

    return install


ADDITIONS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
REPLIES = {"1+1=": ["2", "3", "2", "2"], "2+2=": ["5"], "3+3=": ["6"]}  # 3 of 4, 0 of 4, 4 of 4 correct


def eval_json(capsys, *argv: str) -> dict:
    assert main(["eval", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_evaluate_prompts_gives_exact_accuracy_and_pass_at_k(tiny_model_dir):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    prompts = [PromptRow(r["prompt"], tokenize_prompt(r["prompt"], tokenizer), {"answer": r["answer"]})
               for r in ADDITIONS]
    generator = ScriptedGenerator(tokenizer, REPLIES)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=5)
    report = evaluate_prompts(prompts, generator, ArithmeticEnvironment(), tokenizer, params, num_samples=4,
                              pass_k=[1, 2, 4])
    m = report.metrics
    assert m["accuracy"] == pytest.approx(7 / 12) and m["reward/mean"] == pytest.approx(7 / 12)
    assert m["pass@1"] == pytest.approx((3 / 4 + 0 + 1) / 3)
    assert m["pass@2"] == pytest.approx((1 + 0 + 1) / 3)  # 1 - C(1,2)/C(4,2) = 1 for the first prompt
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["reward/errors"] == 0 and m["truncation_rate"] == 0.0
    assert m["response_length/mean"] == pytest.approx(2.0)  # one digit and the eos token
    assert [s.correct for s in report.samples[:4]] == [True, False, True, True]
    assert [s.prompt_index for s in report.samples] == [0] * 4 + [1] * 4 + [2] * 4
    assert generator.params == [params]


def test_eval_cli_reports_exact_metrics_and_writes_every_sample(tmp_path, tiny_model_dir, scripted, capsys):
    data = write_rows(tmp_path / "add.jsonl", ADDITIONS)
    scripted(REPLIES)
    out = tmp_path / "samples" / "out.jsonl"
    payload = eval_json(capsys, "--model", str(tiny_model_dir), "--data", str(data), "--environment", "arithmetic",
                        "--output", str(out), "num_samples=4", "temperature=1.0", "pass_k=[4,1,2]")
    assert payload["model"] == str(tiny_model_dir) and payload["environment"] == "arithmetic"
    assert (payload["num_prompts"], payload["num_samples"]) == (3, 4)
    assert payload["accuracy"] == pytest.approx(7 / 12)
    assert (payload["pass@1"], payload["pass@2"], payload["pass@4"]) == pytest.approx((7 / 12, 2 / 3, 2 / 3))
    assert payload["reward/errors"] == 0 and payload["reward_errors"] == []
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 12
    assert lines[1] == {"prompt_index": 0, "sample": 1, "prompt": "1+1=", "reference": "2", "completion": "3",
                        "reward": 0.0, "components": None, "correct": False, "error": None}
    assert [line["sample"] for line in lines[:5]] == [0, 1, 2, 3, 0]
    assert sum(line["correct"] for line in lines) == 7

    # The text report says the same.
    assert main(["eval", "--model", str(tiny_model_dir), "--data", str(data), "num_samples=4", "temperature=1.0",
                 "pass_k=[2]"]) == 0
    text = capsys.readouterr().out
    assert "3 prompts x 4 sample(s)" in text and "pass@2                 0.6667" in text
    assert "accuracy               0.5833" in text


def test_a_failing_reward_function_is_masked_and_counted_not_zero(tmp_path, tiny_model_dir, scripted, capsys):
    data = write_rows(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    scripted({"a": ["good", "bad"], "b": ["good"]})
    payload = eval_json(capsys, "--model", str(tiny_model_dir), "--data", str(data), "--environment", "python",
                        f"environment.options={{functions: ['{REWARDS}:raises_on_bad'], num_workers: 0}}",
                        "num_samples=2", "temperature=1.0", "correct_threshold=1.0", "pass_k=[1,2]")
    assert payload["reward/errors"] == 1
    assert payload["reward/mean"] == 1.0 and payload["accuracy"] == 1.0  # the failed sample is left out, not a 0
    assert payload["pass@1"] == 1.0
    assert payload["pass@2"] == 1.0  # only prompt b has 2 scored samples
    (reason,) = payload["reward_errors"]
    assert "raises_on_bad" in reason and "cannot score 'bad'" in reason


def test_a_malformed_row_is_named_by_file_line_and_field(tmp_path, tiny_model_dir, capsys):
    data = write_rows(tmp_path / "add.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}])
    assert main(["eval", "--model", str(tiny_model_dir), "--data", str(data), "--environment", "arithmetic"]) == 1
    err = capsys.readouterr().err
    assert "bad data" in err and "add.jsonl:2" in err and "'answer'" in err
    data = write_rows(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": 7, "answer": "4"}])
    assert main(["eval", "--model", str(tiny_model_dir), "--data", str(data)]) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and "prompt" in err


@pytest.mark.parametrize("argv, message", [
    (["num_samples=2", "temperature=1.0", "pass_k=[1,4]"], "k=4 is more than num_samples=2"),
    (["num_samples=3"], "temperature=0"),
    (["--environment", "python", "pass_k=[1]",
      f"environment.options={{functions: ['{REWARDS}:length'], num_workers: 0}}"], "correct_threshold"),
    (["task=arithmetic"], "two different evaluations"),
])
def test_eval_config_mistakes_fail_at_load_naming_the_keys(tmp_path, argv, message, capsys):
    data = write_rows(tmp_path / "add.jsonl", ADDITIONS)
    assert main(["eval", "--model", "posttrain/tiny", "--data", str(data), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    if "pass_k" in " ".join(argv) and "python" not in argv:
        assert "pass_k" in err and "num_samples" in err


def test_eval_on_the_embedded_model_repeats_with_a_seed(tmp_path, tiny_model_dir, capsys):
    # Real sampling from the untrained tiny model: it never adds, and a seeded re-run samples the same text.
    args = ["--model", str(tiny_model_dir), "--data", "posttrain/arithmetic:heldout[:6]", "num_samples=3",
            "temperature=1.0", "max_new_tokens=5", "pass_k=[1,3]", "seed=3"]
    first = eval_json(capsys, *args, "--output", str(tmp_path / "a.jsonl"))
    again = eval_json(capsys, *args, "--output", str(tmp_path / "b.jsonl"))
    assert first == again
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    assert first["accuracy"] == 0.0 and first["pass@3"] == 0.0 and first["num_prompts"] == 6
    lines = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(lines) == 18 and len({line["completion"] for line in lines}) > 1
    eval_json(capsys, *args[:-1], "seed=4", "--output", str(tmp_path / "c.jsonl"))
    assert (tmp_path / "c.jsonl").read_text() != (tmp_path / "a.jsonl").read_text()


def test_python_rewards_score_the_embedded_models_own_completions(tmp_path, tiny_model_dir, capsys):
    data = write_rows(tmp_path / "p.jsonl", [{"prompt": "12+34="}, {"prompt": "7+8="}])
    out = tmp_path / "out.jsonl"
    payload = eval_json(capsys, "--model", str(tiny_model_dir), "--data", str(data), "--environment", "python",
                        f"environment.options={{functions: ['{REWARDS}:length'], num_workers: 0}}",
                        "max_new_tokens=4", "--output", str(out))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["reward"] for line in lines] == [float(len(line["completion"])) for line in lines]
    assert payload["reward/mean"] == pytest.approx(sum(line["reward"] for line in lines) / 2)
    assert "accuracy" not in payload and payload["truncation_rate"] == 1.0  # the tiny model never stops in 4 tokens


def test_math_environment(tmp_path, tiny_model_dir, scripted, capsys):
    data = write_rows(tmp_path / "math.jsonl", [{"prompt": "half of one", "answer": "\\frac{1}{2}"},
                                                {"prompt": "two squared", "answer": "4"}])
    scripted({"half of one": ["It is \\boxed{0.5}.", "\\boxed{1/3}"], "two squared": ["\\boxed{4}", "4"]})
    payload = eval_json(capsys, "--model", str(tiny_model_dir), "--data", str(data), "--environment", "math",
                        "environment.options.num_workers=0", "num_samples=2", "temperature=1.0", "pass_k=[1,2]")
    assert payload["accuracy"] == 0.75 and payload["pass@2"] == 1.0 and payload["pass@1"] == 0.75
    assert payload["reward/errors"] == 0


def test_code_environment(tmp_path, tiny_model_dir, scripted, capsys):
    tests = [{"input": "3\n", "output": "6"}, {"input": "10\n", "output": "20"}]
    data = write_rows(tmp_path / "code.jsonl", [{"prompt": "double it", "tests": tests}])
    scripted({"double it": ["```python\nprint(int(input()) * 2)\n```", "print(6)", "print(0)"]})
    options = [] if sandbox.sandbox_info().namespaces else ["environment.options.allow_unisolated_fallback=true"]
    payload = eval_json(capsys, "--model", str(tiny_model_dir), "--data", str(data), "--environment", "code",
                        *options, "num_samples=3", "temperature=1.0", "pass_k=[1,3]")
    assert payload["reward/mean"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)  # the fraction of tests passed
    assert payload["accuracy"] == pytest.approx(1 / 3) and payload["pass@3"] == 1.0


def test_reward_model_environment(tmp_path, tiny_model_dir, scripted, capsys):
    model_cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(model_cfg)
    torch.manual_seed(0)
    load_reward_backbone(model_cfg, tokenizer.pad_token_id).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    data = write_rows(tmp_path / "p.jsonl", [{"prompt": "1+1="}, {"prompt": "2+2="}])
    scripted({"1+1=": ["2"], "2+2=": ["4!"]})
    out = tmp_path / "out.jsonl"
    payload = eval_json(capsys, "--model", str(tiny_model_dir), "--data", str(data), "--environment", "reward_model",
                        f"environment.options.path={tmp_path / 'rm'}", "--output", str(out))
    expected = RewardModel.from_pretrained(tmp_path / "rm").score(["1+1=", "2+2="], ["2", "4!"])
    rewards = [json.loads(line)["reward"] for line in out.read_text().splitlines()]
    assert rewards == pytest.approx(expected, abs=1e-5)
    assert payload["reward/mean"] == pytest.approx(sum(expected) / 2, abs=1e-5) and "accuracy" not in payload


# ---- the evaluation: section of training runs -------------------------------------------------------------------


SFT = ["model.name_or_path=posttrain/tiny", "data.train_files=['posttrain/arithmetic:train[:64]']",
       "data.max_length=32", "trainer.max_steps=4", "trainer.micro_batch_size=8", "trainer.learning_rate=1e-3",
       "trainer.lr_scheduler=constant", "logging.progress=none", "logging.plot=false"]
EVAL_SET = ("evaluation=[{name: arith, data: {files: ['posttrain/arithmetic:heldout[:6]']}, every: 2, "
            "num_samples: 2, temperature: 1.0, pass_k: [1, 2], max_new_tokens: 4, samples_logged: 3}]")


@pytest.mark.parametrize("lora", [[], ["lora.enabled=true", "lora.r=4"]], ids=["full", "lora"])
def test_sft_evaluation_sets_log_metrics_and_samples_and_change_nothing_else(tmp_path, tiny_model_dir, lora):
    train_sft(load_config(SFTConfig, None, [*SFT, *lora, f"output_dir={tmp_path / 'plain'}"]))
    train_sft(load_config(SFTConfig, None, [*SFT, *lora, f"output_dir={tmp_path / 'evaluated'}", EVAL_SET]))
    plain, evaluated = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("plain", "evaluated"))
    keys = ("step", "loss", "grad_norm", "learning_rate", "target_tokens")
    assert [{k: r[k] for k in keys} for r in plain] == [{k: r[k] for k in keys} for r in evaluated]
    assert not any(k.startswith("eval/") for r in plain for k in r)
    assert not (tmp_path / "plain" / "samples.jsonl").exists()
    assert [r["step"] for r in evaluated if "eval/arith/accuracy" in r] == [2, 4]
    last = evaluated[-1]
    assert last["eval/arith/accuracy"] == 0.0 and last["eval/arith/pass@2"] == 0.0  # 4 steps teach no sums
    assert last["eval/arith/reward/errors"] == 0 and 0 < last["eval/arith/response_length/mean"] <= 4
    samples = read_samples(tmp_path / "evaluated" / "samples.jsonl")
    assert [(s["step"], s["split"]) for s in samples] == [(2, "eval/arith")] * 3 + [(4, "eval/arith")] * 3
    assert all(set(s) == SAMPLE_KEYS for s in samples)
    assert samples[0]["prompt"] == samples[1]["prompt"] != samples[2]["prompt"]  # 2 samples per prompt
    assert all(s["reward"] == 0.0 and s["correct"] is False and s["error"] is None for s in samples)


def test_an_evaluation_draws_from_no_global_random_stream(tiny_model_dir):
    # Sampling at temperature 1 uses the generator's own seeded torch.Generator only: Python's, NumPy's and torch's
    # global streams (data order, dropout, initialisation) are where the evaluation found them.
    import random

    import numpy as np

    from posttrain.algorithms.evaluate import TrainingEvaluation
    from posttrain.config.schema import EvaluationSet
    from posttrain.generation.transformers_backend import TransformersGenerator

    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(cfg)
    sets = [EvaluationSet(name="arith", data={"files": ["posttrain/arithmetic:heldout[:4]"]}, num_samples=2,
                          temperature=1.0, max_new_tokens=3, samples_logged=0)]
    evaluation = TrainingEvaluation(sets, tokenizer, max_steps=1)
    generator = TransformersGenerator(load_causal_lm(cfg), tokenizer)

    class NoLog:
        def log_samples(self, step, split, records):
            assert records == []

    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    first = evaluation.run(1, generator, NoLog())
    after = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    assert torch.equal(before[0], after[0]) and before[1] == after[1] and (before[2] == after[2]).all()
    assert evaluation.run(1, generator, NoLog()) == first  # the set's own seed: the same samples each time
    assert first["eval/arith/response_length/mean"] == 3.0
    evaluation.close()


def test_dpo_evaluation_set(tmp_path, tiny_model_dir):
    cfg = load_config(DPOConfig, None, [
        "model.name_or_path=posttrain/tiny", "data.train_files=['posttrain/arithmetic-preference:train[:16]']",
        "data.max_length=32", "trainer.max_steps=2", "trainer.micro_batch_size=8", "logging.progress=none",
        "logging.plot=false", f"output_dir={tmp_path}",
        "evaluation=[{name: add, data: {files: ['posttrain/arithmetic:heldout[:4]']}, max_new_tokens: 3}]"])
    train_dpo(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if "eval/add/accuracy" in r] == [2]  # every: 0, only at the end
    assert [s["split"] for s in read_samples(tmp_path / "samples.jsonl")] == ["eval/add"] * 4


def test_evaluation_set_names_must_differ_and_need_data():
    with pytest.raises(ConfigError, match="used twice"):
        load_config(SFTConfig, None, [*SFT, "evaluation=[{name: a, data: {files: [x]}}, {name: a, data: {files: [y]}}]"])
    with pytest.raises(ConfigError, match="data.files is empty"):
        load_config(SFTConfig, None, [*SFT, "evaluation=[{name: a}]"])


GRPO = ["model.name_or_path=posttrain/tiny", "data.train_files=['posttrain/arithmetic[:64]']", "data.max_length=32",
        "rollout.prompts_per_step=4", "rollout.num_generations_per_prompt=2", "rollout.max_new_tokens=4",
        "trainer.learning_rate=1e-3", "trainer.lr_scheduler=constant", "trainer.micro_batch_size=8",
        "environment.kind=python",
        f"environment.options={{functions: ['{REWARDS}:digit_fraction'], num_workers: 0}}",
        "logging.progress=none", "logging.plot=false"]
GRPO_EVAL = ("evaluation=[{name: arith, data: {files: ['posttrain/arithmetic:heldout[:4]']}, every: 2, "
             "num_samples: 2, temperature: 1.0, pass_k: [2], max_new_tokens: 4, samples_logged: 2}]")


def test_grpo_logs_training_samples_and_evaluation_sets_without_changing_the_run(tmp_path, tiny_model_dir):
    train_grpo(load_config(GRPOConfig, None, [*GRPO, "trainer.max_steps=2", f"output_dir={tmp_path / 'plain'}",
                                              "logging.samples_per_step=0"]))
    train_grpo(load_config(GRPOConfig, None, [*GRPO, "trainer.max_steps=2", f"output_dir={tmp_path / 'evaluated'}",
                                              GRPO_EVAL]))
    plain, evaluated = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("plain", "evaluated"))
    keys = ("reward/mean", "loss", "grad_norm", "response_length/mean", "entropy")
    assert [{k: r[k] for k in keys} for r in plain] == [{k: r[k] for k in keys} for r in evaluated]
    assert not (tmp_path / "plain" / "samples.jsonl").exists()
    assert "eval/arith/pass@2" in evaluated[1] and "eval/arith/accuracy" in evaluated[1]
    assert not any(k.startswith("eval/") for k in evaluated[0])

    samples = read_samples(tmp_path / "evaluated" / "samples.jsonl")
    assert [(s["step"], s["split"]) for s in samples] == \
        [(1, "train")] * 4 + [(2, "train")] * 4 + [(2, "eval/arith")] * 2
    assert all(set(s) == SAMPLE_KEYS | ({"group_id", "policy_version", "version_spans"} if s["split"] == "train" else set())
               for s in samples)
    train = [s for s in samples if s["split"] == "train"]
    # digit_fraction scores the completion itself; python rewards judge no correctness.
    assert all(s["reward"] == pytest.approx(sum(ch.isdigit() for ch in s["completion"]) / len(s["completion"])
                                            if s["completion"] else 0.0) for s in train)
    assert all(s["correct"] is None and s["components"] is None for s in train)
    # The step's first 4 episodes: 2 samples of its first prompt, then 2 of its second.
    first = [s["prompt"] for s in train if s["step"] == 1]
    assert first[0] == first[1] != first[2] == first[3]


def test_grpo_resume_gives_the_samples_file_of_the_uninterrupted_run(tmp_path, tiny_model_dir):
    def run(name: str, steps: int) -> None:
        train_grpo(load_config(GRPOConfig, None, [*GRPO, f"trainer.max_steps={steps}", "trainer.save_every=2",
                                                  f"output_dir={tmp_path / name}", GRPO_EVAL]))

    run("full", 4)
    run("resumed", 2)
    # A killed run leaves lines of steps past its checkpoint: they are dropped on resume, like metrics.jsonl's.
    with (tmp_path / "resumed" / "samples.jsonl").open("a") as file:
        file.write(json.dumps({"step": 3, "split": "train", "prompt": "x", "reference": "z", "completion": "y",
                               "reward": 0.0, "components": None, "correct": None, "error": None}) + "\n")
    run("resumed", 4)
    full = (tmp_path / "full" / "samples.jsonl").read_text()
    assert full == (tmp_path / "resumed" / "samples.jsonl").read_text()
    assert [json.loads(line)["step"] for line in full.splitlines()].count(4) == 4 + 2


# ---- posttrain generate -----------------------------------------------------------------------------------------


def test_generate_prints_the_models_completions(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "12+34=", "--prompt", "7+8=",
                 "--no-chat-template", "--max-new-tokens", "5", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    greedy, _ = generate_greedy(load_causal_lm(cfg), load_tokenizer(cfg), ["12+34=", "7+8="], 5, 2)
    assert [line["prompt"] for line in lines] == ["12+34=", "7+8="]
    assert [line["completion"] for line in lines] == greedy  # transformers' own greedy decoding, token for token
    assert all(line["num_tokens"] == 5 and line["finish_reason"] == "length" for line in lines)

    # --chat-template sends the prompt through the chat template; the text output shows prompt, then completion.
    sampled = ["--model", str(tiny_model_dir), "--prompt", "12+34=", "--max-new-tokens", "3", "--num-samples", "2",
               "--temperature", "1.0", "--seed", "7"]
    assert main(["generate", *sampled, "--chat-template"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("### prompt 1\n<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n")
    assert "### completion 1 of 2 (" in text and "### completion 2 of 2" in text
    assert main(["generate", *sampled, "--chat-template"]) == 0
    assert capsys.readouterr().out == text  # seeded
    # By default the prompt is sent as it is, as `posttrain eval` sends it.
    assert main(["generate", *sampled]) == 0
    assert capsys.readouterr().out.startswith("### prompt 1\n12+34=\n### completion 1 of 2")


def test_generate_reads_prompts_from_a_file(tmp_path, tiny_model_dir, capsys):
    data = write_rows(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "5+5=", "answer": "10"}])
    assert main(["generate", "--model", str(tiny_model_dir), "--data", str(data), "--no-chat-template",
                 "--max-new-tokens", "2", "--json", "num_examples=1"]) == 0
    (line,) = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert line["prompt"] == "1+1=" and line["num_tokens"] == 2
    assert main(["generate", "--model", str(tiny_model_dir)]) == 2
    assert "give prompts" in capsys.readouterr().err
