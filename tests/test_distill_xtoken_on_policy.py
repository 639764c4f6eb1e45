"""Cross-tokenizer distillation on the student's own samples (mode=on_policy with a teacher of another tokenizer).

A sampled completion reaches the teacher as its text, encoded by the teacher's tokenizer after the teacher's own
tokens of the row's prompt (an end-of-sequence token the student sampled becomes the teacher's); the two are cut
into the chunks written out below. A same-tokenizer teacher through the aligner gives the plain on-policy (GKD)
losses, so the sampled rows, their alignment and their scoring are those of the plain path; a run with the
embedded BPE teacher samples, aligns and trains, and resumes as an uninterrupted run does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.algorithms.distill import train_distill
from posttrain.algorithms.distill_xtoken import (
    AlignedTeacher,
    CrossTokenizerData,
    CrossTokenizerTeachers,
    ExampleChunks,
    sampled_teacher_example,
)
from posttrain.config import DistillConfig, load_config
from posttrain.config.schema import ModelConfig
from posttrain.data.alignment import Chunk, TokenSurfaces, exact_projection
from posttrain.data.types import TokenizedExample
from posttrain.logging import read_metrics
from posttrain.models.loading import load_tokenizer

from teachers_for_tests import ARITHMETIC_64, TINY_DISTILL, perturbed_tiny_teacher, sft_on_64_rows

TINY = [*TINY_DISTILL, ARITHMETIC_64, "mode=on_policy", "rollout.max_new_tokens=6"]


def config(output_dir: Path, teacher: str | Path, *overrides: str, student: str | Path = "posttrain/tiny"
           ) -> DistillConfig:
    teachers = f"teachers=[{{name_or_path: '{teacher}'}}]"
    return load_config(DistillConfig, None, [*TINY, teachers, f"output_dir={output_dir}",
                                             f"model.name_or_path={student}", *overrides])


def test_a_sampled_completion_reaches_the_teacher_as_its_text_in_the_teachers_tokens(tiny_model_dir):
    student = load_tokenizer(ModelConfig(name_or_path="posttrain/tiny"))
    teacher = load_tokenizer(ModelConfig(name_or_path="posttrain/tiny-bpe"))
    # The row "69+72=" / "14" as the teacher tokenized it for the dataset (its completion is replaced below).
    teacher_prompt = list(teacher("69+72=")["input_ids"])
    data_row = TokenizedExample((*teacher_prompt, *teacher("14", add_special_tokens=False)["input_ids"],
                                 teacher.eos_token_id), (0,) * 6 + (1, 1), "row 1")
    # The student sampled "141" and its end of sequence.
    prompt = list(student("69+72=")["input_ids"])
    sampled_ids = [*student("141", add_special_tokens=False)["input_ids"], student.eos_token_id]
    sampled = TokenizedExample((*prompt, *sampled_ids), (0,) * 6 + (1,) * 4, "row 1 (sampled by the student)")

    teacher_example = sampled_teacher_example(ExampleChunks(data_row, (), ()), sampled, student, teacher)
    assert teacher.convert_ids_to_tokens(list(teacher_example.input_ids)) == [
        "6", "9", "+", "7", "2", "=", "14", "1", teacher.eos_token]
    assert teacher_example.loss_mask == (0,) * 6 + (1, 1, 1)

    projection = torch.tensor(exact_projection(TokenSurfaces(teacher), TokenSurfaces(student)))
    data = CrossTokenizerData((ExampleChunks(data_row, (), ()),), projection, 0, 0, 0)
    group = CrossTokenizerTeachers([AlignedTeacher("bpe", teacher, TokenSurfaces(teacher), data, None)], None, 1.0,
                                   student)
    row = group.aligned_sample(group.teachers[0], 0, sampled)
    # Only chunks of completion tokens on both sides count: 1 4 <-> 14, 1 <-> 1, end of sequence <-> end of sequence.
    assert row.chunks == (Chunk(6, 8, 6, 7), Chunk(8, 9, 7, 8), Chunk(9, 10, 8, 9))
    assert row.exact == (False, True, True)


def test_a_sample_cut_without_its_end_of_sequence_and_a_row_the_teacher_lacks(tiny_model_dir):
    student = load_tokenizer(ModelConfig(name_or_path="posttrain/tiny"))
    teacher = load_tokenizer(ModelConfig(name_or_path="posttrain/tiny-bpe"))
    data_row = TokenizedExample((*teacher("9+9=")["input_ids"], 20, teacher.eos_token_id), (0,) * 4 + (1, 1), "r")
    prompt = list(student("9+9=")["input_ids"])
    sampled = TokenizedExample((*prompt, *student("18+", add_special_tokens=False)["input_ids"]),
                               (0,) * 4 + (1,) * 3, "r (sampled)")
    teacher_example = sampled_teacher_example(ExampleChunks(data_row, (), ()), sampled, student, teacher)
    assert teacher.decode(list(teacher_example.input_ids[4:])) == "18+"  # no end of sequence: none was sampled
    assert teacher.eos_token_id not in teacher_example.input_ids
    # A row the teacher has no tokenization of (dropped on its side) gives nothing to align.
    dropped = ExampleChunks(TokenizedExample((), (), ""), (), ())
    assert sampled_teacher_example(dropped, sampled, student, teacher).input_ids == ()


@pytest.fixture(scope="module")
def digit_student(tiny_model_dir, tmp_path_factory) -> Path:
    """posttrain/tiny after 150 SFT steps on the 64 training rows: it samples digits and its end of sequence (an
    untrained model samples arbitrary bytes, whose text is not valid UTF-8 and so not the same on both sides)."""
    return sft_on_64_rows("posttrain/tiny", tmp_path_factory.mktemp("sft-student"))


def test_a_same_tokenizer_teacher_on_policy_through_the_aligner_gives_the_plain_losses(tmp_path, digit_student):
    teacher = perturbed_tiny_teacher(tmp_path / "teacher")
    # top_k=3: the student samples among its three likeliest tokens (digits, '=' and its end of sequence), never a
    # lone byte of a multi-byte character, which has no text to hand to a teacher (such a token is in no chunk).
    train_distill(config(tmp_path / "plain", teacher, "trainer.max_steps=3", "rollout.top_k=3",
                         student=digit_student))
    train_distill(config(tmp_path / "aligned", teacher, "trainer.max_steps=3", "rollout.top_k=3",
                         "loss.cross_tokenizer.align=always", student=digit_student))
    plain = read_metrics(tmp_path / "plain" / "metrics.jsonl")
    aligned = read_metrics(tmp_path / "aligned" / "metrics.jsonl")
    assert all(r["distill/on_policy"] == 1.0 for r in aligned)
    # The same samples (same seed, same student) re-encoded as text by the same tokenizer: every chunk one token.
    assert [r["distill/sampled_completion_length"] for r in aligned] == [
        r["distill/sampled_completion_length"] for r in plain]
    assert all(r["distill/exact_chunk_fraction"] == 1.0 for r in aligned)
    assert all(r["distill/aligned_target_fraction"] == 1.0 for r in aligned)
    assert [r["loss"] for r in aligned] == pytest.approx([r["loss"] for r in plain], abs=1e-6)


def test_on_policy_with_a_teacher_of_another_tokenizer_trains_and_resumes_as_an_uninterrupted_run(tmp_path,
                                                                                                  digit_student):
    teacher = perturbed_tiny_teacher(tmp_path / "bpe", seed=1, base="posttrain/tiny-bpe")
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    overrides = ["lmbda=0.5", "trainer.save_every=2"]
    train_distill(config(whole, teacher, "trainer.max_steps=4", *overrides, student=digit_student))
    train_distill(config(halves, teacher, "trainer.max_steps=2", *overrides, student=digit_student))
    train_distill(config(halves, teacher, "trainer.max_steps=4", *overrides, student=digit_student))
    records = read_metrics(whole / "metrics.jsonl")
    flags = [r["distill/on_policy"] for r in records]
    assert 0.0 < sum(flags) < len(flags), flags  # both kinds of step happened (seeded per step: fixed)
    sampled = [r for r in records if r["distill/on_policy"] == 1.0]
    # The student's own samples were aligned with the teacher's tokenization: merged digit pairs (not exact) and
    # one-token matches both occur, and the chunks cover most of the sampled targets.
    assert all(0.0 < r["distill/exact_chunk_fraction"] < 1.0 for r in sampled)
    assert all(r["distill/chunk_divergence"] > 0 for r in sampled)
    resumed = read_metrics(halves / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["distill/on_policy"] for r in resumed] == flags
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in records], abs=1e-6)
