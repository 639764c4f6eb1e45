"""FSDP2 workers: the local workers' protocol with the model sharded over the data-parallel ranks.

`torch.distributed.fsdp.fully_shard` is applied to every decoder layer (the classes a Hugging Face model lists in
`_no_split_modules`) and then to the root, so each rank holds 1/N of every parameter, gradient and AdamW moment;
a layer's full weights exist only while it runs. On GPU with trainer.precision=bf16 parameters are cast to bf16
for compute and gradients reduced in float32; `cpu_offload` keeps the shards in host memory.

What changes from a local worker, and nothing else does:
- `forward_backward(minibatch, loss)`: every rank receives the whole minibatch, splits it into the same
  micro-batches and takes every N-th (the normalizer is the whole minibatch's, so N ranks make the update one
  process makes from the same config);
- gradients are summed over ranks (FSDP averages; the backward scales the loss by N to undo that);
- the metrics of `forward_backward` and `optim_step` are reduced over ranks, each with its own reduction;
- `save`/`load` write and read a sharded `torch.distributed.checkpoint` (model and optimizer through
  get_state_dict / set_state_dict), so a run resumes on another number of ranks; a single-process checkpoint
  (a Hugging Face directory with optimizer.pt) loads too;
- `export` gathers the full weights to rank 0, which writes OUTPUT/final/ as a local run does.

Every call that runs the model is collective: all ranks make it, the same number of times (the loops guarantee
it: every rank receives the same minibatch and takes an equal share of its micro-batches; evaluation runs every
batch on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from posttrain.errors import RunError
from posttrain.checkpoint import export_final, is_sharded, load_sharded_state, save_sharded_state
from posttrain.config.schema import TrainerConfig
from posttrain.process_group import barrier, is_main, rank, world_size
from posttrain.workers.base import Exported
from posttrain.models.lora import ADAPTER_DIR
from posttrain.workers.local import LocalPolicyWorker, LocalScoringWorker, export_model, merged_lora_weights
from posttrain.workers.value import CRITIC, ValueOutputs
from posttrain.workers.metrics import MetricDict, all_reduce_metrics

def shard_module(model: torch.nn.Module, trainer: TrainerConfig, cpu_offload: bool = False) -> torch.nn.Module:
    """`fully_shard` every decoder layer, then the root (in place; the module is also returned)."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    if not layer_classes:
        raise ValueError(f"{type(model).__name__} names no decoder-layer classes (_no_split_modules); FSDP2 "
                         "sharding needs them to shard layer by layer")
    options = {}
    if torch.cuda.is_available() and trainer.precision == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"no module of {type(model).__name__} is one of {sorted(layer_classes)}")
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full tensor on every rank (collective)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


class FSDP2PolicyWorker(LocalPolicyWorker):
    """A trained model sharded with FSDP2 over the default process group (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer, trainer: TrainerConfig, schedule: TrainerConfig | None = None,
                 role: str = "policy", cpu_offload: bool = False,
                 unsharded: Callable[[], torch.nn.Module] | None = None):
        """unsharded: builds a plain copy of the starting model (with fresh adapters for LoRA) on the CPU, which
        rank 0 fills with the gathered weights to export a LoRA model (merging needs the peft module whole)."""
        refuse_compile(trainer)
        self._unsharded = unsharded
        self._plain: torch.nn.Module | None = None
        shard_module(model, trainer, cpu_offload)
        super().__init__(model, tokenizer, trainer, schedule, role)

    def _ranks(self) -> int:
        return world_size()

    def _my_share(self, micro_batches: list) -> list:
        if len(micro_batches) % world_size():
            raise ValueError(f"{len(micro_batches)} micro-batches do not split evenly over {world_size()} ranks")
        return micro_batches[rank()::world_size()]

    def _reduce_over_ranks(self, metrics: MetricDict) -> MetricDict:
        return all_reduce_metrics(metrics)

    def _any_rank_nonfinite_loss(self) -> bool:
        """Whether a micro-batch loss since the last step was not finite on any rank: every rank must make the same
        skip decision, or their shards of the model would part ways."""
        flag = torch.as_tensor(self._nonfinite_loss, device=self.device).float().reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _gradient_scale(self) -> int:
        # FSDP2 averages gradients over ranks; the loss contract wants their sum (the normalizer already counts
        # the whole step on every rank), so each rank's backward is scaled by the world size.
        return world_size()

    def sampling_module(self) -> None:
        """A sharded module has no whole weights to sample from: a generator keeps its own copy."""
        return None

    def named_weights(self, adapters_only: bool = False):
        weights = full_state_dict(self.model)
        if not self.is_lora:
            yield from weights.items()
        elif adapters_only:
            yield from ((name, tensor) for name, tensor in weights.items() if "lora_" in name)
        else:
            # Merging needs the peft module whole: each rank fills its own unsharded copy (kept between calls,
            # like the generator's copy a data-parallel GRPO run keeps) with the gathered weights and merges it.
            if self._plain is None:  # building it initialises fresh adapters: not from the run's random stream
                with torch.random.fork_rng(devices=[]):
                    self._plain = self._unsharded()
            load_exactly(self._plain, weights)
            yield from merged_lora_weights(self._plain)

    def save(self, directory: Path) -> None:
        if is_main():
            directory.mkdir(parents=True, exist_ok=True)
            self.model.config.save_pretrained(directory)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(directory)
            torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")
        barrier()
        save_sharded_state(directory, self.model, self.optimizer)
        barrier()

    def load(self, directory: Path) -> None:
        directory = Path(directory)
        if is_sharded(directory):
            load_sharded_state(directory, self.model, self.optimizer)
        else:  # a single-process checkpoint: full weights and an optimizer.pt keyed by parameter index
            if self.is_lora:
                weights = adapter_weights_by_name(self.model, load_file(directory / "adapter_model.safetensors"),
                                                  directory)
            else:
                weights = {}
                for file in sorted(directory.glob("*.safetensors")):
                    weights.update(load_file(file))
            set_model_state_dict(self.model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
            set_optimizer_state_dict(self.model, self.optimizer, by_name_optimizer_state(
                self.model, self.optimizer, torch.load(directory / "optimizer.pt", weights_only=True)),
                options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))

    def export(self, output_dir: Path) -> Exported:
        weights = full_state_dict(self.model)
        exported = Exported(Path(output_dir) / "final", Path(output_dir) / ADAPTER_DIR if self.is_lora else None)
        if is_main():
            if self.is_lora:
                plain = self._plain if self._plain is not None else self._unsharded()
                load_exactly(plain, weights)
                exported = export_model(output_dir, plain, self.tokenizer)
            else:
                exported = Exported(export_final(output_dir, unsharded_copy(self.model, weights), self.tokenizer))
        barrier()
        return exported


class FSDP2ValueWorker(ValueOutputs, FSDP2PolicyWorker):
    """PPO's critic sharded with FSDP2: the policy worker's sharding, checkpoints and gradient sum, with values
    as its outputs. Every rank computes the values of the whole batch (as the policy's log-probabilities)."""

    def __init__(self, model: torch.nn.Module, tokenizer, trainer: TrainerConfig, schedule: TrainerConfig | None = None,
                 cpu_offload: bool = False):
        super().__init__(model, tokenizer, trainer, schedule, role=CRITIC, cpu_offload=cpu_offload)


class FSDP2ScoringWorker(LocalScoringWorker):
    """A frozen model sharded with FSDP2: references and reward models of a data-parallel run."""

    def __init__(self, model: torch.nn.Module, trainer: TrainerConfig, role: str = "reference",
                 cpu_offload: bool = False):
        refuse_compile(trainer)
        model.eval()
        model.requires_grad_(False)
        shard_module(model, trainer, cpu_offload)
        super().__init__(model, trainer, role)


def refuse_compile(trainer: TrainerConfig) -> None:
    """trainer.compile is measured and tested in one process only."""
    if trainer.compile:
        raise RunError("trainer.compile=true is not available with several processes (FSDP2) yet; set "
                       "trainer.compile=false")


def load_exactly(plain: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Gathered full weights into an unsharded copy of the same (LoRA) model; every key must fit."""
    missing, unexpected = plain.load_state_dict({k: v.detach().cpu() for k, v in weights.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"gathered LoRA weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")


def adapter_weights_by_name(model: torch.nn.Module, adapter: dict[str, torch.Tensor],
                            directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of a peft adapter file (saved without the adapter's name in its keys) keyed by the names of
    `model`'s LoRA parameters, as set_model_state_dict reads them; every adapter tensor must have a place and every
    LoRA parameter (and trained whole module, `modules_to_save`) a tensor."""
    places = {}
    for name, _ in model.named_parameters():
        if "lora_" in name:
            adapter_name = name.split("lora_", 1)[1].split(".")[1]  # lora_A.<adapter>.weight
            places[name.replace(f".{adapter_name}.", ".")] = name
        elif ".modules_to_save." in name:  # a trained whole module (a reward model's score head)
            adapter_name = name.split(".modules_to_save.", 1)[1].split(".")[0]
            places[name.replace(f".modules_to_save.{adapter_name}.", ".")] = name
    unexpected = sorted(set(adapter) - set(places))
    missing = sorted(set(places) - set(adapter))
    if unexpected or missing:
        raise ValueError(f"{directory}: the adapter does not fit this LoRA model: no place for {unexpected[:3]}, "
                         f"no tensor for {missing[:3]}")
    return {places[key]: tensor for key, tensor in adapter.items()}


def by_name_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """A single-process optimizer state (keyed by the index of each parameter in the optimizer's groups) keyed by
    parameter name instead, as set_optimizer_state_dict(full_state_dict=True) reads it. posttrain builds the
    optimizer the same way on any number of ranks (optim.build_optimizer), so index i is the same parameter."""
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups = []
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        groups.append({**saved, "params": [order[i] for i in saved["params"]]})
    return {"state": {order[i]: value for i, value in state["state"].items()}, "param_groups": groups}


def unsharded_copy(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain (unsharded) model of `model`'s original class and config holding `weights` (built on the meta
    device and filled in place, so nothing is initialised twice), for save_pretrained on rank 0."""
    original = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        plain = original(model.config)
    missing, unexpected = plain.load_state_dict({k: v.detach().cpu() for k, v in weights.items()}, strict=False,
                                                assign=True)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
        raise ValueError(f"gathered weights do not fit {original.__name__}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    plain.tie_weights()
    return plain


def build_fsdp_policy(module: torch.nn.Module, tokenizer, trainer: TrainerConfig, schedule: TrainerConfig | None,
                      resume_dir: Path | None, unsharded: Callable[[], torch.nn.Module] | None = None
                      ) -> FSDP2PolicyWorker:
    """`module` sharded into an FSDP2 policy worker, restored from a checkpoint folder if `resume_dir`."""
    worker = FSDP2PolicyWorker(module, tokenizer, trainer, schedule, unsharded=unsharded)
    if resume_dir is not None:
        worker.load(resume_dir)
    return worker
