"""Knowledge distillation: the student learns the teacher's top-k next-token distribution, on a dataset's
completions (off-policy KD) or, with mode=on_policy, on completions it samples itself (GKD's lmbda mixes the two).

The loop, top to bottom: load the data (prompt/completion or messages rows, tokenized as for SFT) and check the
teacher's tokenizer is the student's; with teacher.precompute, score every training example's top-k once into
OUTPUT/teacher_topk/ (reused when its checksum and settings match, as on resume) and free the teacher (several
teachers: each its routed examples, into OUTPUT/teacher_topk/<name>/, one teacher loaded at a time), else load
each teacher frozen (with offload, its weights on the CPU between scoring calls); with mode=on_policy and
lmbda > 0, build the student's generator (rollout:). Then for each optimizer step draw micro_batch_size x
gradient_accumulation_steps rows; with probability lmbda (a draw seeded by the run's seed and the step) the step is
on-policy: each row's prompt is continued by the student's current weights and the sampled tokens become the row's
targets; collate, attach the teacher's top-k to each micro-batch (a DistillBatch), hand the step to the student
with `DistillationObjective` (normalized by the target count of the whole step), step, log, evaluate, checkpoint;
at the end write OUTPUT/final/.

Departures from GKD (Agarwal et al. 2024) and TRL's GKDTrainer: the divergence is computed on the teacher's top-k,
not the full vocabulary (docs/distillation.md); the per-step draw and the samples are seeded by (seed, step), not
by a global generator, so a resumed run repeats an uninterrupted one; sampling and the loss have their own
temperatures (rollout.temperature, loss.temperature); no seq_kd (teacher-sampled completions).

Several teachers (MOPD): teacher_column routes each row to the one teacher whose route lists its value; each
teacher scores its rows of every micro-batch (or, precomputed, only its rows of the training set once), and
per-teacher metrics come from one more graph-free forward pass.

A teacher whose tokenizer differs from the student's goes through the aligner instead (algorithms/distill_xtoken.py):
the data is tokenized by both, cut into aligned chunks, and each micro-batch is a CrossTokenizerBatch trained with
`CrossTokenizerObjective`; the teacher is refused before training when its tokenizer cannot serve the student. On an
on-policy step the student's samples are aligned there too (their text in each teacher's tokens). kd_loss_mode=sum or
average sends every teacher through the aligner, each scoring every row, their chunks weighted 1 or 1/n.

Not built here yet (docs/distillation.md): packed rows.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from posttrain.algorithms.common import (
    NonFiniteGuard,
    announce_run,
    epochs_note,
    check_same_tokenizer,
    chunks,
    configure_torch,
    export_policy,
    with_epochs_as_steps,
    is_eval_step,
    log_step,
    prepare_output_dir,
    resume_trainer_state,
    run_logger,
    save_if_due,
    seed_everything,
)
from posttrain.algorithms.distill_xtoken import (
    align_teachers,
    cross_tokenizer_teachers,
    data_fingerprint,
    tokenizers_differ,
)
from posttrain.algorithms.evaluate import TrainingEvaluation
from posttrain.algorithms.rl import policy_generator, rollout_sampling
from posttrain.checkpoint import POLICY, checkpoint_to_resume
from posttrain.config.losses import DistillationLossConfig
from posttrain.config.schema import DistillConfig, TeacherSection, TrainerConfig, WeightSyncSection
from posttrain.data import load_sft_examples
from posttrain.data.collate import collate
from posttrain.data.errors import DataError
from posttrain.data.loading import iter_records
from posttrain.data.sampler import EpochSampler, check_step_fits
from posttrain.data.types import DistillBatch, SFTBatch, TokenizedExample
from posttrain.distributed.builders import (build_policy, build_scorer, build_teacher, check_split,
                                            check_teacher_backend)
from posttrain.distributed.cluster import start_cluster, stops_clusters
from posttrain.errors import RunError
from posttrain.generation.base import Generator, SamplingParams
from posttrain.models.loading import default_device, load_tokenizer
from posttrain.process_group import is_distributed
from posttrain.rundir import one_run_per_output_dir, sha256_all
from posttrain.workers import PolicyWorker, as_floats, reduce_metrics
from posttrain.workers.base import ScoringWorker
from posttrain.workers.objectives import CrossTokenizerObjective, DistillationObjective, NLLObjective

log = logging.getLogger(__name__)

TEACHER_TOPK_DIR = "teacher_topk"
"""OUTPUT/teacher_topk/: the precomputed top-k (topk.safetensors) and what it was computed from (manifest.json)."""


@dataclass(frozen=True)
class DistillResult:
    output_dir: Path
    final_dir: Path
    steps: int
    final_loss: float | None
    eval_nll: float | None


@dataclass(frozen=True)
class TeacherTopk:
    """Every training example's teacher top-k at its target positions, in example order.

    logprobs: [n, k] float32 and ids: [n, k] long, one row per target token of every example, example after
    example; offsets: [N + 1] long, example i's rows are offsets[i]:offsets[i + 1]."""

    logprobs: torch.Tensor
    ids: torch.Tensor
    offsets: torch.Tensor

    def example(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Example i's top-k: ([targets, k] log-probabilities, [targets, k] ids)."""
        return self.logprobs[self.offsets[i]:self.offsets[i + 1]], self.ids[self.offsets[i]:self.offsets[i + 1]]

    def batch(self, rows: SFTBatch, example_indices: Sequence[int]) -> DistillBatch:
        """`rows` (collated padded from the examples `example_indices`, one per row) with their top-k placed at the
        positions that predict each target."""
        return _place_topk(rows, [self.example(i) for i in example_indices])


@dataclass(frozen=True)
class RoutedTeacherTopk:
    """Several teachers' precomputed top-k: each teacher's TeacherTopk holds only the training examples routed to
    it, in example order.

    parts: one TeacherTopk per teacher of cfg.teachers (None for a teacher no example is routed to); where:
    training example i -> (its teacher's index, its position in that teacher's TeacherTopk)."""

    parts: list[TeacherTopk | None]
    where: list[tuple[int, int]]

    def batch(self, rows: SFTBatch, example_indices: Sequence[int]) -> DistillBatch:
        """As TeacherTopk.batch, each row's top-k taken from its own teacher's part."""
        return _place_topk(rows, [self.parts[t].example(position)
                                  for t, position in (self.where[i] for i in example_indices)])


def _place_topk(rows: SFTBatch, per_row: list[tuple[torch.Tensor, torch.Tensor]]) -> DistillBatch:
    k = per_row[0][0].shape[-1]
    values = torch.zeros((*rows.input_ids.shape, k), dtype=torch.float32)
    ids = torch.zeros((*rows.input_ids.shape, k), dtype=torch.long)
    for row, (row_values, row_ids) in enumerate(per_row):
        sources = rows.loss_mask[row].nonzero().squeeze(-1) - 1  # target t is predicted from position t - 1
        values[row, sources] = row_values
        ids[row, sources] = row_ids.long()
    return DistillBatch(rows, values, ids)


def teacher_batch(teacher: ScoringWorker, rows: SFTBatch, loss: DistillationLossConfig) -> DistillBatch:
    """`rows` with the teacher's top-k (config.topk tokens at config.temperature) scored now."""
    values, ids = teacher.topk_logprobs(rows, loss.topk, loss.temperature)
    return DistillBatch(rows, values.float(), ids)


def teacher_batches(teacher: ScoringWorker, rows: Sequence[SFTBatch], loss: DistillationLossConfig
                    ) -> list[DistillBatch]:
    """`teacher_batch` of each of `rows`; a Ray teacher group (`topk_logprobs_each`) scores them at once, spread
    over its actors."""
    each = getattr(teacher, "topk_logprobs_each", None)
    if each is None:
        return [teacher_batch(teacher, part, loss) for part in rows]
    return [DistillBatch(part, values.float(), ids)
            for part, (values, ids) in zip(rows, each(rows, loss.topk, loss.temperature), strict=True)]


PRECOMPUTE_BATCHES_AT_ONCE = 8
"""Precomputing the top-k, batches handed to the teacher at a time (a Ray group scores them in parallel)."""


def examples_topk(teacher: ScoringWorker, examples: Sequence[TokenizedExample], loss: DistillationLossConfig,
                  pad_token_id: int, batch_size: int) -> TeacherTopk:
    """The teacher's top-k at every target of every example (TeacherTopk), in batches of batch_size examples handed
    to the teacher PRECOMPUTE_BATCHES_AT_ONCE at a time (`teacher_batches`)."""
    values, ids, counts = [], [], [0]
    for window in chunks(list(chunks(list(examples), batch_size)), PRECOMPUTE_BATCHES_AT_ONCE):
        collated = [collate(group, pad_token_id, packing=False, max_length=max(len(e) for e in group))  # padded
                    for group in window]
        for group, rows, scored in zip(window, collated, teacher_batches(teacher, collated, loss), strict=True):
            for row in range(len(group)):
                sources = rows.loss_mask[row].nonzero().squeeze(-1) - 1
                values.append(scored.teacher_topk_logprobs[row, sources])
                ids.append(scored.teacher_topk_ids[row, sources])
                counts.append(len(sources))
    return TeacherTopk(torch.cat(values), torch.cat(ids), torch.tensor(counts).cumsum(0))


def precomputed_topk(output_dir: Path, teacher_cfg: TeacherSection, loss: DistillationLossConfig,
                     examples: Sequence[TokenizedExample], pad_token_id: int, trainer: TrainerConfig,
                     device: torch.device, run_log, cluster: Any | None = None) -> TeacherTopk:
    """OUTPUT/teacher_topk/'s top-k when it was computed from this teacher, k, temperature and data and its
    checksum holds (a resumed run); else the teacher is loaded, scores every example once, the file is written
    (topk.safetensors, then manifest.json with its SHA-256, each renamed into place) and the teacher is freed."""
    settings = {"teacher": teacher_cfg.name_or_path, "dtype": teacher_cfg.dtype, "topk": loss.topk,
                "temperature": loss.temperature, "examples": len(examples), "data_sha256": data_fingerprint(examples)}
    return topk_file(output_dir / TEACHER_TOPK_DIR, settings, teacher_cfg, loss, examples, pad_token_id, trainer,
                     device, run_log, cluster)


def routed_precomputed_topk(output_dir: Path, cfg: DistillConfig, examples: Sequence[TokenizedExample],
                            routes: Sequence[int], pad_token_id: int, device: torch.device,
                            run_log, cluster: Any | None = None) -> RoutedTeacherTopk:
    """Several teachers with precompute: each teacher's top-k at only the examples routed to it, in
    OUTPUT/teacher_topk/<name>/ (topk.safetensors and manifest.json, as one teacher's, with teacher_column, the
    route and a SHA-256 of the routed examples' indices in its settings and data_sha256 of those examples). One
    teacher after the other: a file whose settings and checksum hold is reused, else that teacher is loaded, scores
    its examples and is freed before the next one loads; a teacher no example is routed to is not loaded."""
    parts: list[TeacherTopk | None] = []
    where: list[tuple[int, int]] = [(-1, -1)] * len(examples)
    for index, teacher_cfg in enumerate(cfg.teachers):
        members = [i for i, route in enumerate(routes) if route == index]
        for position, i in enumerate(members):
            where[i] = (index, position)
        if not members:
            run_log.message(f"teacher top-k: no training example is routed to teacher {teacher_cfg.name} "
                            f"({cfg.teacher_column} in {teacher_cfg.route}); not loaded")
            parts.append(None)
            continue
        routed = [examples[i] for i in members]
        settings = {"teacher": teacher_cfg.name_or_path, "dtype": teacher_cfg.dtype, "topk": cfg.loss.topk,
                    "temperature": cfg.loss.temperature, "teacher_column": cfg.teacher_column,
                    "route": teacher_cfg.route, "examples": len(routed), "data_sha256": data_fingerprint(routed),
                    "example_indices_sha256": hashlib.sha256(json.dumps(members).encode()).hexdigest()}
        parts.append(topk_file(output_dir / TEACHER_TOPK_DIR / teacher_cfg.name, settings, teacher_cfg, cfg.loss,
                               routed, pad_token_id, cfg.trainer, device, run_log, cluster,
                               teacher_group_name(cfg, index)))
    return RoutedTeacherTopk(parts, where)


def topk_file(folder: Path, settings: dict, teacher_cfg: TeacherSection, loss: DistillationLossConfig,
              examples: Sequence[TokenizedExample], pad_token_id: int, trainer: TrainerConfig,
              device: torch.device, run_log, cluster: Any | None = None, group_name: str | None = None) -> TeacherTopk:
    """folder/topk.safetensors when folder/manifest.json records these settings and the file's SHA-256 holds; else
    the teacher is loaded, scores `examples` once, the file is written (topk.safetensors, then manifest.json with
    the settings and its SHA-256, each renamed into place) and the teacher is freed. With a Ray `cluster`
    (cluster.teacher_workers) the teacher is a scoring group (`group_name`), released once it has scored."""
    path, manifest_path = folder / "topk.safetensors", folder / "manifest.json"
    if manifest_path.exists() and path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest["settings"] == settings and manifest["sha256"] == sha256_all([path])[0]:
            run_log.message(f"teacher top-k: reusing {path} (checksum verified)")
            tensors = load_file(path)
            return TeacherTopk(tensors["logprobs"], tensors["ids"].long(), tensors["offsets"])
        run_log.message(f"teacher top-k: {path} was computed from other settings or data, or fails its checksum; "
                        "scoring again")
    started = time.perf_counter()
    teacher = build_scorer(teacher_cfg.as_model(), trainer, device, role="teacher", cluster=cluster,
                           group_name=group_name)
    topk = examples_topk(teacher, examples, loss, pad_token_id, trainer.eval_batch_size)
    if cluster is not None:  # its actors go: the next teacher's group takes their place
        cluster.release(teacher)
    del teacher  # the student (and the next teacher) loads without this teacher resident
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / "topk.safetensors.tmp"
    save_file({"logprobs": topk.logprobs.contiguous(), "ids": topk.ids.to(torch.int32).contiguous(),
               "offsets": topk.offsets.contiguous()}, str(staging))
    os.replace(staging, path)
    staging = folder / "manifest.json.tmp"
    staging.write_text(json.dumps({"settings": settings, "sha256": sha256_all([path])[0]}, indent=1) + "\n")
    os.replace(staging, manifest_path)
    run_log.message(f"teacher top-k: scored {len(examples)} examples ({topk.logprobs.shape[0]} targets, "
                    f"k={loss.topk}) in {time.perf_counter() - started:.1f}s into {path}; teacher freed")
    return topk


def teacher_routes(cfg: DistillConfig, examples: Sequence[TokenizedExample]) -> list[int] | None:
    """With teacher_column: the index of the teacher (in cfg.teachers) of every example, from its row's column value
    (the rows read again from data.train_files, matched by location); None without. A row lacking the column, or
    whose value no teacher's route lists, is a DataError naming the column (and the value) at the row."""
    column = cfg.teacher_column
    if column is None:
        return None
    serving = {value: i for i, teacher in enumerate(cfg.teachers) for value in teacher.route}
    values: dict[str, object] = {}
    for source in cfg.data.train_files:
        for location, record in iter_records(source, on_bad_record=lambda error: None):
            if cfg.data.column_map:
                record = {cfg.data.column_map.get(key, key): value for key, value in record.items()}
            values[location] = record.get(column, _MISSING)
    routes = []
    for example in examples:
        value = values[example.source]
        if value is _MISSING:
            raise DataError(example.source, f"missing: teacher_column={column!r} routes every row to a teacher, and "
                            "this row has no such column", column)
        if str(value) not in serving:
            served = ", ".join(f"{t.name}: {t.route}" for t in cfg.teachers)
            raise DataError(example.source, f"{column}={value!r}: no teacher serves this value (teachers[].route: "
                            f"{served})", column)
        routes.append(serving[str(value)])
    return routes


_MISSING = object()


def routed_teacher_batch(teachers: Sequence[ScoringWorker], routes: Sequence[int],
                         examples: Sequence[TokenizedExample], rows: SFTBatch, loss: DistillationLossConfig,
                         pad_token_id: int) -> DistillBatch:
    """`rows` (collated from `examples`) with each row's top-k scored by its own teacher, teachers[routes[row]]:
    each teacher scores its rows of the micro-batch together (padded to their own longest, placed back by row)."""
    values = torch.zeros((*rows.input_ids.shape, loss.topk), dtype=torch.float32)
    ids = torch.zeros((*rows.input_ids.shape, loss.topk), dtype=torch.long)
    for index, teacher in enumerate(teachers):
        members = [row for row, route in enumerate(routes) if route == index]
        if not members:
            continue
        part = collate([examples[row] for row in members], pad_token_id, False, rows.input_ids.shape[1])
        scored = teacher_batch(teacher, part, loss)
        width = part.input_ids.shape[1]
        values[members, :width] = scored.teacher_topk_logprobs
        ids[members, :width] = scored.teacher_topk_ids
    return DistillBatch(rows, values, ids)


def per_teacher_metrics(policy: PolicyWorker, loss: DistillationObjective, cfg: DistillConfig,
                        micro_batches: Sequence[DistillBatch], routes: Sequence[Sequence[int]]) -> dict[str, float]:
    """distill/<teacher name>/{divergence, top1_agreement, teacher_topk_mass, student_topk_mass} (means per target
    token of the teacher's rows) and distill/<name>/target_tokens, at the weights the step's update was computed
    at: one more forward pass of the step's rows, without a graph (policy.evaluate)."""
    metrics: dict[str, float] = {}
    for index, teacher in enumerate(cfg.teachers):
        parts = []
        for batch, batch_routes in zip(micro_batches, routes, strict=True):
            members = torch.tensor([row for row, route in enumerate(batch_routes) if route == index], dtype=torch.long)
            if len(members):
                parts.append(select_rows(batch, members))
        if not parts:
            continue
        totals = reduce_metrics(policy.evaluate(part, loss) for part in parts)
        stats = as_floats(totals)
        for name in ("divergence", "top1_agreement", "teacher_topk_mass", "student_topk_mass", "target_tokens"):
            metrics[f"distill/{teacher.name}/{name}"] = stats[name]
    return metrics


def select_rows(batch: DistillBatch, index: torch.Tensor) -> DistillBatch:
    """The rows `index` of a padded DistillBatch."""
    rows = batch.rows
    selected = SFTBatch(rows.input_ids[index], rows.loss_mask[index], rows.position_ids[index],
                        rows.attention_mask[index], len(index), int(rows.attention_mask[index].sum()))
    return DistillBatch(selected, batch.teacher_topk_logprobs[index], batch.teacher_topk_ids[index])


def teacher_group_name(cfg: DistillConfig, index: int) -> str | None:
    """The Ray scoring group of teachers[index] (cluster.teacher_workers): "teacher" (None) for one teacher,
    teacher_<name> for each of several (its metrics: heartbeat/teacher_<name>_seconds, faults/teacher_<name>_...)."""
    return None if len(cfg.teachers) == 1 else f"teacher_{cfg.teachers[index].name}"


def describe_teachers(cfg: DistillConfig, routes: list[int] | None) -> str:
    """The teachers for the run's opening lines (with teacher_column: each one's rows)."""
    if routes is None:
        return f"teacher {cfg.teacher.name_or_path}"
    return "teachers " + ", ".join(f"{t.name} ({t.name_or_path}, {routes.count(i)} rows)"
                                   for i, t in enumerate(cfg.teachers))


@dataclass(frozen=True)
class OnPolicySampling:
    """mode=on_policy (GKD): which steps are on-policy, and the student's samples for them.

    A step is on-policy with probability `lmbda`: one uniform draw from a torch stream seeded by the run's seed
    and the step, so the decision depends on nothing else the run did (a resumed run decides as an uninterrupted
    one, and the draw consumes none of the global generators the student's training reads). An on-policy step
    samples one completion per drawn row from the student, continuing the row's prompt, with `params` seeded by
    the run's seed and the step likewise."""

    generator: Generator
    params: SamplingParams
    lmbda: float
    seed: int

    def is_on_policy(self, step: int) -> bool:
        return is_on_policy_step(self.seed, step, self.lmbda)

    def sample(self, policy: PolicyWorker, examples: Sequence[TokenizedExample], step: int,
               max_length: int) -> tuple[list[TokenizedExample], dict[str, float]]:
        """The examples with their completions replaced by the student's samples (policy's current weights,
        pushed to the generator first), and the sampling metrics: sample_seconds,
        distill/sampled_completion_length (mean sampled tokens, the eos included when produced) and
        distill/sampled_truncated (the fraction that reached rollout.max_new_tokens)."""
        started = time.perf_counter()
        policy.push_weights(self.generator)
        prompts = [prompt_ids(example) for example in examples]
        output = self.generator.generate(prompts, replace(self.params, seed=sampling_seed(self.seed, step)))
        completions = [samples[0] for samples in output.completions]
        sampled = [sampled_example(example, prompt, completion.token_ids, max_length)
                   for example, prompt, completion in zip(examples, prompts, completions, strict=True)]
        return sampled, {
            "sample_seconds": time.perf_counter() - started,
            "distill/sampled_completion_length": sum(len(c.token_ids) for c in completions) / len(completions),
            "distill/sampled_truncated": sum(c.truncated for c in completions) / len(completions),
        }


def is_on_policy_step(seed: int, step: int, lmbda: float) -> bool:
    """Bernoulli(lmbda) for step `step` from its own seeded stream (lmbda 0: never; 1: always)."""
    stream = torch.Generator().manual_seed(sampling_seed(seed, step))
    return bool(torch.rand(1, generator=stream, dtype=torch.float64) < lmbda)


def sampling_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s on-policy draw and samples."""
    return seed * 1_000_003 + step


def prompt_ids(example: TokenizedExample) -> list[int]:
    """The example's tokens before its first target: the prompt the student continues on an on-policy step."""
    return list(example.input_ids[: example.loss_mask.index(1)])


def sampled_example(example: TokenizedExample, prompt: list[int], completion: list[int],
                    max_length: int) -> TokenizedExample:
    """The prompt followed by the sampled tokens, the sampled tokens its targets, cut to max_length tokens (the
    prompt is shorter than the example it came from, so at least one sampled token stays)."""
    ids = (*prompt, *completion)[:max_length]
    mask = ((0,) * len(prompt) + (1,) * len(completion))[:max_length]
    return TokenizedExample(ids, mask, f"{example.source} (sampled by the student)")


def build_on_policy_sampling(cfg: DistillConfig, tokenizer, policy: PolicyWorker) -> OnPolicySampling | None:
    """The student's sampler for mode=on_policy with lmbda > 0 (the rollout.backend generator sampling from the
    policy); None when no step samples."""
    if cfg.on_policy_fraction == 0:
        return None
    sampling, _ = rollout_sampling(cfg.rollout)
    return OnPolicySampling(policy_generator(cfg, tokenizer, policy), sampling, cfg.on_policy_fraction, cfg.seed)


def describe_mode(cfg: DistillConfig) -> str:
    """How the run's steps get their completions, for the run's opening lines."""
    if cfg.on_policy_fraction == 0:
        return "the dataset's completions" + (" (mode=on_policy with lmbda=0)" if cfg.mode == "on_policy" else "")
    return (f"on-policy with probability lmbda={cfg.on_policy_fraction:g} (the student samples up to "
            f"{cfg.rollout.max_new_tokens} tokens at temperature {cfg.rollout.temperature:g})")


def evaluate_nll(policy: PolicyWorker, examples: Sequence[TokenizedExample], cfg: DistillConfig,
                 pad_token_id: int) -> float:
    """The student's mean NLL per target token on `examples` (the held-out data's completions)."""
    totals = reduce_metrics(
        policy.evaluate(collate(group, pad_token_id, False, cfg.data.max_length), NLLObjective())
        for group in chunks(list(examples), cfg.trainer.eval_batch_size)
    )
    return totals["nll_sum"].value / max(totals["target_tokens"].value, 1.0)


@one_run_per_output_dir
@stops_clusters  # a Ray instance started for the teachers stops with the run, also when it fails
def train_distill(cfg: DistillConfig) -> DistillResult:
    configure_torch(cfg.trainer)
    output_dir, changed_keys = prepare_output_dir(cfg, cfg.output_dir)
    seed_everything(cfg.seed)
    device = default_device()
    trainer, teacher_cfg = cfg.trainer, cfg.teacher
    if teacher_cfg.precompute and is_distributed():
        raise RunError("teacher.precompute=true runs in one process for now; run without torchrun, or set "
                       "teacher.precompute=false")
    for each in cfg.teachers:
        check_teacher_backend(each)

    # Data first: a malformed row should fail before minutes go into loading a model.
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    teacher_tokenizers = [load_tokenizer(each.as_model(), padding_side="right") for each in cfg.teachers]
    # The aligner serves teachers with another tokenizer, and combines several teachers' losses (kd_loss_mode).
    cross_tokenizer = (cfg.loss.cross_tokenizer.align == "always" or cfg.kd_loss_mode != "select"
                       or any(tokenizers_differ(tokenizer, other) for other in teacher_tokenizers))
    if cross_tokenizer and cfg.cluster.backend == "ray":
        other = next(t.name_or_path for t, o in zip(cfg.teachers, teacher_tokenizers) if tokenizers_differ(tokenizer, o))
        raise RunError(f"teacher {other}'s tokenizer differs from the student's: such a teacher scores through the "
                       "cross-tokenizer aligner, which runs in the driver process and has no Ray scoring group yet; "
                       "set cluster.backend=local")
    if not cross_tokenizer:
        for each, other in zip(cfg.teachers, teacher_tokenizers, strict=True):
            check_same_tokenizer(tokenizer, other, each.name_or_path)
    train_examples, train_stats = load_sft_examples(cfg.data.train_files, tokenizer, cfg.data)
    cfg = with_epochs_as_steps(cfg, len(train_examples))
    trainer = cfg.trainer
    routes = teacher_routes(cfg, train_examples)  # with teacher_column: each example's teacher
    aligned = align_teachers(cfg, tokenizer, teacher_tokenizers, train_examples, routes) if cross_tokenizer else None
    eval_examples: list[TokenizedExample] = []
    if cfg.data.eval_files:
        eval_examples, _ = load_sft_examples(cfg.data.eval_files, tokenizer, cfg.data)
        eval_examples = eval_examples[: cfg.data.max_eval_examples]
    check_step_fits(trainer, len(train_examples))
    evaluation = TrainingEvaluation(cfg.evaluation, tokenizer, trainer.max_steps, trainer.eval_batch_size)

    check_split(trainer)
    resume = checkpoint_to_resume(output_dir)
    sampler = EpochSampler(len(train_examples), seed=cfg.seed, shuffle=cfg.data.shuffle)
    start_step, state = resume_trainer_state(resume, sampler)
    pad = tokenizer.pad_token_id
    # cluster.backend=ray: the teachers' scoring groups (the student stays in this process).
    cluster = start_cluster(cfg.cluster, WeightSyncSection(), output_dir)

    examples_per_step = trainer.micro_batch_size * trainer.gradient_accumulation_steps
    with run_logger(output_dir, cfg.logging, recipe="distill", total_steps=trainer.max_steps, start_step=start_step,
                    run_config=cfg.model_dump(mode="json")) as run_log, contextlib.closing(evaluation):
        # The teacher: scored once up front (and freed), or resident and scoring each micro-batch.
        cached, teachers, chunked = None, [], None
        if aligned is not None:  # the teachers' scores per aligned chunk
            chunked = cross_tokenizer_teachers(cfg, output_dir, tokenizer, teacher_tokenizers, train_examples, aligned,
                                               routes, device, run_log)
        elif teacher_cfg.precompute and len(cfg.teachers) > 1:  # each teacher its routed examples, one at a time
            cached = routed_precomputed_topk(output_dir, cfg, train_examples, routes, pad, device, run_log, cluster)
        elif teacher_cfg.precompute:
            cached = precomputed_topk(output_dir, teacher_cfg, cfg.loss, train_examples, pad,
                                      trainer, device, run_log, cluster)
        else:  # each teacher loaded once (backend: transformers, or a vLLM engine; or a Ray scoring group)
            teachers = [build_teacher(each, trainer, device, max_length=cfg.data.max_length, topk=cfg.loss.topk,
                                      cluster=cluster, group_name=teacher_group_name(cfg, index))
                        for index, each in enumerate(cfg.teachers)]
        if cluster is not None and "cluster" in state:  # the fault counts go on (max_restarts is per run)
            cluster.load_state_dict(state["cluster"])
        loss = (CrossTokenizerObjective(cfg.loss, teacher_names=chunked.names) if chunked is not None
                else DistillationObjective(cfg.loss))
        policy = build_policy(cfg.model, cfg.lora, trainer, tokenizer, device,
                              resume_dir=resume.worker_dir(POLICY) if resume else None)
        # mode=on_policy: the student's sampler (None when no step samples).
        on_policy = build_on_policy_sampling(cfg, tokenizer, policy)
        announce_run(run_log, train_stats.summary(), resume, changed_keys, policy,
                     f"{examples_per_step} examples per step ({len(train_examples)} in the training set"
                     f"{epochs_note(trainer)}), "
                     f"{describe_teachers(cfg, routes)} (top-{cfg.loss.topk}, {cfg.loss.divergence}, "
                     f"{cfg.loss.outside_topk}), {describe_mode(cfg)}")

        step_loss, eval_nll = None, None
        guard = NonFiniteGuard(trainer, output_dir)
        for step in range(start_step + 1, trainer.max_steps + 1):
            started = time.perf_counter()
            # The step's rows: the dataset's, or (an on-policy step) the same rows' prompts continued by the student.
            draws = [sampler.next_indices(trainer.micro_batch_size) for _ in range(trainer.gradient_accumulation_steps)]
            examples = [[train_examples[i] for i in indices] for indices in draws]
            step_on_policy = on_policy is not None and on_policy.is_on_policy(step)
            sample_metrics = {"sample_seconds": 0.0}
            if step_on_policy:
                flat, sample_metrics = on_policy.sample(policy, [e for part in examples for e in part], step,
                                                        cfg.data.max_length)
                examples = list(chunks(flat, trainer.micro_batch_size))
            # The teacher's top-k at every target of every micro-batch.
            scoring_started = time.perf_counter()
            collated = [collate(part, pad, False, cfg.data.max_length) for part in examples]
            if chunked is not None:
                micro_batches = [chunked.batch(rows, indices, part if step_on_policy else None)
                                 for rows, indices, part in zip(collated, draws, examples, strict=True)]
            elif cached is not None:
                micro_batches = [cached.batch(rows, indices) for rows, indices in zip(collated, draws, strict=True)]
            elif routes is None:  # a Ray teacher group scores the step's micro-batches at once
                micro_batches = teacher_batches(teachers[0], collated, cfg.loss)
            else:
                micro_batches = [routed_teacher_batch(teachers, [routes[i] for i in indices], part, rows, cfg.loss,
                                                      pad)
                                 for rows, indices, part in zip(collated, draws, examples, strict=True)]
            teacher_seconds = time.perf_counter() - scoring_started
            if sum(mb.num_target_tokens for mb in micro_batches) == 0:
                raise ValueError("an optimizer step drew no target tokens; check data.completion_only_loss and the data")
            stats = as_floats(policy.forward_backward(micro_batches, loss))
            per_teacher = {} if routes is None or chunked is not None else per_teacher_metrics(
                policy, loss, cfg, micro_batches, [[routes[i] for i in indices] for indices in draws])
            update = as_floats(policy.optim_step())
            elapsed = time.perf_counter() - started
            step_loss = stats.pop("loss")

            metrics = {
                "loss": step_loss,
                **{f"distill/{name}": value for name, value in stats.items() if name != "target_tokens"},
                "learning_rate": update["learning_rate"],
                "grad_norm": update["grad_norm"],
                "tokens_per_second": sum(mb.num_tokens for mb in micro_batches) / elapsed,
                "step_seconds": elapsed,
                "teacher_seconds": teacher_seconds,
                "distill/on_policy": float(step_on_policy),
                **per_teacher,
                **sample_metrics,
                "target_tokens": stats["target_tokens"],
                "epoch": sampler.epochs_completed,
                **{k: v for k, v in update.items() if k not in ("learning_rate", "grad_norm")},
                **({} if cluster is None else cluster.metrics()),  # Ray teacher groups: heartbeats, restarts
            }
            guard.check(step, metrics)
            if eval_examples and is_eval_step(step, trainer):
                eval_nll = evaluate_nll(policy, eval_examples, cfg, pad)
                metrics["eval_nll"] = eval_nll
            if evaluation.is_due(step):
                metrics.update(evaluation.run_for_policy(step, policy, cfg.model, run_log))
            log_step(run_log, step, metrics, trainer)
            save_if_due(output_dir, step, trainer, {POLICY: policy}, sampler,
                        None if cluster is None else lambda: {"cluster": cluster.state_dict()}, run_log=run_log)

        final_dir = export_policy(output_dir, policy, run_log, cfg.hub)
    return DistillResult(output_dir, final_dir, trainer.max_steps, step_loss, eval_nll)
