"""posttrain distill with a teacher whose tokenizer differs from the student's (algorithms/distill_xtoken.py): a
same-tokenizer teacher through the aligner logs the plain path's losses (1e-6); a teacher with another tokenizer
(posttrain/tiny-bpe) trains, stores its projection with the run (checksummed), precomputes its chunks once and
reuses them on resume with the losses of a run that scores every micro-batch; the student's chunk log-likelihoods
move toward the teacher's; teachers that cannot serve the student are refused before training, with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from posttrain.algorithms.distill import train_distill
from posttrain.algorithms.distill_xtoken import PROJECTION_DIR
from posttrain.config import DistillConfig, load_config
from posttrain.config.schema import ModelConfig
from posttrain.errors import RunError
from posttrain.logging import read_metrics
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.rundir import sha256_all

from teachers_for_tests import ARITHMETIC_64, TINY_DISTILL, perturbed_tiny_teacher, sft_on_64_rows

TINY = [*TINY_DISTILL, ARITHMETIC_64]


def config(output_dir: Path, teacher: str | Path, *overrides: str, precompute: bool = False) -> DistillConfig:
    teachers = f"teachers=[{{name_or_path: '{teacher}', precompute: {str(precompute).lower()}}}]"
    return load_config(DistillConfig, None, [*TINY, teachers, f"output_dir={output_dir}", *overrides])


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return perturbed_tiny_teacher(tmp_path_factory.mktemp("teacher"))


@pytest.fixture(scope="module")
def bpe_teacher_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """posttrain/tiny-bpe with its weights perturbed: another model with another tokenizer."""
    return perturbed_tiny_teacher(tmp_path_factory.mktemp("bpe-teacher"), seed=1, base="posttrain/tiny-bpe")


@pytest.mark.parametrize("overrides", [[], ["loss.kl_type=reverse", "loss.outside_topk=zero_outside",
                                            "loss.nll_weight=0.3"]])
def test_a_same_tokenizer_teacher_through_the_aligner_gives_the_plain_losses(tmp_path, teacher_dir, overrides):
    train_distill(config(tmp_path / "plain", teacher_dir, "trainer.max_steps=3", *overrides))
    train_distill(config(tmp_path / "aligned", teacher_dir, "trainer.max_steps=3",
                         "loss.cross_tokenizer.align=always", *overrides))
    plain = read_metrics(tmp_path / "plain" / "metrics.jsonl")
    aligned = read_metrics(tmp_path / "aligned" / "metrics.jsonl")
    assert [r["loss"] for r in aligned] == pytest.approx([r["loss"] for r in plain], abs=1e-6)
    assert all(r["distill/exact_chunk_fraction"] == 1.0 for r in aligned)  # every chunk one token, matched
    assert "distill/chunk_divergence" not in plain[0]  # the plain run did not go through the aligner


def test_a_teacher_with_another_tokenizer_trains_and_stores_its_projection(tmp_path, bpe_teacher_dir, capsys):
    live = tmp_path / "live"
    train_distill(config(live, bpe_teacher_dir, "trainer.max_steps=4", "loss.cross_tokenizer.unmatched=uld"))
    cached = tmp_path / "cached"
    train_distill(config(cached, bpe_teacher_dir, "trainer.max_steps=2", "trainer.save_every=2",
                         "loss.cross_tokenizer.unmatched=uld", precompute=True))
    chunks = cached / "teacher_topk" / "chunks.safetensors"
    written = chunks.stat().st_mtime_ns
    capsys.readouterr()
    train_distill(config(cached, bpe_teacher_dir, "trainer.max_steps=4", "trainer.save_every=2",
                         "loss.cross_tokenizer.unmatched=uld", precompute=True))  # resumes from step 2
    assert chunks.stat().st_mtime_ns == written and "reusing" in capsys.readouterr().out

    records = read_metrics(cached / "metrics.jsonl")
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in read_metrics(live / "metrics.jsonl")],
                                                         rel=1e-6, abs=1e-7)
    for r in records:
        assert 0 < r["distill/exact_chunk_fraction"] < 1  # merged digits ("10", "14") make chunks of two tokens
        assert r["distill/chunk_divergence"] > 0 and r["distill/uld"] > 0 and r["distill/divergence"] > 0

    projection = cached / PROJECTION_DIR / "projection.safetensors"
    manifest = json.loads((cached / PROJECTION_DIR / "manifest.json").read_text())
    assert manifest["sha256"] == sha256_all([projection])[0]
    student_ids = load_file(projection)["student_ids"]
    student, teacher = (load_tokenizer(ModelConfig(name_or_path=name))
                        for name in ("posttrain/tiny", str(bpe_teacher_dir)))
    assert student_ids[teacher.convert_tokens_to_ids("7")] == student.convert_tokens_to_ids("7")
    assert student_ids[teacher.convert_tokens_to_ids("10")] == -1
    assert student_ids[teacher.eos_token_id] == student.eos_token_id
    assert manifest["settings"]["matched"] == int((student_ids >= 0).sum()) == len(teacher) - 20  # all but merges


@pytest.fixture(scope="module")
def confident_bpe_teacher(bpe_teacher_dir, tmp_path_factory) -> Path:
    """posttrain/tiny-bpe after 150 SFT steps on the 64 training rows: it has their completions nearly by heart, so
    its chunk likelihoods say something."""
    return sft_on_64_rows("posttrain/tiny-bpe", tmp_path_factory.mktemp("sft-bpe"))


def test_the_student_moves_toward_the_cross_tokenizer_teacher(tmp_path, confident_bpe_teacher):
    train_distill(config(tmp_path, confident_bpe_teacher, "trainer.max_steps=40", "trainer.learning_rate=3e-3",
                         precompute=True))
    records = read_metrics(tmp_path / "metrics.jsonl")
    first, last = records[:3], records[-3:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    # The gap between student and teacher chunk log-likelihoods, and the divergences, shrink. Last/first measured on
    # both CPU code paths (default; ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2):
    # logprob_gap 0.24 / 0.22, chunk_divergence 0.12 / 0.11, divergence 0.33 / 0.56; the bounds leave a margin over
    # the worst of each.
    for key, bound in (("distill/logprob_gap", 0.5), ("distill/chunk_divergence", 0.5), ("distill/divergence", 0.8)):
        assert mean(last, key) < bound * mean(first, key), key


def messages_file(folder: Path) -> Path:
    path = folder / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"{a}+{a}="}, {"role": "assistant", "content": str(2 * a)}]}
            for a in range(10, 30)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_teacher_without_the_chat_template_the_data_needs_is_refused(tmp_path, bpe_teacher_dir):
    teacher = tmp_path / "no-template"
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(bpe_teacher_dir)))
    tokenizer.chat_template = None
    tokenizer.save_pretrained(teacher)
    load_causal_lm(ModelConfig(name_or_path=str(bpe_teacher_dir))).save_pretrained(teacher)
    data = messages_file(tmp_path)
    with pytest.raises(RunError, match="cannot serve the student.*no chat template"):
        train_distill(config(tmp_path / "run", teacher, "trainer.max_steps=1", f"data.train_files=['{data}']"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before training
    # Control: the same data with the template trains.
    train_distill(config(tmp_path / "ok", bpe_teacher_dir, "trainer.max_steps=1", f"data.train_files=['{data}']"))


def test_a_teacher_whose_vocabulary_cannot_encode_the_data_is_refused(tmp_path, tiny_model_dir):
    # A word-level vocabulary knows "=" and a few numbers; every other piece of an addition is [UNK].
    backend = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "</s>": 1, "=": 2, "110": 3}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("=", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>",
                                        pad_token="</s>")
    teacher = tmp_path / "words"
    tokenizer.save_pretrained(teacher)
    with pytest.raises(RunError, match=r"cannot serve the student: its tokenization shares the text of only \d+ of"):
        train_distill(config(tmp_path / "run", teacher, "trainer.max_steps=1"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_teacher_ids_beyond_its_tokenizer_project_onto_nothing():
    from posttrain.algorithms.distill_xtoken import projected

    projection = torch.tensor([2, -1, 0])  # a 3-token teacher vocabulary; its LM head has 5 rows
    assert projected(projection, torch.tensor([0, 1, 2, 3, 4])).tolist() == [2, -1, 0, -1, -1]
