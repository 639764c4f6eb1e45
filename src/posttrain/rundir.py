"""One run per output directory: its ownership, the lock, the cleanup of dead runs' leftovers, and the guard on `final/`.

- A run writes only into a folder that is posttrain's: a new or empty one (which it marks with `.posttrain-run`),
  or one already marked (or, from before the marker, holding posttrain's run_info.json or checkpoints). A folder
  with anyone else's files is refused before anything is written, naming them, unless overwrite_output_dir.

- `OUTPUT/.lock` is held (``flock``) for the whole run by its process (rank 0 of a data-parallel run). The
  kernel releases it on any exit, kill -9 included, so a lock whose holder died is free: the next run takes it
  over and says whose it was. A second run on a directory in use fails at once, naming the holder's PID, and
  touches nothing.
- Staging folders (``.tmp-<what>-<pid>``) are removed only when they are this process's own or their PID is
  not running: never another live run's.
- Every export and checkpoint folder carries a manifest (`write_manifest`): its files' sizes and SHA-256.
- `final/` is replaced only when it holds what an export writes (its manifest's files, or for one written
  before manifests, the files a Hugging Face model directory holds); a user's own files there stop the run
  before it starts.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from posttrain.errors import RunError
from posttrain.preemption import preemption_handlers
from posttrain.process_group import broadcast_object, init_from_env, is_main

MANIFEST = "manifest.json"
"""Every export and checkpoint folder holds DIRECTORY/manifest.json: the size and SHA-256 of its other files."""

LOCK_FILE = ".lock"
RUN_MARKER = ".posttrain-run"
"""Written into every run directory posttrain creates (or adopts): what makes a folder one posttrain may write."""
_STAGING = re.compile(r"^\.tmp-.+-(\d+)$")
_EXPORT_FILES = re.compile(
    r"^(config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json"
    r"|pytorch_model.*\.bin(\.index\.json)?|tokenizer(_config)?\.json|[\w.-]*\.model|[\w.-]*\.tiktoken"
    r"|special_tokens_map\.json|added_tokens\.json|preprocessor_config\.json|processor_config\.json"
    r"|vocab\.(json|txt)|merges\.txt|chat_template\.(jinja|json)|adapter_config\.json"
    r"|adapter_model\.(safetensors|bin)|README\.md|manifest\.json|\.gitattributes|\.cache/.*)$"
)
"""What save_pretrained of a model, an adapter, a tokenizer or a processor writes, and what a hub upload
leaves beside it (an export from before manifests)."""

R = TypeVar("R")


def one_run_per_output_dir(train: Callable[..., R]) -> Callable[..., R]:
    """Decorate a recipe's entry point `train(cfg, ...)`: it runs holding the lock on cfg.output_dir, with SIGTERM
    and SIGUSR1 ending it at a step boundary (posttrain.preemption)."""

    @functools.wraps(train)
    def run(cfg, *args, **kwargs) -> R:
        init_from_env()  # the lock is rank 0's, and every rank must learn whether it got it
        with output_dir_lock(cfg.output_dir, cfg.overwrite_output_dir), preemption_handlers():
            return train(cfg, *args, **kwargs)

    return run


@contextmanager
def output_dir_lock(output_dir: str | Path, overwrite: bool = False) -> Iterator[None]:
    """Hold OUTPUT/.lock for the block (rank 0 of a data-parallel run; every rank raises if it is taken). First
    the directory is claimed (claim_output_dir): one holding files posttrain did not write is refused unless
    `overwrite`."""
    out = Path(output_dir)
    handle, problem = None, None
    if is_main():
        try:
            claim_output_dir(out, overwrite)
            handle = _acquire(out)
        except RunError as error:
            problem = str(error)
    problem = broadcast_object(problem)
    if problem is not None:
        raise RunError(problem)
    try:
        yield
    finally:
        if handle is not None:
            handle.truncate(0)  # an empty lock file tells the next run nobody died holding it
            handle.close()  # closing releases the flock


def claim_output_dir(out: Path, overwrite: bool = False) -> None:
    """Make `out` a run directory of posttrain's, or refuse it before anything in it is written.

    A directory holding RUN_MARKER is posttrain's (a run made it). A missing or empty one is created and marked. So
    is one from before the marker existed that shows posttrain's own bookkeeping (run_info.json or a checkpoint's
    trainer_state.json). Any other directory with files in it is someone's: config.yaml, metrics.jsonl, report.html,
    the plot and checkpoints/ of a run would replace or delete theirs, so it is refused (RunError naming up to five
    of its files) unless `overwrite` (the config's overwrite_output_dir) says to write into it anyway.
    """
    if str(out).strip() in ("", "."):
        raise RunError(f"output_dir {str(out)!r} would write the run into the current directory; give it a folder")
    if (out / RUN_MARKER).is_file():
        return
    if out.exists() and not out.is_dir():
        raise RunError(f"output_dir {out} is a file, not a folder; choose another output_dir")
    if out.is_dir() and not overwrite and not _earlier_run(out):
        found = sorted(str(p.relative_to(out)) for p in out.rglob("*") if not p.is_dir())
        if found:
            shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
            raise RunError(f"output_dir {out} already holds files posttrain did not write ({shown}); a run there "
                           "writes config.yaml, metrics.jsonl, report.html, training_curves.png, checkpoints/ and "
                           "final/ and could replace them. Choose another (new or empty) output_dir, or set "
                           "overwrite_output_dir=true to write into this one anyway")
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_MARKER).write_text("This folder is a posttrain run directory.\n"
                                  "Checkpoint rotation deletes only the checkpoints posttrain wrote here.\n")


def _earlier_run(out: Path) -> bool:
    """A run directory written before RUN_MARKER existed: posttrain's run_info.json or a checkpoint of its own."""
    return (out / "run_info.json").is_file() or any((out / "checkpoints").glob("step_*/trainer_state.json"))


def _acquire(out: Path):
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RunError(f"{out} is in use by another run (PID {holder}, lock {path}); wait for it to finish, stop "
                       "it, or choose another output_dir") from None
    handle.seek(0)
    previous = handle.read().strip()
    if previous and previous != str(os.getpid()):
        # The lock was free, so its last holder exited without releasing it in the usual way (it was killed).
        print(f"posttrain: {path}: taking over the lock of PID {previous}, which is no longer running")
    handle.seek(0)
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def remove_dead_staging(folder: Path) -> list[Path]:
    """Remove `.tmp-*-<pid>` folders (staged checkpoints) and files (a report or run_info.json being written) of
    `folder` whose PID is this process or no longer runs; return them."""
    removed = []
    if not folder.is_dir():
        return removed
    for child in folder.iterdir():
        match = _STAGING.match(child.name)
        if match and (int(match.group(1)) == os.getpid() or not _running(int(match.group(1)))):
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
            removed.append(child)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def foreign_files(export_dir: Path) -> list[str]:
    """Files in `export_dir` that no export wrote (empty when it is absent or holds only an export)."""
    if not export_dir.is_dir():
        return []
    present = sorted(str(p.relative_to(export_dir)) for p in export_dir.rglob("*") if p.is_file())
    manifest = read_manifest(export_dir) if (export_dir / MANIFEST).is_file() else None
    if manifest is not None:
        return [name for name in present if name != MANIFEST and name not in manifest]
    return [name for name in present if not _EXPORT_FILES.match(name)]


def check_export_dir(export_dir: Path) -> None:
    """Refuse to replace `export_dir` (OUTPUT/final or OUTPUT/adapter) when it holds files no export wrote."""
    extra = foreign_files(export_dir)
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise RunError(f"{export_dir} holds files this run did not write ({shown}); the export would replace the "
                       "folder: move them, or choose another output_dir")


def write_manifest(directory: Path) -> None:
    """DIRECTORY/manifest.json: the size and SHA-256 of every other file below `directory`."""
    paths = [p for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST]
    files = {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": digest}
             for p, digest in zip(paths, sha256_all(paths))}
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n")


def add_to_manifest(directory: Path, names: list[str]) -> None:
    """List the files `names` (written into `directory` after its manifest, such as a model card) in
    DIRECTORY/manifest.json, hashing only them."""
    files = read_manifest(directory)
    paths = [directory / name for name in names]
    for name, path, digest in zip(names, paths, sha256_all(paths)):
        files[name] = {"size": path.stat().st_size, "sha256": digest}
    (directory / MANIFEST).write_text(json.dumps({"files": dict(sorted(files.items()))}, indent=1) + "\n")


def read_manifest(directory: Path) -> dict[str, dict[str, Any]]:
    return json.loads((directory / MANIFEST).read_text())["files"]


def sha256_all(paths: list[Path]) -> list[str]:
    """SHA-256 of each file, several at a time (hashlib releases the GIL on large blocks): a sharded checkpoint
    is many files, and rank 0 hashes all of them."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(paths)))) as pool:
        return list(pool.map(_sha256, paths))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
