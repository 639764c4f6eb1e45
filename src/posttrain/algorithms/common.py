"""Pieces every recipe loop shares: the run directory, seeding, and the forward pass on a batch."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import yaml
from pydantic import BaseModel

from posttrain.checkpoint import Checkpoint, export_final, load_training_state
from posttrain.config.schema import TrainerConfig
from posttrain.data.sampler import EpochSampler
from posttrain.data.types import SFTBatch, SharedPromptBatch
from posttrain.logging import RunLogger
from posttrain.models.lora import ADAPTER_DIR, is_lora_model, merged_model, save_adapter
from posttrain.models.packing import block_causal_mask, shared_prompt_mask

CONFIG_FILE = "config.yaml"
Batch = TypeVar("Batch", SFTBatch, SharedPromptBatch)


def prepare_output_dir(cfg: BaseModel, output_dir: str | Path) -> tuple[Path, list[str]]:
    """Create the run directory and write the resolved config.yaml.

    Returns the directory and, when an earlier run left a different config there, the dotted keys
    that changed (the caller warns: resuming under other settings is allowed but worth knowing).
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    resolved = cfg.model_dump(mode="json")
    changed: list[str] = []
    previous_file = out / CONFIG_FILE
    if previous_file.is_file():
        previous = yaml.safe_load(previous_file.read_text()) or {}
        changed = _changed_keys(previous, resolved)
    previous_file.write_text(yaml.safe_dump(resolved, sort_keys=False))
    return out, changed


def _changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    keys = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += _changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            keys.append(f"{prefix}{key}")
    return keys


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def configure_torch(cfg: TrainerConfig) -> None:
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    # Deterministic kernels where torch has them, so that CPU runs (and resumed runs) repeat exactly.
    torch.use_deterministic_algorithms(True, warn_only=True)


def autocast(cfg: TrainerConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_logits(model: torch.nn.Module, batch: SFTBatch | SharedPromptBatch) -> torch.Tensor:
    """Logits [B, T, V] for a padded, packed or shared-prompt batch.

    Packed batches (attention_mask None) get a block-diagonal causal mask built from their position ids;
    flash-attention-2 instead reads the example boundaries from position_ids itself. Shared-prompt batches get
    their tree-shaped mask from their segments (sdpa and eager attention only).
    """
    implementation = model.config._attn_implementation
    if isinstance(batch, SharedPromptBatch):
        attention_mask = shared_prompt_mask(batch.segments, implementation, model.dtype)
    else:
        attention_mask = batch.attention_mask
        if attention_mask is None and implementation != "flash_attention_2":
            attention_mask = block_causal_mask(batch.position_ids, implementation, model.dtype)
    return model(
        input_ids=batch.input_ids,
        attention_mask=attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).logits


def batch_to(batch: Batch, device: torch.device) -> Batch:
    """The batch with its tensors on `device` (the same object on CPU)."""
    if device.type == "cpu":
        return batch
    values = {field.name: getattr(batch, field.name) for field in dataclasses.fields(batch)}
    return dataclasses.replace(batch, **{name: v.to(device) for name, v in values.items() if isinstance(v, torch.Tensor)})


def chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def resume_training(
    resume: Checkpoint | None,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    sampler: EpochSampler,
) -> int:
    """Restore optimizer, scheduler, RNG and data position from `resume`; return the last finished step (0 if new)."""
    if resume is None:
        return 0
    state = load_training_state(resume, optimizer, scheduler)
    sampler.load_state_dict(state["sampler"])
    return resume.step


def announce_run(run_log: RunLogger, data_summary: str, resume: Checkpoint | None, changed_keys: list[str],
                 model: torch.nn.Module, what: str) -> None:
    """The lines every recipe prints before its first step."""
    run_log.message(f"data: {data_summary}")
    if resume is not None:
        run_log.message(f"resuming from {resume.path} (step {resume.step})")
        if changed_keys:
            run_log.message(f"warning: config differs from the run being resumed in: {', '.join(changed_keys)}")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    run_log.message(f"training {trainable / 1e6:.2f}M parameters on {model.device}, {what}")


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    max_grad_norm: float | None,
) -> float:
    """Clip the accumulated gradients, apply them, advance the schedule; return the pre-clip gradient norm."""
    grad_norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), max_grad_norm if max_grad_norm is not None else float("inf")
    )
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


def is_eval_step(step: int, trainer: TrainerConfig) -> bool:
    return bool(trainer.eval_every and step % trainer.eval_every == 0) or step == trainer.max_steps


def is_save_step(step: int, trainer: TrainerConfig) -> bool:
    return bool(trainer.save_every and step % trainer.save_every == 0) or step == trainer.max_steps


def log_step(run_log: RunLogger, step: int, metrics: dict[str, float], trainer: TrainerConfig) -> None:
    """A metrics.jsonl record every log_every steps, at the end and whenever an evaluation ran (eval_* or val/*
    metrics); progress otherwise."""
    evaluated = any(key.startswith(("eval_", "val/")) for key in metrics)
    if step % trainer.log_every == 0 or step == trainer.max_steps or evaluated:
        run_log.log(step, metrics)
    else:
        run_log.advance(step, metrics)


def export_model(output_dir: Path, model: torch.nn.Module, tokenizer, run_log: RunLogger) -> Path:
    """Every recipe's end: write OUTPUT/final/ (a Hugging Face model directory) and return it. A LoRA model first
    writes its adapter alone to OUTPUT/adapter/, then is merged into its base for final/ (so `model` is consumed)."""
    if is_lora_model(model):
        adapter_dir = save_adapter(model, Path(output_dir) / ADAPTER_DIR, tokenizer)
        run_log.message(f"LoRA adapter: {adapter_dir}")
        model = merged_model(model)
    final_dir = export_final(output_dir, model, tokenizer)
    run_log.message(f"final model: {final_dir}")
    return final_dir
