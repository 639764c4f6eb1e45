"""The `Generator` protocol: prompts in, sampled completions with their logprobs out.

Every backend (transformers on CPU/GPU, vLLM on GPU) returns the same typed result, so the RL
loop never knows which one sampled. Logprobs are those of the sampled tokens under the sampling
distribution actually used (temperature applied, before top-p/top-k renormalization is a
backend detail documented by each backend); the trainer recomputes its own and corrects the
difference with importance sampling (see losses.policy_gradient).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length"]
"""stop: an eos token or a stop string ended the completion; length: max_new_tokens ran out."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    """Completion budget in tokens."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 keeps all)."""
    top_k: int = 0
    """Keep the k most probable tokens (0 keeps all)."""
    stop_strings: tuple[str, ...] = ()
    """Stop when the decoded completion contains one of these; the completion keeps the stop string."""
    seed: int | None = None
    """Seed of this call's sampling (None: continue the backend's generator)."""
    seeds: tuple[int, ...] | None = None
    """One seed per prompt of the call, instead of `seed`: the j-th sample of prompt i draws from a stream of its
    own seeded `seeds[i] + j` (vLLM's convention for the samples of a request), so what a prompt samples does not
    depend on which prompts share the call (to the float rounding of the logits, which can differ with the
    batch's shape and very rarely tips a draw)."""

    def __post_init__(self) -> None:
        if self.seed is not None and self.seeds is not None:
            raise ValueError("SamplingParams takes seed or seeds, not both")

    def check_seeds_fit(self, num_prompts: int) -> None:
        """Refuse a `seeds` tuple that is not one seed per prompt of the call."""
        if self.seeds is not None and len(self.seeds) != num_prompts:
            raise ValueError(f"SamplingParams.seeds has {len(self.seeds)} seeds for {num_prompts} prompts")


@dataclass(frozen=True)
class Completion:
    """One sampled completion of one prompt."""

    prompt_ids: list[int]
    """Token ids of the prompt as the model saw it (no padding)."""
    token_ids: list[int]
    """Sampled token ids, up to and including the eos token or the token that completed a stop string."""
    logprobs: list[float]
    """Log-probability of each sampled token under the sampling distribution (len == len(token_ids))."""
    text: str
    """The decoded completion, special tokens removed."""
    finish_reason: FinishReason
    """stop (eos or stop string) or length (the budget ran out)."""
    error: str | None = None
    """Why no sample could be drawn (its generation worker died and cluster.on_actor_failure=mask): it then has no
    tokens, and its episode is masked and counted instead of scored."""

    @property
    def truncated(self) -> bool:
        """True when the budget ran out before the model finished."""
        return self.finish_reason == "length"


@dataclass(frozen=True)
class GenerationOutput:
    completions: list[list[Completion]]
    """completions[i][j]: the j-th sample of prompt i."""
    seconds: float = 0.0
    """Wall time of the call."""
    num_generated_tokens: int = 0
    """Total sampled tokens over every completion."""
    extra: dict = field(default_factory=dict)
    """Backend-specific details (for metrics)."""


@dataclass(frozen=True)
class SubmittedBlock:
    """One share of a generation call sent ahead (a Ray generation actor's: `RayGenerator.submit_blocks`): prompts
    `start` to `stop` (exclusive) of the call, waited for on its own."""

    start: int
    stop: int
    wait: Callable[[], GenerationOutput]
    """Waits for the share's completions, within a deadline; extra["weights_versions"] lists the versions that
    sampled them."""


@runtime_checkable
class Generator(Protocol):
    """Samples completions; `update_weights` keeps it in sync with the trained policy, and `weights_version` says
    which policy version it samples from (every episode records it)."""

    weights_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1) -> GenerationOutput:
        """`num_samples` completions for each prompt (prompts given as token ids)."""
        ...

    def update_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load the trainer's weights of policy `version` (Hugging Face names; consumed one tensor at a time and
        loaded in buckets of WEIGHT_BUCKET_BYTES) and return the bytes loaded. A generator that samples from the
        trainer's own module reads none of them and returns 0."""
        ...


WEIGHT_BUCKET_BYTES = 256 * 2**20
"""Weight synchronisation loads tensors in groups of about this many bytes: one bucket at a time in flight, never
a second copy of the whole model."""


def weight_buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = WEIGHT_BUCKET_BYTES
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`weights` in consecutive groups of at least one tensor and about `bucket_bytes` (a tensor larger than that
    is a bucket of its own), in the order given."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
