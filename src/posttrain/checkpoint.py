"""Atomic, resumable checkpoints (one folder per worker) and the final Hugging Face export.

Layout of one checkpoint, ``OUTPUT/checkpoints/step_N/``::

    policy/                  the policy worker: a Hugging Face model directory (loadable as is; with LoRA the
                             adapter alone), its tokenizer, optimizer.pt and scheduler.pt
    <role>/                  any other trained worker (a critic), laid out the same way
    trainer_state.json       step, data position and anything else the loop needs
    rng_state.pt             Python, NumPy and torch RNG states

A checkpoint is written into a hidden temporary directory beside its final place and renamed into
place only when every worker has written its part; rename is atomic, so a process killed mid-write (kill -9
included) leaves at worst a hidden ``.tmp-*`` folder, which resume ignores and the next save removes.
Checkpoints written before the per-worker layout (the policy's files directly in ``step_N/``) still resume.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

CHECKPOINT_DIR = "checkpoints"
FINAL_DIR = "final"
POLICY = "policy"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int

    @property
    def trainer_state(self) -> dict[str, Any]:
        return json.loads((self.path / "trainer_state.json").read_text())

    def worker_dir(self, role: str) -> Path:
        """The folder holding worker `role`'s state (a pre-per-worker checkpoint keeps the policy at its root)."""
        folder = self.path / role
        if not folder.is_dir() and role == POLICY and (self.path / "config.json").is_file():
            return self.path
        return folder


class SavesState(Protocol):
    """What a checkpoint asks of each worker: write its whole training state into a folder."""

    def save(self, directory: Path) -> None: ...


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
    workers: Mapping[str, SavesState],
    trainer_state: dict[str, Any],
    keep_last: int,
) -> Checkpoint:
    """Write checkpoint `step` atomically (every worker into its role's folder, then the RNG and trainer state),
    then delete all but the `keep_last` newest."""
    from posttrain.distributed.env import barrier, broadcast_object, is_main

    root = Path(output_dir) / CHECKPOINT_DIR
    # Every rank writes into the same staging folder (rank 0 names it), and only rank 0 publishes it, after
    # every rank has finished writing.
    staging = root / f".tmp-step_{step}-{broadcast_object(os.getpid())}"
    if is_main():
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(root)
    barrier()
    for role, worker in workers.items():
        worker.save(staging / role)
    barrier()
    target = root / f"step_{step}"
    if is_main():
        torch.save(capture_rng_state(), staging / "rng_state.pt")
        # trainer_state.json is what marks a checkpoint complete for list_checkpoints: written last.
        (staging / "trainer_state.json").write_text(json.dumps({**trainer_state, "step": step}, indent=2) + "\n")
        _fsync_tree(staging)
        if target.exists():  # the same step saved again (a resumed run that re-reached it): replace it
            shutil.rmtree(target)
        os.rename(staging, target)
        _fsync_dir(root)
        for old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old.path)
    barrier()
    return Checkpoint(target, step)


def save_model_state(directory: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None,
                     optimizer: torch.optim.Optimizer | None, scheduler: torch.optim.lr_scheduler.LRScheduler | None,
                     ) -> None:
    """One worker's part of a checkpoint: the model (a Hugging Face directory, or a peft adapter), its tokenizer,
    and the optimizer and schedule states."""
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), directory / "optimizer.pt")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), directory / "scheduler.pt")


def load_optimizer_state(directory: Path, optimizer: torch.optim.Optimizer,
                         scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))


SHARDED_MARKER = ".metadata"
"""The file torch.distributed.checkpoint writes into a sharded checkpoint folder."""


def is_sharded(directory: Path) -> bool:
    """Whether `directory` holds a sharded (torch.distributed.checkpoint) worker state."""
    return (Path(directory) / SHARDED_MARKER).is_file()


def save_sharded_state(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model and optimizer through torch.distributed.checkpoint: every rank writes its shards (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory))


def load_sharded_state(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what `save_sharded_state` wrote into `model` and `optimizer` as they are sharded now: on any number
    of ranks, a single process included (the shards are re-split to fit)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def restore_trainer_state(checkpoint: Checkpoint) -> dict[str, Any]:
    """Restore the RNG states saved with `checkpoint`; return its trainer_state.json. (Workers load their own.)"""
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
