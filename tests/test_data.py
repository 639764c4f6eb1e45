"""Data layer: reading files, validating formats, tokenizing and masking, skip/raise, length limits."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from posttrain.config.schema import DataConfig
from posttrain.data import (
    DataError,
    MessagesRow,
    PreferenceRow,
    PromptCompletionRow,
    PromptOnlyRow,
    TextRow,
    TokenizedExample,
    detect_format,
    iter_records,
    load_rows,
    load_sft_examples,
    parse_row,
    tokenize_sft_row,
    truncate_or_drop,
)

EOS, PAD, IM_START, IM_END = "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "What is 2+2? The answer is 4.",
    "What is 3+3? The answer is 6.",
    "You are a helpful assistant. Hello world, the quick brown fox.",
    "system user assistant",
]


def build_tokenizer(chat_template: str | None = CHATML) -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained on CORPUS, built offline in milliseconds, with a ChatML template."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS, PAD, IM_START, IM_END],
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 5, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=PAD)
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def target_runs(example: TokenizedExample, tokenizer: PreTrainedTokenizerFast) -> list[str]:
    """The decoded text of each maximal run of consecutive target tokens."""
    runs: list[list[int]] = []
    previous = 0
    for token, is_target in zip(example.input_ids, example.loss_mask):
        if is_target and not previous:
            runs.append([])
        if is_target:
            runs[-1].append(token)
        previous = is_target
    return [tokenizer.decode(run) for run in runs]


def write_jsonl(path: Path, lines: list[object | str]) -> str:
    """Write objects as JSON lines; strings are written verbatim (to plant malformed lines)."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


# --- tokenization and masking -------------------------------------------------------------------


def test_text_row_targets_every_token_but_the_first_and_ends_with_eos(tokenizer):
    example = tokenize_sft_row(TextRow("The answer is 4."), tokenizer, completion_only_loss=True, source="x:1")
    expected = tokenizer("The answer is 4.")["input_ids"] + [tokenizer.eos_token_id]
    assert list(example.input_ids) == expected
    assert example.loss_mask == (0,) + (1,) * (len(expected) - 1)
    assert example.source == "x:1"


def test_prompt_completion_strings_mask_only_the_completion(tokenizer):
    row = PromptCompletionRow(prompt="What is 2+2?", completion=" The answer is 4.")
    example = tokenize_sft_row(row, tokenizer, completion_only_loss=True, source="x:1")
    prompt_ids = tokenizer("What is 2+2?")["input_ids"]
    completion_ids = tokenizer(" The answer is 4.", add_special_tokens=False)["input_ids"]
    assert list(example.input_ids) == prompt_ids + completion_ids + [tokenizer.eos_token_id]
    assert example.loss_mask == (0,) * len(prompt_ids) + (1,) * (len(completion_ids) + 1)
    assert target_runs(example, tokenizer) == [" The answer is 4." + EOS]

    everything = tokenize_sft_row(row, tokenizer, completion_only_loss=False, source="x:1")
    assert everything.input_ids == example.input_ids
    assert everything.loss_mask == (0,) + (1,) * (len(example) - 1)


def test_multi_turn_messages_target_only_assistant_turns_and_their_end_tokens(tokenizer):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "The answer is 4."},
        {"role": "user", "content": "What is 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    example = tokenize_sft_row(MessagesRow(messages), tokenizer, completion_only_loss=True, source="x:1")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(list(example.input_ids)) == rendered
    assert target_runs(example, tokenizer) == [f"The answer is 4.{IM_END}", f"6{IM_END}"]
    # The newline after <|im_end|> is never generated, so the token after each run is not a target.
    assert example.loss_mask[-1] == 0

    everything = tokenize_sft_row(MessagesRow(messages), tokenizer, completion_only_loss=False, source="x:1")
    assert everything.loss_mask == (0,) + (1,) * (len(everything) - 1)


def test_conversational_prompt_completion_targets_only_the_completion_turn(tokenizer):
    prompt = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "What is 3+3?"},
    ]
    completion = [{"role": "assistant", "content": "6"}]
    row = PromptCompletionRow(prompt=prompt, completion=completion)
    example = tokenize_sft_row(row, tokenizer, completion_only_loss=True, source="x:1")
    assert target_runs(example, tokenizer) == [f"6{IM_END}"]


def test_conversation_without_assistant_turn_is_a_data_error(tokenizer):
    row = MessagesRow([{"role": "user", "content": "hello"}])
    with pytest.raises(DataError, match=r"^f\.jsonl:4: field 'messages': has no assistant message"):
        tokenize_sft_row(row, tokenizer, completion_only_loss=True, source="f.jsonl:4")


def test_tokenizer_without_chat_template_is_a_clear_error():
    plain = build_tokenizer(chat_template=None)
    row = MessagesRow([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4"}])
    with pytest.raises(ValueError, match="has no chat template.*prompt/completion strings"):
        tokenize_sft_row(row, plain, completion_only_loss=True, source="x:1")


def test_template_that_is_not_incremental_is_refused_not_mismasked():
    # Writes the number of messages first, so a shorter conversation is not a prefix of a longer one.
    counting = build_tokenizer(chat_template="{{ messages | length }}" + CHATML)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "hi"},
    ]
    with pytest.raises(ValueError, match="does not render conversations incrementally"):
        tokenize_sft_row(MessagesRow(messages), counting, completion_only_loss=True, source="x:1")


def test_preference_and_prompt_only_rows_have_no_sft_target(tokenizer):
    with pytest.raises(ValueError, match="PreferenceRow has no SFT target"):
        tokenize_sft_row(PreferenceRow("p", "a", "b"), tokenizer, completion_only_loss=True, source="x:1")


def test_truncate_keeps_the_first_tokens_and_drop_returns_none():
    example = TokenizedExample(input_ids=(1, 2, 3, 4, 5), loss_mask=(0, 0, 1, 1, 1), source="x:1")
    assert truncate_or_drop(example, 5, "drop") is example
    assert truncate_or_drop(example, 3, "truncate") == TokenizedExample((1, 2, 3), (0, 0, 1), "x:1")
    assert truncate_or_drop(example, 3, "drop") is None


# --- formats ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("columns", "expected"),
    [
        (["messages", "prompt"], "messages"),
        (["prompt", "chosen", "rejected"], "preference"),
        (["chosen", "rejected"], "preference"),
        (["prompt", "completion", "id"], "prompt_completion"),
        (["text", "meta"], "text"),
        (["prompt", "answer"], "prompt_only"),
        (["conversations", "id"], "sharegpt"),
        (["instruction", "input", "output"], "alpaca"),
        (["instruction", "output"], "alpaca"),
    ],
)
def test_detect_format(columns, expected):
    assert detect_format(columns) == expected


def test_detect_format_lists_the_columns_and_the_accepted_layouts():
    with pytest.raises(DataError) as info:
        detect_format(["question", "answer"], location="qa.jsonl:1")
    message = str(info.value)
    assert message.startswith("qa.jsonl:1: cannot tell the data format from the columns ['answer', 'question']")
    assert "prompt+completion" in message and "data.format" in message


def test_prompt_only_keeps_every_other_column_as_extras():
    row = parse_row("prompt_only", {"prompt": "What is 2+2?", "answer": "4", "id": 7}, "x:1")
    assert row == PromptOnlyRow(prompt="What is 2+2?", extras={"answer": "4", "id": 7})


def test_sharegpt_rows_become_messages_and_alpaca_rows_prompt_completion():
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2?"},
                                  {"from": "gpt", "value": "4", "weight": 1}], "id": "a"}
    assert parse_row("sharegpt", sharegpt, "x:1") == MessagesRow(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "weight": 1}])
    with_input = {"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"}
    assert parse_row("alpaca", with_input, "x:1") == PromptCompletionRow(prompt="Add the numbers.\n\n2 and 2",
                                                                          completion="4")
    for empty in ("", None):
        row = parse_row("alpaca", {"instruction": "Say hi.", "input": empty, "output": "hi"}, "x:1")
        assert row == PromptCompletionRow(prompt="Say hi.", completion="hi")


def test_preference_explicit_and_implicit_prompt():
    explicit = parse_row("preference", {"prompt": "Q", "chosen": "good", "rejected": "bad"}, "x:1")
    assert explicit == PreferenceRow(prompt="Q", chosen="good", rejected="bad")

    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "What is 2+2?"}
    implicit = parse_row(
        "preference",
        {
            "chosen": [system, user, {"role": "assistant", "content": "4"}],
            "rejected": [system, user, {"role": "assistant", "content": "5"}],
        },
        "x:1",
    )
    assert implicit == PreferenceRow(
        prompt=[system, user],
        chosen=[{"role": "assistant", "content": "4"}],
        rejected=[{"role": "assistant", "content": "5"}],
    )


@pytest.mark.parametrize(
    ("fmt", "record", "expected"),
    [
        ("text", {"text": 3}, "x:1: field 'text': expected a string, got int"),
        ("prompt_completion", {"prompt": "a"}, "x:1: field 'completion': missing (columns found: prompt)"),
        ("prompt_completion", {"prompt": None, "completion": "b"}, "field 'prompt': expected a string or a list of messages, got null"),
        ("prompt_completion", {"prompt": "a", "completion": None}, "x:1: field 'completion': expected a string, got null"),
        (
            "prompt_completion",
            {"prompt": [{"role": "user", "content": "a"}], "completion": "b"},
            "field 'completion': expected a list of messages like prompt, got str; give prompt and completion both",
        ),
        ("messages", {"messages": []}, "field 'messages': expected at least one message"),
        ("messages", {"messages": "hi"}, "field 'messages': expected a list of messages, got str"),
        ("messages", {"messages": [{"role": "user"}]}, "field 'messages[0].content': missing"),
        ("messages", {"messages": [{"role": "bot", "content": "a"}]}, "field 'messages[0].role': expected one of system, user, assistant, tool, got 'bot'"),
        ("messages", {"messages": [{"role": "user", "content": 1}]}, "field 'messages[0].content': expected a string, got int"),
        ("preference", {"chosen": "a", "rejected": "b"}, "field 'prompt': missing; without a prompt column"),
        ("preference", {"prompt": "q", "chosen": "a", "rejected": 1.5}, "field 'rejected': expected a string, got float"),
        ("prompt_only", {"prompt": ["a"]}, "field 'prompt[0]': expected a message"),
        ("sharegpt", {"conversations": "hi"}, "field 'conversations': expected a list of turns, got str"),
        ("sharegpt", {"conversations": [{"from": "bot", "value": "a"}]},
         "field 'conversations[0].from': unknown speaker 'bot'; expected one of human,"),
        ("sharegpt", {"conversations": [{"from": "human"}]}, "field 'conversations[0].value': missing"),
        ("sharegpt", {"conversations": [{"from": "gpt", "value": 3}]},
         "field 'conversations[0].content': expected a string, got int"),
        ("alpaca", {"instruction": "a"}, "field 'output': missing"),
        ("alpaca", {"instruction": "a", "input": 5, "output": "b"}, "field 'input': expected a string, got int"),
    ],
)
def test_parse_row_errors_name_location_and_field(fmt, record, expected):
    with pytest.raises(DataError) as info:
        parse_row(fmt, record, "x:1")
    assert expected in str(info.value)
    assert info.value.location == "x:1"


def test_data_error_fields_and_pickling():
    error = DataError("data/train.jsonl:12", "expected a string, got int", "completion")
    assert str(error) == "data/train.jsonl:12: field 'completion': expected a string, got int"
    assert isinstance(error, ValueError)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.location, copy.field, copy.message, str(copy)) == (error.location, error.field, error.message, str(error))
    assert str(DataError("f.csv", "file not found")) == "f.csv: file not found"


# --- reading files ------------------------------------------------------------------------------

ROWS = [{"prompt": "What is 2+2?", "completion": "4"}, {"prompt": "What is 3+3?", "completion": "6"}]


def test_jsonl_json_csv_parquet_records_and_locations(tmp_path):
    import pyarrow
    import pyarrow.parquet

    jsonl = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], "", ROWS[1]])
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps(ROWS))
    as_data = tmp_path / "data.json"
    as_data.write_text(json.dumps({"data": ROWS}))
    csv_file = tmp_path / "d.csv"
    csv_file.write_text('prompt,completion\nWhat is 2+2?,4\n"What is\n3+3?",6\n')
    parquet = tmp_path / "d.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(ROWS), parquet)

    assert list(iter_records(jsonl)) == [(f"{jsonl}:1", ROWS[0]), (f"{jsonl}:3", ROWS[1])]
    assert list(iter_records(str(as_list))) == [(f"{as_list} item 1", ROWS[0]), (f"{as_list} item 2", ROWS[1])]
    assert [row for _, row in iter_records(str(as_data))] == ROWS
    # CSV values stay strings; a quoted newline does not start a new row.
    assert list(iter_records(str(csv_file))) == [
        (f"{csv_file} row 1", {"prompt": "What is 2+2?", "completion": "4"}),
        (f"{csv_file} row 2", {"prompt": "What is\n3+3?", "completion": "6"}),
    ]
    assert list(iter_records(str(parquet))) == [(f"{parquet} row 1", ROWS[0]), (f"{parquet} row 2", ROWS[1])]


def test_missing_file_and_bad_lines(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: file not found"):
        list(iter_records(str(tmp_path / "nope.jsonl")))
    path = write_jsonl(tmp_path / "train.jsonl", [ROWS[0], "[1, 2]"])
    with pytest.raises(DataError, match=r"train\.jsonl:2: expected a JSON object, got array"):
        list(iter_records(path))
    csv_file = tmp_path / "bad.csv"
    csv_file.write_text("prompt,completion\na,b,c\n")
    with pytest.raises(DataError, match=r"bad\.csv row 1: has more fields than the header's 2 columns"):
        list(iter_records(str(csv_file)))


def test_json_lines_misnamed_as_json_gets_a_hint(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n")
    with pytest.raises(DataError, match=r"d\.json:2: invalid JSON: Extra data .*name the file \.jsonl"):
        list(iter_records(str(path)))


def test_hub_failure_offline_says_what_to_do(monkeypatch):
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/arith' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(DataError) as info:
        list(iter_records("someone/arith:test"))
    message = str(info.value)
    assert message.startswith("hub:someone/arith[test]: dataset 'someone/arith' (split 'test') could not be loaded from the hub")
    assert "seems offline" in message and "local .jsonl" in message and "HF_DATASETS_OFFLINE=1" in message
    assert isinstance(info.value.__cause__, ConnectionError)


def test_hub_rows_are_read_with_their_locations(monkeypatch):
    import datasets

    calls = []

    def fake_load(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert list(iter_records("someone/arith")) == [
        ("hub:someone/arith[train] row 1", ROWS[0]),
        ("hub:someone/arith[train] row 2", ROWS[1]),
    ]
    assert calls == [("someone/arith", "train")]


# --- whole datasets -----------------------------------------------------------------------------


def sft_config(*files: str, **overrides) -> DataConfig:
    return DataConfig(train_files=list(files), **overrides)


def test_load_sft_examples_detects_each_sources_format(tmp_path, tokenizer):
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": "hello world"}])
    chats = write_jsonl(
        tmp_path / "chats.jsonl",
        [{"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}],
    )
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("prompt,completion\nWhat is 3+3?, 6\n")
    examples, stats = load_sft_examples([texts, chats, str(pairs)], tokenizer, sft_config(texts))
    assert tokenizer.decode(list(examples[0].input_ids)) == "hello world" + EOS
    assert examples[0].loss_mask == (0,) + (1,) * (len(examples[0]) - 1)
    assert target_runs(examples[1], tokenizer) == [f"4{IM_END}"]
    assert target_runs(examples[2], tokenizer) == [f" 6{EOS}"]
    assert [example.source for example in examples] == [f"{texts}:1", f"{chats}:1", f"{pairs} row 1"]
    assert (stats.rows_read, stats.examples, stats.rows_skipped) == (3, 3, 0)
    assert stats.target_tokens == sum(example.num_targets for example in examples)


def test_sharegpt_and_alpaca_files_train_like_their_converted_rows(tmp_path, tokenizer):
    turns = [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"}]
    sharegpt = write_jsonl(tmp_path / "sharegpt.jsonl", [{"conversations": turns}])
    messages = write_jsonl(tmp_path / "messages.jsonl", [{"messages": [
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}])
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Add.", "input": "2 2", "output": " 4"}])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Add.\n\n2 2", "completion": " 4"}])
    converted, _ = load_sft_examples([sharegpt, alpaca], tokenizer, sft_config(sharegpt))
    direct, _ = load_sft_examples([messages, pairs], tokenizer, sft_config(messages))
    assert [(e.input_ids, e.loss_mask) for e in converted] == [(e.input_ids, e.loss_mask) for e in direct]
    assert target_runs(converted[0], tokenizer) == [f"4{IM_END}"]


def test_raise_mode_stops_at_the_first_bad_row_naming_file_line_and_field(tmp_path, tokenizer):
    bad_json = write_jsonl(tmp_path / "train.jsonl", [ROWS[0], ROWS[1], '{"prompt": "x", "completion": '])
    with pytest.raises(DataError, match=r"train\.jsonl:3: invalid JSON"):
        load_sft_examples([bad_json], tokenizer, sft_config(bad_json))

    wrong_type = write_jsonl(tmp_path / "typed.jsonl", [ROWS[0], {"prompt": "What is 1+1?", "completion": 2}])
    with pytest.raises(DataError) as info:
        load_sft_examples([wrong_type], tokenizer, sft_config(wrong_type))
    assert str(info.value) == f"{wrong_type}:2: field 'completion': expected a string, got int"
    assert (info.value.location, info.value.field) == (f"{wrong_type}:2", "completion")

    missing = write_jsonl(tmp_path / "missing.jsonl", [ROWS[0], {"prompt": "What is 1+1?"}])
    with pytest.raises(DataError, match=r"missing\.jsonl:2: field 'completion': missing"):
        load_sft_examples([missing], tokenizer, sft_config(missing, format="prompt_completion"))


def test_skip_mode_counts_bad_rows_and_keeps_good_ones(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            ROWS[0],
            {"prompt": "What is 1+1?", "completion": 2},
            "not json",
            "",
            {"prompt": "What is 1+1?"},
            ROWS[1],
            {"messages": [{"role": "user", "content": "hi"}]},
        ],
    )
    examples, stats = load_sft_examples([path], tokenizer, sft_config(path, on_error="skip", format="prompt_completion"))
    assert [example.source for example in examples] == [f"{path}:1", f"{path}:6"]
    assert (stats.rows_read, stats.rows_skipped, stats.examples) == (6, 4, 2)
    assert stats.skip_reasons == [
        f"{path}:2: field 'completion': expected a string, got int",
        f"{path}:3: invalid JSON: Expecting value (column 1)",
        f"{path}:5: field 'completion': missing (columns found: prompt)",
        f"{path}:7: field 'prompt': missing (columns found: messages)",
    ]
    assert "6 rows read: 2 examples" in stats.summary() and "4 skipped as malformed" in stats.summary()


def test_truncate_and_drop_are_counted(tmp_path, tokenizer):
    short = {"prompt": "Q", "completion": "4"}
    long = {"prompt": "Q", "completion": "The answer is 4. The answer is 6. The quick brown fox."}
    prompt_too_long = {"prompt": "You are a helpful assistant. What is 2+2? " * 3, "completion": "4"}
    path = write_jsonl(tmp_path / "train.jsonl", [short, long, prompt_too_long])
    max_length = 8
    lengths = [
        len(tokenize_sft_row(PromptCompletionRow(**row), tokenizer, True, "")) for row in (short, long, prompt_too_long)
    ]
    assert lengths[0] <= max_length < min(lengths[1:])

    truncated, stats = load_sft_examples(
        [path], tokenizer, sft_config(path, max_length=max_length, overlong="truncate", on_error="skip")
    )
    assert [len(example) for example in truncated] == [lengths[0], max_length]
    assert (stats.truncated, stats.dropped_overlong, stats.rows_skipped) == (1, 0, 1)
    assert "no target tokens left after truncation to data.max_length=8" in stats.skip_reasons[0]

    dropped, stats = load_sft_examples([path], tokenizer, sft_config(path, max_length=max_length, overlong="drop"))
    assert [len(example) for example in dropped] == [lengths[0]]
    assert (stats.truncated, stats.dropped_overlong, stats.rows_skipped, stats.rows_read) == (0, 2, 0, 3)

    with pytest.raises(DataError, match=r"train\.jsonl:3: no target tokens left after truncation"):
        load_sft_examples([path], tokenizer, sft_config(path, max_length=max_length))


def test_sft_refuses_preference_data(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Q", "chosen": "a", "rejected": "b"}])
    with pytest.raises(DataError, match=r"pairs\.jsonl:1: is a preference pair .*no SFT target.*posttrain dpo"):
        load_sft_examples([path], tokenizer, sft_config(path, on_error="skip"))


def test_no_usable_rows_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "x", "completion": 1}])
    with pytest.raises(DataError, match=r"no usable rows \(1 rows read: 0 examples.*expected a string, got int"):
        load_sft_examples([path], tokenizer, sft_config(path, on_error="skip"))
    assert load_sft_examples([], tokenizer, sft_config(path))[0] == []


def test_load_rows_reads_prompts_with_extras_from_several_sources(tmp_path):
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "What is 2+2?", "answer": 4}])
    csv_file = tmp_path / "b.csv"
    csv_file.write_text("prompt,answer\nWhat is 3+3?,6\n")
    rows, stats = load_rows([jsonl, str(csv_file)], sft_config(jsonl))
    assert rows == [
        PromptOnlyRow(prompt="What is 2+2?", extras={"answer": 4}),
        PromptOnlyRow(prompt="What is 3+3?", extras={"answer": "6"}),
    ]
    assert (stats.rows_read, stats.examples, stats.target_tokens) == (2, 2, 0)


def test_bench_lengths_rows_spread_from_16_to_1024_tokens_in_every_form():
    import statistics

    from posttrain.data.embedded import iter_embedded

    rows = [row for _, row in iter_embedded("posttrain/bench-lengths")]
    lengths = [len(row[key]) for row in rows for key in ("prompt", "completion")]
    assert len(rows) == 4096 and min(lengths) == 16 and max(lengths) == 1024
    assert 100 <= statistics.median(lengths) <= 160  # log-normal around 128: long-tailed, not uniform
    assert sum(n > 512 for n in lengths) > 0.04 * len(lengths)
    assert [row for _, row in iter_embedded("posttrain/bench-lengths[:3]")] == rows[:3]  # fixed rows
    messages = next(iter_embedded("posttrain/bench-lengths-messages"))[1]["messages"]
    assert [m["content"] for m in messages] == [rows[0]["prompt"], rows[0]["completion"]]
    pair = next(iter_embedded("posttrain/bench-lengths-preference:heldout"))[1]
    assert set(pair) == {"prompt", "chosen", "rejected"} and pair["chosen"] != pair["rejected"]
