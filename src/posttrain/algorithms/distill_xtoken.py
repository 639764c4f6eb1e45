"""The cross-tokenizer part of `posttrain distill`: a teacher whose tokenizer differs from the student's.

Before training: the training data is tokenized a second time with the teacher's tokenizer (the same rows, paired by
their source), each row's two tokenizations are cut into aligned chunks (posttrain.data.alignment), only chunks
whose tokens are all completion targets on both sides are kept, and the exact projection of the teacher's
vocabulary onto the student's is built and written to OUTPUT/teacher_projection/ (projection.safetensors and a
manifest with its SHA-256; reused on resume when the checksum holds). A teacher that cannot serve the student is
refused here, with the reason: one whose tokenizer cannot render the data (no chat template for messages rows), or
whose tokenization shares the aligned text of fewer than MIN_ALIGNED_FRACTION of the student's completion targets
(unknown tokens, another chat template, text it encodes differently).

Then the teacher scores each chunk: its summed log-probability of the chunk's tokens and its top-k at the chunk's
first position (carried onto the student's ids through the projection for exact chunks). With teacher.precompute
that happens once for every example, into OUTPUT/teacher_topk/chunks.safetensors (a manifest of the teacher, k,
temperature, both tokenizations' SHA-256 and the projection's; reused when they and the file's checksum match), and
the teacher is freed; otherwise per micro-batch. Either way `.batch(rows, indices)` gives the CrossTokenizerBatch the
student trains on (losses/cross_tokenizer.py, through CrossTokenizerObjective).
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from posttrain.algorithms.common import chunks
from posttrain.config.losses import DistillationLossConfig
from posttrain.config.schema import DataConfig, TeacherSection, TrainerConfig
from posttrain.data import load_sft_examples
from posttrain.data.alignment import Chunk, TokenSurfaces, align_tokens, exact_projection
from posttrain.data.collate import collate
from posttrain.data.types import CrossTokenizerBatch, SFTBatch, TokenizedExample
from posttrain.distributed.builders import build_scorer, build_teacher
from posttrain.errors import RunError
from posttrain.rundir import sha256_all
from posttrain.workers.base import ScoringWorker

PROJECTION_DIR = "teacher_projection"
"""OUTPUT/teacher_projection/: the exact projection of the teacher's vocabulary onto the student's."""
MIN_ALIGNED_FRACTION = 0.5
"""A teacher whose aligned chunks cover fewer of the student's completion targets than this is refused."""


def tokenizers_differ(student, teacher) -> bool:
    """Whether the teacher's tokenizer is another than the student's (vocabulary, ids, end-of-sequence or padding
    token): the plain top-k loss compares token ids one by one and needs them equal."""
    return (student.get_vocab() != teacher.get_vocab()
            or (student.eos_token_id, student.pad_token_id) != (teacher.eos_token_id, teacher.pad_token_id))


@dataclass(frozen=True)
class ExampleChunks:
    """One training example's counted chunks, in order, and its teacher tokenization."""

    teacher_example: TokenizedExample
    chunks: tuple[Chunk, ...]
    exact: tuple[bool, ...]


@dataclass(frozen=True)
class CrossTokenizerData:
    """The training set aligned for the teacher: per student example (same order) its chunks; the projection
    (teacher id -> student id, -1 none); how many student completion targets the chunks cover."""

    examples: tuple[ExampleChunks, ...]
    projection: torch.Tensor
    covered_targets: int
    targets: int
    fallback_rows: int


def align_training_data(student_tokenizer, teacher_tokenizer, teacher_name: str, student_examples:
                        Sequence[TokenizedExample], data: DataConfig, train_files: Sequence[str]) -> CrossTokenizerData:
    """The training data tokenized by the teacher too, aligned and checked (see the module docstring). RunError
    when the teacher cannot serve the student."""
    try:
        teacher_examples, _ = load_sft_examples(train_files, teacher_tokenizer, data)
    except ValueError as error:  # the tokenizer cannot render the rows (no chat template, a non-incremental one)
        raise RunError(f"teacher {teacher_name} cannot serve the student: its tokenizer cannot render the training "
                       f"data ({error})") from error
    by_source = {example.source: example for example in teacher_examples}
    student_surfaces, teacher_surfaces = TokenSurfaces(student_tokenizer), TokenSurfaces(teacher_tokenizer)
    projection = exact_projection(teacher_surfaces, student_surfaces)
    aligned, covered, targets, fallback, worst = [], 0, 0, 0, None
    empty = TokenizedExample((), (), "")
    for example in student_examples:
        targets += example.num_targets
        teacher_example = by_source.get(example.source)
        if teacher_example is None:  # the teacher's tokenization of this row was dropped (overlong, on_error)
            aligned.append(ExampleChunks(empty, (), ()))
            continue
        alignment = align_tokens(example.input_ids, teacher_example.input_ids, student_surfaces, teacher_surfaces)
        fallback += not alignment.exact
        kept = [chunk for chunk in alignment.chunks
                if all(example.loss_mask[chunk.student_start:chunk.student_end])
                and all(teacher_example.loss_mask[chunk.teacher_start:chunk.teacher_end])]
        exact = tuple(chunk.one_to_one and projection[teacher_example.input_ids[chunk.teacher_start]]
                      == example.input_ids[chunk.student_start] for chunk in kept)
        row_covered = sum(chunk.student_end - chunk.student_start for chunk in kept)
        covered += row_covered
        if row_covered < example.num_targets and worst is None:
            worst = (example, teacher_example)
        aligned.append(ExampleChunks(teacher_example, tuple(kept), exact))
    if targets and covered < MIN_ALIGNED_FRACTION * targets:
        detail = ""
        if worst is not None:
            student_text = student_tokenizer.decode(list(worst[0].input_ids), skip_special_tokens=False)
            teacher_text = teacher_tokenizer.decode(list(worst[1].input_ids), skip_special_tokens=False)
            detail = f"; e.g. {worst[0].source}: the student reads {student_text!r}, the teacher {teacher_text!r}"
        raise RunError(
            f"teacher {teacher_name} cannot serve the student: its tokenization shares the text of only {covered} of "
            f"the student's {targets} completion target tokens ({covered / targets:.0%}, under "
            f"{MIN_ALIGNED_FRACTION:.0%}){detail}. A vocabulary that cannot encode the text (unknown tokens), or a "
            "chat template that renders it differently, leaves nothing to compare; choose a teacher that encodes "
            "this data")
    return CrossTokenizerData(tuple(aligned), torch.tensor(projection, dtype=torch.long), covered, targets, fallback)


def stored_projection(output_dir: Path, teacher_name: str, projection: torch.Tensor, run_log) -> torch.Tensor:
    """The projection as stored with the run in OUTPUT/teacher_projection/: written (file, then a manifest with its
    SHA-256) unless an identical one whose checksum holds is there already."""
    folder = output_dir / PROJECTION_DIR
    path, manifest_path = folder / "projection.safetensors", folder / "manifest.json"
    settings = {"teacher": teacher_name, "kind": "exact", "teacher_vocabulary": len(projection),
                "matched": int((projection >= 0).sum())}
    if manifest_path.exists() and path.exists():
        manifest = json.loads(manifest_path.read_text())
        if (manifest["settings"] == settings and manifest["sha256"] == sha256_all([path])[0]
                and torch.equal(load_file(path)["student_ids"], projection)):
            return projection
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, manifest_path, {"student_ids": projection}, settings)
    run_log.message(f"teacher projection: {settings['matched']} of the teacher's {len(projection)} tokens map exactly "
                    f"onto a student token; written to {path}")
    return projection


def _write_atomically(path: Path, manifest_path: Path, tensors: dict[str, torch.Tensor], settings: dict) -> None:
    staging = path.with_suffix(".tmp")
    save_file(tensors, staging)
    staging.rename(path)
    manifest_staging = manifest_path.with_suffix(".tmp")
    manifest_staging.write_text(json.dumps({"settings": settings, "sha256": sha256_all([path])[0]}, indent=1) + "\n")
    manifest_staging.rename(manifest_path)


@dataclass(frozen=True)
class ChunkTargets:
    """The teacher's side of every counted chunk of a set of examples, example after example: chunk c of example i
    is row offsets[i] + c. start, end: [n] the student tokens; teacher_logprobs: [n]; exact: [n] bool;
    topk_logprobs, topk_ids: [n, k] (ids through the projection for exact chunks, −1 otherwise)."""

    start: torch.Tensor
    end: torch.Tensor
    teacher_logprobs: torch.Tensor
    exact: torch.Tensor
    topk_logprobs: torch.Tensor
    topk_ids: torch.Tensor
    offsets: torch.Tensor

    def batch(self, rows: SFTBatch, example_indices: Sequence[int]) -> CrossTokenizerBatch:
        """`rows` (collated from the examples `example_indices`, one per row) with their chunks."""
        picks = [torch.arange(int(self.offsets[i]), int(self.offsets[i + 1])) for i in example_indices]
        row = torch.cat([torch.full((len(p),), r, dtype=torch.long) for r, p in enumerate(picks)])
        index = torch.cat(picks)
        return CrossTokenizerBatch(rows, row, self.start[index], self.end[index], self.teacher_logprobs[index],
                                   self.exact[index], self.topk_logprobs[index], self.topk_ids[index])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"start": self.start, "end": self.end, "teacher_logprobs": self.teacher_logprobs,
                "exact": self.exact.to(torch.uint8), "topk_logprobs": self.topk_logprobs, "topk_ids": self.topk_ids,
                "offsets": self.offsets}

    @staticmethod
    def from_tensors(tensors: dict[str, torch.Tensor]) -> ChunkTargets:
        return ChunkTargets(tensors["start"], tensors["end"], tensors["teacher_logprobs"], tensors["exact"].bool(),
                            tensors["topk_logprobs"], tensors["topk_ids"], tensors["offsets"])


def score_chunks(teacher: ScoringWorker, aligned: Sequence[ExampleChunks], projection: torch.Tensor,
                 loss: DistillationLossConfig, pad_token_id: int) -> ChunkTargets:
    """The teacher's scores of `aligned`'s chunks in one padded batch of its tokenizations: for each chunk, the sum
    of its tokens' log-probabilities and the top-k at its first token (both at loss.temperature)."""
    k = loss.topk
    with_rows = [a for a in aligned if a.chunks]
    logprobs = topk_values = topk_ids = None
    if with_rows:
        examples = [a.teacher_example for a in with_rows]
        rows = collate(examples, pad_token_id, packing=False, max_length=max(len(e) for e in examples))
        logprobs = teacher.logprobs(rows, loss.temperature)  # [N, T]: log p of token t (t ≥ 1)
        topk_values, topk_ids = teacher.topk_logprobs(rows, k, loss.temperature)  # position s predicts s + 1
    start, end, scores, exact, values, ids, counts = [], [], [], [], [], [], [0]
    row = -1
    for example in aligned:
        counts.append(len(example.chunks))
        if not example.chunks:
            continue
        row += 1
        for chunk, is_exact in zip(example.chunks, example.exact):
            start.append(chunk.student_start)
            end.append(chunk.student_end)
            scores.append(logprobs[row, chunk.teacher_start:chunk.teacher_end].sum())
            exact.append(is_exact)
            values.append(topk_values[row, chunk.teacher_start - 1])
            ids.append(projected(projection, topk_ids[row, chunk.teacher_start - 1]) if is_exact
                       else torch.full((k,), -1, dtype=torch.long))
    if not start:
        none = torch.zeros(0, dtype=torch.long)
        return ChunkTargets(none, none, torch.zeros(0), torch.zeros(0, dtype=torch.bool), torch.zeros(0, k),
                            torch.zeros(0, k, dtype=torch.long), torch.tensor(counts).cumsum(0))
    return ChunkTargets(torch.tensor(start), torch.tensor(end), torch.stack(scores).float(), torch.tensor(exact),
                        torch.stack(values).float(), torch.stack(ids).long(), torch.tensor(counts).cumsum(0))


def projected(projection: torch.Tensor, teacher_ids: torch.Tensor) -> torch.Tensor:
    """The student ids of `teacher_ids` through the projection; −1 for ids without a match, and for ids of the
    teacher's LM head beyond its tokenizer's vocabulary (heads padded to a round size)."""
    inside = teacher_ids < len(projection)
    return torch.where(inside, projection[teacher_ids.clamp(max=len(projection) - 1)], -1)


def concatenated(parts: Sequence[ChunkTargets]) -> ChunkTargets:
    offsets = [parts[0].offsets]
    for part in parts[1:]:
        offsets.append(part.offsets[1:] + offsets[-1][-1])
    return ChunkTargets(*(torch.cat([getattr(p, name) for p in parts]) for name in
                          ("start", "end", "teacher_logprobs", "exact", "topk_logprobs", "topk_ids")),
                        torch.cat(offsets))


class LiveChunkTeacher:
    """A resident teacher scoring each micro-batch's chunks as it is drawn."""

    def __init__(self, teacher: ScoringWorker, data: CrossTokenizerData, loss: DistillationLossConfig,
                 teacher_pad_token_id: int):
        self.teacher, self.data, self.loss, self.pad = teacher, data, loss, teacher_pad_token_id

    def batch(self, rows: SFTBatch, example_indices: Sequence[int]) -> CrossTokenizerBatch:
        aligned = [self.data.examples[i] for i in example_indices]
        scored = score_chunks(self.teacher, aligned, self.data.projection, self.loss, self.pad)
        return scored.batch(rows, range(len(aligned)))


def chunk_teacher(output_dir: Path, teacher_cfg: TeacherSection, loss: DistillationLossConfig,
                  data: CrossTokenizerData, teacher_tokenizer, data_sha256: tuple[str, str],
                  trainer: TrainerConfig, device: torch.device, run_log) -> ChunkTargets | LiveChunkTeacher:
    """What gives each micro-batch its chunks, once the projection is stored with the run (stored_projection):
    with teacher.precompute, every example's chunks scored once (or reused from OUTPUT/teacher_topk/chunks.safetensors
    when its settings and checksum match) and the teacher freed; else the teacher loaded and scoring as training goes.
    data_sha256: the fingerprints of the student's and the teacher's tokenizations of the training data."""
    data = replace(data, projection=stored_projection(output_dir, teacher_cfg.name_or_path, data.projection, run_log))
    run_log.message(f"cross-tokenizer teacher: aligned chunks cover {data.covered_targets} of {data.targets} "
                    f"completion targets; {data.fallback_rows} rows aligned by the sequence-alignment fallback")
    teacher_pad_token_id = next(i for i in (teacher_tokenizer.pad_token_id, teacher_tokenizer.eos_token_id, 0)
                                if i is not None)
    if not teacher_cfg.precompute:
        return LiveChunkTeacher(build_teacher(teacher_cfg, trainer, device, topk=loss.topk), data, loss,
                                teacher_pad_token_id)
    folder = output_dir / "teacher_topk"
    path, manifest_path = folder / "chunks.safetensors", folder / "chunks_manifest.json"
    settings = {"teacher": teacher_cfg.name_or_path, "dtype": teacher_cfg.dtype, "topk": loss.topk,
                "temperature": loss.temperature, "examples": len(data.examples), "data_sha256": data_sha256[0],
                "teacher_data_sha256": data_sha256[1],
                "projection_sha256": _tensor_sha(data.projection)}
    if manifest_path.exists() and path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest["settings"] == settings and manifest["sha256"] == sha256_all([path])[0]:
            run_log.message(f"teacher chunks: reusing {path} (checksum verified)")
            return ChunkTargets.from_tensors(load_file(path))
        run_log.message(f"teacher chunks: {path} was computed from other settings or data, or fails its checksum; "
                        "scoring again")
    started = time.perf_counter()
    teacher = build_scorer(teacher_cfg.as_model(), trainer, device, role="teacher")
    scored = concatenated([score_chunks(teacher, group, data.projection, loss, teacher_pad_token_id)
                           for group in chunks(list(data.examples), trainer.eval_batch_size)])
    del teacher  # the student trains without the teacher resident
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, manifest_path, scored.tensors(), settings)
    run_log.message(f"teacher chunks: scored {len(scored.start)} chunks ({int(scored.exact.sum())} exact) of "
                    f"{len(data.examples)} examples in {time.perf_counter() - started:.1f}s into {path}; teacher freed")
    return scored


def _tensor_sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
