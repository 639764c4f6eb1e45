"""Pieces every recipe loop shares: the run directory, seeding, resuming, announcing, logging and exporting."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import yaml
from pydantic import BaseModel

from posttrain.checkpoint import (
    CHECKPOINT_DIR,
    FINAL_DIR,
    Checkpoint,
    SavesState,
    check_checkpoint_folders,
    latest_checkpoint,
    restore_trainer_state,
    save_checkpoint,
)
from posttrain.config.schema import EvaluationSettings, HubSection, RecipeConfig, TrainerConfig
from posttrain.data.errors import DataError
from posttrain.data.overlap import check_held_out
from posttrain.data.sampler import EpochSampler
from posttrain.process_group import broadcast_object, init_from_env, is_distributed, is_main
from posttrain.errors import RunError
from posttrain.generation.base import SamplingParams
from posttrain.hub import check_push_possible, push_export, write_model_card
from posttrain.logging import RunLogger, read_metrics
from posttrain.logging.report import write_run_info
from posttrain.models.lora import ADAPTER_DIR
from posttrain.models.loading import resolve_model_path
from posttrain.preemption import checkpoint_written, preempted, step_boundary
from posttrain.rundir import check_export_dir, remove_dead_staging
from posttrain.workers import PolicyWorker

CONFIG_FILE = "config.yaml"
R = TypeVar("R", bound=RecipeConfig)


def evaluation_sampling(settings: EvaluationSettings, max_new_tokens: int | None = None) -> SamplingParams:
    """The generator's SamplingParams of an evaluation (`posttrain eval` or a recipe's evaluation set), seeded with
    its `seed`; `max_new_tokens` replaces the settings' own when given."""
    return SamplingParams(max_new_tokens=max_new_tokens or settings.max_new_tokens, temperature=settings.temperature,
                          top_p=settings.top_p, top_k=settings.top_k, stop_strings=tuple(settings.stop_strings),
                          seed=settings.seed)


def prepare_output_dir(cfg: BaseModel, output_dir: str | Path) -> tuple[Path, list[str]]:
    """Create the run directory and write the resolved config.yaml (rank 0 of a data-parallel run).

    The caller holds the directory's lock (rundir.one_run_per_output_dir). Before anything is written, the
    staging folders of dead runs are removed, and a final/ or adapter/ holding files no export wrote stops the
    run (RunError) rather than being replaced at its end, as does a checkpoint folder holding the user's files
    or a metrics.jsonl no run wrote; held-out data sharing prompts with the training data past
    data.max_overlap_fraction stops it (DataError). Returns the directory and, when an earlier run left a
    different config there, the dotted keys that changed (the caller warns: resuming under other settings is
    allowed but worth knowing). In a data-parallel run rank 0 also resolves the model first (an embedded model
    is built once, not by every rank).
    """
    out = Path(output_dir)
    changed: list[str] = []
    problem = None
    if is_main():
        out.mkdir(parents=True, exist_ok=True)
        for folder in (out, out / CHECKPOINT_DIR):
            remove_dead_staging(folder)
        try:
            check_export_dir(out / FINAL_DIR)
            check_export_dir(out / ADAPTER_DIR)
            check_checkpoint_folders(out)
            _check_metrics_file(out / "metrics.jsonl")
            if isinstance(cfg, RecipeConfig):
                check_push_possible(cfg.hub)
            for line in held_out_check(cfg):
                print(line)
        except (RunError, DataError) as error:
            problem = error
    problem = broadcast_object(problem)
    if problem is not None:
        raise problem
    if is_main():
        resolved = cfg.model_dump(mode="json")
        if isinstance(cfg, RecipeConfig) and cfg.trainer.num_epochs is not None:
            del resolved["trainer"]["max_steps"]  # derived from the data at its load: num_epochs is the setting
        previous_file = out / CONFIG_FILE
        if previous_file.is_file():
            previous = yaml.safe_load(previous_file.read_text()) or {}
            changed = _changed_keys(previous, resolved)
        previous_file.write_text(yaml.safe_dump(resolved, sort_keys=False))
        model = getattr(cfg, "model", None)
        if is_distributed() and model is not None:
            resolve_model_path(model.tokenizer_name_or_path or model.name_or_path)
            resolve_model_path(model.name_or_path)
    return out, broadcast_object(changed)


def _check_metrics_file(path: Path) -> None:
    """A metrics.jsonl that no run wrote (not JSON lines with a whole-number step) stops the run before config.yaml
    is written, naming the line, instead of failing as a ValueError once the logger opens it."""
    if not path.is_file():
        return
    try:
        read_metrics(path)
    except ValueError as error:
        raise RunError(f"{error}: this metrics.jsonl was not written by a run (resuming would append to it); move "
                       "it away, or choose another output_dir") from None


def held_out_check(cfg: BaseModel) -> list[str]:
    """data.overlap.check_held_out for a recipe's config: its training files against data.eval_files and each
    `evaluation:` set (the recipes without evaluation sets have none)."""
    data = getattr(cfg, "data", None)
    if data is None:
        return []
    sources = [("data.eval_files", data.eval_files, data.column_map)]
    sources += [(f"evaluation set {s.name!r}", s.data.files, s.data.column_map) for s in getattr(cfg, "evaluation", [])]
    return check_held_out(data.train_files, data.column_map, sources, data.max_overlap_fraction)


def _changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    keys = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += _changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            keys.append(f"{prefix}{key}")
    return keys


def with_epochs_as_steps(cfg: R, num_examples: int) -> R:
    """`cfg` with trainer.max_steps derived from trainer.num_epochs over `num_examples` training examples
    (TrainerConfig.with_epochs_as_steps); `cfg` itself without num_epochs."""
    if cfg.trainer.num_epochs is None:
        return cfg
    return cfg.model_copy(update={"trainer": cfg.trainer.with_epochs_as_steps(num_examples)})


def epochs_note(trainer: TrainerConfig) -> str:
    """What the run's announcement adds when trainer.num_epochs set the number of steps."""
    return f"; trainer.num_epochs={trainer.num_epochs}: {trainer.max_steps} steps" if trainer.num_epochs else ""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def configure_torch(cfg: TrainerConfig) -> None:
    """Threads and deterministic kernels; under torchrun also join the process group (gloo on CPU, NCCL on GPU)."""
    init_from_env()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    # Deterministic kernels where torch has them, so that CPU runs (and resumed runs) repeat exactly.
    torch.use_deterministic_algorithms(True, warn_only=True)


def check_writable_file(path: Path, key: str) -> None:
    """Refuse (RunError), before any work, a `key` path that is a folder or cannot be written: the samples are
    written at the end, and finding out then would lose the whole evaluation."""
    if path.is_dir() or str(path).endswith("/"):
        raise RunError(f"{key}={str(path)!r} is a folder; give a file name, such as {path / 'samples.jsonl'}")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as error:
        raise RunError(f"{key}={str(path)!r} cannot be written: {error.strerror or error}") from None
    if not existed:
        path.unlink()


def chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def resume_trainer_state(resume: Checkpoint | None, sampler: EpochSampler) -> tuple[int, dict]:
    """Restore the RNG and the data position saved with `resume` (the workers load their own state); return the
    last finished step (0 for a new run) and the checkpoint's trainer state ({} for a new run)."""
    if resume is None:
        return 0, {}
    state = restore_trainer_state(resume)
    sampler.load_state_dict(state["sampler"])
    return resume.step, state


class SilentRunLogger:
    """What ranks other than 0 log: nothing (rank 0 writes metrics.jsonl, the progress and the trackers)."""

    def __enter__(self) -> SilentRunLogger:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def message(self, text: str) -> None: ...

    def log(self, step: int, metrics: dict) -> None: ...

    def log_samples(self, step: int, split: str, records: list) -> None: ...

    def advance(self, step: int, metrics: dict) -> None: ...

    def write_report(self) -> None: ...


def run_logger(output_dir: Path, cfg, **kwargs) -> RunLogger | SilentRunLogger:
    """The run's logger on rank 0 (or in a single process); a silent one on the other ranks."""
    return RunLogger(output_dir, cfg, **kwargs) if is_main() else SilentRunLogger()


def announce_run(run_log: RunLogger, data_summary: str, resume: Checkpoint | None, changed_keys: list[str],
                 policy: PolicyWorker, what: str) -> None:
    """The lines every recipe prints before its first step; rank 0 also keeps them in OUTPUT/run_info.json for the
    run report (a file written, nothing computed)."""
    run_log.message(f"data: {data_summary}")
    if resume is not None:
        run_log.message(f"resuming from {resume.path} (step {resume.step})")
        if changed_keys:
            run_log.message(f"warning: config differs from the run being resumed in: {', '.join(changed_keys)}")
    training = f"training {describe_parameters(policy)} on {policy.device}, {what}"
    run_log.message(training)
    if is_main():
        write_run_info(run_log.output_dir, run_log.recipe, data_summary, training,
                       resume.step if resume is not None else None)


def describe_parameters(policy: PolicyWorker) -> str:
    """"1.05M parameters", or where only some train (LoRA) "0.13M of 16.91M parameters (131,072 of 16,908,288:
    0.78%)", the total counting the frozen base and the adapters alike."""
    trainable, total = policy.num_parameters(trainable_only=True), policy.num_parameters()
    if trainable == total:
        return f"{trainable / 1e6:.2f}M parameters"
    return (f"{trainable / 1e6:.2f}M of {total / 1e6:.2f}M parameters ({trainable:,} of {total:,}: "
            f"{trainable / total:.2%})")


class NonFiniteGuard:
    """trainer.on_nonfinite for one run: a step whose loss or gradient norm is NaN or infinite stops the run
    ("stop") or is skipped and counted ("skip", at most trainer.max_nonfinite_skips in a row).

    The workers never apply an update whose gradient norm is not finite, so when the run stops the weights in
    memory are still those of the last good step; nothing is saved from them, and the newest checkpoint and
    any earlier final/ stay as they were.
    """

    def __init__(self, trainer: TrainerConfig, output_dir: Path):
        self.trainer = trainer
        self.output_dir = output_dir
        self.skipped = 0
        self.in_a_row = 0

    def check(self, step: int, metrics: dict[str, float]) -> None:
        """Call once per step with its metrics (loss, grad_norm); adds `nonfinite_skipped_steps` to them when
        steps were skipped. Raises RunError when the run must stop."""
        bad = {name: metrics[name] for name in ("loss", "grad_norm") if name in metrics
               and not math.isfinite(metrics[name])}
        if not bad:
            self.in_a_row = 0
        else:
            what = " and ".join(f"{'the loss' if name == 'loss' else 'the gradient norm'} is {value}"
                                for name, value in bad.items())
            newest = latest_checkpoint(self.output_dir)
            kept = (f"the newest checkpoint, {newest.path}, is kept" if newest
                    else "no checkpoint had been written yet")
            if self.trainer.on_nonfinite == "stop":
                raise RunError(f"step {step}: {what}; the run stopped without applying it: {kept} and final/ "
                               "was not written. Lower trainer.learning_rate, check the data, or set "
                               "trainer.on_nonfinite=skip to skip such steps")
            self.skipped += 1
            self.in_a_row += 1
            if self.in_a_row > self.trainer.max_nonfinite_skips:
                raise RunError(f"step {step}: {what}; {self.in_a_row} non-finite steps in a row, more than "
                               f"trainer.max_nonfinite_skips={self.trainer.max_nonfinite_skips}: the run stopped; "
                               f"{kept} and final/ was not written")
        if self.skipped:
            metrics["nonfinite_skipped_steps"] = float(self.skipped)


def is_eval_step(step: int, trainer: TrainerConfig) -> bool:
    return bool(trainer.eval_every and step % trainer.eval_every == 0) or step == trainer.max_steps


def is_save_step(step: int, trainer: TrainerConfig) -> bool:
    return bool(trainer.save_every and step % trainer.save_every == 0) or step == trainer.max_steps


def log_step(run_log: RunLogger, step: int, metrics: dict[str, float], trainer: TrainerConfig) -> None:
    """A metrics.jsonl record every log_every steps, at the end and whenever an evaluation ran (eval_*, eval/* or
    val/* metrics); progress otherwise. After an evaluation report.html is rewritten, so a run that is killed
    later still leaves its curves up to there."""
    evaluated = any(key.startswith(("eval_", "eval/", "val/")) for key in metrics)
    if step % trainer.log_every == 0 or step == trainer.max_steps or evaluated:
        run_log.log(step, metrics)
    else:
        run_log.advance(step, metrics)
    if evaluated and step < trainer.max_steps:  # the last step's report is written as the run ends
        run_log.write_report()


def save_if_due(output_dir: Path, step: int, trainer: TrainerConfig, workers: Mapping[str, SavesState],
                sampler: EpochSampler, extra_state: dict | Callable[[], dict] | None = None, *,
                run_log: RunLogger | SilentRunLogger | None = None) -> None:
    """Checkpoint every save_every steps, every save_every_minutes, at the last step, and when SIGTERM or SIGUSR1
    arrived: each worker's folder plus the data position and `extra_state` (or what it returns, called only when a
    checkpoint is written), then (given `run_log`) report.html. After a signal's checkpoint, raise Preempted (the run
    ends here and the logger writes the report on its way out; posttrain.preemption). Every rank calls this at the
    end of every step: the decision is collective."""
    boundary = step_boundary(trainer.save_every_minutes)
    if is_save_step(step, trainer) or boundary.save_for_time or boundary.stop_signal is not None:
        extra = extra_state() if callable(extra_state) else extra_state
        checkpoint = save_checkpoint(output_dir, step, workers,
                                     {"sampler": sampler.state_dict(), **(extra or {})}, trainer.keep_last)
        checkpoint_written()
        if boundary.stop_signal is not None and step < trainer.max_steps:
            raise preempted(boundary.stop_signal, step, trainer.max_steps, checkpoint.path)
        if run_log is not None and step < trainer.max_steps:  # the last step's report is written as the run ends
            run_log.write_report()


def export_policy(output_dir: Path, policy: PolicyWorker, run_log: RunLogger, hub: HubSection) -> Path:
    """Every recipe's end: write OUTPUT/final/ (a Hugging Face model directory; with LoRA first the adapter alone
    to OUTPUT/adapter/, then merged into its base for final/), a README.md model card in each (posttrain.hub), and
    with hub.push_at_end upload one of them; return final/. The policy is finished afterwards."""
    exported = policy.export(output_dir)
    if exported.adapter_dir is not None:
        run_log.message(f"LoRA adapter: {exported.adapter_dir}")
    run_log.message(f"final model: {exported.final_dir}")
    if is_main():
        for folder in (exported.final_dir, exported.adapter_dir):
            if folder is not None:
                write_model_card(output_dir, folder)
        if hub.push_at_end:
            url = push_export(output_dir, hub.repo_id, private=hub.private, folder=hub.folder)
            run_log.message(f"pushed {hub.folder}/ to {url}")
    return exported.final_dir


def check_same_tokenizer(student, teacher, teacher_name: str) -> None:
    """RunError unless the teacher's tokenizer is the student's (same vocabulary, ids and special tokens):
    top-k token ids are compared id by id."""
    if student.get_vocab() != teacher.get_vocab():
        raise RunError(f"teacher {teacher_name} has another tokenizer than the student (vocabularies differ); "
                       "cross-tokenizer distillation is not built yet: choose a teacher with the student's tokenizer")
    if (student.eos_token_id, student.pad_token_id) != (teacher.eos_token_id, teacher.pad_token_id):
        raise RunError(f"teacher {teacher_name}'s end-of-sequence or padding token differs from the student's")
