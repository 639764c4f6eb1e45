"""Ray worker groups: generation and environment workers as Ray actors behind the `Generator` and `Environment`
protocols, so that `algorithms/grpo.py` and `ppo.py` drive them unchanged (docs/ray.md).

    cluster = RayCluster(cfg.cluster, cfg.weight_sync, output_dir)   # a local Ray instance, or join cluster.address
    generator = cluster.generator(model, tokenizer, batch_size=..., seed=...)   # a RayGenerator
    environment = cluster.environment(build_recipe_environment, cfg.environment)   # a RayEnvironment
    reference = cluster.scoring_group(model, trainer, role="reference")   # a RayScoringGroup (reference_workers)
    ...
    cluster.close()                                                  # kill the actors, shut the instance down

What this first slice builds, and where it departs from the full design:
- The policy trains in the driver process (a local worker), or with cluster.policy_workers > 0 in a group of
  actors forming one torch.distributed group (`RayCluster.policy`, distributed/ray_policy.py); its weights reach
  the generation actors through `RayGenerator.update_weights`: in buckets of weight_sync.bucket_mb put into Ray's
  object store one at a time, every actor loading each bucket before the next is put, then a check that every
  weight of the model arrived
  and the version stamp (with cluster.max_restarts > 0 the last push's buckets stay in the store for a
  replacement actor: one copy of the model). With weight_sync.method=broadcast the holder of the weights (the
  policy group's rank 0, or this process) broadcasts them to the actors over a process group of their own, bucket
  by bucket of a fixed sorted plan (distributed/weight_broadcast.py); a replacement actor then copies a live peer's
  weights, and the next push re-forms the group with it.
- `RayGenerator.submit` sends a generation call at once and waits for it later: an actor answers calls in the
  order they were sent, so a call sent before a weight push samples from the weights before it (asynchronous
  rollouts, algorithms/rollout_source.py); `submit_blocks` lets the caller wait for each actor's share on its own
  (rollout.group_timeout_s drops the groups of a share that straggles).
- Generation actors run the transformers backend on their own copy of the model, on the first GPU Ray granted them
  (cluster.gpus_per_generation_worker) or the CPU; with rollout.backend=vllm, a vLLM engine on their GPU
  (`VLLMGenerationWorker`), into which pushes load in place (with weight_sync.lora=adapters the LoRA adapters alone,
  sampled with as a LoRA request). An actor that cannot start (a GPU torch does not see, vllm not importable) stops
  the run naming it before anything is pushed. A call whose prompts carry
  per-prompt seeds (rollout.seed_per_group) is divided among the actors in contiguous blocks; a call seeded as a
  whole draws from one stream and goes to the first actor, so it samples what one process samples.
- Environment actors build the environment from its config section in their own process; a step's episodes are
  divided among them in contiguous blocks, single episodes (multi-turn) go round-robin. The episodes of an
  environment that holds them (`envs.base.HoldsEpisodes`: tools, swe, cua) stay on the actor that stepped their
  first turn, which holds their work directories, checkouts and desktops; the driver renders the tools from the
  description that actor gives (`tool_use`), and an episode whose actor died is not re-sent to the replacement but
  restarted from its first turn (`EpisodeLost`). Each environment actor works in a scratch folder of its own
  (distributed/scratch.py), where a replacement stops the processes a dead actor left running and removes its
  folders before it builds its environment. With
  cluster.environment_concurrency = N (other environments) an actor builds N copies and runs N calls at once, each on
  a copy of its own.
- With cluster.reference_workers (teacher_workers) > 0 the reference (teacher) is a group of `ScoringActor`s
  behind the `ScoringWorker` protocol (`RayScoringGroup`): a rollout batch's micro-batches are divided among them
  in contiguous runs and the answers joined in row order; another batch (distill's padded micro-batches, a reward
  model's rows) goes whole to the next actor in turn. Each teacher of `posttrain distill` has a group of its own
  (a precomputed one is released once it has scored). With cluster.reward_workers > 0 a reward_model environment's
  model is such a group (`RayCluster.reward_model`), scored through `sequence_scores` from the driver, where the
  environment then runs.
- Each group's actors are placed by a placement group of one bundle per actor (cluster.cpus_per_<group>_worker,
  gpus_per_<group>_worker; ray_policy.place_actors); GPUs the cluster lacks stop the run when it starts.
- Every remote call waits at most cluster.timeout_s (actor start-up included); past it the run stops with a
  RunError naming the worker, the call and what it waited for (the newest checkpoint on disk is the one to resume
  from). A stuck actor is not restarted: it may be slow rather than dead, and its answer would come twice.
- An actor that dies (its process killed, out of memory) is replaced, up to cluster.max_restarts per group: a
  generation actor first loads the weights the others hold, then the call it was answering is re-sent to it with
  the same arguments (the same seeds: it samples what the dead one would have), and the samples re-sent are
  counted; with cluster.on_actor_failure=mask the call's samples are masked and counted instead (a call that
  carries none is still re-sent). Past the restarts the run stops naming the worker.
- A weight push holds the generator's push lock: a generation call sent from another thread meanwhile (the next
  chunk of a round with in-flight updates) is sent after the push, never between two of its buckets.
- `RayCluster.metrics()` gives each group's seconds since its last answered call, its restarts, re-sent and masked
  samples, logged every step; `state_dict` keeps the counts in checkpoints, so a resumed run goes on from them.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import queue
import shutil
import signal
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from posttrain.checkpoint import capture_rng_state, restore_rng_state
from posttrain.config.environments import RewardModelOptions
from posttrain.config.schema import ClusterSection, LoraSection, ModelConfig, TrainerConfig, WeightSyncSection
from posttrain.data.types import RolloutBatch, SFTBatch
from posttrain.distributed import scratch
from posttrain.envs.base import EnvStep, EpisodeLost, Message, ToolUse, holds_episodes, tool_use_of
from posttrain.errors import RunError
from posttrain.generation.base import Completion, GenerationOutput, SamplingParams, SubmittedBlock, weight_buckets
from posttrain.generation.transformers_backend import TransformersGenerator
from posttrain.generation.vllm_backend import VLLMGenerator, import_vllm
from posttrain.models.loading import default_device, load_causal_lm, weight_specs_of
from posttrain.models.lora import adapter_file_name, write_adapter
from posttrain.preemption import PREEMPTION_SIGNALS
from posttrain.distributed.ray_policy import (
    RankGenerator,
    RankGroup,
    contiguous_blocks,
    group_resources,
    seeded_blocks,
    one_line,
    place_actors,
    refuse_missing_gpus,
    RankZeroWeights,
    RayCriticWorker,
    RayPolicyWorker,
    RayScoringWorker,
    start_critic,
    start_policy,
    start_rank_group,
    start_scorer,
)
from posttrain.distributed.weight_broadcast import (
    SyncGroup,
    WeightLoader,
    WeightSender,
    backend_offer,
    bucket_plan,
    choose_backend,
    first_difference,
    free_port,
    plan_digest,
    receive_bucket,
)
from posttrain.distributed.weight_check import weight_digests
from posttrain.workers import local
from posttrain.workers.forward import AnyBatch
from posttrain.workers.local import LocalScoringWorker
from posttrain.workers.reward_model import RewardModel, load_reward_tokenizer

HOLDER = -1
"""The weights' holder (the policy group's rank 0 or the driver) among the members of a weight-sync group, whose
generation actors are numbered 0..N-1 as their worker group numbers them."""

HOLDER_KEY = "_environment_worker"
"""The metadata key under which a running tool-using episode records the environment actor holding its state:
(its index in the group, its incarnation). Removed when the episode ends."""
ENVIRONMENT_COPY_WAIT_S = 60.0
"""How long an environment call waits for a free copy of the environment (never, when Ray's max_concurrency equals
the copies; the bound says so if that ever breaks)."""

SOCKET_PATH_ROOM = 60
"""Characters Ray appends to its temporary directory for a socket path (session_<date>_<pid>/sockets/plasma_store);
a Unix socket path holds at most 107."""


@dataclass(frozen=True)
class Call:
    """One remote call to a group's actor: which actor, which method, its arguments."""

    index: int
    method: str
    args: tuple = ()
    samples: int = 0
    """Samples the call carries (prompts x samples, episodes): counted as retried when it is re-sent to a restarted
    actor."""
    resend: bool = True
    """Whether the call may be re-sent to the replacement of a dead actor. False for a call that needs what the dead
    actor held (a multi-turn episode's work directory): it then raises `EpisodeLost` (counting its samples as
    retried), and the caller starts the episode again."""
    incarnation: int | None = None
    """For a call that needs what one actor holds: the incarnation of the actor that holds it (`WorkerGroup.
    incarnations`); when the actor at `index` has been replaced since, the call is not sent and raises
    `EpisodeLost`."""


class WorkerGroup:
    """Actors of one role: the deadline of every call to them, restarts of the ones that die, and when the group
    last answered.

    make: starts one actor (the same way for a replacement); max_restarts: actors the group may replace over the
    run; on_restart: given a replacement, the calls that bring it up to date before anything is re-sent to it (the
    generation group's weights); mask: given a call that carries samples and why it failed, the answer that masks
    them (cluster.on_actor_failure=mask), instead of re-sending the call to the replacement."""

    def __init__(self, name: str, make: Callable[[], Any], count: int, timeout_s: float, max_restarts: int,
                 on_restart: Callable[[int], list[Call]] | None = None,
                 mask: Callable[[Call, str], Any] | None = None):
        self.name, self.make, self.timeout_s, self.max_restarts = name, make, timeout_s, max_restarts
        self.on_restart, self.mask = on_restart, mask
        self.actors = [make() for _ in range(count)]
        self.incarnations = [0] * count
        """Per actor: how many times it was replaced (what an episode held by one actor records, to find out that
        the actor holding it is gone)."""
        self.last_progress = time.monotonic()
        self.restarts = 0
        self.retried_samples = 0
        self.masked_samples = 0
        self.failed = False
        """A call to the group ran past its deadline or found an actor dead for good: closing it then kills,
        without asking."""
        self._lock = threading.RLock()

    def worker_name(self, index: int) -> str:
        return f"{self.name} worker {index} of {len(self.actors)}"

    def call(self, calls: Sequence[Call], waiting_for: str) -> list[Any]:
        """The results of `calls`, sent together and awaited in order within one cluster.timeout_s deadline. A call
        whose actor died is re-sent to a replacement (`restart`) while the group has restarts left; RunError
        naming the worker, the call and `waiting_for` past the deadline or when none are left."""
        return self.collect(self.send(calls), waiting_for)

    def send(self, calls: Sequence[Call]) -> list[tuple[Call, Any, Any]]:
        """Send `calls` now (an actor answers its calls in the order they were sent); `collect` waits for them."""
        return [(call, *self._send(call)) for call in calls]

    def collect(self, sent: list[tuple[Call, Any, Any]], waiting_for: str) -> list[Any]:
        """The results of calls `send` sent, within one cluster.timeout_s deadline from now (see `call`)."""
        deadline = time.monotonic() + self.timeout_s
        results = []
        for call, actor, ref in sent:
            while True:
                try:
                    results.append(self._get(ref, call, deadline, waiting_for))
                    break
                except RayActorError as error:
                    self.restart(call.index, actor, error, f"`{call.method}` (waiting for {waiting_for})")
                    if not call.resend:  # what the call needs died with the actor: the caller starts again
                        with self._lock:
                            self.retried_samples += call.samples
                        raise EpisodeLost(f"{self.worker_name(call.index)} died during `{call.method}` (waiting for "
                                          f"{waiting_for}): {one_line(error)}")
                    if self.mask is not None and call.samples:  # its samples are masked, not sampled again
                        with self._lock:
                            self.masked_samples += call.samples
                        results.append(self.mask(call, f"{self.worker_name(call.index)} died during "
                                                       f"`{call.method}`: {one_line(error)}"))
                        break
                    with self._lock:
                        self.retried_samples += call.samples
                    deadline = time.monotonic() + self.timeout_s  # the re-sent call gets a deadline of its own
                    actor, ref = self._send(call)
        with self._lock:
            self.last_progress = time.monotonic()
        return results

    def _send(self, call: Call) -> tuple[Any, Any]:
        """(the actor, the object ref of its answer); waits while a replacement catches up (`restart`)."""
        with self._lock:
            if call.incarnation is not None and call.incarnation != self.incarnations[call.index]:
                self.retried_samples += call.samples
                raise EpisodeLost(f"{self.worker_name(call.index)}, which held what `{call.method}` needs, died and "
                                  "was replaced")
            actor = self.actors[call.index]
            return actor, getattr(actor, call.method).remote(*call.args)

    def _get(self, ref: Any, call: Call, deadline: float, waiting_for: str) -> Any:
        try:
            return ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
        except GetTimeoutError:
            self.failed = True
            raise RunError(f"{self.worker_name(call.index)} did not answer `{call.method}` within cluster.timeout_s="
                           f"{self.timeout_s:g} s (waiting for {waiting_for}); the run stops here and its newest "
                           "checkpoint is intact: re-run the same command to resume from it, with a larger "
                           "cluster.timeout_s if the call was only slow") from None

    def restart(self, index: int, dead: Any, error: Exception, during: str) -> None:
        """Replace actor `index`, found `dead` (unless another thread already replaced it), bring the replacement up
        to date (`on_restart`) and count it; RunError when the group has used its cluster.max_restarts or the
        replacement dies too."""
        with self._lock:
            if self.actors[index] is not dead:
                return
            if self.restarts >= self.max_restarts:
                self.failed = True
                raise RunError(f"{self.worker_name(index)} died during {during}: {one_line(error)} The group has "
                               f"used its cluster.max_restarts={self.max_restarts} restarts; the run stops here: "
                               "re-run the same command to resume from the newest checkpoint") from None
            ray.kill(dead, no_restart=True)
            self.actors[index] = self.make()
            self.incarnations[index] += 1
            self.restarts += 1
            deadline = time.monotonic() + self.timeout_s
            catch_up = [Call(index, "ready"), *(self.on_restart(index) if self.on_restart is not None else [])]
            try:  # under the lock: no other thread sends to the replacement before it has caught up
                for call in catch_up:
                    self._get(self._send(call)[1], call, deadline, f"the replacement of a dead {self.name} worker")
            except RayActorError as again:
                self.failed = True
                raise RunError(f"the replacement of {self.worker_name(index)} died too, during `{call.method}`: "
                               f"{one_line(again)}") from None

    def seconds_since_progress(self) -> float:
        return time.monotonic() - self.last_progress

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


# ---- generation ----------------------------------------------------------------------------------------------


def sampling_device(granted_gpus: Sequence[Any], visible_cuda_devices: int) -> torch.device | str:
    """Where a generation actor loads its copy and samples: the first GPU Ray granted it (Ray shows an actor only the
    GPUs of its bundle, so that is cuda:0 in its process), the CPU when it was granted none; or, as a string, why
    it cannot start (Ray granted GPUs that torch does not see)."""
    if not granted_gpus:
        return torch.device("cpu")
    if visible_cuda_devices == 0:
        return (f"Ray granted it GPU {', '.join(str(gpu) for gpu in granted_gpus)} "
                "(cluster.gpus_per_generation_worker), but torch in its process sees no CUDA device (a CPU-only torch "
                "build on that node, or CUDA_VISIBLE_DEVICES overridden); install a CUDA build of torch there or set "
                "cluster.gpus_per_generation_worker=0 to sample on CPUs")
    return torch.device("cuda", 0)


def vllm_worker_problem(granted_gpus: Sequence[Any], visible_cuda_devices: int, import_problem: str | None
                        ) -> str | None:
    """Why a vLLM generation actor cannot start (vllm not importable in its process, no GPU granted or visible), or
    None."""
    if import_problem is not None:
        return import_problem
    if not granted_gpus:
        return ("a vLLM engine needs a GPU and Ray granted this actor none: set cluster.gpus_per_generation_worker "
                "(1 for one GPU per generation worker)")
    device = sampling_device(granted_gpus, visible_cuda_devices)
    return device if isinstance(device, str) else None


def vllm_import_problem() -> str | None:
    """Why this process cannot import vllm (the message says how to install it), or None."""
    try:
        import_vllm("a vLLM generation worker (cluster.backend=ray with rollout.backend=vllm)")
    except ImportError as error:
        return str(error)
    return None


class WeightSyncMember:
    """A generation worker's membership of the weight-sync group (`weight_sync.method=broadcast`)."""

    def join_weight_sync(self, address: str, port: int, rank: int, world_size: int, backend: str,
                         timeout_s: float) -> bool:
        """Join the weight-sync group at the holder's address (every member at once); replaces an earlier one."""
        self._sync = None
        self._sync = SyncGroup(address, port, rank, world_size, backend, timeout_s)
        self._timeout_s = timeout_s
        return True


class GenerationWorker(WeightSyncMember):
    """A transformers generator on its own copy of the model, loaded from the policy's weight pushes (through the
    object store, `load_bucket`, or by broadcast, `receive_bucket`), on the GPU Ray granted the actor
    (cluster.gpus_per_generation_worker) or on the CPU. `GenerationActor` is this class as a Ray actor.

    An actor that cannot start (Ray granted it a GPU torch does not see) builds nothing and says why: `problem`,
    which the driver reads before anything else (`RayCluster.generator`), and `ready` raises it (a replacement)."""

    def __init__(self, model: ModelConfig, tokenizer, batch_size: int, seed: int, num_threads: int):
        # The driver's thread count: a matrix product split over another number of threads may round differently.
        torch.set_num_threads(num_threads)
        device = sampling_device(ray.get_gpu_ids(), torch.cuda.device_count())
        self.problem = device if isinstance(device, str) else None
        if self.problem is not None:
            return
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # a weight-sync group over NCCL uses the current device
        self.generator = TransformersGenerator(load_causal_lm(model, device=device).eval(), tokenizer,
                                               batch_size=batch_size, seed=seed, owns_weights=True)
        self.generator.model.requires_grad_(False)
        self._expected = set(self.generator.model.state_dict())
        self._loaded: set[str] = set()
        self._loader: WeightLoader | None = None
        self._sync: SyncGroup | None = None
        self._timeout_s = 0.0

    def start_problem(self) -> str | None:
        """Why this actor could not start, or None (asked once every actor has started)."""
        return self.problem

    def ready(self) -> bool:
        if self.problem is not None:
            raise RuntimeError(self.problem)
        return True

    def sampling_device(self) -> str:
        return str(self.device)

    def generate(self, prompts: list[list[int]], params: SamplingParams, num_samples: int) -> GenerationOutput:
        output = self.generator.generate(prompts, params, num_samples)
        output.extra["weights_version"] = self.generator.weights_version
        return output

    def load_bucket(self, bucket: list[tuple[str, str, tuple[int, ...], np.ndarray]]) -> int:
        """Copy one bucket of weights (`bucket_payload`) into the model; the bytes loaded."""
        with warnings.catch_warnings():
            # The arrays are read-only views of Ray's shared memory; they are only read, by the copy into the model.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            weights = {name: torch.from_numpy(data).view(getattr(torch, dtype)).reshape(shape)
                       for name, dtype, shape, data in bucket}
            with torch.no_grad():
                _, unexpected = self.generator.model.load_state_dict(weights, strict=False)
        if unexpected:
            raise ValueError(f"weights this generator's model has no place for: {unexpected[:5]}")
        self._loaded.update(weights)
        return sum(data.nbytes for *_, data in bucket)

    # ---- weight_sync.method=broadcast (distributed/weight_broadcast.py) ----

    def sync_plan(self, bucket_bytes: int) -> tuple[str, str, list[tuple[str, str, tuple[int, ...]]]]:
        """(the digest of the bucket plan computed from this model's weights, the backend this actor offers, the
        (name, dtype, shape) list the plan comes from)."""
        self._loader = WeightLoader(self.generator.model, bucket_bytes)
        return plan_digest(self._loader.plan), backend_offer(self.device), self._loader.specs

    def receive_bucket(self, index: int) -> int:
        """Receive bucket `index` of the plan by broadcast into the model; the bytes loaded."""
        names = self._loader.receive(self._sync, index, self._timeout_s)
        self._loaded.update(names)
        return self._loader.plan[index].nbytes

    def copy_weights_from(self, peer: Any, timeout_s: float) -> int:
        """Load the weights and version a live peer holds (a replacement's catch-up under broadcast sync, where no
        push is kept in the object store); its version."""
        try:
            payload, version = ray.get(peer.weight_payload.remote(), timeout=timeout_s)
        except (RayActorError, GetTimeoutError) as error:
            raise RuntimeError(f"the generation worker to copy the weights from did not answer: {one_line(error)}"
                               ) from None
        self.load_bucket(payload)
        return self.finish_sync(version)

    def weight_payload(self) -> tuple[list[tuple[str, str, tuple[int, ...], np.ndarray]], int]:
        """This actor's weights as one `bucket_payload` and their version (for a replacement's catch-up)."""
        return bucket_payload(list(self.generator.model.state_dict().items())), self.generator.weights_version

    def finish_sync(self, version: int) -> int:
        """Stamp `version` once every weight of the model has arrived since the last sync; its version."""
        missing, self._loaded = sorted(self._expected - self._loaded), set()
        if missing:
            raise ValueError(f"weight update of version {version} left weights unset: {missing[:5]}")
        self.generator.weights_version = version
        return version

    def weights_version(self) -> int:
        return self.generator.weights_version

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().cpu().clone() for name, tensor in self.generator.model.state_dict().items()}

    def weight_digests(self) -> dict[str, str]:
        return weight_digests(self.generator.model.state_dict().items())

    def logprobs(self, batch: RolloutBatch, trainer: TrainerConfig, temperature: float) -> torch.Tensor:
        """[N, T] log-probabilities of the batch's tokens under this actor's weights, computed by the same forward
        pass a local scoring worker runs (workers/forward.py)."""
        return LocalScoringWorker(self.generator.model, trainer, role="generator").logprobs(batch, temperature)


GenerationActor = ray.remote(GenerationWorker)


class VLLMGenerationWorker(WeightSyncMember):
    """A vLLM engine (generation/vllm_backend.py, in this actor's process) on the GPU Ray granted the actor, sampling
    for `rollout.backend=vllm` with the sampled tokens' log-probabilities as the engine reports them (the
    distribution it drew from: docs/rl.md, Generators). The policy's weight pushes arrive as for `GenerationWorker`,
    by the object store (`load_bucket`) or by broadcast (`receive_bucket`, the plan computed from the model's config:
    `weight_specs_of`), and each bucket goes into the engine in place by the model's own loader (Hugging Face names;
    vLLM fuses q/k/v itself); `finish_sync` checks that every weight of the model arrived, drops the prefix cache and
    stamps the version. `VLLMGenerationActor` is this class as a Ray actor.

    The engine keeps the weights in its own layout, so this actor gives no copy of them back: no
    `--check-weight-sync` comparison, and under broadcast sync no replacement can copy a peer's weights (the run
    stops; object_store keeps the last push for a replacement). An actor that cannot start (vllm not importable,
    no GPU granted or visible) builds nothing and says why, as `GenerationWorker` does."""

    def __init__(self, model: ModelConfig, gpu_memory_utilization: float, seed: int, num_threads: int,
                 adapters: LoraSection | None = None):
        torch.set_num_threads(num_threads)
        self.problem = self.find_problem()
        if self.problem is not None:
            return
        self.model, self.adapters = model, adapters
        self.specs = weight_specs_of(model)
        self._expected = {name for name, _, _ in self.specs}
        self._loaded: set[str] = set()
        self._adapter_tensors: dict[str, torch.Tensor] = {}
        self._adapter_names: set[str] | None = None
        """With adapters-only sync: the adapter tensors the first push brought, which every later push must bring."""
        self._adapter_root = Path(tempfile.mkdtemp(prefix="posttrain-adapters-")) if adapters is not None else None
        self.engine = self.build_engine(model, gpu_memory_utilization, seed)
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self._plan: list[Any] = []
        self._sync: SyncGroup | None = None
        self._timeout_s = 0.0

    def find_problem(self) -> str | None:
        """Why this actor cannot start (`vllm_worker_problem`), or None."""
        return vllm_worker_problem(ray.get_gpu_ids(), torch.cuda.device_count(), vllm_import_problem())

    def start_problem(self) -> str | None:
        """Why this actor could not start, or None (asked once every actor has started)."""
        return self.problem

    def build_engine(self, model: ModelConfig, gpu_memory_utilization: float, seed: int) -> VLLMGenerator:
        """The engine on this actor's GPU (Ray shows it only the GPUs of its bundle), as rollout.backend=vllm builds
        it in one process; with adapters-only sync, LoRA enabled for one adapter of at most the next rank vLLM
        offers above lora.r."""
        lora = {}
        if self.adapters is not None:
            rank = min(r for r in VLLM_LORA_RANKS if r >= self.adapters.r)
            lora = {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}
        return VLLMGenerator(model.name_or_path, seed=seed, gpu_memory_utilization=gpu_memory_utilization, **lora)

    def ready(self) -> bool:
        if self.problem is not None:
            raise RuntimeError(self.problem)
        return True

    def sampling_device(self) -> str:
        return f"{self.device} (vllm)"

    def generate(self, prompts: list[list[int]], params: SamplingParams, num_samples: int) -> GenerationOutput:
        output = self.engine.generate(prompts, params, num_samples)
        output.extra["weights_version"] = self.engine.weights_version
        return output

    def load_bucket(self, bucket: list[tuple[str, str, tuple[int, ...], np.ndarray]]) -> int:
        """Load one bucket of weights (`bucket_payload`) into the engine; the bytes loaded."""
        with warnings.catch_warnings():  # read-only views of Ray's shared memory, only read by the copy to the GPU
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            weights = [(name, torch.from_numpy(data).view(getattr(torch, dtype)).reshape(shape).to(self.device))
                       for name, dtype, shape, data in bucket]
        if self.adapters is not None:  # kept until the push ends, then written as one adapter (`finish_sync`)
            self._adapter_tensors |= {adapter_file_name(name): tensor.cpu() for name, tensor in weights}
            return sum(data.nbytes for *_, data in bucket)
        unexpected = sorted(name for name, _ in weights if name not in self._expected)
        if unexpected:
            raise ValueError(f"weights this generator's model has no place for: {unexpected[:5]}")
        self.engine.load_weights(weights)
        self._loaded.update(name for name, _ in weights)
        return sum(data.nbytes for *_, data in bucket)

    def sync_plan(self, bucket_bytes: int) -> tuple[str, str, list[tuple[str, str, tuple[int, ...]]]]:
        """As `GenerationWorker.sync_plan`, from the model's config (`weight_specs_of`): the trainer's names, shapes
        and dtypes, whatever dtype the engine computes in."""
        self._plan = bucket_plan(self.specs, bucket_bytes)
        return plan_digest(self._plan), backend_offer(self.device), self.specs

    def receive_bucket(self, index: int) -> int:
        """Receive bucket `index` of the plan by broadcast and load it into the engine; the bytes loaded."""
        received = receive_bucket(self._sync, self._plan[index], self._timeout_s, self.device)
        self.engine.load_weights(received)
        self._loaded.update(name for name, _ in received)
        return self._plan[index].nbytes

    def finish_sync(self, version: int) -> int:
        """Stamp `version` once every weight of the model has arrived since the last sync (with adapters-only sync:
        every adapter tensor of the first push, then written as a peft adapter the engine samples with); its
        version."""
        if self.adapters is not None:
            return self._finish_adapters(version)
        missing, self._loaded = sorted(self._expected - self._loaded), set()
        if missing:
            raise ValueError(f"weight update of version {version} left weights unset: {missing[:5]}")
        self.engine.finish_weight_update(version)
        return version

    def _finish_adapters(self, version: int) -> int:
        tensors, self._adapter_tensors = self._adapter_tensors, {}
        if not tensors:
            raise ValueError(f"adapters-only update of version {version} brought no adapter tensors")
        if self._adapter_names is None:
            self._adapter_names = set(tensors)
        if set(tensors) != self._adapter_names:
            differing = sorted(set(tensors) ^ self._adapter_names)
            raise ValueError(f"adapters-only update of version {version} brought other adapter tensors than the "
                             f"first push: {differing[:5]}")
        directory = write_adapter(tensors, self.adapters, self.model.name_or_path, self._adapter_root / f"v{version}")
        previous = self.engine.lora_request
        self.engine.use_adapter(str(directory), version)
        if previous is not None and Path(previous.lora_path) != directory:  # no request names it any more
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        return version

    def weights_version(self) -> int:
        return self.engine.weights_version


VLLMGenerationActor = ray.remote(VLLMGenerationWorker)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM's LoRA config accepts (vllm/config/lora.py); an adapter of rank r needs one >= r."""


def bucket_payload(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, tuple[int, ...], np.ndarray]]:
    """A bucket as (name, dtype, shape, bytes as a uint8 array) per tensor: Ray stores NumPy arrays in its shared
    memory and an actor reads them there without a copy (a pickled tensor would be copied on both sides), and
    every dtype, bfloat16 included, travels as bytes."""
    payload = []
    for name, tensor in bucket:
        data = tensor.detach().cpu().contiguous()
        payload.append((name, str(data.dtype).removeprefix("torch."), tuple(data.shape),
                        data.reshape(-1).view(torch.uint8).numpy()))
    return payload


class RayGenerator:
    """The `Generator` protocol over a group of `GenerationActor`s (see the module docstring).

    With restarts allowed (cluster.max_restarts > 0) the buckets of the last weight push stay in Ray's object store
    (one copy of the weights) until the next push, so that a replacement actor loads the version the others hold
    before the call it missed is re-sent to it."""

    def __init__(self, make: Callable[[], Any], count: int, section: ClusterSection, bucket_bytes: int,
                 method: str = "object_store", engine: str = "transformers", adapters_only: bool = False):
        self.group = WorkerGroup("generation", make, count, section.timeout_s, section.max_restarts,
                                 on_restart=self._catch_up,
                                 mask=self._masked if section.on_actor_failure == "mask" else None)
        self.bucket_bytes, self.method, self.engine = bucket_bytes, method, engine
        self.adapters_only = adapters_only
        """weight_sync.lora=adapters: a push asks the policy for its adapter tensors alone (`PolicyWeights`)."""
        self._sync_members: tuple | None = None
        """(who holds the weights, the actors) of the weight-sync group formed for broadcasts, or None: a push
        re-forms the group when either changed (a replaced actor)."""
        self._driver_sync: SyncGroup | None = None
        self.sync_backend: str | None = None
        """The backend of the weight-sync group (nccl or gloo) once a broadcast formed it."""
        self.sync_backend_note: str | None = None
        """Why the group is not over NCCL although a member offered a GPU (`choose_backend`), or None."""
        self._actor_plans: list[tuple[str, str, list]] = []
        self.weights_version = 0
        self._buckets: list[Any] = []
        """The object refs of the weight buckets pushed so far (of the version being pushed during a push)."""
        self._syncing = False
        self._outstanding: dict[int, list[Any]] = {}
        """Per actor, the object refs of its generation calls not yet answered (`_idle_actors`)."""
        self._push_lock = threading.Lock()
        """Held through a weight push: a call sent from another thread (the next chunk of a round sampled with
        in-flight updates) waits for the push to end, so that no call samples from half-loaded weights."""

    def _actors(self) -> range:
        return range(len(self.group.actors))

    def generate(self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1) -> GenerationOutput:
        return self.submit(prompts, params, num_samples)()

    def submit(self, prompts: list[list[int]], params: SamplingParams,
               num_samples: int = 1) -> Callable[[], GenerationOutput]:
        """Send a `generate` call now and return what waits for its output: the actors answer it before any weight
        push sent after it (asynchronous rollouts), and while a push is under way it is sent once the push ends. The
        output's extra["weights_versions"] lists the version each actor sampled its share with."""
        started = time.perf_counter()
        blocks = self.submit_blocks(prompts, params, num_samples)

        def output() -> GenerationOutput:
            outputs = [block.wait() for block in blocks]
            return GenerationOutput([samples for output in outputs for samples in output.completions],
                                    time.perf_counter() - started, sum(o.num_generated_tokens for o in outputs),
                                    {"weights_versions": [v for o in outputs for v in o.extra["weights_versions"]]})

        return output

    def submit_blocks(self, prompts: list[list[int]], params: SamplingParams,
                      num_samples: int = 1) -> list[SubmittedBlock]:
        """`submit`, with each actor's share waited for on its own: a block of contiguous prompts per actor with no
        call outstanding (`_idle_actors`; one block for a whole-call seed), so that a caller can use the blocks that
        answered while another straggles (rollout.group_timeout_s). Each block's wait has a cluster.timeout_s
        deadline from when it is asked."""
        with self._push_lock:
            actors = self._idle_actors()
            parts = seeded_blocks(len(prompts), params, len(actors))
            sent = self.group.send([Call(index, "generate", (prompts[start:stop], block_params, num_samples),
                                         samples=(stop - start) * num_samples)
                                    for index, (start, stop, block_params) in zip(actors, parts)])
            for call, _, ref in sent:
                self._outstanding.setdefault(call.index, []).append(ref)
        blocks = []
        for (start, stop, _), one in zip(parts, sent, strict=True):
            def wait(one=one, start=start, stop=stop) -> GenerationOutput:
                started = time.perf_counter()
                output, = self.group.collect([one], f"prompts {start}..{stop - 1} of {len(prompts)} x {num_samples} "
                                             f"samples of up to {params.max_new_tokens} tokens")
                return GenerationOutput(output.completions, time.perf_counter() - started,
                                        output.num_generated_tokens,
                                        {"weights_versions": [output.extra["weights_version"]]})
            blocks.append(SubmittedBlock(start, stop, wait))
        return blocks

    def _idle_actors(self) -> list[int]:
        """The actors with no generation call outstanding, or every actor when all are busy: a new call's blocks go
        to them, so that a call does not queue behind an actor still sampling an earlier one (a straggler). Which
        actor samples a block changes nothing it samples: every actor holds the same weights, and a block draws
        from its prompts' own seeds (a call seeded as a whole goes to one actor)."""
        idle = []
        for index in self._actors():
            refs = self._outstanding.get(index, [])
            if refs:
                _, refs = ray.wait(refs, num_returns=len(refs), timeout=0)
                self._outstanding[index] = refs
            if not refs:
                idle.append(index)
        return idle or list(self._actors())

    def update_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Send policy `version`'s weights to every actor, one bucket of weight_sync.bucket_mb in flight at a time;
        each actor checks that every weight arrived and stamps the version. The bytes sent (to each actor)."""
        if self.adapters_only:
            weights.adapters_only = True  # PolicyWeights, RankZeroWeights: the policy gives its adapters alone
        with self._push_lock:
            if self.method == "broadcast":
                return self._broadcast(version, weights)
            return self._push(version, weights)

    def _push(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        keep = self.group.max_restarts > 0
        self._buckets, self._syncing = [], True
        sent = 0
        for number, bucket in enumerate(weight_buckets(weights, self.bucket_bytes)):
            size = sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
            ref = ray.put(bucket_payload(bucket))
            if keep:
                self._buckets.append(ref)
            self.group.call([Call(i, "load_bucket", (ref,)) for i in self._actors()],
                            f"weight bucket {number} ({size / 2**20:.1f} MiB) of version {version}")
            del ref  # without restarts, one bucket in the object store at a time
            sent += size
        held = self.group.call([Call(i, "finish_sync", (version,)) for i in self._actors()],
                               f"the check of version {version}'s weights")
        if held != [version] * len(held):
            raise RunError(f"weight sync of policy version {version}: the generation workers hold versions {held}")
        self.weights_version, self._syncing = version, False
        return sent

    # ---- weight_sync.method=broadcast ----

    def _broadcast(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Push `version` by broadcast (distributed/weight_broadcast.py): the holder (the policy group's rank 0 for
        `RankZeroWeights`, else this process) gathers the weights and its plan, the weight-sync group is formed
        when new, every plan is checked against the holder's, then each bucket is broadcast while the driver waits
        for every member within cluster.timeout_s; the actors check that every weight arrived and stamp the
        version. The bytes sent (to each actor)."""
        # A death since the last push is found here, where a replacement can still catch up from a peer; one
        # during the broadcast stops the run.
        self.group.call([Call(i, "ready") for i in self._actors()], "the actor to take part in a weight push")
        self._syncing = True
        ranks = weights if isinstance(weights, RankZeroWeights) else None
        if ranks is not None:
            digest, backend, specs = ranks.gather(self.bucket_bytes)
            sender, holder = None, ranks.group.actors[0]
        else:
            sender = WeightSender(weights, self.bucket_bytes)
            digest, backend, specs, holder = plan_digest(sender.plan), backend_offer(sender.device), sender.specs, None
        plan = bucket_plan(specs, self.bucket_bytes)
        members = ("driver" if holder is None else holder, list(self.group.actors), backend)
        if self._sync_members != members:
            self._form_sync_group(holder, backend)
            self._sync_members = members
        for index, (actor_digest, _, actor_specs) in enumerate(self._actor_plans):
            if actor_digest != digest:
                self.group.failed = True
                raise RunError(f"weight sync of policy version {version}: {self.group.worker_name(index)} planned "
                               f"other buckets than the weights' holder ({first_difference(specs, actor_specs)}); "
                               "weight_sync.method=broadcast needs the generator's copy to have the trainer's "
                               "names, shapes and dtypes: use weight_sync.method=object_store otherwise")
        for index, bucket in enumerate(plan):
            what = f"broadcast {bucket.describe(index, len(plan))} of version {version}"
            deadline = time.monotonic() + self.group.timeout_s
            refs = {actor.receive_bucket.remote(index): rank for rank, actor in enumerate(self.group.actors)}
            work = None
            if holder is not None:
                refs[holder.broadcast_bucket.remote(index)] = HOLDER
            else:
                work = sender.send(self._driver_sync, index)
            self._await_members(refs, "receive_bucket", what, deadline, work)
        held = self.group.call([Call(i, "finish_sync", (version,)) for i in self._actors()],
                               f"the check of version {version}'s weights")
        if held != [version] * len(held):
            raise RunError(f"weight sync of policy version {version}: the generation workers hold versions {held}")
        self.weights_version, self._syncing = version, False
        return sum(bucket.nbytes for bucket in plan)

    def _form_sync_group(self, holder: Any | None, holder_backend: str) -> None:
        """Every actor's plan, then the weight-sync group: the holder (rank 0, hosting the store) and the actors
        (ranks 1..N) join at the holder's address, nccl when every member offers it, gloo otherwise."""
        self._actor_plans = self.group.call([Call(i, "sync_plan", (self.bucket_bytes,)) for i in self._actors()],
                                            "its weights' bucket plan")
        offers = {self._member_name(HOLDER): holder_backend}
        offers |= {self._member_name(i): offered for i, (_, offered, _) in enumerate(self._actor_plans)}
        backend, self.sync_backend_note = choose_backend(offers)
        if self.sync_backend_note is not None and any(offer != "gloo" for offer in offers.values()):
            warnings.warn(f"weight_sync.method=broadcast goes over gloo, not NCCL: {self.sync_backend_note}",
                          stacklevel=2)
        self.sync_backend = backend
        world_size, timeout_s = len(self.group.actors) + 1, self.group.timeout_s
        deadline = time.monotonic() + timeout_s
        if holder is None:
            address, port = free_port()
        else:
            self._await_members({(ask := holder.weight_sync_address.remote()): HOLDER}, "weight_sync_address",
                                "its address and a free port for the weight-sync group", deadline)
            address, port = ray.get(ask)
        refs = {actor.join_weight_sync.remote(address, port, rank + 1, world_size, backend, timeout_s): rank
                for rank, actor in enumerate(self.group.actors)}
        what = f"the weight-sync group ({backend}, {world_size} members) to form at {address}:{port}"
        failure = None
        self._driver_sync = None
        if holder is not None:
            refs[holder.join_weight_sync.remote(address, port, world_size, backend, timeout_s)] = HOLDER
        else:
            try:  # returns once every actor has joined, or raises past the deadline
                self._driver_sync = SyncGroup(address, port, 0, world_size, backend, timeout_s)
            except RuntimeError as error:  # the store or the group past the deadline
                failure = error
        self._await_members(refs, "join_weight_sync", what, deadline, None, failure)

    def _await_members(self, refs: dict[Any, int], method: str, what: str, deadline: float, work: Any = None,
                       failure: Exception | None = None) -> None:
        """Wait for every member's answer (`refs`: the actors' ranks, HOLDER for the holder's) and the driver's own
        `work` by `deadline`. RunError naming the members that died, did not answer (the first cause of a stalled
        collective: the others fail waiting for them), or failed."""
        pending, failures = dict(refs), {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                break
            who = pending.pop(ready[0])
            try:
                ray.get(ready[0])
            except (RayActorError, RayTaskError) as error:
                failures[who] = error
                if isinstance(error, RayActorError):
                    break  # a dead member: the collective cannot finish
        if work is not None and not pending and not failures:
            try:
                work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError as error:
                failure = error
        if not (pending or failures or failure):
            return
        self.group.failed = True
        resume = "the run stops here: re-run the same command to resume from the newest checkpoint"
        dead = [who for who, error in failures.items() if isinstance(error, RayActorError)]
        if dead:
            raise RunError(f"{self._member_name(dead[0])} died during `{method}` (waiting for {what}): "
                           f"{one_line(failures[dead[0]])} A broadcast cannot go on without a member of its group; "
                           f"{resume}")
        if silent := [who for who in pending.values() if who != HOLDER] or list(pending.values()):
            names = ", ".join(self._member_name(who) for who in sorted(silent))
            raise RunError(f"{names} did not answer `{method}` within cluster.timeout_s={self.group.timeout_s:g} s "
                           f"(waiting for {what}); {resume}, with a larger cluster.timeout_s if it was only slow")
        who, error = next(iter(failures.items())) if failures else (HOLDER, failure)
        raise RunError(f"{self._member_name(who)} failed during `{method}` (waiting for {what}): {one_line(error)}; "
                       f"{resume}")

    def _member_name(self, who: int) -> str:
        return "the weights' holder" if who == HOLDER else self.group.worker_name(who)

    def _masked(self, call: Call, why: str) -> GenerationOutput:
        """The answer to a `generate` call whose actor died (cluster.on_actor_failure=mask): every sample masked."""
        prompts, _, num_samples = call.args
        return GenerationOutput([[Completion(list(prompt), [], [], "", "stop", error=why)] * num_samples
                                 for prompt in prompts], 0.0, 0, {"weights_version": self.weights_version})

    def _catch_up(self, index: int) -> list[Call]:
        """What a replacement actor loads before the call it missed: the last version's buckets and its stamp, or
        during a push the buckets of the new version sent so far (the rest and the stamp follow)."""
        if self.method == "broadcast":
            return self._catch_up_from_peer(index)
        loads = [Call(index, "load_bucket", (ref,)) for ref in self._buckets]
        return loads if self._syncing else [*loads, Call(index, "finish_sync", (self.weights_version,))]

    def _catch_up_from_peer(self, index: int) -> list[Call]:
        """Under broadcast sync no push is kept in the object store: a replacement copies the weights and version
        of a live peer, and the next push re-forms the weight-sync group with it. RunError when no peer can give
        them (one generation worker, or a death during a push)."""
        name = self.group.worker_name(index)
        if self._syncing:
            self.group.failed = True
            raise RunError(f"{name} died during a weight push by broadcast, which cannot go on without a member of "
                           "its group; the run stops here: re-run the same command to resume from the newest "
                           "checkpoint")
        peers = [i for i in self._actors() if i != index]
        if self.engine == "vllm":
            self.group.failed = True
            raise RunError(f"{name} died; with weight_sync.method=broadcast a replacement copies a live peer's "
                           "weights, and a vLLM engine keeps them in its own layout, which it cannot give back: the run "
                           "stops here (re-run the same command to resume from the newest checkpoint), or use "
                           "weight_sync.method=object_store, which keeps the last push for a replacement")
        if not peers:
            self.group.failed = True
            raise RunError(f"{name} died; with weight_sync.method=broadcast its replacement copies the weights of a "
                           "live generation worker, and there is none: the run stops here (re-run the same command "
                           "to resume from the newest checkpoint), or use weight_sync.method=object_store, which "
                           "keeps the last push for a replacement")
        return [Call(index, "copy_weights_from", (self.group.actors[peers[0]], self.group.timeout_s))]

    # ---- what check-weight-sync compares ----

    def weight_digests(self) -> list[dict[str, str]]:
        """Each actor's weight digests (`weight_digests`)."""
        return self.group.call([Call(i, "weight_digests") for i in self._actors()], "the digests of its weights")

    def named_weights(self, index: int = 0) -> dict[str, torch.Tensor]:
        return self.group.call([Call(index, "named_weights")], "a copy of its weights")[0]

    def sampling_devices(self) -> list[str]:
        """Where each actor samples: "cpu", "cuda:0" (its process's first visible GPU), "cuda:0 (vllm)"."""
        return self.group.call([Call(i, "sampling_device") for i in self._actors()], "where it samples")

    def actor_versions(self) -> list[int]:
        return self.group.call([Call(i, "weights_version") for i in self._actors()], "its weights' version")

    def logprobs(self, batch: RolloutBatch, trainer: TrainerConfig, temperature: float,
                 index: int = 0) -> torch.Tensor:
        return self.group.call([Call(index, "logprobs", (batch, trainer, temperature))],
                               f"the log-probabilities of {len(batch)} rows")[0]


# ---- environments --------------------------------------------------------------------------------------------


@ray.remote
class EnvironmentActor:
    """`copies` environments built in this actor's process from their config section (`build(section, *args)`),
    when the group `start`s the actor with its scratch folder (distributed/scratch.py): the environments' temporary
    folders and the processes they start belong to it, and a replacement started with a dead actor's folder first
    stops that actor's processes and removes its folders.

    One copy (environments whose episodes live in it: tools, swe, cua; and the default): Ray's max_concurrency says
    how many calls run on it at once, each in a thread. Several copies (cluster.environment_concurrency): each call
    takes a copy no other call holds, so an environment is never stepped from two threads at once (a reward worker
    pool serves one call at a time)."""

    def __init__(self, build: Callable[..., Any], section: Any, *args: Any, copies: int = 1):
        self._build, self._section, self._args, self._copies = build, section, args, copies
        self.environments: list[Any] = []
        self.scratch: Path | None = None
        self.cleanup = scratch.Cleanup((), False)
        self._free: queue.SimpleQueue = queue.SimpleQueue()

    def ready(self) -> bool:
        return True

    def start(self, folder: str | None) -> scratch.Cleanup:
        """Claim scratch folder `folder` (cleaning up after the actor that held it before, if any; a relative one is
        taken under this node's system temporary folder; None: none), then build the environments; what the cleanup
        did. Once started, a second call (a start re-sent to a replacement that already ran it) does nothing."""
        if self.environments:
            return self.cleanup
        if folder is not None:
            self.scratch = Path(tempfile.gettempdir()) / folder
            self.cleanup = scratch.claim(self.scratch)
        self.environments = [self._build(self._section, *self._args) for _ in range(self._copies)]
        for environment in self.environments:
            self._free.put(environment)
        return self.cleanup

    def cleaned_up(self) -> scratch.Cleanup:
        """What this actor's start found of a dead predecessor and removed."""
        return self.cleanup

    def holds_episodes(self) -> bool:
        """Whether the environment's episodes live in this process (`envs.base.holds_episodes`)."""
        return holds_episodes(self.environments[0])

    def reward_weights(self) -> dict[str, float]:
        # Only multi-component environments have it.
        return dict(getattr(self.environments[0], "reward_weights", {}))

    def tool_use(self) -> ToolUse | None:
        """The tools (their schemas) and token budget of the environment built here, or None: the driver renders
        the prompts and observations offering the tools from this, the one description of them."""
        return tool_use_of(self.environments[0])

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        if len(self.environments) == 1:
            return self.environments[0].step(message_logs, metadata)
        # Ray runs at most `copies` calls at once (max_concurrency), so a copy is free: the wait is for a release.
        try:
            environment = self._free.get(timeout=ENVIRONMENT_COPY_WAIT_S)
        except queue.Empty:
            raise RuntimeError(f"no copy of the environment was free within {ENVIRONMENT_COPY_WAIT_S:g} s, although "
                               f"the actor runs at most {len(self.environments)} calls at once "
                               "(cluster.environment_concurrency)") from None
        try:
            return environment.step(message_logs, metadata)
        finally:
            self._free.put(environment)

    def close(self) -> None:
        for environment in self.environments:
            environment.close()
        if self.scratch is not None:
            scratch.release(self.scratch)


def masked_rewards(call: Call, why: str) -> EnvStep:
    """The answer to a `step` call whose actor died (cluster.on_actor_failure=mask): every episode masked, ended."""
    _, metadata = call.args
    count = len(metadata)
    return EnvStep([None] * count, [True] * count, [None] * count, [why] * count, [dict(m) for m in metadata])


class RayEnvironment:
    """The `Environment` protocol over a group of `EnvironmentActor`s (see the module docstring).

    tool_use: the tools of the environment the actors built (None when it offers none). holds_episodes: whether its
    episodes hold state in the actor that stepped their first turn (work directories, sandboxed checkouts, desktops;
    `envs.base.HoldsEpisodes`): then every later turn goes to that actor (`HOLDER_KEY` in the episode's metadata
    while it runs), and when that actor has died and been replaced the step raises `EpisodeLost`, so that the
    rollout starts the episode again from its first turn; the call is never re-sent to the replacement, which lacks
    the episode's state. scratch_folders: each actor's scratch folder when the driver can reach them (a local Ray
    instance), cleaned up at close after a group that failed (its actors were killed without closing)."""

    def __init__(self, group: WorkerGroup, reward_weights: dict[str, float], tool_use: ToolUse | None,
                 holds_episodes: bool = False, scratch_folders: Sequence[Path] = ()):
        self.group = group
        self.reward_weights = reward_weights
        self.tool_use = tool_use
        self.holds_episodes = holds_episodes
        self.scratch_folders = list(scratch_folders)
        self._next = itertools.count()
        self._lock = threading.Lock()

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        if len(message_logs) == 1 and self.holds_episodes:
            return self._step_episode(message_logs[0], metadata[0])
        actors = self.group.actors
        if len(message_logs) == 1:  # one episode (multi-turn): the next actor in turn
            with self._lock:
                first = next(self._next) % len(actors)
            order = [first]
        else:
            order = list(range(len(actors)))
        calls = [Call(index, "step", (message_logs[start:stop], metadata[start:stop]), samples=stop - start)
                 for index, (start, stop) in zip(order, contiguous_blocks(len(message_logs), len(order)))]
        results = self.group.call(calls, f"the rewards of {len(message_logs)} episodes")
        return EnvStep(*([item for result in results for item in getattr(result, field)]
                         for field in ("rewards", "done", "observations", "errors", "metadata")))

    def _step_episode(self, messages: list[Message], row: dict[str, Any]) -> EnvStep:
        """One turn of an episode that lives in an actor, on the actor holding it (the next in turn for a first
        turn)."""
        holder = row.get(HOLDER_KEY)
        if holder is None:
            with self._lock:
                index = next(self._next) % len(self.group.actors)
            holder = (index, self.group.incarnations[index])
        index, incarnation = holder
        turn = sum(message["role"] == "assistant" for message in messages)
        row = {key: value for key, value in row.items() if key != HOLDER_KEY}
        call = Call(index, "step", ([messages], [row]), samples=1, resend=False, incarnation=incarnation)
        (result,) = self.group.call([call], f"the environment's answer to turn {turn} of an episode")
        if not result.done[0]:
            result.metadata[0] = {**result.metadata[0], HOLDER_KEY: holder}
        return result

    def close(self) -> None:
        """Let each actor's environment release what it holds (reward worker processes), then kill the actors; a
        group that already missed a deadline or lost an actor is killed at once (the run is stopping over that)."""
        if self.group.actors and not self.group.failed:
            self.group.call([Call(i, "close") for i in range(len(self.group.actors))],
                            "the environment to release its workers")
        self.group.kill()
        for folder in self.scratch_folders:  # left by actors killed without closing (desktops' servers included)
            scratch.clean_up(folder)
        for parent in {folder.parent for folder in self.scratch_folders}:
            if parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()


# ---- scorers: the reference, the teacher ---------------------------------------------------------------------


class ScoringProcess:
    """A frozen scorer (reference, teacher, reward model) on its own copy of the model, built in this actor's process
    by `build(*args)` (a module-level function: `causal_lm_scorer`, `reward_model_scorer`) as the driver would build
    it. `ScoringActor` is this class as a Ray actor."""

    def __init__(self, build: Callable[..., Any], args: tuple, num_threads: int, rng_state: dict):
        # The driver's thread count and deterministic kernels (configure_torch's settings): the same sums, rounded
        # the same way, as the scorer the driver would have built.
        torch.set_num_threads(num_threads)
        torch.use_deterministic_algorithms(True, warn_only=True)
        restore_rng_state(rng_state)  # the driver's random stream, so that loading draws what it draws there
        self.scorer = build(*args)
        self._rng_state = capture_rng_state()

    def ready(self) -> bool:
        return True

    def rng_state(self) -> dict:
        """The random state right after building (where the driver continues)."""
        return self._rng_state

    def logprobs(self, batch: AnyBatch, temperature: float) -> torch.Tensor:
        return self.scorer.logprobs(batch, temperature)

    def topk_logprobs(self, batch: AnyBatch, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scorer.topk_logprobs(batch, k, temperature)

    def sequence_scores(self, batch: AnyBatch) -> torch.Tensor:
        return self.scorer.sequence_scores(batch)


ScoringActor = ray.remote(ScoringProcess)


def causal_lm_scorer(model: ModelConfig, trainer: TrainerConfig, role: str, offload: bool) -> LocalScoringWorker:
    """A reference or teacher, as `local.build_scorer` builds it in one process (on this process's device)."""
    return local.build_scorer(model, trainer, default_device(), role, offload)


def reward_model_scorer(options: RewardModelOptions) -> LocalScoringWorker:
    """A reward_model environment's model (options.path, device, batch_size, max_length), loaded as the environment
    loads it in one process (`RewardModel.from_pretrained`): its scorer, whose `sequence_scores` reads the head."""
    return RewardModel.from_pretrained(options.path, device=options.device, batch_size=options.batch_size,
                                       max_length=options.max_length).scorer


class RayScoringGroup:
    """The `ScoringWorker` protocol over a group of `ScoringActor`s (cluster.reference_workers, teacher_workers):
    a rollout batch is cut into the micro-batches a local scorer would score (micro_batch_size rows each), the
    actors score contiguous runs of them, and the answers are joined in row order, so each row is scored exactly as
    in one process. Another batch (pairs, packed rows) goes whole to the next actor in turn. Every call has the
    group's deadline (cluster.timeout_s); a dead actor is replaced and its share re-sent (`WorkerGroup`)."""

    def __init__(self, group: WorkerGroup, role: str, micro_batch_size: int, placement: Any = None):
        self.group, self.role, self.micro_batch_size = group, role, micro_batch_size
        self.placement = placement
        """The group's placement group (`RayCluster.release` removes it with the actors)."""
        self._next = itertools.count()

    def logprobs(self, batch: AnyBatch, temperature: float = 1.0) -> torch.Tensor:
        return torch.cat(self._scatter("logprobs", batch, "the log-probabilities", temperature))

    def topk_logprobs(self, batch: AnyBatch, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self._scatter("topk_logprobs", batch, f"the top-{k} log-probabilities", k, temperature)
        return torch.cat([values for values, _ in parts]), torch.cat([ids for _, ids in parts])

    def sequence_scores(self, batch: AnyBatch) -> torch.Tensor:
        return torch.cat(self._scatter("sequence_scores", batch, "the scores"))

    def sequence_scores_each(self, batches: Sequence[AnyBatch]) -> list[torch.Tensor]:
        """`sequence_scores` of each batch (a reward model's batches of one environment step), in parallel: `_each`."""
        return self._each("sequence_scores", batches, "the scores")

    def topk_logprobs_each(self, batches: Sequence[AnyBatch], k: int,
                           temperature: float = 1.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`topk_logprobs` of each batch (the micro-batches of a distillation step), in parallel: `_each`."""
        return self._each("topk_logprobs", batches, f"the top-{k} log-probabilities", k, temperature)

    def _each(self, method: str, batches: Sequence[AnyBatch], what: str, *args: Any) -> list[Any]:
        """`method` of each batch, whole, to the actors in turn, one call per actor at a time (N actors answer N
        calls in parallel, and no call waits in an actor's queue against its own cluster.timeout_s deadline); the
        answers in the batches' order."""
        actors, results = len(self.group.actors), []
        for first in range(0, len(batches), actors):
            calls = [Call(next(self._next) % actors, method, (batch, *args), samples=rows_of(batch))
                     for batch in batches[first:first + actors]]
            rows = sum(call.samples for call in calls)
            of = f" (batches {first + 1}..{first + len(calls)} of {len(batches)})" if len(batches) > 1 else ""
            results += self.group.call(calls, f"{what} of {rows} rows{of}")
        return results

    def _scatter(self, method: str, batch: AnyBatch, what: str, *args: Any) -> list[Any]:
        """The actors' answers to `method` on their shares of `batch`, in row order (`what`: the answer, as the
        messages name it)."""
        if not isinstance(batch, RolloutBatch):  # whole, to the next actor in turn
            return self._each(method, [batch], what, *args)
        rows, size = len(batch), self.micro_batch_size
        chunks = -(-rows // size)
        calls = []
        for index, (start, stop) in enumerate(contiguous_blocks(chunks, len(self.group.actors)) or [(0, 0)]):
            first, last = start * size, min(stop * size, rows)
            calls.append(Call(index, method, (batch.select(torch.arange(first, last)), *args), samples=last - first))
        return self.group.call(calls, f"{what} of {rows} rows")


def rows_of(batch: Any) -> int:
    """The samples a scorer's batch holds (an SFTBatch: its examples, one per row unless packed)."""
    return batch.num_examples if isinstance(batch, SFTBatch) else len(batch)


# ---- the cluster ---------------------------------------------------------------------------------------------


class RayCluster:
    """A Ray instance for one run: started locally (cluster.num_cpus, temporary files under OUTPUT/ray/) or joined
    at cluster.address (or the one this process already initialised); `close` kills the run's actors and shuts
    down what it started."""

    def __init__(self, section: ClusterSection, weight_sync: WeightSyncSection, output_dir: Path):
        self.section, self.weight_sync = section, weight_sync
        self.output_dir = Path(output_dir).resolve()
        self.groups: list[WorkerGroup | RankGroup] = []
        self.started = False
        self._short_temp_dir: Path | None = None
        self._placements: list[Any] = []
        """The placement groups of the generation, environment and scoring groups (removed on close; the policy
        group removes its own)."""
        if not ray.is_initialized():
            handlers = {number: signal.getsignal(number) for number in PREEMPTION_SIGNALS}
            if section.address is not None:
                ray.init(address=section.address, include_dashboard=False)
            else:
                temp_dir = ray_temp_dir(Path(output_dir))
                if temp_dir.parent != Path(output_dir).resolve():
                    self._short_temp_dir = temp_dir
                ray.init(num_cpus=section.num_cpus, _temp_dir=str(temp_dir), include_dashboard=False)
                self.started = True
            keep_signal_handlers(handlers)
        try:  # GPUs the cluster lacks stop the run now, before any actor or model
            for group in group_resources(section).values():
                refuse_missing_gpus(group)
        except RunError:
            self.close()
            raise

    def _placement(self, name: str, group_name: str | None = None) -> PlacementGroupSchedulingStrategy:
        """Where group `name`'s actors go (`group_name`: one of several groups of that kind, a teacher of several):
        a placement group of one bundle per actor (`place_actors`); a replacement actor takes the bundle its dead
        predecessor freed."""
        resources = group_resources(self.section)[name]
        if group_name is not None:
            resources = replace(resources, name=group_name)
        placement = place_actors(resources, self.section, self.started)
        self._placements.append(placement)
        return PlacementGroupSchedulingStrategy(placement)

    def _start(self, group: WorkerGroup) -> WorkerGroup:
        self.groups.append(group)
        group.call([Call(i, "ready") for i in range(len(group.actors))], "the actor to start and build its worker")
        return group

    def generator(self, model: ModelConfig, tokenizer, *, batch_size: int, seed: int, backend: str = "transformers",
                  vllm_gpu_memory_utilization: float = 0.3, lora: LoraSection | None = None) -> RayGenerator:
        """cluster.generation_workers generation actors, each loading `model` (its weights then come from the
        policy's pushes) on the GPU Ray granted it (cluster.gpus_per_generation_worker) or the CPU: the transformers
        backend (`GenerationActor`), or with backend=vllm a vLLM engine (`VLLMGenerationActor`, a GPU each). An
        actor that cannot start (vllm not importable there, a GPU torch does not see) stops the run here, named.
        With weight_sync.lora=adapters (vLLM only; `lora` the policy's LoRA settings) pushes carry the adapters alone."""
        options = {"num_cpus": self.section.cpus_per_generation_worker,
                   "num_gpus": self.section.gpus_per_generation_worker,
                   "scheduling_strategy": self._placement("generation")}
        threads = torch.get_num_threads()
        adapters = lora if self.weight_sync.lora == "adapters" else None
        if backend == "vllm":
            actor = VLLMGenerationActor.options(**options)
            arguments = (model, vllm_gpu_memory_utilization, seed, threads, adapters)
        else:
            actor = GenerationActor.options(**options)
            arguments = (model, tokenizer, batch_size, seed, threads)

        def make() -> Any:
            return actor.remote(*arguments)

        generator = RayGenerator(make, self.section.generation_workers, self.section,
                                 int(self.weight_sync.bucket_mb * 2**20), self.weight_sync.method, backend,
                                 adapters_only=adapters is not None)
        self.groups.append(generator.group)
        problems = generator.group.call([Call(i, "start_problem") for i in generator._actors()],
                                        "the actor to start and build its generator")
        for index, problem in enumerate(problems):
            if problem is not None:
                generator.group.failed = True
                raise RunError(f"{generator.group.worker_name(index)} could not start: {problem}")
        return generator

    def colocated_generator(self, policy: RayPolicyWorker, model: ModelConfig, tokenizer, *, batch_size: int,
                            seed: int) -> RankGenerator:
        """cluster.colocated=true with a policy group: a transformers generator of `model` on each of the policy's
        ranks, on the rank's device, filled with the policy's current weights (ray_policy.RankGenerator)."""
        return RankGenerator(policy, model, tokenizer, batch_size, seed)

    def policy(self, model: ModelConfig, lora: LoraSection, trainer: TrainerConfig, tokenizer, *,
               task: str = "causal_lm", schedule: TrainerConfig | None = None,
               resume_dir: Path | None = None) -> RayPolicyWorker:
        """The policy on cluster.policy_workers actors forming one torch.distributed group (ray_policy.py), built
        on every rank with `build_policy`'s arguments."""
        return start_policy(self._policy_group(), model, lora, trainer, tokenizer,
                            int(self.weight_sync.bucket_mb * 2**20), task, schedule, resume_dir)

    def critic(self, init_from: str, model: ModelConfig, trainer: TrainerConfig, tokenizer, *,
               schedule: TrainerConfig | None = None, resume_dir: Path | None = None) -> RayCriticWorker:
        """PPO's critic on the policy group's actors (started here if the policy is not there yet)."""
        return start_critic(self._policy_group(), init_from, model, trainer, tokenizer, schedule, resume_dir)

    def scorer(self, model: ModelConfig, trainer: TrainerConfig, *, role: str, offload: bool = False
               ) -> RayScoringWorker:
        """A frozen scorer (reference, teacher) sharded over the policy group's actors."""
        return start_scorer(self._policy_group(), model, trainer, role, offload)

    def scoring_group(self, model: ModelConfig, trainer: TrainerConfig, *, role: str, offload: bool = False,
                      name: str | None = None) -> RayScoringGroup:
        """A frozen scorer (reference, teacher) in a group of its own: cluster.reference_workers (teacher_workers)
        actors of cluster.cpus_per_scoring_worker CPUs and gpus_per_scoring_worker GPUs, each loading `model`.
        `name`: the group's name when a run has several of `role` (the teachers of distill: teacher_<name>),
        naming its metrics and errors; `role` by default."""
        return self._scoring_group(role, name or role, causal_lm_scorer, (model, trainer, role, offload),
                                   trainer.micro_batch_size)

    def reward_model(self, options: RewardModelOptions) -> RewardModel:
        """A reward_model environment's model in a group of its own (cluster.reward_workers actors), behind the
        `RewardModel` the environment scores with: the text is tokenized here as in one process, and each call of
        options.batch_size rows is scored by the next actor in turn (`sequence_scores`)."""
        group = self._scoring_group("reward", "reward", reward_model_scorer, (options,), options.batch_size)
        return RewardModel.scored_by(group, load_reward_tokenizer(options.path), options.batch_size,
                                     options.max_length)

    def _scoring_group(self, role: str, name: str, build: Callable[..., Any], args: tuple,
                       micro_batch_size: int) -> RayScoringGroup:
        strategy = self._placement(role, name)
        actor = ScoringActor.options(num_cpus=self.section.cpus_per_scoring_worker,
                                     num_gpus=self.section.gpus_per_scoring_worker, scheduling_strategy=strategy)
        threads, state = torch.get_num_threads(), capture_rng_state()
        group = self._start(WorkerGroup(name, lambda: actor.remote(build, args, threads, state),
                                        self.section.scoring_workers(role), self.section.timeout_s,
                                        self.section.max_restarts))
        restore_rng_state(group.call([Call(0, "rng_state")], f"the {name}'s random state after building")[0])
        return RayScoringGroup(group, role, micro_batch_size, strategy.placement_group)

    def release(self, scorer: RayScoringGroup) -> None:
        """Kill a scoring group's actors and free its placement (a precomputed teacher, done scoring); its counts
        leave the step metrics with it."""
        scorer.group.kill()
        self.groups.remove(scorer.group)
        self._placements.remove(scorer.placement)
        remove_placement_group(scorer.placement)

    def _policy_group(self) -> RankGroup:
        for group in self.groups:
            if isinstance(group, RankGroup):
                return group
        group = start_rank_group(self.section, local_instance=self.started)
        self.groups.append(group)  # before connecting: closing the cluster kills the actors whatever happens
        group.connect()
        return group

    def environment(self, build: Callable[..., Any], section: Any, *args: Any, concurrency: int = 1
                    ) -> RayEnvironment:
        """cluster.environment_workers environment actors, each running `build(section, *args)` (a module-level
        function, so that it travels by name) and answering up to `concurrency` calls at once on that one copy (each
        in a thread of its own: the environment must take `step` calls from several threads, as tool environments
        do), or, with cluster.environment_concurrency = N, building N copies and answering N calls at once, each on
        a copy of its own."""
        copies = self.section.environment_concurrency
        if copies > 1 and concurrency > 1:
            raise ValueError("an environment that answers several calls at once on one copy (tools, swe) takes no "
                             "cluster.environment_concurrency: its episodes' state lives in that copy")
        actor = EnvironmentActor.options(num_cpus=self.section.cpus_per_environment_worker,
                                         num_gpus=self.section.gpus_per_environment_worker,
                                         scheduling_strategy=self._placement("environment"),
                                         max_concurrency=max(concurrency, copies))
        masks = self.section.on_actor_failure == "mask"
        folder = self._scratch_folder

        def start(index: int) -> list[Call]:  # also what a replacement runs before anything else reaches it
            return [Call(index, "start", (folder(index),))]

        group = WorkerGroup("environment", lambda: actor.remote(build, section, *args, copies=copies),
                            self.section.environment_workers, self.section.timeout_s, self.section.max_restarts,
                            on_restart=start, mask=masked_rewards if masks else None)
        self.groups.append(group)
        group.call([call for index in range(len(group.actors)) for call in start(index)],
                   "the actor to start and build its environment")
        weights = group.call([Call(0, "reward_weights")], "the environment's reward weights")[0]
        tool_use = group.call([Call(0, "tool_use")], "the environment's tools")[0]
        holds = group.call([Call(0, "holds_episodes")], "whether the environment's episodes live in it")[0]
        local = [Path(folder(index)) for index in range(len(group.actors))] if self.started else []
        return RayEnvironment(group, weights, tool_use, holds, local)

    def _scratch_folder(self, index: int) -> str:
        """Environment actor `index`'s scratch folder (distributed/scratch.py), the same for its replacements and
        for the run when resumed: OUTPUT/environments/worker-<index> on a local instance; in a joined cluster, where
        the run directory may not exist on the actor's node, under the system's temporary folder there, named by
        the run directory."""
        if self.started:
            return str(self.output_dir / "environments" / f"worker-{index}")
        run = hashlib.sha256(str(self.output_dir).encode()).hexdigest()[:16]
        return f"posttrain-environments-{run}/worker-{index}"

    def metrics(self) -> dict[str, float]:
        """Per worker group, logged every step: heartbeat/<group>_seconds (since it last answered a call),
        faults/<group>_restarts, faults/<group>_retried_samples and faults/<group>_masked_samples (actors replaced,
        samples re-sent to them or masked, over the run so far: a resumed run goes on from its checkpoint's
        counts)."""
        metrics = {}
        for group in self.groups:
            metrics |= {f"heartbeat/{group.name}_seconds": group.seconds_since_progress(),
                        f"faults/{group.name}_restarts": float(group.restarts),
                        f"faults/{group.name}_retried_samples": float(group.retried_samples),
                        f"faults/{group.name}_masked_samples": float(group.masked_samples)}
        return metrics

    def state_dict(self) -> dict[str, dict[str, int]]:
        """Each group's fault counts, kept in checkpoints: cluster.max_restarts bounds the restarts of the whole
        run, resumes included."""
        return {group.name: {"restarts": group.restarts, "retried_samples": group.retried_samples,
                             "masked_samples": group.masked_samples} for group in self.groups}

    def load_state_dict(self, state: dict[str, dict[str, int]]) -> None:
        for group in self.groups:
            counts = state.get(group.name, {})
            group.restarts = counts.get("restarts", 0)
            group.retried_samples = counts.get("retried_samples", 0)
            group.masked_samples = counts.get("masked_samples", 0)

    def close(self) -> None:
        for group in self.groups:
            group.kill()
        self.groups = []
        for placement in self._placements:
            remove_placement_group(placement)
        self._placements = []
        if self.started:
            ray.shutdown()
            self.started = False
        if self._short_temp_dir is not None:  # the stand-in for OUTPUT/ray under the system's temporary folder
            shutil.rmtree(self._short_temp_dir, ignore_errors=True)
            self._short_temp_dir = None


def keep_signal_handlers(handlers: dict[int, Any]) -> None:
    """Put back the SIGTERM and SIGUSR1 handlers this process had before `ray.init`, which installs Ray's own: that one
    ends the driver at once, where the run's (posttrain.preemption) finishes the step, writes a checkpoint and stops.
    Only the main thread can install handlers; elsewhere the run had none to keep."""
    if threading.current_thread() is not threading.main_thread():
        return
    for number, handler in handlers.items():
        if handler is not None:
            signal.signal(number, handler)


def ray_temp_dir(output_dir: Path) -> Path:
    """OUTPUT/ray, Ray's temporary directory for this run (its logs stay there after the run); when that path is
    too long for Ray's socket paths, a short directory under the system's temporary folder, with OUTPUT/ray a link
    to it while the run lasts (removed with the run's end)."""
    wanted = output_dir.resolve() / "ray"
    if len(str(wanted)) + SOCKET_PATH_ROOM <= 107:
        wanted.mkdir(parents=True, exist_ok=True)
        return wanted
    short = Path(tempfile.mkdtemp(prefix="posttrain-ray-"))
    if wanted.is_symlink() or wanted.is_file():
        wanted.unlink()
    elif wanted.is_dir():
        shutil.rmtree(wanted)
    wanted.symlink_to(short, target_is_directory=True)
    return short
