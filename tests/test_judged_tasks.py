"""HLE- and GDPval-format judged tasks: the calibration error against hand-computed values, the response's stated
confidence, the HLE verdict and the GDPval rubric sum through a judge that answers from a table, an HTTP judge on
127.0.0.1, bad rows named by file, line and field, parquet copies, image rows skipped and counted, the config
sections, and `posttrain eval` reporting accuracy and calibration error."""

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from posttrain.algorithms import evaluate
from posttrain.algorithms.rollout import Episode, judged_task_metrics
from posttrain.cli import main
from posttrain.config import ConfigError, load_config
from posttrain.config.environments import GdpvalOptions, HleOptions, environment_section
from posttrain.config.schema import GRPOConfig
from posttrain.envs.judged.environments import parse_hle_verdict, stated_confidence
from posttrain.envs.judged.tasks import (
    JudgedTaskError,
    bundled_gdpval_tasks,
    bundled_hle_tasks,
    gdpval_prompt_rows,
    hle_prompt_rows,
    load_gdpval_tasks,
    load_hle_tasks,
)
from posttrain.envs.registry import build_environment
from posttrain.generation.base import Completion, GenerationOutput
from posttrain.metrics import calibration_error


# ---- calibration error ------------------------------------------------------------------------------------------


def test_calibration_error_matches_hand_computed_values():
    # Sorted by confidence: (0.3 wrong, 0.6 right) | (0.8 wrong, 0.9 right).
    # Bin 1: mean confidence 0.45, accuracy 0.5, gap 0.05; bin 2: 0.85 vs 0.5, gap 0.35.
    # sqrt(2/4 * 0.05² + 2/4 * 0.35²) = sqrt(0.00125 + 0.06125) = sqrt(0.0625) = 0.25
    assert calibration_error([0.9, 0.8, 0.3, 0.6], [True, False, False, True], bin_size=2) == pytest.approx(0.25)
    # One bin (fewer answers than bin_size): |0.65 − 0.5| = 0.15
    assert calibration_error([0.9, 0.8, 0.3, 0.6], [True, False, False, True]) == pytest.approx(0.15)
    # Five answers, bins of 2: the last bin takes the remainder (3 answers).
    # Bin 1 (0.1, 0.2 both wrong): gap 0.15; bin 2 (0.3, 0.4, 0.5 all right): gap 0.6.
    # sqrt(2/5 * 0.0225 + 3/5 * 0.36) = sqrt(0.225)
    assert calibration_error([0.5, 0.1, 0.4, 0.2, 0.3], [True, False, True, False, True], bin_size=2) \
        == pytest.approx(math.sqrt(0.225))
    assert calibration_error([1.0, 0.0], [True, False], bin_size=1) == 0.0  # perfectly calibrated
    with pytest.raises(ValueError, match="at least one"):
        calibration_error([], [])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        calibration_error([85.0], [True])


@pytest.mark.parametrize("response, confidence", [
    ("Explanation: ...\nExact Answer: 205\nConfidence: 85%", 0.85),
    ("Answer: C\n**Confidence:** 40 %", 0.40),
    ("confidence: 100%\n", 1.0),
    ("Confidence: 20%\nOn reflection...\nConfidence: 70%", 0.70),  # the last line counts
    ("Exact Answer: 205", None),                                    # none stated
    ("Confidence: 150%", None),                                     # outside 0-100%
    ("Confidence: high", None),
    ("Confidence: 85", None),                                       # the format asks for a percentage
])
def test_stated_confidence_reads_the_hle_format(response, confidence):
    assert stated_confidence(response) == (None if confidence is None else pytest.approx(confidence))


def test_the_judge_verdict_is_read_or_named():
    assert parse_hle_verdict("extracted_final_answer: 21\nreasoning: same\ncorrect: yes\nconfidence: 90") \
        == (True, "21", None)
    assert parse_hle_verdict("extracted_final_answer: B\n**correct:** No") == (False, "B", None)
    assert parse_hle_verdict("I think it is right.")[2].startswith("no_verdict")
    assert parse_hle_verdict("correct: yes\ncorrect: no")[2].startswith("several_verdicts")


# ---- a judge that answers from a table --------------------------------------------------------------------------


class TableJudge:
    """A local judge (`JudgeModel`): the reply of the first (needle, reply) pair whose needle is in the
    conversation's text; records every conversation it was asked."""

    def __init__(self, table: list[tuple[str, str]]):
        self.table, self.asked, self.closed = table, [], False

    def complete(self, conversations):
        self.asked += conversations
        return [next(reply for needle, reply in self.table if needle in c[-1]["content"]) for c in conversations]

    def close(self):
        self.closed = True


def log(prompt: str, reply: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]


def hle_env(judge, tasks=None):
    return build_environment(HleOptions(tasks=tasks, judge={"path": "table-judge"}), models={"": judge})


def test_hle_rewards_the_judged_verdict_and_records_the_stated_confidence():
    judge = TableJudge([("Exact Answer: 205", "extracted_final_answer: 205\nreasoning: same\ncorrect: yes"),
                        ("Answer: A", "extracted_final_answer: A\nreasoning: the reference is C\ncorrect: no"),
                        ("Exact Answer: 7", "extracted_final_answer: 7\ncorrect: maybe")])
    env = hle_env(judge)
    step = env.step([log("q1", "Explanation: 3 h 25 min\nExact Answer: 205\nConfidence: 90%"),
                     log("q2", "Explanation: 91 looks prime\nAnswer: A\nConfidence: 60%"),
                     log("q6", "Exact Answer: 7")],
                    [{"id": "synth-hle-001"}, {"id": "synth-hle-002"}, {"id": "synth-hle-006"}])
    assert step.rewards == [1.0, 0.0, None]
    assert step.done == [True] * 3
    assert [m.get("correct") for m in step.metadata] == [True, False, None]
    assert [m["stated_confidence"] for m in step.metadata] == [pytest.approx(0.9), pytest.approx(0.6), None]
    assert step.metadata[1]["extracted_final_answer"] == "A"
    assert step.errors[0] is None and "no_verdict" in step.errors[2]
    assert env.counts["no_verdict"] == 1 and env.counts["judged"] == 3
    # The judge read the question, the response and the reference answer with its type.
    first = judge.asked[0][-1]["content"]
    assert "How many minutes" in first and "Exact Answer: 205" in first and "Reference answer (exact match): 205" \
        in first
    assert "Reference answer (multiple choice): C" in judge.asked[1][-1]["content"]
    # A repeated (question, response) is not judged again.
    env.step([log("q1", "Explanation: 3 h 25 min\nExact Answer: 205\nConfidence: 90%")], [{"id": "synth-hle-001"}])
    assert env.counts["judged"] == 3 and env.counts["cache_hits"] == 1
    env.close()
    assert judge.closed


def test_hle_rows_with_an_image_are_skipped_and_counted():
    tasks = load_hle_tasks(bundled_hle_tasks())
    assert tasks.skipped_image_rows == 1 and len(tasks.tasks) == 6 and "synth-hle-007" not in tasks.tasks
    assert [row["id"] for row in hle_prompt_rows(tasks)] == [f"synth-hle-00{i}" for i in range(1, 7)]
    env = hle_env(TableJudge([]))
    with pytest.raises(ValueError, match=r"synth-hle-007.*1 were skipped for their image"):
        env.step([log("q", "Exact Answer: 70")], [{"id": "synth-hle-007"}])


def episode(metadata, reward=1.0):
    return Episode(group_id=0, messages=[], metadata=metadata, token_ids=[1], prompt_length=1, reward=reward)


def test_calibration_is_computed_over_the_answers_that_state_a_confidence_and_the_rest_are_counted():
    episodes = [episode({"correct": True, "stated_confidence": 0.9}),
                episode({"correct": False, "stated_confidence": 0.8}, 0.0),
                episode({"correct": False, "stated_confidence": 0.3}, 0.0),
                episode({"correct": True, "stated_confidence": 0.6}),
                episode({"correct": True, "stated_confidence": None}),   # states none: counted, left out
                episode({"stated_confidence": 0.99}, None)]              # the judge failed: left out entirely
    metrics = judged_task_metrics(episodes)
    assert metrics["calibration/stated"] == 4 and metrics["calibration/missing"] == 1
    assert metrics["calibration_error"] == pytest.approx(0.15)  # one bin: |0.65 - 0.5|
    metrics = judged_task_metrics([episode({"correct": True, "stated_confidence": None})])
    assert metrics == {"calibration/stated": 0, "calibration/missing": 1}
    assert judged_task_metrics([episode({"correct": True})]) == {}


# ---- GDPval ------------------------------------------------------------------------------------------------------


def test_gdpval_scores_each_rubric_item_and_sums_them_over_the_total():
    judge = TableJudge([("Ana's gross pay", "Ana is right. Score: 2"),
                        ("Ben's gross pay", "Score: 2"),
                        ("Chloe's gross pay", "Chloe is wrong (840). Score: 0"),
                        ("total payroll as 1976", "Score: 1"),
                        ("memo addressed", "**Score:** 1"),
                        ("four dishes", "Score: 3"),
                        ("introductory", "Score: 1"),
                        ("are marked (V)", "Score: seven")])
    env = build_environment(GdpvalOptions(judge={"path": "table-judge"}), models={"": judge})
    rows = {row["task_id"]: row["prompt"] for row in gdpval_prompt_rows(load_gdpval_tasks(bundled_gdpval_tasks()))}
    step = env.step([log(rows["synth-gdpval-payroll"], "Memo: Ana 690, Ben 456, Chloe 840, total 1986."),
                     log(rows["synth-gdpval-menu"], "Our lunch menu: ...")],
                    [{"task_id": "synth-gdpval-payroll"}, {"task_id": "synth-gdpval-menu"}])
    assert step.rewards[0] == pytest.approx((2 + 2 + 0 + 1 + 1) / 9)
    assert step.metadata[0]["rubric_points"] == [2.0, 2.0, 0.0, 1.0, 1.0]
    assert step.metadata[0]["rubric_max"] == 9.0 and step.metadata[0]["rubric_score"] == pytest.approx(6 / 9)
    # One unreadable item masks the whole sample (a partial sum would read as a low score), naming the item.
    assert step.rewards[1] is None and step.metadata[1]["rubric_points"] == [3.0, None, 1.0]
    assert "rubric r2 (not_a_number)" in step.errors[1]
    assert env.counts["not_a_number"] == 1 and env.counts["judged"] == 8
    # Each item is one question carrying the task (with its reference file), the deliverable and the criterion.
    first = judge.asked[0][-1]["content"]
    assert "Ana,15,44" in first and "Chloe 840" in first and "(worth 2 points)" in first
    assert judged_task_metrics([episode(m, r) for m, r in zip(step.metadata, step.rewards)]) \
        == {"rubric_score/mean": pytest.approx(6 / 9)}


def test_a_score_above_the_items_points_masks_the_sample():
    judge = TableJudge([("Identifies exactly", "Score: 3"), ("Orders them", "Score: 2"), ("distance", "Score: 1")])
    env = build_environment(GdpvalOptions(judge={"path": "table-judge"}), models={"": judge})
    step = env.step([log("p", "V4 then V2")], [{"task_id": "synth-gdpval-fleet"}])
    assert step.rewards == [None] and "out_of_range" in step.errors[0] and env.counts["out_of_range"] == 1


# ---- the judge over HTTP on 127.0.0.1 ---------------------------------------------------------------------------


@pytest.fixture
def judge_server():
    """An OpenAI-compatible chat-completions server: an HLE verdict "correct: yes" when the response gives 21 or B
    (else no), and 1 point for every GDPval rubric item."""
    requests = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append({"path": self.path, "body": body, "authorization": self.headers.get("Authorization")})
            text = body["messages"][-1]["content"]
            verdict = "yes" if "Exact Answer: 21" in text or "Answer: B" in text else "no"
            content = f"extracted_final_answer: x\nreasoning: r\ncorrect: {verdict}\nconfidence: 50"
            if text.startswith("Grade a deliverable"):  # a GDPval rubric item: 1 point, whatever it is worth
                content = "Partly met. Score: 1"
            payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", requests
    server.shutdown()
    server.server_close()


def test_hle_through_an_http_judge_sends_the_key_from_the_environment(judge_server, monkeypatch):
    url, requests = judge_server
    monkeypatch.setenv("HLE_JUDGE_KEY", "sk-test")
    env = build_environment(HleOptions(judge={"base_url": url, "model": "judge-1", "api_key_env": "HLE_JUDGE_KEY",
                                              "timeout_s": 10.0}))
    step = env.step([log("q", "Exact Answer: 21\nConfidence: 80%"), log("q", "Exact Answer: 20")],
                    [{"id": "synth-hle-006"}, {"id": "synth-hle-006"}])
    assert step.rewards == [1.0, 0.0]
    assert len(requests) == 2 and requests[0]["path"] == "/v1/chat/completions"
    assert requests[0]["authorization"] == "Bearer sk-test" and requests[0]["body"]["model"] == "judge-1"
    assert requests[0]["body"]["temperature"] == 0


# ---- task files: bad rows, parquet ------------------------------------------------------------------------------


GOOD_HLE = {"id": "q1", "question": "2+2?", "answer": "4", "answer_type": "exactMatch"}
GOOD_GDPVAL = {"task_id": "t1", "prompt": "Do it.", "rubric_json": [{"criterion": "Done", "score": 2}]}


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("bad, message", [
    ({**GOOD_HLE, "answer_type": "freeForm"}, r"tasks.jsonl:2: field 'answer_type' must be one of exactMatch, "
                                              r"multipleChoice"),
    ({k: v for k, v in GOOD_HLE.items() if k != "answer"}, r"tasks.jsonl:2: field 'answer' must be a non-empty"),
    ({**GOOD_HLE, "question": ""}, r"tasks.jsonl:2: field 'question'"),
    ({**GOOD_HLE, "id": "q0"}, r"tasks.jsonl:2: field 'id': 'q0' is already the id of .*tasks.jsonl:1"),
    ({**GOOD_HLE, "id": "q2", "image": 5}, r"tasks.jsonl:2: field 'image' must be a string"),
    ("{not json", r"tasks.jsonl:2: not JSON"),
    ("[1, 2]", r"tasks.jsonl:2: a row must be a JSON object"),
])
def test_bad_hle_rows_name_file_line_and_field(tmp_path, bad, message):
    path = write_rows(tmp_path / "tasks.jsonl", [{**GOOD_HLE, "id": "q0"}, bad])
    with pytest.raises(JudgedTaskError, match=message):
        load_hle_tasks(path)


@pytest.mark.parametrize("bad, message", [
    ({**GOOD_GDPVAL, "rubric_json": None, "rubric_pretty": "1. Done (2 pts)"},
     r"g.jsonl:2: field 'rubric_json' is missing \(rubric_pretty is prose"),
    ({**GOOD_GDPVAL, "rubric_json": "[{oops"}, r"g.jsonl:2: field 'rubric_json' is a string but not JSON"),
    ({**GOOD_GDPVAL, "rubric_json": []}, r"g.jsonl:2: field 'rubric_json' must be a non-empty list"),
    ({**GOOD_GDPVAL, "rubric_json": [{"criterion": "Done", "score": 0}]},
     r"g.jsonl:2: field 'rubric_json' item 0: 'score' \(the item's points\) must be a positive number"),
    ({**GOOD_GDPVAL, "rubric_json": [{"criterion": "Done", "score": 1}, {"score": 1}]},
     r"g.jsonl:2: field 'rubric_json' item 1: 'criterion' must be non-empty text"),
    ({**GOOD_GDPVAL, "reference_files": ["https://example.org/a.xlsx"]},
     r"g.jsonl:2: field 'reference_files': 'https://example.org/a.xlsx' is a URL; nothing is downloaded"),
    ({**GOOD_GDPVAL, "reference_files": ["reference_files/missing.pdf"]},
     r"g.jsonl:2: field 'reference_files': 'reference_files/missing.pdf' is not a file"),
    ({**GOOD_GDPVAL, "prompt": None}, r"g.jsonl:2: field 'prompt' must be a non-empty string, got nothing"),
])
def test_bad_gdpval_rows_name_file_line_and_field(tmp_path, bad, message):
    path = write_rows(tmp_path / "g.jsonl", [{**GOOD_GDPVAL, "task_id": "t0"}, {**bad, "task_id": "t1"}])
    with pytest.raises(JudgedTaskError, match=message):
        load_gdpval_tasks(path)


def test_a_parquet_copy_loads_like_the_release_with_relative_reference_files(tmp_path):
    import pyarrow
    import pyarrow.parquet

    (tmp_path / "reference_files" / "abc").mkdir(parents=True)
    (tmp_path / "reference_files" / "abc" / "sheet.bin").write_bytes(b"\xff\xfe\x00binary")
    rubric = json.dumps([{"rubric_item_id": "i1", "score": 3, "criterion": "Uses the sheet"},
                         {"rubric_item_id": "i2", "score": 1.5, "criterion": "Is short"}])
    table = pyarrow.Table.from_pylist([{"task_id": "t1", "sector": "S", "occupation": "O", "prompt": "Summarise.",
                                        "reference_files": ["reference_files/abc/sheet.bin"],
                                        "reference_file_urls": ["https://example.org/sheet.bin"],
                                        "rubric_pretty": "...", "rubric_json": rubric}])
    pyarrow.parquet.write_table(table, tmp_path / "train.parquet")
    task = load_gdpval_tasks(tmp_path / "train.parquet")["t1"]
    assert task.max_points == 4.5 and [i.item_id for i in task.rubric] == ["i1", "i2"]
    assert task.occupation == "O" and task.reference_files == (tmp_path / "reference_files/abc/sheet.bin",)
    assert "Reference file sheet.bin: binary, 9 bytes, not shown." in gdpval_prompt_rows({"t1": task})[0]["prompt"]

    hle = pyarrow.Table.from_pylist([{**GOOD_HLE, "image": "", "rationale": None, "category": "Math"},
                                     {**GOOD_HLE, "id": "q2", "image": "data:image/png;base64,AAAA"},
                                     {**GOOD_HLE, "id": "q3", "answer_type": "exact"}])
    pyarrow.parquet.write_table(hle, tmp_path / "hle.parquet")
    with pytest.raises(JudgedTaskError, match=r"hle.parquet row 3: field 'answer_type'"):
        load_hle_tasks(tmp_path / "hle.parquet")
    pyarrow.parquet.write_table(hle.slice(0, 2), tmp_path / "hle.parquet")
    tasks = load_hle_tasks(tmp_path / "hle.parquet")
    assert list(tasks.tasks) == ["q1"] and tasks.skipped_image_rows == 1


# ---- config -----------------------------------------------------------------------------------------------------


def test_the_sections_load_and_refuse_a_judge_prompt_of_their_own():
    section = environment_section({"kind": "hle", "options": {"judge": {"base_url": "http://127.0.0.1:1",
                                                                        "model": "m"}}})
    assert isinstance(section.options, HleOptions) and not section.options.loads_model
    assert not section.reward_only
    section = environment_section({"kind": "gdpval", "options": {"tasks": "g.jsonl", "judge": {"path": "j"}}})
    assert section.options.loads_model and section.reward_only
    with pytest.raises(ConfigError, match=r"judge.template: the hle environment writes its own judge prompt"):
        load_config(GRPOConfig, overrides=["environment.kind=hle", "environment.options.judge.path=j",
                                           "environment.options.judge.template='{response}'"])
    with pytest.raises(ConfigError, match="judge"):
        load_config(GRPOConfig, overrides=["environment.kind=gdpval", "environment.options.tasks=g.jsonl"])


# ---- posttrain eval ---------------------------------------------------------------------------------------------


class OrderedGenerator:
    """A Generator answering the i-th prompt of each call with replies[i]."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies, self.weights_version = tokenizer, replies, 0

    def generate(self, prompts, params, num_samples=1):
        groups = []
        for prompt_ids, text in zip(prompts, self.replies):
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            groups.append([Completion(list(prompt_ids), ids, [0.0] * len(ids), text, "stop")])
        return GenerationOutput(groups, 0.0, sum(len(g[0].token_ids) for g in groups))

    def update_weights(self, version, weights):
        self.weights_version = version
        return 0


def test_eval_reports_accuracy_and_calibration_error_on_hle(tmp_path, tiny_model_dir, judge_server, monkeypatch,
                                                            capsys):
    url, requests = judge_server
    tasks = write_rows(tmp_path / "hle.jsonl", [
        {"id": "a", "question": "7 choose 2?", "answer": "21", "answer_type": "exactMatch"},
        {"id": "b", "question": "Pick B.\nA. x\nB. y", "answer": "B", "answer_type": "multipleChoice"},
        {"id": "c", "question": "7 choose 2, again?", "answer": "21", "answer_type": "exactMatch"},
        {"id": "d", "question": "Pick B again.\nA. x\nB. y", "answer": "B", "answer_type": "multipleChoice"}])
    prompts = write_rows(tmp_path / "prompts.jsonl", hle_prompt_rows(load_hle_tasks(tasks)))
    replies = ["Exact Answer: 21\nConfidence: 90%", "Answer: A\nConfidence: 80%", "Exact Answer: 20\nConfidence: 30%",
               "Answer: B"]
    monkeypatch.setattr(evaluate, "build_generator",
                        lambda model, backend, tokenizer, policy=None, **kwargs: OrderedGenerator(tokenizer, replies))
    assert main(["eval", "--model", str(tiny_model_dir), "--data", str(prompts), "--environment", "hle",
                 f"environment.options={{tasks: {tasks}, judge: {{base_url: '{url}', model: j}}}}",
                 "max_new_tokens=8", "data.max_length=512", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert payload["accuracy"] == pytest.approx(0.5) and payload["reward/errors"] == 0
    # Stated: 0.9 right, 0.8 wrong, 0.3 wrong (one bin): |0.6667 - 0.3333|; the fourth states none.
    assert payload["calibration_error"] == pytest.approx(1 / 3)
    assert (payload["calibration/stated"], payload["calibration/missing"]) == (3, 1)
    assert len(requests) == 4


def test_grpo_trains_a_step_on_the_bundled_hle_sample_with_an_http_judge(tmp_path, tiny_model_dir, judge_server):
    from rl_configs import TINY_RL

    from posttrain.algorithms.grpo import train_grpo
    from posttrain.logging import read_metrics

    url, requests = judge_server
    prompts = write_rows(tmp_path / "prompts.jsonl", hle_prompt_rows(load_hle_tasks(bundled_hle_tasks()))[:2])
    cfg = load_config(GRPOConfig, None, [*TINY_RL, f"data.train_files=['{prompts}']", "environment.kind=hle",
                                         f"environment.options={{judge: {{base_url: '{url}', model: j}}}}",
                                         f"output_dir={tmp_path}/run", "trainer.max_steps=1", "trainer.save_every=0",
                                         "rollout.prompts_per_step=2", "rollout.num_generations_per_prompt=2",
                                         "rollout.max_new_tokens=4", "data.max_length=512"])
    train_grpo(cfg)
    (record,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    # The embedded model states no confidence in 4 tokens: every scored answer is counted as missing one.
    assert record["reward/mean"] == 0.0 and record["accuracy"] == 0.0
    assert record["calibration/missing"] == 4 and record["calibration/stated"] == 0
    assert "calibration_error" not in record
    assert 1 <= len(requests) <= 4  # identical (question, response) pairs are judged once


def test_eval_reports_the_mean_rubric_score_on_the_bundled_gdpval_sample(tmp_path, tiny_model_dir, judge_server,
                                                                         monkeypatch, capsys):
    url, requests = judge_server
    prompts = write_rows(tmp_path / "prompts.jsonl", gdpval_prompt_rows(load_gdpval_tasks(bundled_gdpval_tasks())))
    monkeypatch.setattr(evaluate, "build_generator", lambda model, backend, tokenizer, policy=None, **kwargs:
                        OrderedGenerator(tokenizer, ["Memo: ...", "Menu: ...", "Vans: ..."]))
    assert main(["eval", "--model", str(tiny_model_dir), "--data", str(prompts), "--environment", "gdpval",
                 f"environment.options={{judge: {{base_url: '{url}', model: j}}}}", "max_new_tokens=8",
                 "data.max_length=1024", "correct_threshold=0.5", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # 1 point per item: payroll 5 of 9, menu 3 of 6, fleet 3 of 5.
    assert payload["rubric_score/mean"] == pytest.approx((5 / 9 + 3 / 6 + 3 / 5) / 3)
    assert payload["reward/mean"] == pytest.approx((5 / 9 + 3 / 6 + 3 / 5) / 3)
    assert payload["accuracy"] == pytest.approx(3 / 3)  # every rubric score reaches the threshold 0.5
    assert len(requests) == 5 + 3 + 3
