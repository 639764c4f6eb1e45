"""Bad input is a clean, early error naming where it is (file, line or row, field), or a counted skip.

Each test reproduces one way a bad config or data file used to hang, crash with a raw traceback or train on
nothing silently, and pins the message that replaces it. None of them loads a model except the one that
checks what a skipping run prints (the embedded tiny model, one step).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow
import pyarrow.parquet
import pytest

from posttrain.config import ConfigError, SFTConfig, load_config
from posttrain.config.schema import DataConfig, DPOConfig, GRPOConfig, ModelConfig, RMConfig
from posttrain.data import DataError, iter_records, load_rows
from posttrain.data.preference import load_preference_examples
from posttrain.data.sampler import EpochSampler
from posttrain.errors import RunError
from posttrain.models.loading import load_tokenizer

GOOD = {"prompt": "1+1=", "completion": "2"}
QUICK = ["logging.progress=none", "logging.plot=false", "trainer.max_steps=1", "data.max_length=32"]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    return load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))


def no_model(*args, **kwargs):
    raise AssertionError("a model was built before the bad input was refused")


# --- row 5: knobs larger than the data are refused before anything is allocated -------------------------


def _sft_rows(tmp_path: Path, n: int = 200) -> str:
    return write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(n)])


def _pair_rows(tmp_path: Path, n: int = 200) -> str:
    return write_jsonl(tmp_path / "pairs.jsonl",
                       [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(n)])


@pytest.mark.parametrize("recipe, knob, expected", [
    ("sft", "trainer.micro_batch_size=1000000000",
     r"trainer\.micro_batch_size=1000000000 × trainer\.gradient_accumulation_steps=1 = 1000000000 training "
     r"examples per step, but data\.train_files hold only 200"),
    ("sft", "trainer.gradient_accumulation_steps=1000000000",
     r"trainer\.micro_batch_size=8 × trainer\.gradient_accumulation_steps=1000000000 = 8000000000 training "
     r"examples per step, but data\.train_files hold only 200"),
    ("dpo", "trainer.micro_batch_size=1000000000", r"1000000000 training pairs per step, but .* only 200"),
    ("rm", "trainer.gradient_accumulation_steps=1000000000", r"8000000000 training pairs per step, but .* only 200"),
    ("grpo", "rollout.prompts_per_step=1000000000",
     r"rollout\.prompts_per_step=1000000000 training prompts per step, but data\.train_files hold only 200"),
])
def test_huge_batch_knobs_are_refused_at_load_naming_the_knob_and_the_data_size(tmp_path, monkeypatch, tiny_model_dir,
                                                                                  recipe, knob, expected):
    from posttrain.algorithms import dpo, grpo, rm, sft

    module, schema, train = {
        "sft": (sft, SFTConfig, sft.train_sft), "dpo": (dpo, DPOConfig, dpo.train_dpo),
        "rm": (rm, RMConfig, rm.train_rm), "grpo": (grpo, GRPOConfig, grpo.train_grpo),
    }[recipe]
    monkeypatch.setattr(module, "build_policy", no_model)
    data = _pair_rows(tmp_path) if recipe in ("dpo", "rm") else _sft_rows(tmp_path)
    if recipe == "grpo":
        data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(200)])
    cfg = load_config(schema, None, [*QUICK, f"model.name_or_path={tiny_model_dir}", f"data.train_files=[{data}]",
                                     f"output_dir={tmp_path / 'run'}", knob])
    started = time.perf_counter()
    with pytest.raises(RunError, match=expected):
        train(cfg)
    assert time.perf_counter() - started < 30  # the old sampler grew by gigabytes for minutes before failing


def test_the_sampler_never_materialises_a_draw_larger_than_the_data():
    started = time.perf_counter()
    with pytest.raises(ValueError, match="cannot draw 1000000000 indices at once from 200 examples"):
        EpochSampler(200, seed=0).next_indices(10**9)
    assert time.perf_counter() - started < 1
    # A draw a few times the data wraps into the next epochs, as small files with the default batch need.
    assert sorted(EpochSampler(5, seed=0).next_indices(15)) == sorted(list(range(5)) * 3)


def test_a_file_smaller_than_the_batch_still_trains(tmp_path, tiny_model_dir):
    from posttrain.algorithms.sft import train_sft

    data = write_jsonl(tmp_path / "five.jsonl", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(5)])
    cfg = load_config(SFTConfig, None, [*QUICK, f"model.name_or_path={tiny_model_dir}", f"data.train_files=[{data}]",
                                        f"output_dir={tmp_path / 'run'}", "trainer.micro_batch_size=8",
                                        "trainer.max_steps=1"])
    assert train_sft(cfg).steps == 1


def test_an_absurd_group_size_is_a_config_error():
    with pytest.raises(ConfigError, match=r"rollout\.num_generations_per_prompt.*less than or equal to 4096"):
        load_config(GRPOConfig, None, ["data.train_files=[x.jsonl]", "rollout.num_generations_per_prompt=1000000000"])
    # A group larger than the generation batch is sampled one group per batch: allowed.
    load_config(GRPOConfig, None, ["data.train_files=[x.jsonl]", "rollout.num_generations_per_prompt=16",
                                   "rollout.generation_batch_size=8"])
    # generation_batch_size itself only bounds how many sequences are sampled together: nothing is sized by it.
    load_config(GRPOConfig, None, ["data.train_files=[x.jsonl]", "rollout.generation_batch_size=1000000000"])


# --- row 6: invalid UTF-8 names file, row and field in every format; skip mode skips the row -----------------

BAD_UTF8 = b"ab\xff\xfe"


def _write_with_bad_bytes(tmp_path: Path, suffix: str) -> str:
    """Three prompt/completion rows; the second one's completion holds bytes that are not UTF-8."""
    path = tmp_path / f"train{suffix}"
    if suffix == ".jsonl":
        path.write_bytes(b'{"prompt": "a", "completion": "1"}\n{"prompt": "b", "completion": "' + BAD_UTF8
                         + b'"}\n{"prompt": "c", "completion": "3"}\n')
    elif suffix == ".json":
        path.write_bytes(b'[\n {"prompt": "a", "completion": "1"},\n {"prompt": "b", "completion": "' + BAD_UTF8
                         + b'"},\n {"prompt": "c", "completion": "3"}\n]\n')
    elif suffix == ".csv":
        path.write_bytes(b"prompt,completion\na,1\nb," + BAD_UTF8 + b"\nc,3\n")
    else:  # Parquet strings must be UTF-8, but a writer can store any bytes in them
        values = b"1" + BAD_UTF8 + b"3"
        offsets = pyarrow.array([0, 1, 1 + len(BAD_UTF8), len(values)], type=pyarrow.int32())
        completion = pyarrow.Array.from_buffers(pyarrow.string(), 3, [None, offsets.buffers()[1],
                                                                      pyarrow.py_buffer(values)])
        pyarrow.parquet.write_table(pyarrow.table({"prompt": ["a", "b", "c"], "completion": completion}), path)
    return str(path)


@pytest.mark.parametrize("suffix, location", [
    (".jsonl", "train.jsonl:2"),
    (".json", "train.json item 2: field 'completion'"),
    (".csv", "train.csv row 2: field 'completion'"),
    (".parquet", "train.parquet row 2: field 'completion'"),
])
def test_invalid_utf8_is_a_data_error_naming_file_row_and_field_and_skip_mode_skips_it(tmp_path, suffix, location):
    path = _write_with_bad_bytes(tmp_path, suffix)
    with pytest.raises(DataError) as raised:
        load_rows([path], DataConfig(train_files=[path]))
    assert str(raised.value).startswith(f"{tmp_path}/{location}: not valid UTF-8"), str(raised.value)

    rows, stats = load_rows([path], DataConfig(train_files=[path], on_error="skip"))
    assert [row.prompt for row in rows] == ["a", "c"]
    assert stats.rows_read == 3 and stats.rows_skipped == 1
    assert stats.skip_reasons[0].startswith(f"{tmp_path}/{location}: not valid UTF-8")


def test_csv_error_also_names_the_line_and_the_bytes(tmp_path):
    path = _write_with_bad_bytes(tmp_path, ".csv")
    with pytest.raises(DataError, match=r"row 2: field 'completion': not valid UTF-8 \(bytes ff fe at character 3\) "
                                        r"on line 3$"):
        list(iter_records(path))


@pytest.mark.parametrize("name, content, expected", [
    ("utf16.json", json.dumps([GOOD]).encode("utf-16"), r"utf16\.json: is encoded as UTF-16 .*save it as UTF-8"),
    ("utf16.jsonl", json.dumps(GOOD).encode("utf-16"), r"utf16\.jsonl: is encoded as UTF-16"),
    ("utf16.csv", "prompt,completion\na,1\n".encode("utf-16"), r"utf16\.csv: is encoded as UTF-16"),
    ("structure.json", b'[\n {"prompt": "a", "completion": "1"}\xff\n]', r"structure\.json:2: not valid UTF-8 "
                                                                          r"\(bytes ff .*outside any string"),
    ("header.csv", b"prompt,compl\xffetion\na,1\n", r"header\.csv line 1 \(header\): column 2: not valid UTF-8"),
])
def test_a_file_that_cannot_be_split_into_rows_is_one_error_naming_it_even_in_skip_mode(tmp_path, name, content,
                                                                                        expected):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=expected):
        load_rows([str(path)], DataConfig(train_files=[str(path)], on_error="skip"))


# --- row 11: a preference pair must have two different completions ------------------------------------------

SAME = [
    {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
    {"prompt": "2+2=", "chosen": "4", "rejected": "4"},
    {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "yo"}],
     "rejected": [{"role": "assistant", "content": "yo"}]},
]


def test_chosen_equal_to_rejected_names_the_row_or_is_skipped_and_counted(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "pairs.jsonl", SAME)
    with pytest.raises(DataError, match=r"pairs\.jsonl:2: field 'rejected': is identical to chosen; a preference "
                                        r"pair needs two different completions"):
        load_preference_examples([path], tiny_tokenizer, DataConfig(train_files=[path]))
    examples, stats = load_preference_examples([path], tiny_tokenizer, DataConfig(train_files=[path], on_error="skip"))
    assert len(examples) == 1 and stats.rows_skipped == 2
    assert [reason.split(": field")[0] for reason in stats.skip_reasons] == [f"{path}:2", f"{path}:3"]


def test_completions_made_identical_by_truncation_are_malformed_too(tmp_path, tiny_tokenizer):
    # The prompt leaves room for one completion token: "12" and "13" both keep only their first digit.
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "1+1+1+1=", "chosen": "12", "rejected": "13"}])
    prompt_length = len(tiny_tokenizer("1+1+1+1=")["input_ids"])
    cfg = DataConfig(train_files=[path], max_length=prompt_length + 1)
    with pytest.raises(DataError, match=r"pairs\.jsonl:1: field 'rejected': is the same as chosen once both are "
                                        r"truncated to fit data\.max_length"):
        load_preference_examples([path], tiny_tokenizer, cfg)


# --- row 12: raw tracebacks become messages, found with the data --------------------------------------------


@pytest.mark.parametrize("row, expected", [
    ({"prompt": "1+1=", "chosen": "2", "rejected": "3"},
     r"train\.jsonl:1: is a preference pair .*no SFT target; .*`posttrain dpo` or `posttrain rm`"),
    ({"prompt": "1+1=", "answer": "2"},
     r"train\.jsonl:1: has a prompt but no completion \(columns: prompt, answer\).*`posttrain grpo`"),
])
def test_sft_on_preference_or_prompt_only_data_is_a_clean_error(tmp_path, capsys, row, expected):
    from posttrain.cli import main

    path = write_jsonl(tmp_path / "train.jsonl", [row, row])
    assert main(["sft", f"data.train_files=[{path}]", f"output_dir={tmp_path / 'run'}", *QUICK]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("posttrain sft: bad data: ") and len(err.splitlines()) == 1
    assert re.search(expected, err), err


@pytest.mark.parametrize("kind, rows, expected", [
    ("arithmetic", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "solution": "4"}],
     r"prompts\.jsonl:2: field 'answer': missing: the arithmetic environment scores each reply against the row's "
     r"'answer' \(columns found: prompt, solution"),
    ("code", [{"prompt": "write f"}], r"prompts\.jsonl:1: field 'tests': missing: the code environment scores each "
                                      r"reply against the row's 'tests' or 'assert_code'"),
])
def test_grpo_rows_missing_the_environments_column_fail_with_the_data_before_a_model_loads(
        tmp_path, monkeypatch, tiny_model_dir, kind, rows, expected):
    from posttrain.algorithms import grpo

    monkeypatch.setattr(grpo, "build_policy", no_model)
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    cfg = load_config(GRPOConfig, None, [*QUICK, f"model.name_or_path={tiny_model_dir}", f"data.train_files=[{path}]",
                                         f"output_dir={tmp_path / 'run'}", f"environment.kind={kind}",
                                         "rollout.prompts_per_step=1"])
    with pytest.raises(DataError, match=expected):
        grpo.train_grpo(cfg)


def test_an_option_value_the_environment_refuses_is_a_message_not_a_traceback(tmp_path, tiny_model_dir):
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "1+1=", "tests": "assert True"}])
    result = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "grpo", *QUICK, f"model.name_or_path={tiny_model_dir}",
         f"data.train_files=[{path}]", f"output_dir={tmp_path / 'run'}", "environment.kind=code",
         "environment.options={time_limit_s: -1.0}", "rollout.prompts_per_step=1"],
        capture_output=True, text=True)
    assert result.returncode == 1
    assert "environment.options of the code environment: time_limit_s" in result.stderr and "must be positive" \
        in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("options, expected", [
    ("{timeout_seconds: 3}", r"environment\.options\.timeout_seconds: the math environment has no option "
                             r"'timeout_seconds' \(did you mean timeout_s\?\); its options are timeout_s, num_workers"),
    ("{timeout_s: soon}", r"options\.timeout_s: the math environment expects float, got 'soon' \(str\)"),
    ("{num_workers: 1.5}", r"options\.num_workers: the math environment expects int, got 1\.5 \(float\)"),
])
def test_invalid_environment_options_are_a_config_error_naming_option_and_environment(options, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(GRPOConfig, None, ["data.train_files=[x.jsonl]", "environment.kind=math",
                                       f"environment.options={options}"])


def test_a_required_environment_option_left_out_is_named():
    with pytest.raises(ConfigError, match=r"options\.path: required by the reward_model environment"):
        load_config(GRPOConfig, None, ["data.train_files=[x.jsonl]", "environment.kind=reward_model"])


def test_preference_conversation_without_an_assistant_reply_names_the_message_not_the_template(tmp_path,
                                                                                                tiny_tokenizer):
    user = {"role": "user", "content": "hi"}
    rows = [
        {"prompt": [user], "chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]},
        {"chosen": [user, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}],
         "rejected": [user, {"role": "assistant", "content": "a"}, {"role": "user", "content": "less"}]},
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows[:1])
    with pytest.raises(DataError, match=r"pairs\.jsonl:1: field 'chosen\[0\]\.role': expected 'assistant', got 'user': "
                                        r"the chosen completion must begin with the assistant's reply"):
        load_preference_examples([path], tiny_tokenizer, DataConfig(train_files=[path]))
    second = write_jsonl(tmp_path / "implicit.jsonl", rows[1:])
    with pytest.raises(DataError, match=r"implicit\.jsonl:1: field 'chosen\[2\]\.role': expected 'assistant'"):
        load_preference_examples([second], tiny_tokenizer, DataConfig(train_files=[second]))


# --- row 13: skip mode prints the first reasons with their locations ----------------------------------------


def test_skip_mode_prints_the_first_reasons_with_their_locations(tmp_path, capsys, tiny_model_dir):
    from posttrain.algorithms.sft import train_sft

    bad = [{"prompt": f"{i}+1=", "completion": i} for i in range(7)]
    path = write_jsonl(tmp_path / "train.jsonl", [*[GOOD] * 4, *bad])
    cfg = load_config(SFTConfig, None, [*QUICK, f"model.name_or_path={tiny_model_dir}", f"data.train_files=[{path}]",
                                        f"output_dir={tmp_path / 'run'}", "data.on_error=skip",
                                        "trainer.micro_batch_size=2"])
    train_sft(cfg)
    out = capsys.readouterr().out
    assert "11 rows read: 4 examples" in out and "7 skipped as malformed" in out
    lines = out.splitlines()
    first = lines.index(next(line for line in lines if "first skipped:" in line))
    assert lines[first + 1:first + 7] == [
        *(f"  {path}:{line}: field 'completion': expected a string, got int" for line in range(5, 10)),
        "  ... and 2 more",
    ]


# --- row 14: a local-looking path never goes to the hub -----------------------------------------------------


@pytest.mark.parametrize("source, reason", [
    ("data/x.txt", "it ends in a file extension (.txt)"),
    ("./prompts", "it starts with '.'"),
    ("runs/a/train", "it has more than one '/'"),
    ("data/train", "its first folder 'data' exists in the current directory"),
])
def test_a_missing_local_path_is_file_not_found_without_touching_the_hub(tmp_path, monkeypatch, source, reason):
    import datasets

    def hub(*args, **kwargs):
        raise AssertionError(f"{source!r} was looked up on the hub")

    monkeypatch.setattr(datasets, "load_dataset", hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    started = time.perf_counter()
    with pytest.raises(DataError) as raised:
        list(iter_records(source))
    assert time.perf_counter() - started < 1
    message = str(raised.value)
    assert message.startswith(f"{source}: file not found (looked for {tmp_path / source.removeprefix('./')}")
    assert f"It is read as a local path, not a hub dataset name, because {reason}" in message
    if source == "data/x.txt":
        assert "'.txt' is not a supported file type either" in message


def test_hub_names_still_go_to_the_hub(tmp_path, monkeypatch):
    import datasets

    calls = []
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda name, split: calls.append(name) or datasets.Dataset.from_list([GOOD]))
    monkeypatch.chdir(tmp_path)
    for name in ("someone/arith", "teknium/OpenHermes-2.5:train", "squad"):
        assert len(list(iter_records(name))) == 1
    assert calls == ["someone/arith", "teknium/OpenHermes-2.5", "squad"]


# --- row 15c: a scalar section with keys set in it ----------------------------------------------------------


def test_keys_set_in_a_scalar_section_are_a_config_error_naming_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer: 5\ndata:\n  train_files: [x.jsonl]\n")
    with pytest.raises(ConfigError, match=r"^trainer: is 5 \(int\), not a section of keys, so trainer\.max_steps "
                                          r"cannot be set in it"):
        load_config(SFTConfig, path, ["trainer.max_steps=3"])
    # An empty section (YAML null) takes the keys.
    path.write_text("trainer:\ndata:\n  train_files: [x.jsonl]\n")
    assert load_config(SFTConfig, path, ["trainer.max_steps=3"]).trainer.max_steps == 3
