"""Workers that hold their model in this process: the default for every recipe on one CPU or GPU.

    policy = build_policy(cfg.model, cfg.lora, cfg.trainer, tokenizer, device)      # a LocalPolicyWorker
    reference = build_scorer(cfg.model, cfg.trainer, device, role="reference")      # frozen, a LocalScoringWorker
    reference = base_model_scorer(policy)        # with LoRA: the policy itself with its adapters switched off

`LocalPolicyWorker` owns the module, its AdamW optimizer and learning-rate schedule; `LocalScoringWorker` a frozen
module (eval mode, no gradients). Both run the one forward pass of workers/forward.py under the trainer's
precision, so a policy and its reference read a batch identically.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file
from torch.distributed.tensor import distribute_tensor

from posttrain.checkpoint import (
    check_finite_weights,
    export_final,
    is_sharded,
    load_optimizer_state,
    load_sharded_state,
    save_model_state,
)
from posttrain.config.schema import LoraSection, ModelConfig, TrainerConfig
from posttrain.data.types import CrossTokenizerBatch, DistillBatch, PairBatch, RolloutBatch, SFTBatch
from posttrain.models.loading import load_causal_lm, load_trainable_model
from posttrain.models.packing import unverified_architecture
from posttrain.models.lora import ADAPTER_DIR, TaskKind, adapters_disabled, is_lora_model, merged_model, save_adapter
from posttrain.optim import build_optimizer, build_scheduler
from posttrain.workers.base import Exported, PolicyWeights, TrainBatch, WeightReceiver
from posttrain.errors import RunError
from posttrain.workers.forward import (
    AnyBatch,
    Outputs,
    TargetHidden,
    autocast,
    batch_to,
    chunked_head_outputs,
    forward_logits,
    lm_head_problem,
    outputs_of_logits,
    target_hidden,
    topk_at_targets,
    uses_chunked_head,
)
from posttrain.workers.metrics import Metric, MetricDict, reduce_metrics
from posttrain.workers.objectives import Objective
from posttrain.workers.packed import packed_logits, packed_target_hidden, packed_target_outputs


class _LocalModel:
    """The forward passes a local policy and a local scorer share."""

    model: torch.nn.Module
    trainer: TrainerConfig
    adapters_off: bool = False

    @property
    def device(self) -> torch.device:
        return self.model.device

    @contextlib.contextmanager
    def _frozen_pass(self) -> Iterator[None]:
        """Eval mode, no graph (and the adapters off for a LoRA model's base), restoring the mode afterwards."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), adapters_disabled(self.model) if self.adapters_off else contextlib.nullcontext():
                yield
        finally:
            self.model.train(was_training)

    def _outputs(self, batch: AnyBatch | PairBatch | DistillBatch | CrossTokenizerBatch, kind: Outputs = "logits",
                 temperature: float = 1.0):
        """`kind` (workers/forward.py's Outputs) of `batch`, log-probabilities under `temperature` (a PairBatch,
        DistillBatch or CrossTokenizerBatch: of its rows)."""
        if isinstance(batch, (PairBatch, DistillBatch, CrossTokenizerBatch)):
            batch = batch.rows
        if self._packs(batch):
            with autocast(self.trainer, self.device):
                if kind in ("logits", "target_hidden"):  # packed rows keep their full head
                    return packed_logits(self.model, batch)
                return packed_target_outputs(self.model, batch, kind, self._chunked_head(batch),
                                             self.trainer.lm_head_chunk_size, temperature)
        if kind == "target_hidden":
            if not self._chunked_head(batch):
                kind = "logits"
            else:
                with autocast(self.trainer, self.device):
                    hidden, positions = target_hidden(self.model, batch)
                head = self.model.get_output_embeddings()
                return TargetHidden(hidden, head.weight, head.bias, *positions, self.trainer.lm_head_chunk_size)
        if kind != "logits" and self._chunked_head(batch):
            with autocast(self.trainer, self.device):
                return chunked_head_outputs(self.model, batch, kind, self.trainer.lm_head_chunk_size, temperature)
        with autocast(self.trainer, self.device):
            logits = forward_logits(self.model, batch)
        return outputs_of_logits(logits, batch, kind, temperature)

    def _refuse_inexact_packing(self) -> None:
        """RunError at construction when trainer.packing is on for an architecture whose masks are not verified."""
        if self.trainer.packing and (problem := unverified_architecture(self.model.config)):
            raise RunError(f"trainer.packing=true would not be exact: {problem}; set trainer.packing=false")

    def _compile_if_asked(self) -> None:
        """trainer.compile: torch.compile the module's forward in place (state_dict names unchanged), with dynamic
        shapes so that variable-length batches reuse one graph."""
        if self.trainer.compile:
            self.model.compile(dynamic=True)

    def _packs(self, batch: AnyBatch) -> bool:
        """Whether trainer.packing packs `batch`: a padded one (an SFT batch packed at collation is left alone)."""
        return self.trainer.packing and not (isinstance(batch, SFTBatch) and batch.attention_mask is None)

    def _chunked_head(self, batch: AnyBatch) -> bool:
        head = self.model.get_output_embeddings()
        rows = self.trainer.micro_batch_size if isinstance(batch, RolloutBatch) else None
        return uses_chunked_head(self.trainer.lm_head, batch, head.weight.shape[0], self._head_problem(), rows)

    def _head_problem(self) -> str | None:
        """Why this worker cannot chunk its LM head (lm_head_problem: an inexact head, or a sharded one), or None;
        found once per model (it walks the module tree), not once per micro-batch."""
        if getattr(self, "_head_problem_of", (None,))[0] is not self.model:
            self._head_problem_of = (self.model, lm_head_problem(self.model))
        return self._head_problem_of[1]

    def _chunks(self, batch: AnyBatch) -> list[AnyBatch]:
        """A rollout batch in micro-batches of trainer.micro_batch_size rows; other batches are micro-batches."""
        if isinstance(batch, RolloutBatch) and len(batch) > self.trainer.micro_batch_size:
            return [batch.select(index) for index in torch.arange(len(batch)).split(self.trainer.micro_batch_size)]
        return [batch]

    def logprobs(self, batch: AnyBatch, temperature: float = 1.0) -> torch.Tensor:
        parts = []
        with self._frozen_pass():
            for chunk in self._chunks(batch):
                chunk = batch_to(chunk, self.device)
                parts.append(self._outputs(chunk, "target_logprobs", temperature).cpu())
        return torch.cat(parts)

    def evaluate(self, batch: AnyBatch | PairBatch, loss: Objective) -> MetricDict:
        """`loss`'s metrics on `batch` and the batch's mean loss (`loss`, weighted by its normalizer), in eval mode
        and without a graph."""
        with self._frozen_pass():
            batch = batch_to(batch, self.device)
            value, metrics = loss(self._outputs(batch, loss.outputs, loss.temperature), batch, None)
            return {**metrics, "loss": Metric.mean(value, loss.normalizer([batch]))}


def micro_batches_of(batch: TrainBatch, micro_batch_size: int, ranks: int) -> list:
    """The micro-batches of one optimizer step: a list of collated micro-batches as given (SFT, pairs); a
    RolloutBatch split into ranks·⌈N / (micro_batch_size·ranks)⌉ contiguous pieces of near-equal size, so that
    every data-parallel rank gets as many and none exceeds micro_batch_size rows."""
    if not isinstance(batch, RolloutBatch):
        return list(batch)
    pieces = ranks * math.ceil(len(batch) / (micro_batch_size * ranks))
    return [batch.select(index) for index in torch.tensor_split(torch.arange(len(batch)), pieces)]


class LocalPolicyWorker(_LocalModel):
    """A trained model in this process with its optimizer and schedule (see workers/base.py for the protocol).

    schedule: the TrainerConfig the learning-rate schedule counts in, when it is not `trainer` (GRPO counts
    optimizer updates, several per RL step).
    """

    def __init__(self, model: torch.nn.Module, tokenizer, trainer: TrainerConfig, schedule: TrainerConfig | None = None,
                 role: str = "policy"):
        self.model, self.tokenizer, self.trainer, self.role = model, tokenizer, trainer, role
        self.model.train()
        self.optimizer = build_optimizer(model, trainer)
        self.scheduler = build_scheduler(self.optimizer, schedule or trainer)
        self._nonfinite_loss = False
        self._refuse_inexact_packing()
        self._compile_if_asked()
        has_lm_head = getattr(model, "get_output_embeddings", lambda: None)() is not None  # not critics, not RMs
        if trainer.lm_head == "chunked" and has_lm_head and (problem := self._head_problem()):
            raise RunError(f"trainer.lm_head=chunked: {problem}; use trainer.lm_head=auto or full")

    @property
    def is_lora(self) -> bool:
        return is_lora_model(self.model)

    @property
    def version(self) -> int:
        """The policy version: optimizer steps taken (restored with the schedule when resuming)."""
        return self.scheduler.last_epoch

    # Data parallelism: one process holds every micro-batch and needs no reduction (distributed/fsdp.py overrides
    # these three).
    def _ranks(self) -> int:
        return 1

    def _my_share(self, micro_batches: list) -> list:
        return micro_batches

    def _reduce_over_ranks(self, metrics: MetricDict) -> MetricDict:
        return metrics

    def forward_backward(self, batch: TrainBatch, loss: Objective) -> MetricDict:
        """Forward and backward one minibatch (a RolloutBatch, split here into micro-batches of at most
        trainer.micro_batch_size rows; or a step's collated micro-batches) with `loss` normalized over all of it
        and every rank; gradients add up until `optim_step`. Metrics reduced over micro-batches and ranks; `loss`
        is the step's loss (0 without a forward pass when nothing in the minibatch carries loss)."""
        micro_batches = micro_batches_of(batch, self.trainer.micro_batch_size, self._ranks())
        normalizer = loss.normalizer([batch] if isinstance(batch, RolloutBatch) else micro_batches)
        if normalizer == 0:  # every sample masked (all filtered or failed): nothing to learn from
            return {"loss": Metric.sum(0.0)}
        records = []
        for micro_batch in self._my_share(micro_batches):
            micro_batch = batch_to(micro_batch, self.device)
            value, metrics = loss(self._outputs(micro_batch, loss.outputs, loss.temperature), micro_batch, normalizer)
            (value * self._gradient_scale()).backward()
            # Kept on the device (read once per step, in optim_step and with the step's metrics): no wait per
            # micro-batch.
            value = value.detach()
            self._nonfinite_loss = self._nonfinite_loss | ~torch.isfinite(value)
            records.append({**metrics, "loss": Metric.sum(value)})
        return self._reduce_over_ranks(reduce_metrics(records))

    def _gradient_scale(self) -> int:
        """What each rank's backward is multiplied by: 1 here; the world size under FSDP2, which averages
        gradients over ranks while the loss contract wants their sum."""
        return 1

    def optim_step(self) -> MetricDict:
        learning_rate = self.scheduler.get_last_lr()[0]
        max_norm = self.trainer.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                   max_norm if max_norm is not None else float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # sharded gradients (FSDP2): the norm over every rank's shard
            grad_norm = grad_norm.full_tensor()
        grad_norm = float("nan") if self._any_rank_nonfinite_loss() else float(grad_norm)
        # Never apply a non-finite update: the weights stay those of the last good step, whatever the recipe's
        # trainer.on_nonfinite then decides (stop, or skip and go on). The schedule advances either way, so the
        # learning rate stays a function of the step.
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._nonfinite_loss = False
        metrics = {"grad_norm": Metric.mean(grad_norm), "learning_rate": Metric.mean(learning_rate)}
        if self.device.type == "cuda":  # the largest of any rank's, under data parallelism
            metrics["peak_memory_gib"] = Metric.max(torch.cuda.max_memory_allocated(self.device) / 2**30)
        return self._reduce_over_ranks(metrics)

    def _any_rank_nonfinite_loss(self) -> bool:
        """Whether a micro-batch loss since the last step was not finite (on any data-parallel rank: FSDP2
        overrides this, since every rank must make the same skip decision)."""
        return bool(self._nonfinite_loss)

    def named_weights(self, adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.is_lora:
            for name, tensor in self.model.state_dict().items():
                yield name, tensor.detach()
            return
        if adapters_only:
            yield from get_peft_model_state_dict(self.model).items()
            return
        yield from merged_lora_weights(self.model)

    def push_weights(self, generator: WeightReceiver) -> dict[str, float]:
        """Give `generator` this policy's current weights, stamped with `version`; streamed tensor by tensor (the
        generator loads them in buckets), so the caller never holds a second full copy. A generator that samples
        from this worker's own module takes the version and reads no tensor. Metrics weight_sync/seconds,
        weight_sync/bytes and weight_sync/version (the version pushed)."""
        started = time.perf_counter()
        sent = generator.update_weights(self.version, PolicyWeights(self.named_weights))
        return {"weight_sync/seconds": time.perf_counter() - started, "weight_sync/bytes": float(sent),
                "weight_sync/version": float(self.version)}

    def sampling_module(self) -> torch.nn.Module | None:
        """The module a generator in this process may sample from directly, sharing the trained weights (for a
        LoRA policy its base model, into whose layers peft put the adapters): this worker's own."""
        return self.model.get_base_model() if self.is_lora else self.model

    def base_model_scorer(self, role: str = "reference") -> LocalScoringWorker | None:
        """The starting model as a frozen scorer without a second copy, when this worker can give one: a LoRA
        policy's base (its own module with the adapters switched off for every pass); None otherwise (load a
        frozen copy)."""
        if not self.is_lora:
            return None
        return LocalScoringWorker(self.model, self.trainer, role, adapters_off=True)

    def interpolation_problem(self) -> str | None:
        """Why `interpolate_toward_start` could not be exact for this model, or None. With LoRA an adapter's
        update is B·A (lora_embedding_B·lora_embedding_A on an embedding), linear in its B; anything else that
        trains (DoRA's magnitudes, a head outside the adapters) is not."""
        if not self.is_lora:
            return None
        for name, parameter in self.model.named_parameters():
            if parameter.requires_grad and _lora_part(name) is None:
                return f"{name} trains and is not a LoRA A or B matrix, so its update cannot be scaled exactly"
        return None

    def interpolate_toward_start(self, weight: float, start: ModelConfig) -> None:
        """Set the weights to start + weight·(current − start), in place. With LoRA the start is the base model,
        and scaling every adapter's B matrix by `weight` scales its update exactly so; otherwise the starting model
        `start` is loaded on the CPU for its full tensors."""
        if problem := self.interpolation_problem():
            raise RunError(f"cannot interpolate toward the base model: {problem}")
        with torch.no_grad():
            if self.is_lora:
                for name, parameter in self.model.named_parameters():
                    if parameter.requires_grad and _lora_part(name) in ("lora_B", "lora_embedding_B"):
                        parameter.mul_(weight)
                return
            # The starting model's parameters by name, loaded afresh on the CPU.
            start_weights = {name: tensor.detach() for name, tensor in load_causal_lm(start).named_parameters()}
            # named_parameters lists a tied tensor once, so the embedding and the head it shares are moved once.
            for name, parameter in self.model.named_parameters():
                if name not in start_weights:
                    raise RunError(f"cannot interpolate toward the starting model: it has no weight {name}")
                begin = start_weights[name].to(device=parameter.device, dtype=parameter.dtype)
                if hasattr(parameter, "device_mesh"):  # an FSDP2 shard: the same slice of the start tensor
                    begin = distribute_tensor(begin, parameter.device_mesh, parameter.placements)
                parameter.copy_(begin + weight * (parameter - begin))

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_model_state(directory, self.model, self.tokenizer, self.optimizer, self.scheduler)

    def load(self, directory: Path) -> None:
        """Restore a checkpoint folder: this worker's own format, or a data-parallel run's sharded one (a run
        resumed in one process after training on several)."""
        if is_sharded(directory):
            load_sharded_state(directory, self.model, self.optimizer)
            self.scheduler.load_state_dict(torch.load(Path(directory) / "scheduler.pt", weights_only=True))
            return
        load_weights(self.model, directory)
        load_optimizer_state(directory, self.optimizer, self.scheduler)

    def export(self, output_dir: Path) -> Exported:
        lora = self.is_lora
        exported = export_model(output_dir, self.model, self.tokenizer)
        if lora:
            self.model = None  # merged into its base in place: the worker is finished
        return exported

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad or not trainable_only)


def _lora_part(name: str) -> str | None:
    """Which LoRA matrix the parameter `name` is (lora_A, lora_B, lora_embedding_A, lora_embedding_B), or None."""
    return next((part for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
                 if f".{part}." in f".{name}."), None)


class LocalScoringWorker(_LocalModel):
    """A frozen model in this process (see workers/base.py for the protocol). With `adapters_off` the model is a
    LoRA policy's and scores as its frozen base (adapters switched off for each pass, nothing copied)."""

    def __init__(self, model: torch.nn.Module, trainer: TrainerConfig, role: str = "reference",
                 adapters_off: bool = False, compute_device: torch.device | None = None):
        self.model, self.trainer, self.role, self.adapters_off = model, trainer, role, adapters_off
        # Offloaded (compute_device given): the weights live where the model was loaded (the CPU) between passes.
        self.home_device = model.device if compute_device is not None else None
        self.compute_device = compute_device
        self._refuse_inexact_packing()
        if not adapters_off:  # a LoRA policy's base is the policy's own module, compiled (or not) with it
            self._compile_if_asked()
            self.model.eval()
            self.model.requires_grad_(False)

    @contextlib.contextmanager
    def _frozen_pass(self) -> Iterator[None]:
        """The frozen pass; an offloaded scorer moves its weights to its compute device for the pass and back
        home afterwards (no-ops when both are the CPU)."""
        if self.compute_device is None:
            with super()._frozen_pass():
                yield
            return
        self.model.to(self.compute_device)
        try:
            with super()._frozen_pass():
                yield
        finally:
            self.model.to(self.home_device)

    def topk_logprobs(self, batch: AnyBatch, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = [], []
        with self._frozen_pass():
            for chunk in self._chunks(batch):
                chunk = batch_to(chunk, self.device)
                if self._chunked_head(chunk):  # only the positions that predict a target, chunk by chunk
                    with autocast(self.trainer, self.device):
                        hidden, positions = (packed_target_hidden if self._packs(chunk) else target_hidden)(
                            self.model, chunk)
                    top = topk_at_targets(hidden, self.model.get_output_embeddings(), positions,
                                          chunk.input_ids.shape, k, self.trainer.lm_head_chunk_size, temperature)
                else:
                    logits = self._outputs(chunk).float() / temperature
                    top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
                values.append(top[0].cpu())
                indices.append(top[1].cpu())
        return torch.cat(values), torch.cat(indices)

    def sequence_scores(self, batch: AnyBatch) -> torch.Tensor:
        with self._frozen_pass():
            return torch.cat([self._outputs(batch_to(chunk, self.device)).squeeze(-1).float().cpu()
                              for chunk in self._chunks(batch)])


# ---- building local workers --------------------------------------------------------------------------------


def build_policy(model: ModelConfig, lora: LoraSection, trainer: TrainerConfig, tokenizer, device: torch.device,
                 task: TaskKind = "causal_lm", schedule: TrainerConfig | None = None,
                 resume_dir: Path | None = None) -> LocalPolicyWorker:
    """The policy a recipe trains: the starting model (with fresh LoRA adapters if lora.enabled), or, with
    `resume_dir`, restored from a checkpoint's policy folder."""
    module = load_trainable_model(model, lora, None, device, task=task, pad_token_id=tokenizer.pad_token_id)
    worker = LocalPolicyWorker(module, tokenizer, trainer, schedule)
    if resume_dir is not None:
        worker.load(resume_dir)
    return worker


def build_scorer(model: ModelConfig, trainer: TrainerConfig, device: torch.device,
                 role: str = "reference", offload: bool = False) -> LocalScoringWorker:
    """`model` loaded frozen (eval mode, no gradients): a reference or teacher. With `offload` its weights are
    kept in CPU memory and moved to `device` only while it scores."""
    if offload:
        return LocalScoringWorker(load_causal_lm(model, device=torch.device("cpu")), trainer, role,
                                  compute_device=device)
    return LocalScoringWorker(load_causal_lm(model, device=device), trainer, role)


def export_model(output_dir: Path, model: torch.nn.Module, tokenizer) -> Exported:
    """OUTPUT/final/ from an unsharded model; a LoRA model first writes its adapter alone to OUTPUT/adapter/ and
    is then merged into its base (in place) for final/."""
    adapter_dir = None
    check_finite_weights(model, Path(output_dir) / "final")  # before adapter/ too: nothing is written from NaN
    if is_lora_model(model):
        adapter_dir = save_adapter(model, Path(output_dir) / ADAPTER_DIR, tokenizer)
        model = merged_model(model)
    return Exported(export_final(output_dir, model, tokenizer), adapter_dir)


def merged_lora_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft LoRA model's weights with the adapters merged in, under the base model's Hugging Face names (what a
    generator loads), one tensor at a time. The merge is undone when the iteration ends (or is abandoned): the
    adapters keep training."""
    model.merge_adapter()
    try:
        for name, tensor in model.get_base_model().state_dict().items():
            if "lora_" in name or ".original_module." in name:
                continue
            yield (name.replace(".base_layer.", ".").replace(".modules_to_save.default.", "."),
                   tensor.detach().clone())
    finally:
        model.unmerge_adapter()


def load_weights(model: torch.nn.Module, directory: Path) -> None:
    """Load the weights `save_model_state` wrote into `model` in place: a peft adapter into a LoRA model, the
    safetensors files of a Hugging Face directory into a full one (weights tied to a loaded one may be absent)."""
    directory = Path(directory)
    if is_lora_model(model):
        result = set_peft_model_state_dict(model, load_file(directory / "adapter_model.safetensors"))
        unexpected = list(getattr(result, "unexpected_keys", []))
        if unexpected:
            raise ValueError(f"{directory}: adapter weights that this LoRA model has no place for: {unexpected[:5]}")
        return
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights to load")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    missing, unexpected = model.load_state_dict(state, strict=False)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    loaded = {parameters[k].data_ptr() for k in state if k in parameters}
    untied = [k for k in missing if k not in parameters or parameters[k].data_ptr() not in loaded]
    if unexpected or untied:
        raise ValueError(f"{directory} does not match the model: missing {untied[:5]}, unexpected {unexpected[:5]}")
