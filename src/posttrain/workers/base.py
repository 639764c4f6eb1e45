"""The worker protocols: what a recipe loop may ask of a model role, whoever holds the weights.

A loop composes workers and never touches an `nn.Module`, optimizer or scheduler. A local worker holds them in
this process (workers/local.py); an FSDP2 worker holds one rank's shard (distributed/); a Ray worker group
forwards the same calls to actors. Going distributed swaps the workers, not the loop.

Batches crossing the seam are the typed dataclasses of `posttrain.data.types`; results come back on the CPU
(log-probabilities, scores) or as `Metric`s that carry their reduction (workers/metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from posttrain.workers.forward import AnyBatch, Outputs
from posttrain.workers.metrics import MetricDict

LossFn = Callable[[Any, AnyBatch, float], tuple[torch.Tensor, MetricDict]]
"""(model outputs for the micro-batch, of the kind the call asked for (workers/forward.py's Outputs): logits
[B, T, V] ([B, 1] for a reward model), target log-probabilities [B, T] or TargetScores; the micro-batch, on the
worker's device; the normalizer of the whole optimizer step: tokens, sequences or pairs summed over every
micro-batch and rank) -> (this micro-batch's share of the step's loss, its metrics)."""

MetricsFn = Callable[[torch.Tensor, AnyBatch], MetricDict]
"""(model outputs, the batch) -> metrics, for evaluation passes without a graph."""


@dataclass(frozen=True)
class Exported:
    """Where `export` wrote the model: a Hugging Face directory, and with LoRA also the adapter alone."""

    final_dir: Path
    adapter_dir: Path | None = None


@runtime_checkable
class PolicyWorker(Protocol):
    """A trained model: the policy of every recipe (a reward model is the policy of `posttrain rm`)."""

    role: str

    def logprobs(self, batch: AnyBatch, temperature: float = 1.0) -> torch.Tensor:
        """[N, T] log p(token t | its own preceding tokens) under `temperature`, in eval mode, no graph, on CPU."""
        ...

    def shard(self, items: list) -> list:
        """This process's share of one optimizer step's micro-batches (all of them in one process; every N-th
        for data-parallel rank r of N). The loop gives each its share, with the whole step's normalizer."""
        ...

    def all_reduce(self, metrics: MetricDict) -> MetricDict:
        """A step's metrics reduced over every data-parallel process, each with its own reduction."""
        ...

    def forward_backward(self, batch: AnyBatch, loss_fn: LossFn, normalizer: float,
                         outputs: Outputs = "logits", temperature: float = 1.0) -> MetricDict:
        """Forward `batch`, take `loss_fn` of the `outputs` (the logits; or the target tokens' log-probabilities,
        with their entropies for "target_scores", under `temperature`, which a large vocabulary's chunked LM head
        computes without the logits: trainer.lm_head), backward (gradients add up until `optim_step`); the metrics
        include `loss` (a sum over the step's micro-batches)."""
        ...

    def evaluate(self, batch: AnyBatch, metrics_fn: MetricsFn, outputs: Outputs = "logits") -> MetricDict:
        """`metrics_fn` of the model's `outputs` on `batch`, in eval mode and without a graph."""
        ...

    def optim_step(self) -> MetricDict:
        """Clip the accumulated gradients, apply them, advance the schedule; metrics `grad_norm` (before
        clipping) and `learning_rate` (the rate this update used). An update whose gradient norm (or any
        micro-batch loss since the last step) is not finite is not applied, and `grad_norm` is then NaN or
        infinite: the recipe's trainer.on_nonfinite decides what follows."""
        ...

    def named_weights(self, adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Hugging Face parameter names and full tensors: with LoRA the adapters merged in (or, with
        `adapters_only`, the adapter tensors alone), for weight synchronisation to a generator."""
        ...

    def interpolation_problem(self) -> str | None:
        """Why `interpolate_toward_start` could not be exact for this model (a LoRA model training more than
        its A and B matrices), or None; recipes ask before training."""
        ...

    def interpolate_toward_start(self, weight: float, start_weights: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Set the weights to start + weight·(current − start) in place (DPO's final_interpolation);
        `start_weights()` gives the starting model's full tensors by name (not called for LoRA, whose start is
        the base model: its adapters' updates are scaled)."""
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
    def device(self) -> torch.device: ...


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
