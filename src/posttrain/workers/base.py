"""The worker protocols: what a recipe loop may ask of a model role, whoever holds the weights.

A loop composes workers and never touches an `nn.Module`, optimizer or scheduler. A local worker holds them in
this process (workers/local.py); an FSDP2 worker holds one rank's shard (distributed/); a Ray policy group
(distributed/ray_policy.py) forwards the same calls to its actors, one FSDP2 rank each. Going distributed swaps the
workers, not the loop.

Batches crossing the seam are the typed dataclasses of `posttrain.data.types`; results come back on the CPU
(log-probabilities, scores) or as `Metric`s that carry their reduction (workers/metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from posttrain.config.schema import ModelConfig
from posttrain.data.types import CrossTokenizerBatch, DistillBatch, PairBatch, RolloutBatch
from posttrain.workers.forward import AnyBatch
from posttrain.workers.metrics import MetricDict
from posttrain.workers.objectives import Objective

TrainBatch = RolloutBatch | Sequence[AnyBatch | PairBatch | DistillBatch | CrossTokenizerBatch]
"""One optimizer step's minibatch as a worker receives it: a RolloutBatch (the worker splits it into micro-batches
of trainer.micro_batch_size rows), or the step's micro-batches already collated (SFT's packed rows, pairs)."""


@dataclass(frozen=True)
class Exported:
    """Where `export` wrote the model: a Hugging Face directory, and with LoRA also the adapter alone."""

    final_dir: Path
    adapter_dir: Path | None = None


@runtime_checkable
class WeightReceiver(Protocol):
    """What a policy pushes its weights to: a generator (workers never import generation/; any object with this
    method will do)."""

    def update_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load Hugging Face-named `weights` (consumed one by one, loaded in buckets) and record `version`;
        returns the bytes loaded (0 for a generator that samples from the trainer's own module and reads none)."""
        ...


class PolicyWeights:
    """A policy's weights as a push hands them to a generator: iterated, (Hugging Face name, full tensor) one at a
    time, with LoRA the adapters merged in; a generator that loads the adapters alone (vLLM generation actors with
    weight_sync.lora=adapters) sets `adapters_only` before iterating."""

    def __init__(self, named_weights: Callable[[bool], Iterator[tuple[str, torch.Tensor]]]):
        self.named_weights = named_weights
        self.adapters_only = False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.named_weights(self.adapters_only)


@runtime_checkable
class PolicyWorker(Protocol):
    """A trained model: the policy of every recipe (a reward model is the policy of `posttrain rm`).

    Every call takes whole minibatches and plain data (typed batches, loss descriptions that pickle), so the same
    loop drives a worker in this process, FSDP2 ranks under torchrun, or a remote actor."""

    role: str

    def logprobs(self, batch: AnyBatch, temperature: float = 1.0) -> torch.Tensor:
        """[N, T] log p(token t | its own preceding tokens) under `temperature`, in eval mode, no graph, on CPU."""
        ...

    def forward_backward(self, batch: TrainBatch, loss: Objective) -> MetricDict:
        """Forward and backward one minibatch with the loss description `loss` (workers/objectives.py): the worker
        splits it into micro-batches, divides them among its data-parallel ranks, normalizes the loss over the
        whole minibatch and every rank (gradients add up until `optim_step`), and returns the metrics reduced over
        micro-batches and ranks, `loss` among them."""
        ...

    def evaluate(self, batch: AnyBatch | PairBatch, loss: Objective) -> MetricDict:
        """`loss`'s metrics of one batch and its mean `loss`, in eval mode and without a graph."""
        ...

    def optim_step(self) -> MetricDict:
        """Clip the accumulated gradients, apply them, advance the schedule and the version; metrics `grad_norm`
        (before clipping) and `learning_rate` (the rate this update used), reduced over ranks. An update whose
        gradient norm (or any micro-batch loss since the last step) is not finite is not applied, and `grad_norm`
        is then NaN or infinite: the recipe's trainer.on_nonfinite decides what follows."""
        ...

    @property
    def version(self) -> int:
        """The policy version: optimizer steps taken, restored on resume. Episodes record the version that sampled
        them."""
        ...

    def push_weights(self, generator: WeightReceiver) -> dict[str, float]:
        """Give a generator the current weights stamped with `version`, streamed (never a second full copy in the
        caller); metrics weight_sync/seconds, weight_sync/bytes and weight_sync/version."""
        ...

    def sampling_module(self) -> torch.nn.Module | None:
        """The module a generator in this same process may sample from directly (sharing the trained weights, so
        a weight push reads nothing), or None (sharded, or in another process): the generator then keeps its own
        copy, filled by `push_weights`."""
        ...

    def base_model_scorer(self, role: str = "reference") -> ScoringWorker | None:
        """The starting model as a frozen scorer sharing this worker's weights (a LoRA policy with its adapters
        off), or None when there is no such thing (a full fine-tune: the recipe loads a frozen copy)."""
        ...

    def named_weights(self, adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Hugging Face parameter names and full tensors: with LoRA the adapters merged in (or, with
        `adapters_only`, the adapter tensors alone), for weight synchronisation to a generator."""
        ...

    def interpolation_problem(self) -> str | None:
        """Why `interpolate_toward_start` could not be exact for this model (a LoRA model training more than
        its A and B matrices), or None; recipes ask before training."""
        ...

    def interpolate_toward_start(self, weight: float, start: ModelConfig) -> None:
        """Set the weights to start + weight·(current − start) in place (DPO's final_interpolation); the worker
        loads the starting model `start` itself (not for LoRA, whose start is the base model: its adapters'
        updates are scaled)."""
        ...

    def save(self, directory: Path) -> None:
        """Write everything needed to resume this worker (weights, optimizer, schedule) into `directory`."""
        ...

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote."""
        ...

    def export(self, output_dir: Path) -> Exported:
        """Write OUTPUT/final/ (a Hugging Face model directory) and with LoRA OUTPUT/adapter/. The worker is
        finished afterwards (LoRA adapters are merged in place)."""
        ...

    def num_parameters(self, trainable_only: bool = False) -> int: ...

    @property
    def device(self) -> torch.device:
        """Where the worker computes (for messages; batches cross the seam on the CPU)."""
        ...


@runtime_checkable
class ScoringWorker(Protocol):
    """A frozen model that only scores: the reference of DPO, GRPO's KL anchor, reward models, later teachers
    and judges."""

    role: str

    def logprobs(self, batch: AnyBatch, temperature: float = 1.0) -> torch.Tensor:
        """[N, T] as PolicyWorker.logprobs."""
        ...

    def topk_logprobs(self, batch: AnyBatch, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """([N, T, k] log-probabilities, [N, T, k] token ids) of the k most likely next tokens at every position
        (position t predicts token t + 1), on CPU. With a chunked LM head (trainer.lm_head), only at the positions
        that predict a target token (the batch's loss_mask: a student's positions), 0 at the others."""
        ...

    def sequence_scores(self, batch: AnyBatch) -> torch.Tensor:
        """[N] float32 scalar score of each row (a reward model's head on the row's last real token), on CPU."""
        ...


@runtime_checkable
class CriticWorker(Protocol):
    """A learned value function (PPO's critic): V(s_t) before every token, trained beside the policy."""

    role: str

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        """[N, T] float32 V(s_t) before each token t (0 at t = 0), eval mode, no graph, on CPU."""
        ...

    def forward_backward(self, batch: TrainBatch, loss: Objective) -> MetricDict:
        """As PolicyWorker.forward_backward; the loss reads the critic's values."""
        ...

    def optim_step(self) -> MetricDict:
        """As PolicyWorker.optim_step."""
        ...

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path) -> None: ...

    def num_parameters(self, trainable_only: bool = False) -> int: ...
