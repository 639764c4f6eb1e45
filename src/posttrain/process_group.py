"""The process group of a data-parallel run: started from torchrun's environment, asked for rank and size.

Every helper is safe in a single process (no process group): rank 0 of a world of 1, barriers that return at
once. `init_from_env` starts the group when torchrun (or `posttrain RECIPE --nproc-per-node N`) launched this
process: gloo on CPU, NCCL on GPU, one GPU per local rank.

A module of its own, low in the layer table (torch.distributed only): the run directory's lock and the
checkpoints use it, and they sit below posttrain.distributed, whose package builds workers.
"""

from __future__ import annotations

import atexit
import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def init_from_env() -> bool:
    """Join the process group torchrun describes in the environment (WORLD_SIZE, RANK, MASTER_ADDR, ...), once.
    Returns whether this process is part of a data-parallel run."""
    if not launched_by_torchrun():
        return False
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30))
        else:
            dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
        atexit.register(_leave_process_group)
    return True


def _leave_process_group() -> None:
    """Tear the group down while the interpreter is still whole. A gloo group left to the interpreter's own
    teardown can abort the process (SIGABRT, "terminate called without an active exception") after the run has
    finished and saved: its worker threads still hold tensors when Python is already half gone."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def leave_together() -> None:
    """The end of a run every rank finished: wait until all are here (rank 0 alone writes final/, the report and the
    model card after the last collective), then leave the group at the same moment. A rank that left while rank 0
    was still writing could end the job under it, and a group torn down on one side while the other still holds
    it has aborted a finished run at exit."""
    if is_distributed():
        dist.barrier()
    _leave_process_group()


def broadcast_object(value):
    """`value` as rank 0 has it, on every rank."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(value) -> list:
    """Every rank's `value` (any picklable object), in rank order, on every rank; [value] in a single process."""
    if not is_distributed():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


@dataclass(frozen=True)
class RankFailure:
    """What a rank sends in place of its result when its own work raised (see all_gather_results)."""

    message: str


def all_gather_results(work: Callable[[], T], what: str) -> list[T]:
    """Every rank's `work()` result, in rank order, on every rank; [work()] in a single process.

    Work whose failure depends on the rank's share (its rows, its environment) can raise on one rank only. That
    rank still joins the gather, sending a RankFailure, and then raises its own error; every other rank raises
    a RuntimeError naming it ("rank 1 failed {what}: ValueError: ..."). No rank is left waiting in the collective
    for the group's timeout."""
    if not is_distributed():
        return [work()]
    try:
        result, failure = work(), None
    except Exception as error:  # re-raised below, once every rank has the news
        result, failure = None, error
    gathered = all_gather_objects(result if failure is None else RankFailure(f"{type(failure).__name__}: {failure}"))
    if failure is not None:
        raise failure
    for other, value in enumerate(gathered):
        if isinstance(value, RankFailure):
            raise RuntimeError(f"rank {other} failed {what}: {value.message}")
    return gathered


def gather_divided(num_items: int, work: Callable[[int, int], T], what: str) -> list[T]:
    """`work(start, stop)` on this rank's contiguous share [start, stop) of `num_items` (rank r of N takes
    [num_items·r/N, num_items·(r+1)/N)), and every rank's result in rank order, on every rank; [work(0, num_items)]
    in a single process. A failing rank fails every rank, naming it (all_gather_results)."""
    ranks, me = world_size(), rank()
    if ranks == 1:
        return [work(0, num_items)]
    start, stop = num_items * me // ranks, num_items * (me + 1) // ranks
    return all_gather_results(lambda: work(start, stop), what)
