"""posttrain distill with several teachers (MOPD): teacher_column routes each row to the one teacher whose route
lists its value; each row's top-k is its own teacher's (off- and on-policy), per-teacher metrics are logged, and a
row without the column or with a value no teacher serves is refused naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import posttrain.algorithms.distill as distill
from posttrain.algorithms.distill import train_distill
from posttrain.config import ConfigError, DistillConfig, load_config
from posttrain.config.schema import ModelConfig, TrainerConfig
from posttrain.data.collate import collate
from posttrain.data.errors import DataError
from posttrain.data.loading import iter_records
from posttrain.logging import read_metrics
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.workers.local import LocalScoringWorker

from teachers_for_tests import TINY_DISTILL, perturbed_tiny_teacher

BASE = TINY_DISTILL


@pytest.fixture(scope="module")
def teacher_dirs(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    return (perturbed_tiny_teacher(tmp_path_factory.mktemp("add"), seed=0),
            perturbed_tiny_teacher(tmp_path_factory.mktemp("sub"), seed=1))


def write_rows(folder: Path, task_of=lambda i: "add" if i % 3 else "sub", drop_column_at: int | None = None) -> Path:
    """32 arithmetic rows with a `task` column."""
    path = folder / "mixed.jsonl"
    with path.open("w") as file:
        for i, (_, record) in enumerate(iter_records("posttrain/arithmetic")):
            if i == 32:
                break
            row = {"prompt": record["prompt"], "completion": record["completion"], "task": task_of(i)}
            if i == drop_column_at:
                del row["task"]
            file.write(json.dumps(row) + "\n")
    return path


def config(output_dir: Path, data: Path, teacher_dirs, *overrides: str) -> DistillConfig:
    teachers = (f"teachers=[{{name: add, name_or_path: '{teacher_dirs[0]}', route: [add]}}, "
                f"{{name: sub, name_or_path: '{teacher_dirs[1]}', route: [sub]}}]")
    return load_config(DistillConfig, None, [*BASE, f"data.train_files=['{data}']", teachers, "teacher_column=task",
                                             f"output_dir={output_dir}", *overrides])


@pytest.mark.parametrize("mode", ["off_policy", "on_policy"])
def test_each_rows_topk_is_its_own_teachers(tmp_path, teacher_dirs, monkeypatch, mode):
    calls = []
    original = distill.routed_teacher_batch

    def recording(teachers, routes, examples, rows, loss, pad_token_id):
        batch = original(teachers, routes, examples, rows, loss, pad_token_id)
        calls.append((list(routes), batch))
        return batch

    monkeypatch.setattr(distill, "routed_teacher_batch", recording)
    extra = ["mode=on_policy", "rollout.max_new_tokens=6"] if mode == "on_policy" else []
    train_distill(config(tmp_path / "run", write_rows(tmp_path), teacher_dirs, "trainer.max_steps=2", *extra))

    tokenizer = load_tokenizer(ModelConfig(name_or_path="posttrain/tiny"))
    workers = [LocalScoringWorker(load_causal_lm(ModelConfig(name_or_path=str(d))), TrainerConfig())
               for d in teacher_dirs]
    assert len(calls) == 4 and {r for routes, _ in calls for r in routes} == {0, 1}
    for routes, batch in calls:
        for row, route in enumerate(routes):
            length = int(batch.rows.attention_mask[row].sum())
            alone = collate_one(batch, row, length, tokenizer.pad_token_id)
            sources = alone.loss_mask[0, 1:].bool()
            for index, worker in enumerate(workers):
                values, ids = worker.topk_logprobs(alone, 8)
                same = torch.equal(batch.teacher_topk_ids[row, : length - 1][sources], ids[0, :-1][sources])
                assert same == (index == route)  # its teacher's top-k, and not the other's
            torch.testing.assert_close(batch.teacher_topk_logprobs[row, : length - 1][sources],
                                       workers[route].topk_logprobs(alone, 8)[0][0, :-1][sources],
                                       rtol=1e-4, atol=2e-4)  # a row scored in a padded batch or alone: float rounding

    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    for r in records:
        assert r["distill/add/target_tokens"] + r["distill/sub/target_tokens"] == r["target_tokens"]
        mean = (r["distill/add/divergence"] * r["distill/add/target_tokens"]
                + r["distill/sub/divergence"] * r["distill/sub/target_tokens"]) / r["target_tokens"]
        assert mean == pytest.approx(r["distill/divergence"], rel=1e-4)


def collate_one(batch, row: int, length: int, pad: int):
    from posttrain.data.types import TokenizedExample

    example = TokenizedExample(tuple(batch.rows.input_ids[row, :length].tolist()),
                               tuple(int(v) for v in batch.rows.loss_mask[row, :length].tolist()))
    return collate([example], pad, False, 32)


def test_a_row_without_the_routing_column_is_refused_naming_the_column_and_the_file(tmp_path, teacher_dirs):
    data = write_rows(tmp_path, drop_column_at=5)
    with pytest.raises(DataError, match=r"mixed.jsonl:6.*teacher_column='task'"):
        train_distill(config(tmp_path / "run", data, teacher_dirs, "trainer.max_steps=1"))


def test_a_value_no_teacher_serves_is_refused_naming_it(tmp_path, teacher_dirs):
    data = write_rows(tmp_path, task_of=lambda i: "mul" if i == 7 else "add")
    with pytest.raises(DataError, match=r"mixed.jsonl:8.*task='mul'.*no teacher serves"):
        train_distill(config(tmp_path / "run", data, teacher_dirs, "trainer.max_steps=1"))


@pytest.mark.parametrize(("teachers", "message"), [
    ("[{name_or_path: a}, {name_or_path: b}]", "need teacher_column"),
    ("[{name_or_path: a, route: [x]}]", r"teachers\[0\].route applies with teacher_column"),
])
def test_several_teachers_need_a_routing_column(tmp_path, teachers, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DistillConfig, None, [*BASE, "data.train_files=[x]", f"teachers={teachers}",
                                          f"output_dir={tmp_path}"])


@pytest.mark.parametrize(("teachers", "message"), [
    ("[{name_or_path: a, route: [x]}, {name: b, name_or_path: b, route: [y]}]", r"teachers\[0\].name"),
    ("[{name: a, name_or_path: a, route: [x]}, {name: a, name_or_path: b, route: [y]}]", r"teachers\[1\].name='a'"),
    ("[{name: a, name_or_path: a, route: [x]}, {name: b, name_or_path: b}]", r"teachers\[1\].route is empty"),
    ("[{name: a, name_or_path: a, route: [x]}, {name: b, name_or_path: b, route: [y, x]}]",
     r"teachers\[1\].route: the 'task' value 'x' is also served by teachers\[0\]"),
    ("[{name: a, name_or_path: a, route: [x], precompute: true}, {name: b, name_or_path: b, route: [y]}]",
     r"teachers\[0\].precompute"),
    ("[{name: 'a b', name_or_path: a, route: [x]}, {name: b, name_or_path: b, route: [y]}]", r"teachers\[0\].name"),
])
def test_teacher_routing_settings_are_validated_naming_the_keys(tmp_path, teachers, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DistillConfig, None, [*BASE, "data.train_files=[x]", f"teachers={teachers}",
                                          "teacher_column=task", f"output_dir={tmp_path}"])
