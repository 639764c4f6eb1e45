"""Atomic, resumable checkpoints and the final Hugging Face export.

Layout of one checkpoint, ``OUTPUT/checkpoints/step_N/``::

    config.json, model.safetensors, tokenizer files   a Hugging Face model directory (loadable as is)
    optimizer.pt                                      optimizer state
    scheduler.pt                                      learning-rate scheduler state
    trainer_state.json                                step, data position and anything else the loop needs
    rng_state.pt                                      Python, NumPy and torch RNG states

A checkpoint is written into a hidden temporary directory beside its final place and renamed into
place only when complete; rename is atomic, so a process killed mid-write (kill -9 included) leaves
at worst a hidden ``.tmp-*`` folder, which resume ignores and the next save removes.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

CHECKPOINT_DIR = "checkpoints"
FINAL_DIR = "final"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int

    @property
    def trainer_state(self) -> dict[str, Any]:
        return json.loads((self.path / "trainer_state.json").read_text())


def list_checkpoints(output_dir: str | Path) -> list[Checkpoint]:
    """Complete checkpoints under OUTPUT/checkpoints, oldest first."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / "trainer_state.json").is_file():
            found.append(Checkpoint(child, int(match.group(1))))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(output_dir: str | Path) -> Checkpoint | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def capture_rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    trainer_state: dict[str, Any],
    keep_last: int,
) -> Checkpoint:
    """Write checkpoint `step` atomically, then delete all but the `keep_last` newest."""
    root = Path(output_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(root)
    staging = root / f".tmp-step_{step}-{os.getpid()}"
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    torch.save(optimizer.state_dict(), staging / "optimizer.pt")
    torch.save(scheduler.state_dict(), staging / "scheduler.pt")
    torch.save(capture_rng_state(), staging / "rng_state.pt")
    # trainer_state.json is what marks a checkpoint complete for list_checkpoints: written last.
    (staging / "trainer_state.json").write_text(json.dumps({**trainer_state, "step": step}, indent=2) + "\n")
    _fsync_tree(staging)
    target = root / f"step_{step}"
    if target.exists():  # the same step saved again (a resumed run that re-reached it): replace it
        shutil.rmtree(target)
    os.rename(staging, target)
    _fsync_dir(root)
    for old in list_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old.path)
    return Checkpoint(target, step)


def load_training_state(
    checkpoint: Checkpoint, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler
) -> dict[str, Any]:
    """Restore optimizer, scheduler and RNG state; return trainer_state.json. (Weights load with the model.)"""
    optimizer.load_state_dict(torch.load(checkpoint.path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(checkpoint.path / "scheduler.pt", weights_only=True))
    restore_rng_state(torch.load(checkpoint.path / "rng_state.pt", weights_only=False))
    return checkpoint.trainer_state


def export_final(output_dir: str | Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Path:
    """Write OUTPUT/final/ (a Hugging Face model directory) atomically, replacing an older one."""
    target = Path(output_dir) / FINAL_DIR
    staging = Path(output_dir) / f".tmp-{FINAL_DIR}-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    _fsync_tree(staging)
    if target.exists():
        shutil.rmtree(target)
    os.rename(staging, target)
    return target


def _remove_stale_temporaries(root: Path) -> None:
    for child in root.iterdir():
        if child.name.startswith(".tmp-"):
            shutil.rmtree(child, ignore_errors=True)


def _fsync_tree(directory: Path) -> None:
    """Flush file contents before the rename that publishes them, so a power loss cannot publish empty files."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
