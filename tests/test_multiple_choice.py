"""Multiple-choice evaluation by log-likelihood: the row shapes accepted (and the malformed ones refused, named),
lm-eval's context/continuation split on a tokenizer that merges across the boundary (hand-derived ids), the
log-likelihoods against a direct forward pass, acc and acc_norm on a constructed case, the bundled arithmetic_mc
task (`posttrain eval --task arithmetic_mc`), the config checks, and the trained arithmetic model against the
untrained one (slow)."""

import json
from pathlib import Path

import pytest
import torch

from posttrain.algorithms.multiple_choice import (
    choice_loglikelihoods,
    encode_continuation,
    encode_question,
    evaluate_multiple_choice,
    score_questions,
)
from posttrain.cli import main
from posttrain.config import ConfigError, load_config
from posttrain.config.schema import EvalConfig, ModelConfig, PromptSection, TrainerConfig
from posttrain.data.errors import DataError
from posttrain.data.loading import iter_records
from posttrain.data.multiple_choice import load_multiple_choice_rows, parse_multiple_choice_row
from posttrain.envs import arithmetic
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.workers.local import LocalScoringWorker


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# ---- rows -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("record, answer", [
    ({"question": "2+2=", "subject": "math", "choices": ["3", "4", "5"], "answer": 1}, 1),           # MMLU
    ({"question": "q", "choices": {"text": ["a", "b", "c"], "label": ["A", "B", "C"]}, "answerKey": "C"}, 2),  # ARC
    ({"question": "q", "choices": {"text": ["a", "b"], "label": ["1", "2"]}, "answerKey": "1"}, 0),  # ARC, digits
    ({"prompt": "q", "choices": ["x", "y", "z"], "answer": "B"}, 1),                                # a letter
    ({"prompt": "12+34=", "choices": ["45", "46", "47"], "answer": "46"}, 1),                        # a choice's text
    ({"prompt": "q", "choices": ["x", "y", "z"], "answer": "2"}, 2),                                # index as text
    ({"prompt": "q", "choices": ["x", "y"], "label": 0}, 0),                                         # HellaSwag's label
])
def test_accepted_row_shapes(record, answer):
    row = parse_multiple_choice_row(record, "q.jsonl:1")
    assert row.answer == answer
    assert len(row.choices) == len(record["choices"]["text"] if isinstance(record["choices"], dict)
                                   else record["choices"])


@pytest.mark.parametrize("record, field, words", [
    ({"text": "q", "choices": ["a", "b"], "answer": 0}, "prompt", "'prompt' or 'question'"),
    ({"prompt": "q", "answer": 0}, "choices", "'choices' column"),
    ({"prompt": "q", "choices": ["a"], "answer": 0}, "choices", "at least two"),
    ({"prompt": "q", "choices": ["a", 3], "answer": 0}, "choices[1]", "non-empty string"),
    ({"prompt": "q", "choices": ["a", "b"]}, "answer", "answer"),
    ({"prompt": "q", "choices": ["a", "b"], "answer": 2}, "answer", "out of range"),
    ({"prompt": "q", "choices": ["a", "b"], "answer": "c"}, "answer", "names none"),
    ({"prompt": "q", "choices": ["1", "2", "3"], "answer": "1"}, "answer", "ambiguous"),
    ({"prompt": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "C"}, "answerKey", "labels"),
])
def test_malformed_rows_name_location_and_field(record, field, words):
    with pytest.raises(DataError) as error:
        parse_multiple_choice_row(record, "q.jsonl:7")
    assert error.value.location == "q.jsonl:7" and error.value.field == field
    assert words in str(error.value)


def test_bundled_rows_hold_the_sum_among_four_distinct_choices():
    records = [record for _, record in iter_records("posttrain/arithmetic-mc:heldout[:50]")]
    problems = arithmetic.sample_problems("heldout", 50)
    assert [r["prompt"] for r in records] == [p.prompt for p in problems]
    for record, problem in zip(records, problems):
        assert len(set(record["choices"])) == 4
        assert record["choices"][record["answer"]] == problem.answer
    assert len({r["answer"] for r in records}) == 4  # the right answer is not always in one place


# ---- tokenization: lm-eval's split -------------------------------------------------------------------------------


def test_continuation_split_follows_lm_eval_where_tokens_merge():
    tokenizer = load_tokenizer(ModelConfig(name_or_path="posttrain/tiny-bpe"))
    digit = {str(d): tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    plus, equals, ten = (tokenizer.convert_tokens_to_ids(t) for t in ("+", "=", "10"))
    assert tokenizer("5+5=10")["input_ids"][-1] == ten  # the BPE merges "1" and "0" across the boundary below
    context, continuation = encode_continuation("5+5=1", "0+0", tokenizer)
    # The prompt keeps its own tokens; the continuation is the whole text's tokens after as many: "+0".
    assert context == [digit["5"], plus, digit["5"], equals, digit["1"]]
    assert continuation == [plus, digit["0"]]
    # Trailing whitespace of the prompt moves to the continuation.
    context, continuation = encode_continuation("Answer: ", "46", tokenizer)
    assert context == tokenizer("Answer:")["input_ids"]
    assert continuation == tokenizer(" 46")["input_ids"]


def test_a_choice_merged_entirely_into_the_prompt_is_refused():
    tokenizer = load_tokenizer(ModelConfig(name_or_path="posttrain/tiny-bpe"))
    row = parse_multiple_choice_row({"prompt": "5+5=1", "choices": ["0", "9"], "answer": 0}, "m.jsonl:3")
    with pytest.raises(DataError, match="no tokens of its own") as error:
        encode_question(row, PromptSection(), tokenizer, "", 1024)
    assert error.value.location == "m.jsonl:3" and error.value.field == "choices[0]"


# ---- log-likelihoods and accuracy -------------------------------------------------------------------------------


def test_loglikelihoods_equal_a_direct_forward_pass(tiny_model_dir):
    model_cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(model_cfg)
    model = load_causal_lm(model_cfg).eval()
    rows = [parse_multiple_choice_row(record, f"t.jsonl:{n}") for n, record in enumerate([
        {"prompt": "12+34=", "choices": ["46", "47", "4"], "answer": 0},
        {"prompt": "7+8=", "choices": ["15", "151", "16"], "answer": 0},
        {"prompt": "Q: 1+1? A:", "choices": ["2", "two"], "answer": 0},
    ], start=1)]
    questions = [encode_question(row, PromptSection(), tokenizer, " ", 1024) for row in rows]
    scorer = LocalScoringWorker(model, TrainerConfig())
    # 3 sequences per pass: batches mix lengths (right padding) and split questions between passes.
    batched = choice_loglikelihoods(questions, scorer, tokenizer.pad_token_id, batch_size=3)
    for question, lls in zip(questions, batched):
        assert len(lls) == len(question.row.choices)
        for continuation, ll in zip(question.continuation_ids, lls):
            ids = torch.tensor([question.context_ids + continuation])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
            start = len(question.context_ids)
            direct = sum(logprobs[start + i - 1, token].item() for i, token in enumerate(continuation))
            assert ll == pytest.approx(direct, abs=1e-5)
            assert ll < 0


class ConstantScorer:
    """A scorer that gives every token log-probability -1: a choice's log-likelihood is minus its token count."""

    def logprobs(self, batch, temperature: float = 1.0) -> torch.Tensor:
        return torch.full(batch.input_ids.shape, -1.0)


def test_acc_and_acc_norm_on_a_constructed_case(tiny_model_dir):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))  # one token per character
    rows = [parse_multiple_choice_row(record, f"c.jsonl:{n}") for n, record in enumerate([
        # log-likelihoods -1, -2: acc picks "7" (right); per character -1, -1: a tie, the first (right)
        {"prompt": "q", "choices": ["7", "88"], "answer": 0},
        # -2, -1: acc picks "7" (wrong); per character a tie, the first "88" (right)
        {"prompt": "q", "choices": ["88", "7"], "answer": 0},
        # -2, -1, -3: acc picks "7" (wrong); per character a three-way tie, "88" (wrong)
        {"prompt": "q", "choices": ["88", "7", "999"], "answer": 2},
    ], start=1)]
    questions = [encode_question(row, PromptSection(), tokenizer, "", 1024) for row in rows]
    report = score_questions(questions, ConstantScorer(), tokenizer.pad_token_id, batch_size=2)
    assert [r.loglikelihoods for r in report.records] == [(-1.0, -2.0), (-2.0, -1.0), (-2.0, -1.0, -3.0)]
    assert [(r.prediction, r.prediction_norm) for r in report.records] == [(0, 0), (1, 0), (1, 0)]
    assert report.metrics == {"acc": pytest.approx(1 / 3), "acc_norm": pytest.approx(2 / 3), "count": 3}


def test_acc_norm_divides_by_characters_not_tokens():
    tokenizer = load_tokenizer(ModelConfig(name_or_path="posttrain/tiny-bpe"))  # "10" is one token of two characters
    row = parse_multiple_choice_row({"prompt": "q=", "choices": ["7", "10"], "answer": 1}, "c.jsonl:1")
    question = encode_question(row, PromptSection(), tokenizer, "", 1024)
    assert [len(ids) for ids in question.continuation_ids] == [1, 1]
    record = score_questions([question], ConstantScorer(), tokenizer.pad_token_id, batch_size=2).records[0]
    # -1 and -1: acc's tie goes to the first (wrong); per character -1 and -0.5: acc_norm picks "10" (right)
    assert (record.prediction, record.prediction_norm) == (0, 1)


def test_prompt_template_sees_the_choices(tiny_model_dir):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    row = parse_multiple_choice_row({"question": "Sum?", "choices": ["3", "4"], "answer": "B"}, "t.jsonl:1")
    template = PromptSection(template="{prompt}\nA. {choices[0]}\nB. {choices[1]}\nAnswer:")
    question = encode_question(row, template, tokenizer, " ", 1024)
    assert question.prompt == "Sum?\nA. 3\nB. 4\nAnswer:"
    assert question.continuation_ids[1] == tuple(tokenizer(" 4")["input_ids"])


def test_chat_template_prompt_is_rendered_before_the_split(tiny_model_dir):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    row = parse_multiple_choice_row({"prompt": "12+34=", "choices": ["46", "47"], "answer": 0}, "t.jsonl:1")
    question = encode_question(row, PromptSection(use_chat_template=True), tokenizer, "", 1024)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "12+34="}], tokenize=False,
                                             add_generation_prompt=True)
    assert question.prompt == rendered and rendered != "12+34="
    # The template's trailing newline moves to the front of each continuation (lm-eval's whitespace rule).
    assert rendered.endswith("\n")
    assert question.context_ids == tuple(tokenizer(rendered.rstrip(), add_special_tokens=False)["input_ids"])
    assert question.continuation_ids[0] == tuple(tokenizer("\n46", add_special_tokens=False)["input_ids"])


# ---- posttrain eval --------------------------------------------------------------------------------------------


def test_eval_cli_scores_a_file_and_writes_every_question(tmp_path, tiny_model_dir, capsys):
    data = write_jsonl(tmp_path / "mc.jsonl", [
        {"question": "12+34=", "choices": ["46", "47"], "answer": 0},
        {"question": "1+1=", "choices": ["3", "2"], "answer": "2"},
        {"question": "5+5=", "choices": ["10", "11", "9"], "answer": 2},
    ])
    out = tmp_path / "records.jsonl"
    assert main(["eval", "--model", str(tiny_model_dir), "--data", str(data), "--multiple-choice", "--output",
                 str(out), "--json", "target_delimiter=''", "batch_size=2"]) == 0
    report = json.loads(capsys.readouterr().out)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_index"] for r in records] == [0, 1, 2]
    assert [r["answer"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["prediction"] == max(range(len(r["choices"])), key=lambda i: r["loglikelihoods"][i])
        assert r["correct"] == (r["prediction"] == r["answer"])
    assert report["count"] == 3 and report["scoring"] == "multiple_choice"
    assert report["acc"] == pytest.approx(sum(r["correct"] for r in records) / 3)
    assert report["acc_norm"] == pytest.approx(sum(r["correct_norm"] for r in records) / 3)


def test_a_malformed_row_stops_before_the_model_loads(tmp_path, capsys):
    data = write_jsonl(tmp_path / "mc.jsonl", [{"question": "q", "choices": ["a", "b"], "answer": 0},
                                               {"question": "q", "choices": ["a", "b"], "answer": 5}])
    assert main(["eval", "--model", "no/such-model", "--data", str(data), "--multiple-choice"]) == 1
    assert f"bad data: {data}:2: field 'answer': index 5 is out of range" in capsys.readouterr().err


def test_bundled_task_untrained_is_near_chance(tiny_model_dir, capsys):
    assert main(["eval", "--model", str(tiny_model_dir), "--task", "arithmetic_mc", "num_examples=100",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["count"] == 100
    assert 0.1 <= report["acc"] <= 0.45 and 0.1 <= report["acc_norm"] <= 0.45  # four choices: chance is 0.25


@pytest.mark.parametrize("argv, words", [
    (["--multiple-choice"], "give --data FILE"),
    (["--data", "x.jsonl", "--multiple-choice", "temperature=0.5"], "temperature: sampling and environment keys"),
    (["--data", "x.jsonl", "--multiple-choice", "--environment", "math"], "environment"),
    (["--data", "x.jsonl", "target_delimiter=''"], "target_delimiter is for multiple-choice scoring"),
    (["--task", "arithmetic_mc", "--data", "x.jsonl"], "two different evaluations"),
    (["--lm-eval-include-path", "tasks"], "without lm_eval_tasks"),
    (["--lm-eval-tasks", "t", "--data", "x.jsonl"], "data: not used by an lm-eval run"),
    (["--lm-eval-tasks", "t", "prompt.template='{prompt}!'"], "lm-eval tasks format their own prompts"),
])
def test_config_refuses_keys_that_do_not_apply(argv, words, capsys):
    assert main(["eval", *argv]) == 2
    assert words in capsys.readouterr().err


def test_lm_eval_tasks_flag_splits_on_commas():
    cfg = load_config(EvalConfig, None, [], flags={"lm_eval_tasks": ["a", "b"]})
    assert cfg.lm_eval_tasks == ["a", "b"]
    with pytest.raises(ConfigError):
        load_config(EvalConfig, None, ["scoring=ranking"])


# ---- the trained model against the untrained one ------------------------------------------------------------


@pytest.mark.slow
def test_trained_arithmetic_model_beats_the_untrained_one(tiny_model_dir):
    """The embedded arithmetic model (built on first use: minutes) against posttrain/tiny on 200 held-out
    questions. Measured on the default and the AVX2 code path alike: acc and acc_norm 1.0 against 0.21 and 0.20
    (docs/evaluation.md); the thresholds leave room for a model rebuilt on another CPU."""
    def scores(model: str) -> dict:
        cfg = load_config(EvalConfig, None, [f"model.name_or_path={model}", "task=arithmetic_mc"])
        return evaluate_multiple_choice(cfg).metrics

    trained, untrained = scores("posttrain/tiny-arithmetic-sft"), scores(str(tiny_model_dir))
    assert trained["acc"] >= 0.95 and trained["acc_norm"] >= 0.95
    assert untrained["acc"] <= 0.4 and untrained["acc_norm"] <= 0.4
    assert trained["acc"] - untrained["acc"] >= 0.5
