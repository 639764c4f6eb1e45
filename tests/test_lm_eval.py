"""`posttrain eval --lm-eval-tasks`: lm-evaluation-harness run offline on a local task YAML (json rows on disk) and
an embedded model. posttrain's own multiple-choice scoring of the same rows gives lm-eval's acc and acc_norm and,
question by question, the same log-likelihoods (1e-5), with the default one-space delimiter and on a tokenizer that
merges characters across the prompt/choice boundary. Skipped, saying why, where the lm-eval extra is not
installed; the message for a missing extra is tested without it."""

import json
import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.data.loading import iter_records

SKIP_REASON = "the lm-eval extra is not installed (pip install 'posttrain[lm-eval]')"

TASK_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {rows}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{doc_to_text}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
{delimiter}metric_list:
  - metric: acc
  - metric: acc_norm
"""

MERGING_ROWS = [  # posttrain/tiny-bpe merges "10".."18" and "89".."99": "5+5=1" + "0+0" is scored as "+0"
    {"prompt": "5+5=1", "choices": ["0+0", "1+1", "9+9"], "answer": 0},
    {"prompt": "8+1=", "choices": ["9", "89", "10"], "answer": 0},
    {"prompt": "9+9=1", "choices": ["8+0", "7+1", "0+8"], "answer": 0},
]


def write_task(folder: Path, name: str, rows: list[dict], doc_to_text: str, delimiter: str | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows_file = folder / f"{name}.jsonl"
    rows_file.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    line = "" if delimiter is None else f"target_delimiter: {json.dumps(delimiter)}\n"
    (folder / f"{name}.yaml").write_text(TASK_YAML.format(name=name, rows=rows_file, cache=folder / "cache",
                                                          doc_to_text=doc_to_text, delimiter=line), encoding="utf-8")
    return rows_file


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("model, template, delimiter, merging", [
    ("posttrain/tiny", "Question: {prompt}\nAnswer:", None, False),   # lm-eval's default delimiter, one space
    ("posttrain/tiny-bpe", "{prompt}", "", True),                      # no delimiter; merges across the boundary
])
def test_lm_eval_agrees_with_posttrain_multiple_choice(tmp_path, monkeypatch, capsys, model, template, delimiter,
                                                       merging):
    pytest.importorskip("lm_eval", reason=SKIP_REASON)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = [record for _, record in iter_records("posttrain/arithmetic-mc:heldout[:30]")]
    rows += MERGING_ROWS if merging else []
    doc_to_text = template.replace("{prompt}", "{{prompt}}").replace("\n", "\\n")
    rows_file = write_task(tmp_path / "tasks", "arith_mc_local", rows, doc_to_text, delimiter)

    harness_out = tmp_path / "lm_eval_samples.jsonl"
    assert main(["eval", "--model", model, "--lm-eval-tasks", "arith_mc_local", "--lm-eval-include-path",
                 str(tmp_path / "tasks"), "--output", str(harness_out), "--json", "batch_size=16"]) == 0
    harness = json.loads(capsys.readouterr().out)["lm_eval"]["arith_mc_local"]

    own_out = tmp_path / "posttrain_records.jsonl"
    overrides = [f"prompt.template={json.dumps(template)}"] + (
        [] if delimiter is None else [f"target_delimiter={json.dumps(delimiter)}"])
    assert main(["eval", "--model", model, "--data", str(rows_file), "--multiple-choice", "--output", str(own_out),
                 "--json", *overrides]) == 0
    own = json.loads(capsys.readouterr().out)

    assert harness["count"] == own["count"] == len(rows)
    assert harness["acc"] == own["acc"] and harness["acc_norm"] == own["acc_norm"]
    samples = sorted(read_jsonl(harness_out), key=lambda sample: sample["doc_id"])
    records = read_jsonl(own_out)
    assert len(samples) == len(records) == len(rows)
    for sample, record in zip(samples, records):
        assert sample["target"] == record["answer"]
        harness_lls = [response[0] for response in sample["filtered_resps"]]
        assert record["loglikelihoods"] == pytest.approx(harness_lls, abs=1e-5)
        assert sample["acc"] == float(record["correct"]) and sample["acc_norm"] == float(record["correct_norm"])


@pytest.mark.slow  # an unknown task makes lm-eval index its ~15k built-in task definitions: 15-90 s on 2 cores
def test_an_unknown_task_is_named(tmp_path, capsys):
    pytest.importorskip("lm_eval", reason=SKIP_REASON)
    write_task(tmp_path / "tasks", "arith_mc_local", MERGING_ROWS, "{{prompt}}", "")
    assert main(["eval", "--lm-eval-tasks", "arith_mc_local,no_such_task", "--lm-eval-include-path",
                 str(tmp_path / "tasks")]) == 1
    assert "lm-eval task(s) 'no_such_task' not found among lm-eval's tasks or" in capsys.readouterr().err


def test_without_the_extra_the_error_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    assert main(["eval", "--lm-eval-tasks", "hellaswag"]) == 1
    assert "needs lm-evaluation-harness, an optional extra: pip install 'posttrain[lm-eval]'" in \
        capsys.readouterr().err
