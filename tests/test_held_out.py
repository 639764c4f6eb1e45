"""Held-out means held out: evaluation data that shares prompts with the training data is counted, reported, and
refused past data.max_overlap_fraction (default 0), naming both sources and a shared row; the embedded splits are
checked the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.algorithms.common import held_out_check
from posttrain.config import DPOConfig, SFTConfig, load_config
from posttrain.config.schema import GRPOConfig
from posttrain.data.errors import DataError
from posttrain.data.overlap import check_held_out, normalize


def _rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_same_file_for_training_and_evaluation_stops_the_run_before_the_model_loads(tmp_path):
    # Issue 34: the same file as train_files and eval_files ran without a word.
    from posttrain.algorithms.sft import train_sft

    data = _rows(tmp_path / "data.jsonl", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(8)])
    cfg = load_config(SFTConfig, None, [f"data.train_files=[{data}]", f"data.eval_files=[{data}]",
                                        "model.name_or_path=no/such-model", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(DataError, match=rf"8 of 8 rows of data.eval_files share a prompt with the training data "
                                        rf"\(8 the whole example\) \({data}\), more than data.max_overlap_fraction=0; "
                                        rf"for example {data}:1 \(the same as training row {data}:1\)"):
        train_sft(cfg)  # no/such-model would fail later, when the model loads
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_shared_prompts_are_found_after_normalisation_and_counted_apart_from_whole_rows(tmp_path):
    train = _rows(tmp_path / "train.jsonl", [{"prompt": "What is 2+2?", "completion": "4"},
                                            {"prompt": "Name a colour.", "completion": "red"}])
    held_out = _rows(tmp_path / "eval.jsonl", [{"prompt": "  what IS 2+2?\n", "completion": "4"},  # the same row
                                               {"prompt": "NAME a colour.", "completion": "blue"},  # the same prompt
                                               {"prompt": "What is 3+3?", "completion": "6"}])
    with pytest.raises(DataError, match=r"2 of 3 rows of data.eval_files share a prompt .* \(1 the whole example\)"):
        check_held_out([train], {}, [("data.eval_files", [held_out], {})], 0.5)
    assert check_held_out([train], {}, [("data.eval_files", [held_out], {})], 0.7) == [
        "held-out check: 2 of 3 rows of data.eval_files share a prompt with the training data (1 the whole example)"]
    assert normalize(" A\u00a0 b\tC ") == "a b c"
    # Conversations: the messages before the last assistant reply are the prompt; column_map is applied.
    chat_train = _rows(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "Hi there"},
                                                               {"role": "assistant", "content": "Hello"}]}])
    chat_eval = _rows(tmp_path / "chat_eval.jsonl", [{"question": "hi  THERE"}])
    assert check_held_out([chat_train], {}, [("set", [chat_eval], {"question": "prompt"})], 1.0)[0].startswith(
        "held-out check: 0 of 1")  # a plain prompt is not the conversation's prompt (roles differ)...
    chat_eval_messages = _rows(tmp_path / "chat_eval2.jsonl", [{"messages": [{"role": "user", "content": "hi  THERE"},
                                                                             {"role": "assistant", "content": "Yo"}]}])
    with pytest.raises(DataError, match="1 of 1 rows of set"):
        check_held_out([chat_train], {}, [("set", [chat_eval_messages], {})], 0.0)  # ...the same conversation is


def test_embedded_held_out_split_as_training_data_is_refused_in_grpo_and_evaluation_sets():
    # Issue 34: posttrain/arithmetic:heldout as training data, evaluated on the same split, ran without a word.
    base = ["data.train_files=['posttrain/arithmetic:heldout[:64]']", "output_dir=unused"]
    cfg = load_config(GRPOConfig, None, [*base, "data.eval_files=['posttrain/arithmetic:heldout[:16]']"])
    with pytest.raises(DataError, match=r"16 of 16 rows of data.eval_files share a prompt .*for example "
                                        r"posttrain/arithmetic:heldout"):
        held_out_check(cfg)
    cfg = load_config(SFTConfig, None, [*base, "evaluation=[{name: add, data: {files: "
                                               "['posttrain/arithmetic:heldout[:4]']}}]"])
    with pytest.raises(DataError, match=r"4 of 4 rows of evaluation set 'add'"):
        held_out_check(cfg)


def test_the_embedded_splits_share_nothing():
    for task in ("arithmetic", "arithmetic-preference", "arithmetic-judge", "subtraction", "arithmetic-two-tasks"):
        assert check_held_out([f"posttrain/{task}:train"], {}, [("heldout", [f"posttrain/{task}:heldout"], {})],
                              0.0) == [f"held-out check: 0 of {_count(task)} rows of heldout share a prompt with the "
                                       "training data (0 the whole example)"]


def _count(task: str) -> int:
    from posttrain.data.loading import iter_records

    return sum(1 for _ in iter_records(f"posttrain/{task}:heldout"))


def test_dpo_pairs_are_compared_by_prompt(tmp_path):
    pairs = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i)} for i in range(4)]
    train = _rows(tmp_path / "train.jsonl", pairs)
    held_out = _rows(tmp_path / "eval.jsonl", [{**pairs[0], "rejected": "99"}, {"prompt": "9+9=", "chosen": "18",
                                                                               "rejected": "17"}])
    cfg = load_config(DPOConfig, None, [f"data.train_files=[{train}]", f"data.eval_files=[{held_out}]",
                                        "output_dir=unused"])
    with pytest.raises(DataError, match=r"1 of 2 rows of data.eval_files share a prompt .* \(0 the whole example\)"):
        held_out_check(cfg)
    relaxed = load_config(DPOConfig, None, [f"data.train_files=[{train}]", f"data.eval_files=[{held_out}]",
                                            "output_dir=unused", "data.max_overlap_fraction=0.5"])
    assert held_out_check(relaxed) == ["held-out check: 1 of 2 rows of data.eval_files share a prompt with the "
                                       "training data (0 the whole example)"]
