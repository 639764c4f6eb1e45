"""Weight sync by collective broadcast (weight_sync.method=broadcast, docs/ray.md): the holder of the full weights
(the policy group's rank 0, or the driver when the policy trains there) and every generation actor form a process
group of their own, and the holder broadcasts the weights bucket by bucket straight into the actors' models.

    plan = bucket_plan(weight_specs(weights), bucket_bytes)   # the same list on every member
    group = SyncGroup(address, port, rank, world_size, backend, timeout_s)   # every member at once
    sender = WeightSender(weights, bucket_bytes); sender.send(group, index)  # rank 0, one call per bucket
    loader = WeightLoader(model, bucket_bytes); loader.receive(group, index, timeout_s)  # ranks 1.., into the model

- **The plan.** Every member computes it from its own tensors: names sorted within each dtype, dtypes in sorted
  order, consecutive tensors of one dtype flattened into buckets of about `weight_sync.bucket_mb` (a larger tensor
  is a bucket of its own). The driver compares each member's digest of its plan before the first bucket, so a
  holder and a generator that disagree on a name, a shape or a dtype stop the sync naming the first difference,
  and no member ever waits in a collective the others skip (TRL #6797: ranks that disagree on bucket order hang).
- **Bytes, not dtypes, travel.** A bucket is the bytes of its tensors in a uint8 buffer (gloo has no bfloat16
  reduction and a broadcast needs none); it holds one dtype, so each tensor's bytes start at a multiple of its
  element size and are read back as a view without a copy, then copied into the model's parameter.
- **A process group of its own**, made with `ProcessGroupGloo` / `ProcessGroupNCCL` over a `TCPStore` at the
  holder's address, not `init_process_group`: the policy's rank 0 already belongs to the FSDP2 group, and a process
  has one default group. Its timeout is cluster.timeout_s: a member that stops answering makes the others' call
  fail past it (the driver names the member and the bucket from the calls it waits for, within the same deadline).
- NCCL is chosen only when every member offers a CUDA device and no two members share one (`choose_backend`: NCCL
  refuses two ranks on one GPU, which is what a policy in the driver and a generation actor on the same single GPU
  would be). Otherwise gloo, from host memory: a member whose weights are on a GPU copies each bucket to the host
  and back. The holder offers its device when its weights are CUDA tensors, a generation actor when its copy is
  on the GPU Ray granted it; the NCCL path is written but not run on hardware yet (HV-12, HV-13).
"""

from __future__ import annotations

import datetime
import hashlib
import math
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import ray
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Bucket:
    """One broadcast: tensors of one dtype, flattened in this order into one uint8 buffer."""

    dtype: str
    """The tensors' dtype, e.g. float32."""
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    """(name, shape) of each tensor, names sorted."""
    nbytes: int
    """The buffer's size."""

    def describe(self, index: int, count: int) -> str:
        return f"bucket {index} of {count} ({self.nbytes / 2**20:.2f} MiB of {self.dtype}, {len(self.tensors)} tensors)"


def weight_specs(weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of each tensor: what the plan is computed from."""
    return [(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)) for name, tensor in weights]


def bucket_plan(specs: Iterable[tuple[str, str, tuple[int, ...]]], bucket_bytes: int) -> list[Bucket]:
    """The fixed plan of the module docstring from (name, dtype, shape) triples, whatever their order."""
    by_dtype: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, dtype, shape in specs:
        by_dtype.setdefault(dtype, []).append((name, tuple(shape)))
    plan = []
    for dtype in sorted(by_dtype):
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        tensors: list[tuple[str, tuple[int, ...]]] = []
        size = 0
        for name, shape in sorted(by_dtype[dtype]):
            tensors.append((name, shape))
            size += itemsize * math.prod(shape)
            if size >= bucket_bytes:
                plan.append(Bucket(dtype, tuple(tensors), size))
                tensors, size = [], 0
        if tensors:
            plan.append(Bucket(dtype, tuple(tensors), size))
    return plan


def plan_digest(plan: list[Bucket]) -> str:
    """SHA-256 of the plan: equal digests, the same broadcasts in the same order."""
    return hashlib.sha256(repr([(b.dtype, b.tensors, b.nbytes) for b in plan]).encode()).hexdigest()


def first_difference(ours: list[tuple[str, str, tuple[int, ...]]],
                     theirs: list[tuple[str, str, tuple[int, ...]]]) -> str:
    """The first tensor (by name) whose dtype or shape differs between two spec lists, or that only one has."""
    a = {name: (dtype, shape) for name, dtype, shape in ours}
    b = {name: (dtype, shape) for name, dtype, shape in theirs}
    for name in sorted(a.keys() | b.keys()):
        if a.get(name) != b.get(name):
            return f"{name}: {_spec(a.get(name))} on the holder, {_spec(b.get(name))} on the generator"
    return "the same tensors, another bucket size"


def _spec(spec: tuple[str, tuple[int, ...]] | None) -> str:
    return "absent" if spec is None else f"{spec[0]} {list(spec[1])}"


def free_port() -> tuple[str, int]:
    """(this node's address as others reach it, a port free on it now)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return ray.util.get_node_ip_address(), port


class SyncGroup:
    """One member's end of the weight-sync process group (rank 0: the holder, which also hosts the store). Made by
    every member at once: the constructor returns when all have connected, or raises past `timeout_s`."""

    def __init__(self, address: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(address, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
        prefixed = dist.PrefixStore("posttrain-weight-sync", self.store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.process_group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.process_group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            self.device = torch.device("cpu")
        self.rank, self.world_size, self.backend = rank, world_size, backend

    def broadcast(self, buffer: torch.Tensor):
        """Start broadcasting `buffer` from rank 0 into every member's `buffer`; the work to `wait` on."""
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        return self.process_group.broadcast([buffer], options)


def local_backend() -> str:
    """What this member can offer the group: its current CUDA device (`backend_offer`) when it has one, gloo
    without."""
    return backend_offer(torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None)


def backend_offer(device: torch.device | None) -> str:
    """What a member whose weights live on `device` offers the group: "nccl:<the GPU's UUID>" for a CUDA device (the
    UUID tells two processes on one GPU apart from two GPUs, whatever each process's device numbering), "gloo" for
    the CPU or None."""
    if device is None or device.type != "cuda":
        return "gloo"
    return f"nccl:{torch.cuda.get_device_properties(device).uuid}"


def choose_backend(offers: dict[str, str]) -> tuple[str, str | None]:
    """(the group's backend, why NCCL was not chosen or None) from each member's offer (`backend_offer`, by the
    member's name): nccl when every member offers a GPU and no two offer the same one; gloo otherwise."""
    gpus = {name: offer.removeprefix("nccl:") for name, offer in offers.items() if offer.startswith("nccl:")}
    if not gpus:
        return "gloo", None
    if len(gpus) < len(offers):
        on_cpu = ", ".join(sorted(offers.keys() - gpus.keys()))
        return "gloo", f"{on_cpu} has no CUDA device (its weights are on the CPU)"
    by_gpu: dict[str, list[str]] = {}
    for name, gpu in gpus.items():
        by_gpu.setdefault(gpu, []).append(name)
    for gpu, names in by_gpu.items():
        if len(names) > 1:
            return "gloo", (f"{' and '.join(sorted(names))} share one GPU ({gpu}), and NCCL refuses two ranks on one "
                            "device")
    return "nccl", None


class WeightSender:
    """The holder's side: the full weights by name, the plan, and one bucket's broadcast at a time."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int):
        self.weights = {name: tensor.detach() for name, tensor in weights}
        self.specs = weight_specs(self.weights.items())
        self.plan = bucket_plan(self.specs, bucket_bytes)
        devices = {tensor.device for tensor in self.weights.values()}
        self.device = devices.pop() if len(devices) == 1 else None
        """Where every weight is (what the holder offers the group: `backend_offer`), or None when they are spread."""

    def send(self, group: SyncGroup, index: int):
        """Start broadcasting bucket `index` (its tensors' bytes, concatenated); the work to `wait` on."""
        bucket = self.plan[index]
        buffer = torch.cat([self.weights[name].contiguous().reshape(-1).view(torch.uint8).to(group.device)
                            for name, _ in bucket.tensors])
        return group.broadcast(buffer)

    def bytes_total(self) -> int:
        return sum(bucket.nbytes for bucket in self.plan)


class WeightLoader:
    """A generator's side: its model's weights by name, the plan computed from them, and each received bucket copied
    into the model."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int):
        self.state = model.state_dict()
        self.specs = weight_specs(self.state.items())
        self.plan = bucket_plan(self.specs, bucket_bytes)

    def receive(self, group: SyncGroup, index: int, timeout_s: float) -> list[str]:
        """Receive bucket `index` and copy each tensor into the model; the names loaded."""
        bucket = self.plan[index]
        received = receive_bucket(group, bucket, timeout_s, self.state[bucket.tensors[0][0]].device)
        with torch.no_grad():
            for name, tensor in received:
                self.state[name].copy_(tensor)
        return [name for name, _ in received]


def receive_bucket(group: SyncGroup, bucket: Bucket, timeout_s: float, device: torch.device
                   ) -> list[tuple[str, torch.Tensor]]:
    """Receive `bucket` by broadcast (waiting at most `timeout_s`); (name, tensor) of each of its tensors, views of the
    received bytes on `device` (a generator that loads them elsewhere, a vLLM engine, reads them from there)."""
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
    group.broadcast(buffer).wait(datetime.timedelta(seconds=timeout_s))
    buffer = buffer.to(device)
    dtype = getattr(torch, bucket.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    received, offset = [], 0
    for name, shape in bucket.tensors:
        nbytes = itemsize * math.prod(shape)
        received.append((name, buffer[offset:offset + nbytes].view(dtype).view(shape)))
        offset += nbytes
    return received
