"""Off-policy knowledge distillation: the student learns the teacher's top-k next-token distribution on a dataset.

The loop, top to bottom: load the data (prompt/completion or messages rows, tokenized as for SFT) and check the
teacher's tokenizer is the student's; with teacher.precompute, score every training example's top-k once into
OUTPUT/teacher_topk/ (reused when its checksum and settings match, as on resume) and free the teacher, else load
the teacher frozen; then for each optimizer step draw micro_batch_size x gradient_accumulation_steps examples,
collate them, attach the teacher's top-k to each micro-batch (a DistillBatch), hand the step to the student with
`DistillationObjective` (normalized by the target count of the whole step), step, log, evaluate, checkpoint; at
the end write OUTPUT/final/.

A teacher whose tokenizer differs from the student's goes through the aligner instead (algorithms/distill_xtoken.py):
the data is tokenized by both, cut into aligned chunks, and each micro-batch is a CrossTokenizerBatch trained with
`CrossTokenizerObjective`; the teacher is refused before training when its tokenizer cannot serve the student.

Not built here yet (docs/distillation.md): on-policy distillation (GRPO's advantage.estimator=opd does OPD; GKD's
lmbda mixing is not built), several teachers, teacher offload, packed rows.
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
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from posttrain.algorithms.common import (
    NonFiniteGuard,
    announce_run,
    check_same_tokenizer,
    chunks,
    configure_torch,
    export_policy,
    is_eval_step,
    log_step,
    prepare_output_dir,
    resume_trainer_state,
    run_logger,
    save_if_due,
    seed_everything,
)
from posttrain.algorithms.distill_xtoken import align_training_data, chunk_teacher, tokenizers_differ
from posttrain.algorithms.evaluate import TrainingEvaluation
from posttrain.checkpoint import POLICY, checkpoint_to_resume
from posttrain.config.losses import DistillationLossConfig
from posttrain.config.schema import DistillConfig, TeacherSection, TrainerConfig
from posttrain.data import load_sft_examples
from posttrain.data.collate import collate
from posttrain.data.sampler import EpochSampler, check_step_fits
from posttrain.data.types import DistillBatch, SFTBatch, TokenizedExample
from posttrain.distributed.builders import build_policy, build_scorer, check_split
from posttrain.errors import RunError
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

    def batch(self, rows: SFTBatch, example_indices: Sequence[int]) -> DistillBatch:
        """`rows` (collated padded from the examples `example_indices`, one per row) with their top-k placed at the
        positions that predict each target."""
        return _place_topk(rows, [(self.logprobs[self.offsets[i]:self.offsets[i + 1]],
                                   self.ids[self.offsets[i]:self.offsets[i + 1]]) for i in example_indices])


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


def examples_topk(teacher: ScoringWorker, examples: Sequence[TokenizedExample], loss: DistillationLossConfig,
                  pad_token_id: int, batch_size: int) -> TeacherTopk:
    """The teacher's top-k at every target of every example (TeacherTopk), scored batch_size examples at a time."""
    values, ids, counts = [], [], [0]
    for group in chunks(list(examples), batch_size):
        rows = collate(group, pad_token_id, packing=False, max_length=max(len(e) for e in group))  # padded
        scored = teacher_batch(teacher, rows, loss)
        for row in range(len(group)):
            sources = rows.loss_mask[row].nonzero().squeeze(-1) - 1
            values.append(scored.teacher_topk_logprobs[row, sources])
            ids.append(scored.teacher_topk_ids[row, sources])
            counts.append(len(sources))
    return TeacherTopk(torch.cat(values), torch.cat(ids), torch.tensor(counts).cumsum(0))


def data_fingerprint(examples: Sequence[TokenizedExample]) -> str:
    """SHA-256 of the examples' tokens and masks: a precomputed top-k belongs to exactly this data."""
    digest = hashlib.sha256()
    for example in examples:
        digest.update(json.dumps([example.input_ids, example.loss_mask]).encode())
    return digest.hexdigest()


def precomputed_topk(output_dir: Path, teacher_cfg: TeacherSection, loss: DistillationLossConfig,
                     examples: Sequence[TokenizedExample], pad_token_id: int, trainer: TrainerConfig,
                     device: torch.device, run_log) -> TeacherTopk:
    """OUTPUT/teacher_topk/'s top-k when it was computed from this teacher, k, temperature and data and its
    checksum holds (a resumed run); else the teacher is loaded, scores every example once, the file is written
    (topk.safetensors, then manifest.json with its SHA-256, each renamed into place) and the teacher is freed."""
    folder = output_dir / TEACHER_TOPK_DIR
    path, manifest_path = folder / "topk.safetensors", folder / "manifest.json"
    settings = {"teacher": teacher_cfg.name_or_path, "dtype": teacher_cfg.dtype, "topk": loss.topk,
                "temperature": loss.temperature, "examples": len(examples), "data_sha256": data_fingerprint(examples)}
    if manifest_path.exists() and path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest["settings"] == settings and manifest["sha256"] == sha256_all([path])[0]:
            run_log.message(f"teacher top-k: reusing {path} (checksum verified)")
            tensors = load_file(path)
            return TeacherTopk(tensors["logprobs"], tensors["ids"].long(), tensors["offsets"])
        run_log.message(f"teacher top-k: {path} was computed from other settings or data, or fails its checksum; "
                        "scoring again")
    started = time.perf_counter()
    teacher = build_scorer(teacher_cfg.as_model(), trainer, device, role="teacher")
    topk = examples_topk(teacher, examples, loss, pad_token_id, trainer.eval_batch_size)
    del teacher  # the student trains without the teacher resident
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


def evaluate_nll(policy: PolicyWorker, examples: Sequence[TokenizedExample], cfg: DistillConfig,
                 pad_token_id: int) -> float:
    """The student's mean NLL per target token on `examples` (the held-out data's completions)."""
    totals = reduce_metrics(
        policy.evaluate(collate(group, pad_token_id, False, cfg.data.max_length), NLLObjective())
        for group in chunks(list(examples), cfg.trainer.eval_batch_size)
    )
    return totals["nll_sum"].value / max(totals["target_tokens"].value, 1.0)


@one_run_per_output_dir
def train_distill(cfg: DistillConfig) -> DistillResult:
    configure_torch(cfg.trainer)
    output_dir, changed_keys = prepare_output_dir(cfg, cfg.output_dir)
    seed_everything(cfg.seed)
    device = default_device()
    trainer, teacher_cfg = cfg.trainer, cfg.teacher
    if teacher_cfg.precompute and is_distributed():
        raise RunError("teacher.precompute=true runs in one process for now; run without torchrun, or set "
                       "teacher.precompute=false")

    # Data first: a malformed row should fail before minutes go into loading a model.
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    teacher_tokenizer = load_tokenizer(teacher_cfg.as_model(), padding_side="right")
    cross_tokenizer = cfg.loss.cross_tokenizer.align == "always" or tokenizers_differ(tokenizer, teacher_tokenizer)
    if not cross_tokenizer:
        check_same_tokenizer(tokenizer, teacher_tokenizer, teacher_cfg.name_or_path)
    train_examples, train_stats = load_sft_examples(cfg.data.train_files, tokenizer, cfg.data)
    aligned = (align_training_data(tokenizer, teacher_tokenizer, teacher_cfg.name_or_path, train_examples, cfg.data,
                                   cfg.data.train_files) if cross_tokenizer else None)
    eval_examples: list[TokenizedExample] = []
    if cfg.data.eval_files:
        eval_examples, _ = load_sft_examples(cfg.data.eval_files, tokenizer, cfg.data)
        eval_examples = eval_examples[: cfg.data.max_eval_examples]
    check_step_fits(trainer, len(train_examples))
    evaluation = TrainingEvaluation(cfg.evaluation, tokenizer, trainer.max_steps, trainer.eval_batch_size)

    check_split(trainer)
    resume = checkpoint_to_resume(output_dir)
    sampler = EpochSampler(len(train_examples), seed=cfg.seed, shuffle=cfg.data.shuffle)
    start_step, _ = resume_trainer_state(resume, sampler)
    loss = CrossTokenizerObjective(cfg.loss) if cross_tokenizer else DistillationObjective(cfg.loss)
    pad = tokenizer.pad_token_id

    examples_per_step = trainer.micro_batch_size * trainer.gradient_accumulation_steps
    with run_logger(output_dir, cfg.logging, recipe="distill", total_steps=trainer.max_steps, start_step=start_step,
                    run_config=cfg.model_dump(mode="json")) as run_log, contextlib.closing(evaluation):
        # The teacher: scored once up front (and freed), or resident and scoring each micro-batch.
        cached = teacher = chunked = None
        if aligned is not None:  # another tokenizer: the teacher's scores per aligned chunk
            chunked = chunk_teacher(output_dir, teacher_cfg, cfg.loss, aligned, teacher_tokenizer,
                                    (data_fingerprint(train_examples),
                                     data_fingerprint([a.teacher_example for a in aligned.examples])),
                                    trainer, device, run_log)
        elif teacher_cfg.precompute:
            cached = precomputed_topk(output_dir, teacher_cfg, cfg.loss, train_examples, pad,
                                      trainer, device, run_log)
        else:
            teacher = build_scorer(teacher_cfg.as_model(), trainer, device, role="teacher")
        policy = build_policy(cfg.model, cfg.lora, trainer, tokenizer, device,
                              resume_dir=resume.worker_dir(POLICY) if resume else None)
        announce_run(run_log, train_stats.summary(), resume, changed_keys, policy,
                     f"{examples_per_step} examples per step ({len(train_examples)} in the training set), teacher "
                     f"{teacher_cfg.name_or_path} (top-{cfg.loss.topk}, {cfg.loss.divergence}, "
                     f"{cfg.loss.outside_topk})")

        step_loss, eval_nll = None, None
        guard = NonFiniteGuard(trainer, output_dir)
        for step in range(start_step + 1, trainer.max_steps + 1):
            started = time.perf_counter()
            micro_batches = []
            for _ in range(trainer.gradient_accumulation_steps):
                indices = sampler.next_indices(trainer.micro_batch_size)
                rows = collate([train_examples[i] for i in indices], pad, False, cfg.data.max_length)
                micro_batches.append(chunked.batch(rows, indices) if chunked is not None
                                     else cached.batch(rows, indices) if cached is not None
                                     else teacher_batch(teacher, rows, cfg.loss))
            teacher_seconds = time.perf_counter() - started
            if sum(mb.num_target_tokens for mb in micro_batches) == 0:
                raise ValueError("an optimizer step drew no target tokens; check data.completion_only_loss and the data")
            stats = as_floats(policy.forward_backward(micro_batches, loss))
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
                "target_tokens": stats["target_tokens"],
                "epoch": sampler.epochs_completed,
                **{k: v for k, v in update.items() if k not in ("learning_rate", "grad_norm")},
            }
            guard.check(step, metrics)
            if eval_examples and is_eval_step(step, trainer):
                eval_nll = evaluate_nll(policy, eval_examples, cfg, pad)
                metrics["eval_nll"] = eval_nll
            if evaluation.is_due(step):
                metrics.update(evaluation.run_for_policy(step, policy, cfg.model, run_log))
            log_step(run_log, step, metrics, trainer)
            save_if_due(output_dir, step, trainer, {POLICY: policy}, sampler)

        final_dir = export_policy(output_dir, policy, run_log)
    return DistillResult(output_dir, final_dir, trainer.max_steps, step_loss, eval_nll)
