"""posttrain distill with several teachers (MOPD): teacher_column routes each row to the one teacher whose route
lists its value; each row's top-k is its own teacher's (off- and on-policy), per-teacher metrics are logged, and a
row without the column or with a value no teacher serves is refused naming it. Precomputed (precompute: true):
each teacher scores only its routed rows once, one teacher loaded at a time, into its own checksummed file, and
the run logs the losses of one whose teachers score every micro-batch; a resumed run reuses the files, a corrupt
one is scored again."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch

import posttrain.algorithms.distill as distill
from posttrain.algorithms.distill import TEACHER_TOPK_DIR, examples_topk, teacher_routes, train_distill
from posttrain.config import ConfigError, DistillConfig, load_config
from posttrain.config.schema import ModelConfig, TrainerConfig
from posttrain.data import load_sft_examples
from posttrain.data.collate import collate
from posttrain.data.errors import DataError
from posttrain.data.loading import iter_records
from posttrain.logging import read_metrics
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.workers.local import LocalScoringWorker
from safetensors.torch import load_file

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


def config(output_dir: Path, data: Path, teacher_dirs, *overrides: str, precompute: bool = False) -> DistillConfig:
    flag = str(precompute).lower()
    teachers = (f"teachers=[{{name: add, name_or_path: '{teacher_dirs[0]}', route: [add], precompute: {flag}}}, "
                f"{{name: sub, name_or_path: '{teacher_dirs[1]}', route: [sub], precompute: {flag}}}]")
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
     r"teachers\[1\].precompute=false but teachers\[0\].precompute=true.*every teacher's top-k is precomputed or "
     "none"),
    ("[{name: 'a b', name_or_path: a, route: [x]}, {name: b, name_or_path: b, route: [y]}]", r"teachers\[0\].name"),
])
def test_teacher_routing_settings_are_validated_naming_the_keys(tmp_path, teachers, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DistillConfig, None, [*BASE, "data.train_files=[x]", f"teachers={teachers}",
                                          "teacher_column=task", f"output_dir={tmp_path}"])


def test_on_policy_steps_refuse_precomputed_teachers_naming_every_teachers_key(tmp_path):
    teachers = ("[{name: a, name_or_path: a, route: [x], precompute: true}, "
                "{name: b, name_or_path: b, route: [y], precompute: true}]")
    with pytest.raises(ConfigError, match=r"teachers\[0\].precompute=false \(and every other teacher's\)"):
        load_config(DistillConfig, None, [*BASE, "data.train_files=[x]", f"teachers={teachers}",
                                          "teacher_column=task", "mode=on_policy", f"output_dir={tmp_path}"])


class TeacherLoads:
    """build_scorer in the distill loop, recorded: which teachers were loaded, and how many teachers loaded
    before were still alive (not yet freed) at each load."""

    def __init__(self, monkeypatch):
        self.loaded: list[str] = []
        self.alive_at_load: list[int] = []
        self._models: list[weakref.ref] = []
        original = distill.build_scorer

        def recording(model, trainer, device, role="reference", offload=False, **where):  # where: a Ray cluster
            gc.collect()
            self.alive_at_load.append(sum(ref() is not None for ref in self._models))
            self.loaded.append(model.name_or_path)
            worker = original(model, trainer, device, role=role, offload=offload, **where)
            self._models.append(weakref.ref(worker.model))
            return worker

        monkeypatch.setattr(distill, "build_scorer", recording)


def routed_examples(cfg: DistillConfig) -> list[list]:
    """The training examples each teacher of cfg serves, in example order."""
    tokenizer = load_tokenizer(ModelConfig(name_or_path="posttrain/tiny"), padding_side="right")
    examples, _ = load_sft_examples(cfg.data.train_files, tokenizer, cfg.data)
    routes = teacher_routes(cfg, examples)
    return [[e for e, route in zip(examples, routes, strict=True) if route == t] for t in range(len(cfg.teachers))]


def test_precomputed_teachers_give_the_live_losses_each_file_its_own_rows_reused_on_resume(
        tmp_path, teacher_dirs, monkeypatch, capsys):
    data = write_rows(tmp_path)
    live = tmp_path / "live"
    train_distill(config(live, data, teacher_dirs, "trainer.max_steps=4"))

    # Precomputed, in two parts: 2 steps (scoring both teachers' files), then resumed from step 2's checkpoint.
    cached = tmp_path / "cached"
    loads = TeacherLoads(monkeypatch)
    cfg = config(cached, data, teacher_dirs, "trainer.max_steps=2", "trainer.save_every=2", precompute=True)
    train_distill(cfg)
    assert loads.loaded == [str(d) for d in teacher_dirs]  # each teacher loaded once ...
    assert loads.alive_at_load == [0, 0]  # ... the first freed before the second loads
    paths = [cached / TEACHER_TOPK_DIR / name / "topk.safetensors" for name in ("add", "sub")]
    assert not (cached / TEACHER_TOPK_DIR / "topk.safetensors").exists()  # the one-teacher layout is not written

    # Each file holds exactly its teacher's top-k at its routed rows (21 additions, 11 subtractions), in order.
    tokenizer = load_tokenizer(ModelConfig(name_or_path="posttrain/tiny"), padding_side="right")
    for path, teacher_dir, rows in zip(paths, teacher_dirs, routed_examples(cfg), strict=True):
        stored = load_file(path)
        manifest = json.loads((path.parent / "manifest.json").read_text())
        assert manifest["settings"]["route"] == [path.parent.name] and manifest["settings"]["examples"] == len(rows)
        assert len(stored["offsets"]) == len(rows) + 1
        alone = LocalScoringWorker(load_causal_lm(ModelConfig(name_or_path=str(teacher_dir))), TrainerConfig())
        expected = examples_topk(alone, rows, cfg.loss, tokenizer.pad_token_id, cfg.trainer.eval_batch_size)
        assert torch.equal(stored["offsets"], expected.offsets)
        assert torch.equal(stored["ids"].long(), expected.ids)
        torch.testing.assert_close(stored["logprobs"], expected.logprobs, rtol=0, atol=1e-6)
    assert [len(rows) for rows in routed_examples(cfg)] == [21, 11]

    written = [path.stat().st_mtime_ns for path in paths]
    capsys.readouterr()
    loads.loaded.clear()
    train_distill(config(cached, data, teacher_dirs, "trainer.max_steps=4", "trainer.save_every=2",
                         precompute=True))
    printed = capsys.readouterr().out
    assert "resuming from" in printed
    assert loads.loaded == []  # no teacher loaded: both files reused
    assert [f"teacher top-k: reusing {path} (checksum verified)" in printed for path in paths] == [True, True]
    assert [path.stat().st_mtime_ns for path in paths] == written

    live_records, cached_records = (read_metrics(folder / "metrics.jsonl") for folder in (live, cached))
    assert [r["step"] for r in cached_records] == [1, 2, 3, 4]
    for name in ("loss", "distill/add/divergence", "distill/sub/divergence", "grad_norm"):
        # A row scored in a precompute batch or in its micro-batch is padded to another length: float rounding.
        assert [r[name] for r in cached_records] == pytest.approx([r[name] for r in live_records], rel=1e-6,
                                                                  abs=1e-7), name
    assert [r["distill/sub/target_tokens"] for r in cached_records] == [
        r["distill/sub/target_tokens"] for r in live_records]


def test_a_corrupt_teacher_file_is_scored_again_by_its_teacher_alone(tmp_path, teacher_dirs, monkeypatch, capsys):
    data = write_rows(tmp_path)
    train_distill(config(tmp_path / "run", data, teacher_dirs, "trainer.max_steps=1", precompute=True))
    add, sub = (tmp_path / "run" / TEACHER_TOPK_DIR / name / "topk.safetensors" for name in ("add", "sub"))
    original = sub.read_bytes()
    damaged = bytearray(original)
    damaged[-1] ^= 0xFF
    sub.write_bytes(bytes(damaged))
    written = add.stat().st_mtime_ns

    loads = TeacherLoads(monkeypatch)
    capsys.readouterr()
    train_distill(config(tmp_path / "run", data, teacher_dirs, "trainer.max_steps=2", precompute=True))
    printed = capsys.readouterr().out
    assert loads.loaded == [str(teacher_dirs[1])]  # only the damaged file's teacher scores again
    assert f"teacher top-k: {sub} was computed from other settings or data, or fails its checksum" in printed
    assert f"teacher top-k: reusing {add} (checksum verified)" in printed
    assert sub.read_bytes() == original and add.stat().st_mtime_ns == written


def test_a_precomputed_teacher_no_row_is_routed_to_is_not_loaded(tmp_path, teacher_dirs, monkeypatch, capsys):
    loads = TeacherLoads(monkeypatch)
    train_distill(config(tmp_path / "run", write_rows(tmp_path, task_of=lambda i: "add"), teacher_dirs,
                         "trainer.max_steps=1", precompute=True))
    assert loads.loaded == [str(teacher_dirs[0])]
    assert "no training example is routed to teacher sub (task in ['sub']); not loaded" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "run" / TEACHER_TOPK_DIR).iterdir()) == ["add"]
