"""The policy (and PPO's critic) as a Ray worker group: one actor per FSDP2 rank, the ranks forming one
torch.distributed group, behind the same `PolicyWorker` and `CriticWorker` protocols the recipe loops already speak
(docs/ray.md, "The policy group").

    policy = cluster.policy(model, lora, trainer, tokenizer, schedule=..., resume_dir=...)   # a RayPolicyWorker
    critic = cluster.critic(init_from, model, trainer, tokenizer, ...)   # PPO: on the same actors, a RayCriticWorker
    reference = cluster.scorer(model, trainer, role="reference")        # a RayScoringWorker on the same actors
    policy.forward_backward(batch, loss)   # every rank gets the whole minibatch and takes its share, as under torchrun

How it is built, and where it departs from the full design:
- `cluster.policy_workers` actors, one per rank, placed by a Ray placement group of one bundle per rank
  (`cluster.cpus_per_policy_worker` CPUs and `cluster.gpus_per_policy_worker` GPUs each, packed; `place_actors`,
  which places the other worker groups too, from `group_resources`). Rank 0 picks a free
  port on its node; every rank joins the group there (gloo on CPU, NCCL on GPU) with cluster.timeout_s as the
  deadline of every collective.
- Each actor builds its worker with the builders a torchrun rank uses (distributed/builders.py): an FSDP2 worker
  sharded over the group, restored from the run's checkpoint when resuming. The critic, the reference and a
  transformers teacher live on the same actors, in the same process group, as they do on torchrun's ranks (a LoRA
  policy's reference is its own shards with the adapters off), unless cluster.reference_workers (teacher_workers)
  gives them a group of their own (RayScoringGroup, distributed/ray_groups.py).
- The driver's proxy sends every protocol call to every rank with the whole minibatch (each FSDP2 rank takes every
  N-th micro-batch itself) and returns rank 0's answer; the workers reduce metrics over ranks themselves. The
  driver's random stream continues where a rank's stops after building, so a run draws what one process draws.
- Weights reach the generation actors gathered: every rank gathers the full weights (FSDP2's full state dict, a
  collective), rank 0 keeps them and hands them to the driver in pieces of about weight_sync.bucket_mb, which feed
  the generators' bucketed path (`RayGenerator.update_weights`); with weight_sync.method=broadcast rank 0 keeps them
  and broadcasts them to the generation actors itself over a process group of their own (`gather_for_broadcast`,
  `broadcast_bucket`; distributed/weight_broadcast.py).
- cluster.colocated=true: no generation actors; each rank loads a transformers generator on its own device and
  samples its block of a round's prompts (`RankGenerator`); a weight push makes every rank gather the full weights
  and copy them into its generator in its own process (`sync_generator`).
- Checkpoints: every rank writes its shards into the checkpoint's staging folder (torch.distributed.checkpoint), as
  torchrun's ranks do; the folder must be one file system for the driver and every actor (one machine, or a shared
  volume).
- Every call waits at most cluster.timeout_s for all ranks. A rank that dies cannot be replaced inside a live
  torch.distributed group: the run stops with a RunError naming the rank and the call, and re-running the same
  command resumes from the newest checkpoint.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from posttrain.checkpoint import capture_rng_state, restore_rng_state
from posttrain.config.schema import ClusterSection, LoraSection, ModelConfig, TrainerConfig
from posttrain.data.types import RolloutBatch
from posttrain.distributed import builders
from posttrain.distributed.weight_broadcast import SyncGroup, WeightSender, free_port, local_backend, plan_digest
from posttrain.distributed.weight_check import InProcessCopy
from posttrain.errors import RunError
from posttrain.generation.base import GenerationOutput, SamplingParams
from posttrain.models.loading import default_device
from posttrain.workers.base import AnyBatch, Exported, TrainBatch, WeightReceiver
from posttrain.workers.metrics import MetricDict
from posttrain.workers.objectives import Objective
from posttrain.workers.value import CRITIC

GROUP = "policy"
"""The worker group's name in messages and metrics (heartbeat/policy_seconds)."""

FAILURE_GRACE_S = 10.0
"""After one rank fails, how long the driver still waits for the others' answers: a rank blocked in a collective
with a dead peer fails soon after, and the account then names the rank that died rather than one that waited."""


@ray.remote
class TrainerRankActor:
    """One rank of the policy group: its worker(s) by role, built in this process, sharded over the group."""

    def __init__(self, rank: int, world_size: int, num_threads: int):
        self.rank, self.world_size = rank, world_size
        # The driver's thread count, and deterministic kernels where torch has them (configure_torch's settings).
        torch.set_num_threads(num_threads)
        torch.use_deterministic_algorithms(True, warn_only=True)
        self.workers: dict[str, Any] = {}
        self._gathered: dict[str, torch.Tensor] = {}
        self._sender: WeightSender | None = None
        self._sync: SyncGroup | None = None
        self._sync_timeout_s = 0.0
        self.generator: InProcessCopy | None = None
        """cluster.colocated: this rank's generator (`start_generator`)."""

    def ready(self) -> bool:
        return True

    def rendezvous(self) -> tuple[str, int]:
        """(address, port) where the group meets: this node's address and a port free on it now (rank 0)."""
        return free_port()

    def join(self, address: str, port: int, timeout_s: float) -> str:
        """Join the group's torch.distributed process group (every rank at once); the backend used."""
        if torch.cuda.is_available():  # Ray shows the actor only the GPUs of its bundle
            torch.cuda.set_device(0)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=datetime.timedelta(seconds=timeout_s))
        return backend

    def build(self, role: str, build: str, args: tuple, kwargs: dict, rng_state: dict) -> dict:
        """Build worker `role` with builders.`build` (every rank at once: FSDP2 sharding is collective), starting
        from the driver's random state; the random state after it (what the driver continues from)."""
        restore_rng_state(rng_state)
        self.workers[role] = getattr(builders, build)(*args, device=default_device(), **kwargs)
        return capture_rng_state()

    def call(self, role: str, method: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        return getattr(self.workers[role], method)(*args, **(kwargs or {}))

    def attribute(self, role: str, name: str) -> Any:
        return getattr(self.workers[role], name)

    def derive(self, role: str, method: str, args: tuple, new_role: str) -> bool:
        """Keep worker `role`.`method`(*args) as worker `new_role` (a LoRA policy's base-model scorer); whether
        there was one (the method may answer None)."""
        derived = getattr(self.workers[role], method)(*args)
        if derived is not None:
            self.workers[new_role] = derived
        return derived is not None

    def gather_weights(self, role: str, adapters_only: bool) -> list[tuple[str, int]]:
        """Gather the full weights (collective); rank 0 keeps them for `weight_piece` and lists (name, bytes) in
        the worker's order, the other ranks drop theirs and list nothing."""
        weights = self.workers[role].named_weights(adapters_only)
        if self.rank != 0:
            for _ in weights:  # every rank takes part in the gather; only rank 0 keeps what it yields
                pass
            return []
        self._gathered = {name: tensor.detach().cpu() for name, tensor in weights}
        return [(name, tensor.numel() * tensor.element_size()) for name, tensor in self._gathered.items()]

    def weight_piece(self, names: list[str]) -> list[tuple[str, torch.Tensor]]:
        """Gathered tensors `names`, handed over once (rank 0 drops each as it goes)."""
        return [(name, self._gathered.pop(name)) for name in names]

    # ---- cluster.colocated: a generator on each rank, on the rank's device, filled in this process ----

    def start_generator(self, role: str, model: ModelConfig, tokenizer, batch_size: int, seed: int) -> int:
        """Load a transformers generator of `model` on this rank's device, then fill it with worker `role`'s current
        weights (`sync_generator`, collective); the bytes copied."""
        self.generator = InProcessCopy(model, tokenizer, batch_size, seed, default_device())
        self.generator.generator.model.requires_grad_(False)
        return self.sync_generator(role)

    def sync_generator(self, role: str) -> int:
        """Every rank gathers worker `role`'s full weights (collective) and copies them into its own generator,
        stamped with the worker's version: no byte leaves the process. The bytes copied."""
        worker = self.workers[role]
        return self.generator.update_weights(worker.version, worker.named_weights())

    def generate(self, prompts: list[list[int]], params: SamplingParams, num_samples: int) -> GenerationOutput:
        output = self.generator.generate(prompts, params, num_samples)
        output.extra["weights_version"] = self.generator.weights_version
        return output

    def generator_version(self) -> int:
        return self.generator.weights_version

    def generator_device(self) -> str:
        return str(self.generator.generator.device)

    def generator_digests(self) -> dict[str, str]:
        return self.generator.weight_digests()[0]

    def generator_logprobs(self, batch: RolloutBatch, trainer: TrainerConfig, temperature: float) -> torch.Tensor:
        return self.generator.logprobs(batch, trainer, temperature)

    # ---- weight_sync.method=broadcast: rank 0 holds the gathered weights and broadcasts them ----

    def gather_for_broadcast(self, role: str, adapters_only: bool, bucket_bytes: int
                             ) -> tuple[str, str, list[tuple[str, str, tuple[int, ...]]]] | None:
        """Gather the full weights (collective); rank 0 keeps them with their bucket plan and answers (its digest,
        the backend it offers, the (name, dtype, shape) list), the other ranks drop theirs and answer None."""
        weights = self.workers[role].named_weights(adapters_only)
        if self.rank != 0:
            for _ in weights:  # every rank takes part in the gather
                pass
            return None
        on_cpu = local_backend() == "gloo"  # gloo sends from host memory; NCCL from the device
        self._sender = WeightSender(((name, tensor.cpu() if on_cpu else tensor) for name, tensor in weights),
                                    bucket_bytes)
        return plan_digest(self._sender.plan), local_backend(), self._sender.specs

    def weight_sync_address(self) -> tuple[str, int]:
        return free_port()

    def join_weight_sync(self, address: str, port: int, world_size: int, backend: str, timeout_s: float) -> bool:
        """Join (as its rank 0, hosting the store) the weight-sync group of the generation actors."""
        self._sync = None
        self._sync = SyncGroup(address, port, 0, world_size, backend, timeout_s)
        self._sync_timeout_s = timeout_s
        return True

    def broadcast_bucket(self, index: int) -> int:
        """Broadcast bucket `index` of the plan to the generation actors; its bytes. The last one drops the
        gathered weights."""
        self._sender.send(self._sync, index).wait(datetime.timedelta(seconds=self._sync_timeout_s))
        nbytes = self._sender.plan[index].nbytes
        if index == len(self._sender.plan) - 1:
            self._sender = None
        return nbytes


def one_line(error: Exception) -> str:
    """A multi-line error (Ray's account of a dead actor, a remote traceback) on one line."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


class RankGroup:
    """The policy group's actors: their placement, the rendezvous, and every call sent to all ranks within one
    cluster.timeout_s deadline (see the module docstring). Shaped like the other worker groups for the cluster's
    metrics and close (name, restarts, retried_samples, seconds_since_progress, kill)."""

    def __init__(self, actors: list[Any], timeout_s: float, placement: Any | None = None):
        """actors: rank i's actor at index i (`start_rank_group` makes them); placement: their placement group,
        removed with them."""
        self.name, self.actors, self.timeout_s, self.placement = GROUP, actors, timeout_s, placement
        self.size = len(actors)
        self.restarts = self.retried_samples = self.masked_samples = 0  # a rank is never replaced (module docstring)
        self.failed = False
        self.roles: set[str] = set()
        self.last_progress = time.monotonic()
        self.backend: str | None = None

    def connect(self) -> None:
        """Wait for every actor to start, then form the process group at rank 0's address (cluster.timeout_s each)."""
        self.each("ready", "the actor to start")
        address, port = self.one("rendezvous", "the rank-0 actor's address and a free port")
        self.backend = self.each("join", f"every rank to join the process group at {address}:{port}",
                                 address, port, self.timeout_s)[0]

    def worker_name(self, rank: int) -> str:
        return f"policy worker {rank} of {self.size} (rank {rank})"

    def one(self, method: str, waiting_for: str, *args: Any) -> Any:
        """Rank 0's answer to a call sent to it alone (no collective)."""
        return self.collect({getattr(self.actors[0], method).remote(*args): 0}, method, waiting_for)[0]

    def each(self, method: str, waiting_for: str, *args: Any, named: str | None = None) -> list[Any]:
        """Every rank's answer, in rank order, to the same call sent to all; `named`: the call as messages name it
        (the worker's method, for `call`)."""
        refs = {getattr(actor, method).remote(*args): rank for rank, actor in enumerate(self.actors)}
        return self.collect(refs, named or method, waiting_for)

    def collect(self, refs: dict[Any, int], method: str, waiting_for: str) -> list[Any]:
        """The answers of `refs` by rank. RunError naming a rank that died, ran past the deadline, or (re-raised
        with the rank named) the error a rank's call raised."""
        if self.failed:
            raise RunError(f"the policy group stopped after an earlier failure; `{method}` was not sent")
        deadline = time.monotonic() + self.timeout_s
        results: dict[int, Any] = {}
        failures: dict[int, Exception] = {}
        pending = dict(refs)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                break
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except (RayActorError, RayTaskError) as error:
                if not failures:  # the others get a short grace (FAILURE_GRACE_S), not the whole deadline
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                failures[rank] = error
        if failures or pending:
            self.failed = True
            raise self._failure(failures, sorted(pending.values()), method, waiting_for)
        self.last_progress = time.monotonic()
        return [results[rank] for rank in sorted(results)]

    def _failure(self, failures: dict[int, Exception], silent: list[int], method: str,
                 waiting_for: str) -> Exception:
        resume = "the run stops here: re-run the same command to resume from the newest checkpoint"
        dead = sorted(rank for rank, error in failures.items() if isinstance(error, RayActorError))
        if dead:
            rank = dead[0]
            return RunError(f"{self.worker_name(rank)} died during `{method}` (waiting for {waiting_for}): "
                            f"{one_line(failures[rank])} A rank of the group's torch.distributed group cannot be "
                            f"replaced while it runs; {resume}")
        if failures:  # the call raised on a rank: its own error, with the rank named
            rank = min(failures)
            error = failures[rank]
            cause = error.cause if isinstance(error, RayTaskError) else None
            if isinstance(cause, Exception):
                cause.add_note(f"(raised by {self.worker_name(rank)} during `{method}`)")
                return cause
            return RunError(f"{self.worker_name(rank)} failed during `{method}` (waiting for {waiting_for}): "
                            f"{one_line(error)}")
        return RunError(f"{', '.join(self.worker_name(rank) for rank in silent)} did not answer `{method}` within "
                        f"cluster.timeout_s={self.timeout_s:g} s (waiting for {waiting_for}); {resume}, with a larger "
                        "cluster.timeout_s if the call was only slow")

    def seconds_since_progress(self) -> float:
        return time.monotonic() - self.last_progress

    def kill(self) -> None:
        """Kill the actors (a rank blocked in a collective included) and free their placement."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self.placement is not None:
            remove_placement_group(self.placement)
            self.placement = None

    def build(self, role: str, build: str, args: tuple, kwargs: dict) -> None:
        """Build worker `role` on every rank (builders.`build`(*args, **kwargs)), continuing the driver's random
        stream."""
        if role in self.roles:
            raise RunError(f"the policy group already holds a {role} worker")
        state = self.each("build", f"every rank to build its {role} worker", role, build, args, kwargs,
                          capture_rng_state())[0]
        restore_rng_state(state)
        self.roles.add(role)

    def call(self, role: str, method: str, waiting_for: str, *args: Any, **kwargs: Any) -> Any:
        """Rank 0's answer to `role`.`method`(*args, **kwargs) made on every rank."""
        named = method if role == "policy" else f"{role} {method}"
        return self.each("call", waiting_for, role, method, args, kwargs, named=named)[0]


def start_rank_group(section: ClusterSection, local_instance: bool) -> RankGroup:
    """cluster.policy_workers actors in their placement group (`place_actors`), not yet connected: the caller keeps
    the group (so that closing the cluster kills the actors whatever happens next), then calls `connect`."""
    placement = place_actors(group_resources(section)[GROUP], section, local_instance)
    threads = torch.get_num_threads()
    actors = [TrainerRankActor.options(
        num_cpus=section.cpus_per_policy_worker, num_gpus=section.gpus_per_policy_worker,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=rank),
    ).remote(rank, section.policy_workers, threads) for rank in range(section.policy_workers)]
    return RankGroup(actors, section.timeout_s, placement)


@dataclass(frozen=True)
class GroupResources:
    """What one worker group asks of the cluster: `size` actors of `cpus` CPUs and `gpus` GPUs each, set by the
    cluster keys `size_key`, `cpus_key` and `gpus_key` (named in refusals)."""

    name: str
    size: int
    cpus: float
    gpus: float
    size_key: str
    cpus_key: str
    gpus_key: str

    @property
    def bundle(self) -> dict[str, float]:
        """One actor's bundle in the group's placement group."""
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}


def group_resources(section: ClusterSection) -> dict[str, GroupResources]:
    """Every worker group the cluster section asks for, by name (groups of 0 actors left out): the policy group, the
    generation actors (not when colocated), the environment actors (not with a reward group: the environment then
    runs in the driver), the reference, teacher and reward groups. Several teachers of `posttrain distill` each
    take a group of the "teacher" group's size."""
    c = section
    groups = [GroupResources(GROUP, c.policy_workers, c.cpus_per_policy_worker, c.gpus_per_policy_worker,
                             "policy_workers", "cpus_per_policy_worker", "gpus_per_policy_worker"),
              GroupResources("generation", 0 if c.colocated else c.generation_workers, c.cpus_per_generation_worker,
                             c.gpus_per_generation_worker, "generation_workers", "cpus_per_generation_worker",
                             "gpus_per_generation_worker"),
              GroupResources("environment", 0 if c.reward_workers else c.environment_workers,
                             c.cpus_per_environment_worker,
                             c.gpus_per_environment_worker, "environment_workers", "cpus_per_environment_worker",
                             "gpus_per_environment_worker"),
              *(GroupResources(role, c.scoring_workers(role), c.cpus_per_scoring_worker, c.gpus_per_scoring_worker,
                               f"{role}_workers", "cpus_per_scoring_worker", "gpus_per_scoring_worker")
                for role in ("reference", "teacher", "reward"))]
    return {group.name: group for group in groups if group.size}


def refuse_missing_gpus(group: GroupResources) -> None:
    """RunError, naming the key, when `group` asks for more GPUs than the Ray cluster has (checked for every group
    when the cluster starts, before any actor, and again when a group is placed)."""
    offered = ray.cluster_resources().get("GPU", 0)
    if group.gpus and offered < group.gpus * group.size:
        raise RunError(f"cluster.{group.gpus_key}={group.gpus:g} asks for {group.gpus * group.size:g} GPUs for "
                       f"{group.size} {group.name} workers; the Ray cluster offers {offered:g}: set "
                       f"cluster.{group.gpus_key}=0 to run them on CPUs, or join a cluster with GPUs")


def place_actors(group: GroupResources, section: ClusterSection, local_instance: bool) -> Any:
    """A placement group of one bundle per actor of `group`, packed onto as few nodes as hold them; RunError when
    the cluster cannot hold it: at once for GPUs it does not have (or a local instance short of CPUs), else past
    cluster.timeout_s."""
    refuse_missing_gpus(group)
    wanted = group.cpus * group.size
    available = ray.available_resources().get("CPU", 0)
    if local_instance and available < wanted:
        raise RunError(f"the {group.name} group needs {wanted:g} CPUs (cluster.{group.size_key}={group.size} x "
                       f"cluster.{group.cpus_key}={group.cpus:g}); this run's Ray instance has {available:g} free: "
                       f"raise cluster.num_cpus (a count of slots: the actors then share this machine's cores) or "
                       f"lower cluster.{group.cpus_key}")
    placement = placement_group([group.bundle for _ in range(group.size)], strategy="PACK")
    try:
        ray.get(placement.ready(), timeout=section.timeout_s)
    except GetTimeoutError:
        remove_placement_group(placement)
        raise RunError(f"the {group.name} group's placement ({group.size} bundles of {group.bundle}) was not "
                       f"granted within cluster.timeout_s={section.timeout_s:g} s; the cluster has "
                       f"{ray.available_resources()} free: lower cluster.{group.size_key} or the resources per "
                       "worker") from None
    return placement


class RayPolicyWorker:
    """The `PolicyWorker` protocol over a `RankGroup` (see the module docstring): every call made on every rank."""

    def __init__(self, group: RankGroup, role: str, bucket_bytes: int):
        self.group, self.role, self.bucket_bytes = group, role, bucket_bytes
        self._device = group.one("attribute", "the worker's device", role, "device")

    def logprobs(self, batch: AnyBatch, temperature: float = 1.0) -> torch.Tensor:
        return self.group.call(self.role, "logprobs", f"the log-probabilities of {len(batch)} rows", batch,
                               temperature)

    def forward_backward(self, batch: TrainBatch, loss: Objective) -> MetricDict:
        return self.group.call(self.role, "forward_backward", f"forward and backward of {len(batch)} rows", batch,
                               loss)

    def evaluate(self, batch, loss: Objective) -> MetricDict:
        return self.group.call(self.role, "evaluate", f"the evaluation of {len(batch)} rows", batch, loss)

    def optim_step(self) -> MetricDict:
        return self.group.call(self.role, "optim_step", "the optimizer step")

    @property
    def version(self) -> int:
        return self.group.one("attribute", "the policy version", self.role, "version")

    def push_weights(self, generator: WeightReceiver) -> dict[str, float]:
        """The gathered weights to `generator`, in pieces of about weight_sync.bucket_mb (the module docstring)."""
        started = time.perf_counter()
        version = self.version
        sent = generator.update_weights(version, RankZeroWeights(self))
        return {"weight_sync/seconds": time.perf_counter() - started, "weight_sync/bytes": float(sent),
                "weight_sync/version": float(version)}

    def sampling_module(self) -> None:
        """The weights live in the actors: a generator keeps its own copy."""
        return None

    def base_model_scorer(self, role: str = "reference") -> RayScoringWorker | None:
        """A LoRA policy's base model (its adapters off) as a scorer on the same ranks, sharing their shards; None
        for a full fine-tune (the recipe then builds a frozen copy, on the group too: `RayCluster.scorer`)."""
        if role in self.group.roles:
            raise RunError(f"the policy group already holds a {role} worker")
        shared = self.group.each("derive", f"the {role} scorer of the policy's base model", self.role,
                                 "base_model_scorer", (role,), role)[0]
        if not shared:
            return None
        self.group.roles.add(role)
        return RayScoringWorker(self.group, role)

    def named_weights(self, adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors, gathered by every rank and handed over by rank 0 in pieces of about bucket_bytes."""
        listing = self.group.each("gather_weights", "every rank to gather the full weights", self.role,
                                  adapters_only)[0]
        piece: list[str] = []
        size = 0
        for number, (name, nbytes) in enumerate(listing):
            piece.append(name)
            size += nbytes
            if size >= self.bucket_bytes or number == len(listing) - 1:
                yield from self.group.one("weight_piece", f"{len(piece)} gathered weights from rank 0", piece)
                piece, size = [], 0

    def interpolation_problem(self) -> str | None:
        return self.group.one("call", "the interpolation check", self.role, "interpolation_problem")

    def interpolate_toward_start(self, weight: float, start: ModelConfig) -> None:
        self.group.call(self.role, "interpolate_toward_start", "the interpolation toward the start", weight, start)

    def save(self, directory: Path) -> None:
        self.group.call(self.role, "save", f"its shards written into {directory}", directory)

    def load(self, directory: Path) -> None:
        self.group.call(self.role, "load", f"its state read from {directory}", directory)

    def export(self, output_dir: Path) -> Exported:
        return self.group.call(self.role, "export", f"the model exported to {output_dir}", output_dir)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return self.group.one("call", "its parameter count", self.role, "num_parameters", (trainable_only,))

    @property
    def device(self) -> torch.device:
        return self._device


class RankZeroWeights:
    """The policy group's weights as a push sees them: iterated, the pieces rank 0 hands to the driver
    (weight_sync.method=object_store); for a broadcast, `rank 0` holds them and sends them itself."""

    def __init__(self, policy: RayPolicyWorker):
        self.policy, self.adapters_only = policy, False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.policy.named_weights(self.adapters_only)

    @property
    def group(self) -> RankGroup:
        return self.policy.group

    def gather(self, bucket_bytes: int) -> tuple[str, str, list[tuple[str, str, tuple[int, ...]]]]:
        """Every rank gathers, rank 0 keeps the weights and its plan: (its digest, backend, specs)."""
        return self.group.each("gather_for_broadcast", "every rank to gather the full weights", self.policy.role,
                               self.adapters_only, bucket_bytes)[0]


class RankGenerator:
    """The `Generator` protocol on the policy group's own ranks (cluster.colocated=true with cluster.policy_workers >
    0): each rank samples with a generator of its own on its own device, which a weight push fills in the rank's
    process from the weights every rank gathers (no byte crosses a process or the object store). A step's prompts go
    to the ranks in contiguous blocks when they carry per-prompt seeds, a call seeded as a whole to rank 0. A rank
    that dies stops the run, as during training (`RankGroup`)."""

    def __init__(self, policy: RayPolicyWorker, model: ModelConfig, tokenizer, batch_size: int, seed: int):
        self.group, self.role = policy.group, policy.role
        self.group.each("start_generator", "every rank to load its generator and fill it with the gathered weights",
                        self.role, model, tokenizer, batch_size, seed)
        self.weights_version = policy.version

    def generate(self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1) -> GenerationOutput:
        """Each rank's block of `prompts`, sampled on the ranks at once; extra["weights_versions"] lists the version
        each rank sampled with. One cluster.timeout_s deadline covers them all (rollouts here are synchronous)."""
        started = time.perf_counter()
        blocks = seeded_blocks(len(prompts), params, self.group.size)
        refs = {self.group.actors[rank].generate.remote(prompts[start:stop], block_params, num_samples): rank
                for rank, (start, stop, block_params) in enumerate(blocks)}
        outputs = self.group.collect(refs, "generate", f"{len(prompts)} prompts x {num_samples} samples of up to "
                                     f"{params.max_new_tokens} tokens on {len(blocks)} rank(s)")
        return GenerationOutput([samples for output in outputs for samples in output.completions],
                                time.perf_counter() - started, sum(o.num_generated_tokens for o in outputs),
                                {"weights_versions": [output.extra["weights_version"] for output in outputs]})

    def update_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Every rank refills its generator from the gathered weights of the policy (`weights`: `RankZeroWeights` of
        this group's policy); the bytes each rank copied."""
        if getattr(weights, "group", None) is not self.group:
            raise RunError("a colocated generator on the policy group takes weights from that group's policy only")
        copied = self.group.each("sync_generator", f"every rank to refill its generator with version {version}",
                                 self.role)
        self.weights_version = version
        return copied[0]

    def actor_versions(self) -> list[int]:
        return self.group.each("generator_version", "the version each rank's generator holds")

    def sampling_devices(self) -> list[str]:
        return self.group.each("generator_device", "the device each rank's generator samples on")

    def weight_digests(self) -> list[dict[str, str]]:
        return self.group.each("generator_digests", "the digests of each rank's generator weights")

    def logprobs(self, batch: RolloutBatch, trainer: TrainerConfig, temperature: float) -> torch.Tensor:
        """The log-probabilities of rank 0's generator copy (every rank's holds the same weights: `weight_digests`)."""
        return self.group.one("generator_logprobs", f"the log-probabilities of {len(batch)} rows on rank 0's "
                              "generator", batch, trainer, temperature)


def seeded_blocks(count: int, params: SamplingParams, parts: int) -> list[tuple[int, int, SamplingParams]]:
    """A generation call of `count` prompts cut for `parts` workers: (start, stop, the block's parameters) of
    contiguous blocks, each with its slice of the per-prompt seeds; one block for a call seeded as a whole (one
    random stream, which one worker must draw)."""
    params.check_seeds_fit(count)
    blocks = contiguous_blocks(count, parts if params.seed is None else 1)
    return [(start, stop, params if params.seeds is None else replace(params, seeds=params.seeds[start:stop]))
            for start, stop in blocks]


def contiguous_blocks(count: int, parts: int) -> list[tuple[int, int]]:
    """(start, stop) of `count` items cut into at most `parts` contiguous, non-empty blocks of near-equal size."""
    size, extra = divmod(count, parts)
    blocks, start = [], 0
    for part in range(parts):
        stop = start + size + (part < extra)
        if stop > start:
            blocks.append((start, stop))
        start = stop
    return blocks


class RayCriticWorker:
    """The `CriticWorker` protocol over a `RankGroup`: PPO's critic on the policy group's ranks."""

    def __init__(self, group: RankGroup, role: str = CRITIC):
        self.group, self.role = group, role

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        return self.group.call(self.role, "values", f"the values of {len(batch)} rows", batch)

    def forward_backward(self, batch: TrainBatch, loss: Objective) -> MetricDict:
        return self.group.call(self.role, "forward_backward", f"forward and backward of {len(batch)} rows", batch,
                               loss)

    def optim_step(self) -> MetricDict:
        return self.group.call(self.role, "optim_step", "the optimizer step")

    def save(self, directory: Path) -> None:
        self.group.call(self.role, "save", f"its shards written into {directory}", directory)

    def load(self, directory: Path) -> None:
        self.group.call(self.role, "load", f"its state read from {directory}", directory)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return self.group.one("call", "its parameter count", self.role, "num_parameters", (trainable_only,))


class RayScoringWorker:
    """The `ScoringWorker` protocol over a `RankGroup`: a frozen model (reference, teacher) sharded over the policy
    group's ranks, as an FSDP2 scorer is over torchrun's."""

    def __init__(self, group: RankGroup, role: str):
        self.group, self.role = group, role

    def logprobs(self, batch: AnyBatch, temperature: float = 1.0) -> torch.Tensor:
        return self.group.call(self.role, "logprobs", f"the log-probabilities of {len(batch)} rows", batch,
                               temperature)

    def topk_logprobs(self, batch: AnyBatch, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.group.call(self.role, "topk_logprobs", f"the top-{k} log-probabilities of {len(batch)} rows",
                               batch, k, temperature)

    def sequence_scores(self, batch: AnyBatch) -> torch.Tensor:
        return self.group.call(self.role, "sequence_scores", f"the scores of {len(batch)} rows", batch)


def start_policy(group: RankGroup, model: ModelConfig, lora: LoraSection, trainer: TrainerConfig, tokenizer,
                 bucket_bytes: int, task: str = "causal_lm", schedule: TrainerConfig | None = None,
                 resume_dir: Path | None = None) -> RayPolicyWorker:
    """The policy built on every rank of `group` (builders.build_policy: FSDP2), restored from `resume_dir`."""
    group.build("policy", "build_policy", (model, lora, trainer, tokenizer),
                {"task": task, "schedule": schedule, "resume_dir": resume_dir})
    return RayPolicyWorker(group, "policy", bucket_bytes)


def start_critic(group: RankGroup, init_from: str, model: ModelConfig, trainer: TrainerConfig, tokenizer,
                 schedule: TrainerConfig | None = None, resume_dir: Path | None = None) -> RayCriticWorker:
    """PPO's critic built on every rank of `group` (builders.build_critic: FSDP2), restored from `resume_dir`."""
    group.build(CRITIC, "build_critic", (init_from, model, trainer, tokenizer),
                {"schedule": schedule, "resume_dir": resume_dir})
    return RayCriticWorker(group, CRITIC)


def start_scorer(group: RankGroup, model: ModelConfig, trainer: TrainerConfig, role: str,
                 offload: bool = False) -> RayScoringWorker:
    """A frozen scorer built on every rank of `group` (builders.build_scorer: FSDP2), as worker `role`."""
    group.build(role, "build_scorer", (model, trainer), {"role": role, "offload": offload})
    return RayScoringWorker(group, role)
