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

On the student's own samples (mode=on_policy): a sampled completion is handed to the teacher as text, decoded from
the student's tokens and encoded once by the teacher's tokenizer after the teacher's own tokens of the row's prompt
(an end-of-sequence token the student sampled becomes the teacher's); the two are aligned as the data's rows are and
scored by the resident teacher. A sampled byte that is not valid UTF-8 on its own (a lone piece of a multi-byte
character) has no text to hand over: the decoded replacement character differs from the student's bytes, so that
stretch is in no chunk (the fallback alignment) and its targets carry no divergence.

Several teachers (CrossTokenizerTeachers): each is aligned on its own rows (kd_loss_mode=select with teacher_column)
or on all of them (sum, average), with its own projection (stored only when its tokenizer differs from the
student's, in OUTPUT/teacher_projection/<name>/) and its own chunk file when precomputed
(OUTPUT/teacher_topk/<name>/); a micro-batch holds every serving teacher's chunks, each marked with its teacher and
weighted 1 (sum) or 1/n (average).
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from posttrain.algorithms.common import chunks
from posttrain.config.losses import DistillationLossConfig
from posttrain.config.schema import DataConfig, DistillConfig, TeacherSection, TrainerConfig
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


def align_example(student_example: TokenizedExample, teacher_example: TokenizedExample,
                  student_surfaces: TokenSurfaces, teacher_surfaces: TokenSurfaces,
                  projection: Sequence[int]) -> tuple[ExampleChunks, bool]:
    """One row's counted chunks (those whose tokens are all completion targets on both sides, each marked exact
    when it is one token a side and the projection maps the teacher's onto the student's), and whether the offsets
    were exact (False: the sequence-alignment fallback)."""
    alignment = align_tokens(student_example.input_ids, teacher_example.input_ids, student_surfaces,
                             teacher_surfaces)
    kept = [chunk for chunk in alignment.chunks
            if all(student_example.loss_mask[chunk.student_start:chunk.student_end])
            and all(teacher_example.loss_mask[chunk.teacher_start:chunk.teacher_end])]
    exact = tuple(chunk.one_to_one and projection[teacher_example.input_ids[chunk.teacher_start]]
                  == student_example.input_ids[chunk.student_start] for chunk in kept)
    return ExampleChunks(teacher_example, tuple(kept), exact), alignment.exact


def align_training_data(student_tokenizer, teacher_tokenizer, teacher_name: str, student_examples:
                        Sequence[TokenizedExample], data: DataConfig, train_files: Sequence[str],
                        serves: Sequence[bool] | None = None) -> CrossTokenizerData:
    """The training data tokenized by the teacher too, aligned and checked (see the module docstring). serves: which
    examples this teacher scores (several teachers routed by teacher_column); None: all. Examples it does not serve
    keep the teacher's tokenization but no chunks. RunError when the teacher cannot serve the student."""
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
    for index, example in enumerate(student_examples):
        teacher_example = by_source.get(example.source, empty)  # empty: dropped on its side (overlong, on_error)
        if serves is not None and not serves[index]:
            aligned.append(ExampleChunks(teacher_example, (), ()))
            continue
        targets += example.num_targets
        if not teacher_example.input_ids:
            aligned.append(ExampleChunks(empty, (), ()))
            continue
        row, exact_offsets = align_example(example, teacher_example, student_surfaces, teacher_surfaces, projection)
        fallback += not exact_offsets
        row_covered = sum(chunk.student_end - chunk.student_start for chunk in row.chunks)
        covered += row_covered
        if row_covered < example.num_targets and worst is None:
            worst = (example, teacher_example)
        aligned.append(row)
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


def sampled_teacher_example(row: ExampleChunks, sampled: TokenizedExample, student_tokenizer,
                            teacher_tokenizer) -> TokenizedExample:
    """The teacher's tokenization of a row whose completion the student sampled (mode=on_policy): the teacher's own
    tokens of the row's prompt (its tokenization's tokens before the first target, so a chat template renders the
    prompt as the teacher's), then the text of the student's sampled tokens encoded by the teacher's tokenizer; an
    end-of-sequence token the student sampled becomes the teacher's. Empty when the teacher has no tokenization of
    the row. The sampled text is encoded once, whole, as the data's completions are."""
    teacher_row = row.teacher_example
    if 1 not in teacher_row.loss_mask:
        return TokenizedExample((), (), sampled.source)
    prompt = teacher_row.input_ids[:teacher_row.loss_mask.index(1)]
    completion = [token for token, target in zip(sampled.input_ids, sampled.loss_mask, strict=True) if target]
    ended = bool(completion) and completion[-1] == student_tokenizer.eos_token_id
    if ended:
        completion = completion[:-1]
    text = student_tokenizer.decode(completion, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    ids = list(teacher_tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
    if ended and teacher_tokenizer.eos_token_id is not None:
        ids.append(teacher_tokenizer.eos_token_id)
    return TokenizedExample((*prompt, *ids), (0,) * len(prompt) + (1,) * len(ids), sampled.source)


def stored_projection(folder: Path, teacher_name: str, projection: torch.Tensor, run_log) -> torch.Tensor:
    """The projection as stored with the run in `folder` (OUTPUT/teacher_projection/, with several teachers
    OUTPUT/teacher_projection/<name>/): written (file, then a manifest with its SHA-256) unless an identical one
    whose checksum holds is there already."""
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

    def batch(self, rows: SFTBatch, example_indices: Sequence[int],
              batch_rows: Sequence[int] | None = None) -> CrossTokenizerBatch:
        """`rows` (collated from the examples `example_indices`, one per row) with their chunks. batch_rows: the row
        of `rows` holding each of example_indices (default: 0, 1, ...), when this teacher scores only some rows."""
        batch_rows = range(len(example_indices)) if batch_rows is None else batch_rows
        picks = [torch.arange(int(self.offsets[i]), int(self.offsets[i + 1])) for i in example_indices]
        row = torch.cat([torch.full((len(p),), r, dtype=torch.long) for r, p in zip(batch_rows, picks, strict=True)]
                        + [torch.zeros(0, dtype=torch.long)])
        index = torch.cat([*picks, torch.zeros(0, dtype=torch.long)])
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

    def batch(self, rows: SFTBatch, example_indices: Sequence[int],
              batch_rows: Sequence[int] | None = None) -> CrossTokenizerBatch:
        return self.score(rows, [self.data.examples[i] for i in example_indices], batch_rows)

    def score(self, rows: SFTBatch, aligned: Sequence[ExampleChunks],
              batch_rows: Sequence[int] | None = None) -> CrossTokenizerBatch:
        """`rows` with the chunks of `aligned` (one per row of batch_rows, default 0, 1, ...) scored now."""
        scored = score_chunks(self.teacher, aligned, self.data.projection, self.loss, self.pad)
        return scored.batch(rows, range(len(aligned)), batch_rows)


def chunk_teacher(output_dir: Path, teacher_cfg: TeacherSection, loss: DistillationLossConfig,
                  data: CrossTokenizerData, teacher_tokenizer, data_sha256: tuple[str, str],
                  trainer: TrainerConfig, device: torch.device, run_log, subfolder: str = "",
                  store_projection: bool = True) -> ChunkTargets | LiveChunkTeacher:
    """What gives each micro-batch its chunks, once the projection is stored with the run (stored_projection, unless
    store_projection is False: a teacher sharing the student's tokenizer, whose projection is the identity):
    with teacher.precompute, every example's chunks scored once (or reused from OUTPUT/teacher_topk/chunks.safetensors
    when its settings and checksum match) and the teacher freed; else the teacher loaded and scoring as training goes.
    data_sha256: the fingerprints of the student's and the teacher's tokenizations of the training data. subfolder:
    the teacher's name with several teachers (their files go to OUTPUT/teacher_projection/<name>/ and
    OUTPUT/teacher_topk/<name>/)."""
    label = f"teacher {subfolder}" if subfolder else "teacher"
    if store_projection:
        data = replace(data, projection=stored_projection(output_dir / PROJECTION_DIR / subfolder,
                                                          teacher_cfg.name_or_path, data.projection, run_log))
    run_log.message(f"cross-tokenizer {label}: aligned chunks cover {data.covered_targets} of {data.targets} "
                    f"completion targets; {data.fallback_rows} rows aligned by the sequence-alignment fallback")
    teacher_pad_token_id = next(i for i in (teacher_tokenizer.pad_token_id, teacher_tokenizer.eos_token_id, 0)
                                if i is not None)
    if not teacher_cfg.precompute:
        return LiveChunkTeacher(build_teacher(teacher_cfg, trainer, device, topk=loss.topk), data, loss,
                                teacher_pad_token_id)
    folder = output_dir / "teacher_topk" / subfolder
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


@dataclass(frozen=True)
class AlignedTeacher:
    """One teacher on the cross-tokenizer path: its tokenizer, its alignment of the training data, and what scores
    its chunks (precomputed ChunkTargets or a resident LiveChunkTeacher)."""

    name: str
    tokenizer: object
    surfaces: TokenSurfaces
    data: CrossTokenizerData
    source: ChunkTargets | LiveChunkTeacher

    @cached_property
    def projection_ids(self) -> list[int]:
        """The projection as a list (teacher id -> student id), read per aligned sample."""
        return self.data.projection.tolist()


class CrossTokenizerTeachers:
    """Every teacher of a run on the cross-tokenizer path, and which rows each scores: with `routes` (kd_loss_mode=
    select and teacher_column) a row's chunks come from its own teacher only; without, every teacher scores every
    row, and each chunk's terms weigh `weight` (1 for kd_loss_mode=sum, 1/n for average). A micro-batch's chunks
    are the teachers' chunks one after the other, each marked with its teacher (chunk_teacher) when there are
    several."""

    def __init__(self, teachers: Sequence[AlignedTeacher], routes: Sequence[int] | None, weight: float,
                 student_tokenizer):
        self.teachers, self.routes, self.weight = list(teachers), routes, weight
        self.student_tokenizer = student_tokenizer
        self.student_surfaces = TokenSurfaces(student_tokenizer)

    @property
    def names(self) -> tuple[str, ...]:
        """The teachers' names for per-teacher metrics; empty with one teacher."""
        return tuple(t.name for t in self.teachers) if len(self.teachers) > 1 else ()

    def batch(self, rows: SFTBatch, example_indices: Sequence[int],
              sampled: Sequence[TokenizedExample] | None = None) -> CrossTokenizerBatch:
        """`rows` (collated from the training examples `example_indices`, or on an on-policy step from `sampled`,
        the same rows with the student's samples as their completions) with every serving teacher's chunks."""
        parts = []
        for index, teacher in enumerate(self.teachers):
            members = [r for r, i in enumerate(example_indices) if self.routes is None or self.routes[i] == index]
            if not members:
                continue
            if sampled is None:
                part = teacher.source.batch(rows, [example_indices[r] for r in members], members)
            else:  # the student's own samples: aligned now, scored by the resident teacher
                aligned = [self.aligned_sample(teacher, example_indices[r], sampled[r]) for r in members]
                part = teacher.source.score(rows, aligned, members)
            parts.append((index, part))
        return self._joined(rows, parts)

    def aligned_sample(self, teacher: AlignedTeacher, example_index: int, sampled: TokenizedExample) -> ExampleChunks:
        """The chunks of a row whose completion the student sampled, for `teacher`."""
        teacher_example = sampled_teacher_example(teacher.data.examples[example_index], sampled,
                                                  self.student_tokenizer, teacher.tokenizer)
        if not teacher_example.input_ids:
            return ExampleChunks(teacher_example, (), ())
        row, _ = align_example(sampled, teacher_example, self.student_surfaces, teacher.surfaces,
                               teacher.projection_ids)
        return row

    def _joined(self, rows: SFTBatch, parts: Sequence[tuple[int, CrossTokenizerBatch]]) -> CrossTokenizerBatch:
        if len(self.teachers) == 1:
            return parts[0][1]
        fields = ("chunk_row", "chunk_start", "chunk_end", "chunk_teacher_logprobs", "chunk_exact",
                  "teacher_topk_logprobs", "teacher_topk_ids")
        joined = {name: torch.cat([getattr(part, name) for _, part in parts]) for name in fields}
        teacher = torch.cat([torch.full((len(part.chunk_row),), index, dtype=torch.long) for index, part in parts])
        return CrossTokenizerBatch(rows, **joined, chunk_teacher=teacher,
                                   chunk_weight=torch.full((len(teacher),), self.weight, dtype=torch.float32))


def align_teachers(cfg: DistillConfig, student_tokenizer, teacher_tokenizers: Sequence,
                   train_examples: Sequence[TokenizedExample], routes: Sequence[int] | None) -> list[CrossTokenizerData]:
    """Each teacher of `cfg` aligned to the training data (on the rows `routes` sends it, or all), before any model
    is loaded: a teacher that cannot serve the student is refused here (RunError)."""
    return [align_training_data(student_tokenizer, teacher_tokenizer, teacher_cfg.name_or_path, train_examples,
                                cfg.data, cfg.data.train_files,
                                None if routes is None else [route == index for route in routes])
            for index, (teacher_cfg, teacher_tokenizer) in enumerate(zip(cfg.teachers, teacher_tokenizers,
                                                                         strict=True))]


def cross_tokenizer_teachers(cfg: DistillConfig, output_dir: Path, student_tokenizer, teacher_tokenizers: Sequence,
                             train_examples: Sequence[TokenizedExample], aligned: Sequence[CrossTokenizerData],
                             routes: Sequence[int] | None, device: torch.device, run_log) -> CrossTokenizerTeachers:
    """The teachers of `cfg` with their alignments (align_teachers): each one's projection stored with the run when
    its tokenizer differs from the student's, and its chunks precomputed or scored live (chunk_teacher); with
    several teachers each one's files go to a folder of its name."""
    several = len(cfg.teachers) > 1
    student_fingerprint = data_fingerprint(train_examples)
    teachers = []
    for teacher_cfg, teacher_tokenizer, data in zip(cfg.teachers, teacher_tokenizers, aligned, strict=True):
        source = chunk_teacher(output_dir, teacher_cfg, cfg.loss, data, teacher_tokenizer,
                               (student_fingerprint, data_fingerprint([a.teacher_example for a in data.examples])),
                               cfg.trainer, device, run_log, subfolder=teacher_cfg.name if several else "",
                               store_projection=tokenizers_differ(student_tokenizer, teacher_tokenizer))
        teachers.append(AlignedTeacher(teacher_cfg.name or teacher_cfg.name_or_path, teacher_tokenizer,
                                       TokenSurfaces(teacher_tokenizer), data, source))
    weight = 1.0 / len(cfg.teachers) if cfg.kd_loss_mode == "average" else 1.0
    return CrossTokenizerTeachers(teachers, routes, weight, student_tokenizer)


def data_fingerprint(examples: Sequence[TokenizedExample]) -> str:
    """SHA-256 of the examples' tokens and masks: a precomputed top-k belongs to exactly this data."""
    digest = hashlib.sha256()
    for example in examples:
        digest.update(json.dumps([example.input_ids, example.loss_mask]).encode())
    return digest.hexdigest()
