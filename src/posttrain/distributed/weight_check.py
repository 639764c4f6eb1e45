"""What `posttrain grpo --check-weight-sync` compares: a generator's copy of the weights against the trainer's.

A generator that keeps its own copy of the model (Ray generation actors; `InProcessCopy` here, the same in this
process) answers two questions after a weight push: are its weights bitwise the trainer's (`weight_digests`,
SHA-256 per tensor), and does its copy give a fixed batch the trainer's log-probabilities (`logprobs`, the forward
pass of workers/forward.py run on its copy)?
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from posttrain.config.schema import ModelConfig, TrainerConfig
from posttrain.data.types import RolloutBatch
from posttrain.generation.base import GenerationOutput, SamplingParams
from posttrain.generation.transformers_backend import TransformersGenerator
from posttrain.models.loading import load_causal_lm
from posttrain.workers.local import LocalScoringWorker


def weight_digests(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """{name: SHA-256 of the tensor's dtype, shape and bytes}: equal digests are bitwise-equal weights."""
    digests = {}
    for name, tensor in weights:
        data = tensor.detach().cpu().contiguous()
        digest = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        digests[name] = digest.hexdigest()
    return digests


class InProcessCopy:
    """A transformers generator on its own copy of the model in this process, filled by weight pushes (what a
    data-parallel rank keeps), with the questions of the module docstring."""

    def __init__(self, model: ModelConfig, tokenizer, batch_size: int, seed: int, device: torch.device):
        self.generator = TransformersGenerator(load_causal_lm(model, device=device).eval(), tokenizer,
                                               batch_size=batch_size, seed=seed, owns_weights=True)

    @property
    def weights_version(self) -> int:
        return self.generator.weights_version

    def generate(self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1) -> GenerationOutput:
        return self.generator.generate(prompts, params, num_samples)

    def update_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        return self.generator.update_weights(version, weights)

    def weight_digests(self) -> list[dict[str, str]]:
        return [weight_digests(self.generator.model.state_dict().items())]

    def logprobs(self, batch: RolloutBatch, trainer: TrainerConfig, temperature: float) -> torch.Tensor:
        return LocalScoringWorker(self.generator.model, trainer, role="generator").logprobs(batch, temperature)
