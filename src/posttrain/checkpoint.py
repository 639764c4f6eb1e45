"""Atomic, resumable checkpoints (one folder per worker) and the final Hugging Face export.

Layout of one checkpoint, ``OUTPUT/checkpoints/step_N/``::

    policy/                  the policy worker: a Hugging Face model directory (loadable as is; with LoRA the
                             adapter alone), its tokenizer, optimizer.pt and scheduler.pt
    <role>/                  any other trained worker (a critic), laid out the same way
    trainer_state.json       step, data position and anything else the loop needs
    rng_state.pt             Python, NumPy and torch RNG states

    manifest.json            every other file's size and SHA-256, written last

A checkpoint is written into a hidden temporary directory beside its final place and renamed into
place only when every worker has written its part; rename is atomic, so a process killed mid-write (kill -9
included) leaves at worst a hidden ``.tmp-*`` folder, which resume ignores and the next run removes.
Resume verifies the newest checkpoint against its manifest; one that fails (a truncated or overwritten file)
is named, moved aside to ``step_N.damaged`` and passed over for the next newest that verifies, so a run
never trains on damaged state. A write that fails (disk full, read-only) removes its staging folder and
stops the run with a message naming the path. Checkpoints written before manifests (or before the
per-worker layout, the policy's files directly in ``step_N/``) still resume, unverified.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.errors import RunError
from posttrain.process_group import barrier, broadcast_object, is_main
from posttrain.rundir import (  # the run directory's manifest format; re-exported for checkpoint readers
    MANIFEST,
    check_export_dir,
    read_manifest,
    remove_dead_staging,
    sha256_all,
    write_manifest,
)

CHECKPOINT_DIR = "checkpoints"
FINAL_DIR = "final"
POLICY = "policy"
CHECKPOINT_FORMAT = 2
"""trainer_state.json's `format`: 2 for checkpoints with a manifest (one without it is then damaged)."""
DAMAGED_SUFFIX = ".damaged"
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
        if match and ((child / MANIFEST).is_file() or (child / "trainer_state.json").is_file()):
            found.append(Checkpoint(child, int(match.group(1))))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(output_dir: str | Path) -> Checkpoint | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def checkpoint_to_resume(output_dir: str | Path) -> Checkpoint | None:
    """The newest checkpoint that verifies against its manifest (None for a new run). Damaged ones on the way
    are reported, moved aside to step_N.damaged (kept for inspection, out of keep_last's rotation) and passed
    over. Every rank of a data-parallel run gets rank 0's answer. Raises RunError when checkpoints exist but
    none is intact: starting over silently would discard them."""
    chosen, problem = None, None
    if is_main():
        damaged = []
        for checkpoint in reversed(list_checkpoints(output_dir)):
            fault = verify_checkpoint(checkpoint.path)
            if fault is None:
                chosen = checkpoint.step
                break
            aside = _set_aside(checkpoint.path)
            damaged.append(f"{checkpoint.path} ({fault})")
            print(f"posttrain: checkpoint {checkpoint.path} is damaged: {fault}; moved it to {aside} and "
                  "looking for an older one", file=sys.stderr)
        if chosen is None and damaged:
            problem = (f"no intact checkpoint in {Path(output_dir) / CHECKPOINT_DIR}: {'; '.join(damaged)}. The "
                       "damaged ones were moved aside (*.damaged); run again to start from step 0, or restore a "
                       "good copy")
    chosen, problem = broadcast_object((chosen, problem))
    if problem is not None:
        raise RunError(problem)
    return None if chosen is None else Checkpoint(Path(output_dir) / CHECKPOINT_DIR / f"step_{chosen}", chosen)


def _set_aside(path: Path) -> Path:
    aside = path.with_name(path.name + DAMAGED_SUFFIX)
    number = 1
    while aside.exists():
        number += 1
        aside = path.with_name(f"{path.name}{DAMAGED_SUFFIX}{number}")
    os.rename(path, aside)
    return aside


def verify_checkpoint(directory: Path) -> str | None:
    """What is wrong with the checkpoint in `directory` (a missing, truncated or altered file), or None. One
    written before manifests is checked only for its trainer_state.json."""
    if not (directory / MANIFEST).is_file():
        try:
            written_with_manifest = json.loads((directory / "trainer_state.json").read_text()).get("format", 1) >= 2
        except (OSError, ValueError, AttributeError) as error:
            return f"{MANIFEST} missing and trainer_state.json unreadable ({error})"
        return f"{directory / MANIFEST} is missing" if written_with_manifest else None
    try:
        files = read_manifest(directory)
        for name, expected in files.items():
            path = directory / name
            if not path.is_file():
                return f"{path} is missing"
            size = path.stat().st_size
            if size != expected["size"]:
                return f"{path} has {size} bytes, {expected['size']} were written"
        paths = [directory / name for name in files]
        for path, digest in zip(paths, sha256_all(paths)):
            if digest != files[str(path.relative_to(directory))]["sha256"]:
                return f"{path} does not match the checksum written with it"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{directory} could not be checked ({type(error).__name__}: {error})"
    return None


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
    """Write checkpoint `step` atomically (every worker into its role's folder, then the RNG and trainer state,
    then the manifest), then delete all but the `keep_last` newest. A write the file system refuses removes the
    staging folder and raises RunError on every rank."""
    root = Path(output_dir) / CHECKPOINT_DIR
    # Every rank writes into the same staging folder (rank 0 names it), and only rank 0 publishes it, after
    # every rank has finished writing.
    staging = root / f".tmp-step_{step}-{broadcast_object(os.getpid())}"
    target = root / f"step_{step}"
    problem = None
    try:
        if is_main():
            root.mkdir(parents=True, exist_ok=True)
            remove_dead_staging(root)
        barrier()
        for role, worker in workers.items():
            worker.save(staging / role)
        barrier()
        if is_main():
            torch.save(capture_rng_state(), staging / "rng_state.pt")
            state = {**trainer_state, "step": step, "format": CHECKPOINT_FORMAT}
            (staging / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
            # The manifest is what marks a checkpoint complete and checkable: written last, flushed, renamed.
            write_manifest(staging)
            _fsync_tree(staging)
    except BaseException as error:  # noqa: BLE001 - classified below; anything else is re-raised unchanged
        reason = describe_write_failure(error, root)
        if reason is None:
            raise
        problem = (error, reason)
    # Rank 0's own writes fail on rank 0 alone: every rank learns of it here, so none waits in a collective.
    failed = broadcast_object(None if problem is None else problem[1])
    if failed is not None:
        if is_main():
            shutil.rmtree(staging, ignore_errors=True)
        previous = latest_checkpoint(output_dir)
        raise RunError(f"could not write checkpoint step {step} into {staging}: {failed}. The partial checkpoint "
                       f"was removed; {f'{previous.path} is intact' if previous else 'there is no earlier checkpoint'}"
                       ". Free space (or fix the permissions) and run the same command again to resume"
                       f"{f' from step {previous.step}' if previous else ''}") from (problem[0] if problem else None)
    problem = None
    if is_main():
        foreign = files_not_written_by_posttrain(target) if target.exists() else []
        if foreign:
            shutil.rmtree(staging, ignore_errors=True)
            problem = (f"not writing checkpoint step {step}: {target} holds files posttrain did not write "
                       f"({_listed(foreign)}); move them away and run the same command again to resume")
        else:
            if target.exists():  # the same step saved again (a resumed run that re-reached it): replace it
                shutil.rmtree(target)
            os.rename(staging, target)
            _fsync_dir(root)
            for old in list_checkpoints(output_dir)[:-keep_last]:
                if not files_not_written_by_posttrain(old.path):  # rotation deletes only what posttrain wrote
                    shutil.rmtree(old.path)
    problem = broadcast_object(problem)
    if problem is not None:
        raise RunError(problem)
    barrier()
    return Checkpoint(target, step)


def files_not_written_by_posttrain(directory: Path) -> list[str]:
    """Files below checkpoint folder `directory` that posttrain did not write: all of them when it has no readable
    manifest, else those its manifest does not list. Empty for an intact (or a truncated) checkpoint of posttrain's;
    a checkpoint written before manifests counts as foreign, so it is never deleted, only passed over."""
    present = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if not p.is_dir())
    try:
        listed = set(read_manifest(directory))
    except (OSError, ValueError, KeyError, TypeError):
        return present
    return [name for name in present if name != MANIFEST and name not in listed]


def check_checkpoint_folders(output_dir: str | Path) -> None:
    """Refuse (RunError, before training) when a OUTPUT/checkpoints/step_N folder holds files posttrain did not
    write: saving step N would replace the folder. Checkpoints from before manifests are left alone (resume reads
    them; rotation keeps them)."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return
    for child in sorted(root.iterdir()):
        if not (_STEP_DIR.match(child.name) and child.is_dir()):
            continue
        if not (child / MANIFEST).is_file() and (child / "trainer_state.json").is_file():
            continue  # written before manifests
        foreign = files_not_written_by_posttrain(child)
        if foreign:
            raise RunError(f"{child} holds files posttrain did not write ({_listed(foreign)}); a checkpoint of that "
                           "step would replace the folder: move them, or choose another output_dir")


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


_FILE_SYSTEM_ERRORS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
                       errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                       errno.EPERM: "permission denied"}
_OS_ERROR_TEXT = re.compile(r"os error (\d+)|\[Errno (\d+)\]")


def describe_write_failure(error: BaseException, where: Path) -> str | None:
    """Why writing below `where` failed, in words, when it is the file system's doing (disk full, quota,
    read-only, permissions); None for other errors. The writers report it in several shapes: an OSError;
    safetensors' own error type, whose text carries "os error 28"; torch.save's RuntimeError ("unexpected pos",
    "failed writing file", counted when the disk has no room left); and torch.distributed.checkpoint's
    CheckpointException, which holds each rank's error."""
    if isinstance(error, OSError) and error.errno in _FILE_SYSTEM_ERRORS:
        return f"{_FILE_SYSTEM_ERRORS[error.errno]} ({error.filename or where})"
    failures = getattr(error, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if isinstance(failures, Mapping):
        for failure in failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, BaseException):
                reason = describe_write_failure(cause, where)
                if reason is not None:
                    return reason
    if not isinstance(error, Exception) or isinstance(error, (KeyboardInterrupt, MemoryError)):
        return None
    match = _OS_ERROR_TEXT.search(str(error))
    if match and int(match.group(1) or match.group(2)) in _FILE_SYSTEM_ERRORS:
        return f"{_FILE_SYSTEM_ERRORS[int(match.group(1) or match.group(2))]} ({where}: {error})"
    if isinstance(error, RuntimeError) or type(error).__name__ == "SafetensorError":
        if _nearly_full(where):
            return f"no space left on the device ({error})"
    return None


def _nearly_full(where: Path) -> bool:
    existing = next((p for p in [where, *where.parents] if p.exists()), Path("/"))
    return shutil.disk_usage(existing).free < 1 << 20


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


def check_finite_weights(model: torch.nn.Module, where: Path) -> None:
    """Raise RunError, naming the first offending tensor, when `model` holds a NaN or infinite weight."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise RunError(f"not writing {where}: the weight {name} holds NaN or infinite values (the training "
                           "diverged; lower trainer.learning_rate or check the data)")


def export_final(output_dir: str | Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Path:
    """Write OUTPUT/final/ (a Hugging Face model directory with a manifest) atomically, replacing an older
    export; never from non-finite weights, and never over a final/ holding the user's own files."""
    target = Path(output_dir) / FINAL_DIR
    staging = Path(output_dir) / f".tmp-{FINAL_DIR}-{os.getpid()}"
    check_finite_weights(model, target)
    check_export_dir(target)
    if staging.exists():
        shutil.rmtree(staging)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        write_manifest(staging)
        _fsync_tree(staging)
    except BaseException as error:  # noqa: BLE001 - classified below; anything else is re-raised unchanged
        reason = describe_write_failure(error, staging)
        shutil.rmtree(staging, ignore_errors=True)
        if reason is None:
            raise
        raise RunError(f"could not write {target}: {reason}. The partial export was removed; the last checkpoint "
                       "is intact: free space and run the same command again to export from it") from error
    if target.exists():
        shutil.rmtree(target)
    os.rename(staging, target)
    return target


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
