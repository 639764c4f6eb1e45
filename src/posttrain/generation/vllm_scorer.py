"""A teacher served by vLLM (GPU extra: ``pip install 'posttrain[vllm]'`` on a CUDA machine).

`VLLMScoringWorker` implements the scoring half of the ScoringWorker protocol (workers/base.py) that distillation
and GRPO's on-policy distillation call, `logprobs` and `topk_logprobs`, with a vLLM engine in this process: each
row of the batch is sent as a token-id prompt with ``SamplingParams(max_tokens=1, prompt_logprobs=k)``, and vLLM's
prompt log-probabilities are placed in exactly the layout the transformers scorer (workers/local.py) returns:

  - `logprobs`: [N, T] float32, entry t = log p(token t | tokens < t) from the prompt log-probability of token t;
    0 at position 0 and on padding.
  - `topk_logprobs`: ([N, T, k] float32, [N, T, k] long), position s holding the k likeliest next tokens after
    tokens ≤ s, largest first: positions 0 … L−2 from the prompt log-probabilities of tokens 1 … L−1, the last
    real position L−1 from the one sampled token's log-probabilities (``logprobs=k``); 0 on padding (the
    transformers scorer's values there are those of the pad tokens, which no loss reads).

How vLLM's numbers are read (checked against vLLM's source, v1 engine: `vllm/v1/worker/gpu_model_runner.py`
`_get_prompt_logprobs_dict`, `vllm/v1/worker/gpu/sample/prompt_logprob.py`, `vllm/v1/sample/sampler.py`
`gather_logprobs`, `vllm/v1/engine/logprobs.py`, `vllm/logprobs.py`, `vllm/v1/core/kv_cache_manager.py`):

  - A prompt position's log-probabilities are ``log_softmax(logits, dtype=float32)`` of the model's logits: no
    temperature, whatever the request's temperature (and with ``logprobs_mode`` raw_logits or processed_logits
    they would be logits, not log-probabilities, so the engine is built with ``logprobs_mode="raw_logprobs"``;
    the one sampled token's log-probabilities are then the same log_softmax of the raw logits). A temperature τ
    cannot be applied afterwards: log softmax(z/τ) needs the log-sum-exp of every logit, and only the top-k and
    the actual token come back. So this scorer serves temperature 1 only, and the recipes refuse
    ``loss.temperature`` (distill) or ``rollout.temperature`` (GRPO's OPD) ≠ 1 with ``backend: vllm`` at load.
  - Each position's entry is a ``{token id: Logprob(logprob, rank, decoded_token)}`` mapping (a list of them, or
    vLLM's ``FlatLogprobs``, which reads as one) built from the actual token followed by ``torch.topk``'s k
    entries; the actual token keeps its own rank (the count of log-probabilities ≥ its own) unless it is among
    the top k. The top-k returned here is the k largest values of the mapping, ordered by value, ties by
    vLLM's rank, so the actual token never displaces a top-k token it ties with. The prompt's first entry is
    None (nothing predicts token 0).
  - ``prompt_logprobs=0`` returns the actual token alone (enough for `logprobs`); a request asking for more
    than the engine's ``max_logprobs`` (vLLM's default 20) is refused by vLLM, so the engine is built with
    ``max_logprobs`` = the largest k the recipe will ask for.
  - Requests with prompt log-probabilities skip the prefix cache in vLLM's v1 scheduler; the engine is built with
    ``enable_prefix_caching=False`` all the same, since a cached block would carry no prompt log-probabilities.
  - The engine runs without its tokenizer (``skip_tokenizer_init=True``, ``detokenize=False``): prompts are
    token ids and nothing is decoded, which also spares decoding k tokens per position.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as the vLLM generator does) with one GPU:
one vLLM engine per process (the recipes refuse a second one: a vLLM rollout generator or another vLLM teacher),
never under torchrun. Its logits come from vLLM's kernels in the engine's dtype, so they differ from the
transformers teacher's by float rounding (HV-8 in docs/hardware-deferred-validation.md measures how much).

The conversions (`row_tokens`, `top_entries`, `token_logprobs_from_outputs`, `topk_from_outputs`) are plain
functions, tested on the CPU against a stand-in engine that computes prompt log-probabilities as vLLM does from
a real tiny model (tests/test_vllm_teacher.py); only `VLLMScoringWorker`'s engine needs vLLM and a GPU. The module
imports without vllm installed; vllm is imported when a `VLLMScoringWorker` is built.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.data.types import RolloutBatch, SFTBatch
from posttrain.generation.vllm_backend import import_vllm, vllm_engine_kwargs, vllm_environment
from posttrain.models.loading import resolve_model_path

TEMPERATURE_ONE_ONLY = (
    "vLLM computes prompt log-probabilities as log_softmax of the raw logits whatever the request's temperature, "
    "and a temperature cannot be applied to a top-k afterwards (its normalizer needs every logit)")
"""Why a vLLM teacher scores at temperature 1 only (the config refusals quote it)."""


def row_tokens(batch: SFTBatch | RolloutBatch) -> list[list[int]]:
    """Each row's real tokens: the batch must be right-padded (its attention_mask 1 on a prefix of every row) with
    position ids 0, 1, … on them (a padded SFTBatch, a RolloutBatch), which is what vLLM computes for a prompt. A
    packed or shared-prompt batch, or another layout, is a ValueError."""
    if not isinstance(batch, (SFTBatch, RolloutBatch)):
        raise ValueError(f"a vLLM teacher scores padded rows (SFTBatch, RolloutBatch), not a {type(batch).__name__}")
    if batch.attention_mask is None:
        raise ValueError("a vLLM teacher scores padded rows; packed rows (data.packing=true) are not built for it")
    mask = batch.attention_mask.bool()
    width = mask.shape[1]
    lengths = mask.sum(dim=1)
    positions = torch.arange(width).expand_as(mask)
    if not torch.equal(mask, positions < lengths[:, None]):
        raise ValueError("a vLLM teacher scores right-padded rows: some row's attention_mask is not 1 on a prefix")
    if isinstance(batch, SFTBatch) and not bool(((batch.position_ids == positions) | ~mask).all()):
        raise ValueError("a vLLM teacher scores rows whose position ids are 0, 1, 2, …; this batch's are not")
    return [batch.input_ids[row, :length].tolist() for row, length in enumerate(lengths.tolist())]


def _rank(entry: Any) -> float:
    return math.inf if entry.rank is None else entry.rank


def top_entries(position: Mapping[int, Any], k: int, where: str) -> tuple[list[float], list[int]]:
    """The k largest log-probabilities of one position's {token id: Logprob} and their token ids, largest first,
    ties in vLLM's rank order (so a tied actual token outside vLLM's top-k stays outside). RuntimeError naming
    `where` when the position holds fewer than k."""
    if len(position) < k:
        raise RuntimeError(f"{where}: vLLM returned {len(position)} log-probabilities, fewer than k={k}")
    ranked = sorted(position.items(), key=lambda item: (-item[1].logprob, _rank(item[1])))[:k]
    return [float(entry.logprob) for _, entry in ranked], [int(token) for token, _ in ranked]


def _prompt_steps(prompt: Sequence[int], output: Any, row: int) -> Sequence[Mapping[int, Any] | None]:
    steps = output.prompt_logprobs
    if steps is None:
        raise RuntimeError(f"row {row}: vLLM returned no prompt log-probabilities (the request sets prompt_logprobs)")
    if len(steps) != len(prompt):
        raise RuntimeError(f"row {row}: vLLM returned {len(steps)} prompt log-probability entries for "
                           f"{len(prompt)} prompt tokens")
    return steps


def _checked_outputs(prompts: Sequence[Sequence[int]], outputs: Sequence[Any]) -> None:
    if len(outputs) != len(prompts):
        raise RuntimeError(f"vLLM returned {len(outputs)} results for {len(prompts)} prompts")
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        if list(output.prompt_token_ids) != list(prompt):
            raise RuntimeError(f"vLLM result {i} is for a different prompt than prompt {i}: results out of order")


def token_logprobs_from_outputs(rows: Sequence[Sequence[int]], outputs: Sequence[Any],
                                shape: tuple[int, int]) -> torch.Tensor:
    """[N, T] float32 log p(token t | tokens < t) of each row's real tokens from vLLM's RequestOutputs (one per
    non-empty row, in order); 0 at position 0 and on padding."""
    scored = [row for row in rows if row]
    _checked_outputs(scored, outputs)
    values = torch.zeros(shape, dtype=torch.float32)
    results = iter(outputs)
    for row, prompt in enumerate(rows):
        if not prompt:
            continue
        steps = _prompt_steps(prompt, next(results), row)
        for s in range(1, len(prompt)):
            entry = steps[s].get(prompt[s]) if steps[s] is not None else None
            if entry is None:
                raise RuntimeError(f"row {row}, position {s}: vLLM's prompt log-probabilities lack the prompt's own "
                                   f"token {prompt[s]}")
            values[row, s] = entry.logprob
    return values


def topk_from_outputs(rows: Sequence[Sequence[int]], outputs: Sequence[Any], k: int,
                      shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, T, k] float32, [N, T, k] long) the k likeliest next tokens at each real position (position s predicts
    token s + 1), largest first, from vLLM's RequestOutputs (one per non-empty row, in order): the prompt
    log-probabilities of token s + 1 for s < L − 1, the sampled token's log-probabilities (logprobs=k) for the
    last real position; 0 on padding."""
    scored = [row for row in rows if row]
    _checked_outputs(scored, outputs)
    values = torch.zeros((*shape, k), dtype=torch.float32)
    ids = torch.zeros((*shape, k), dtype=torch.long)
    results = iter(outputs)
    for row, prompt in enumerate(rows):
        if not prompt:
            continue
        output = next(results)
        steps = _prompt_steps(prompt, output, row)
        last = output.outputs[0].logprobs if output.outputs else None
        if not last:
            raise RuntimeError(f"row {row}: vLLM returned no log-probabilities for the token after the prompt "
                               "(the request sets logprobs=k)")
        positions = [*steps[1:], last[0]]  # position s predicts token s + 1
        for s, position in enumerate(positions):
            if position is None:
                raise RuntimeError(f"row {row}, position {s + 1}: vLLM returned no prompt log-probabilities")
            top_values, top_ids = top_entries(position, k, f"row {row}, position {s}")
            values[row, s] = torch.tensor(top_values, dtype=torch.float32)
            ids[row, s] = torch.tensor(top_ids, dtype=torch.long)
    return values, ids


class VLLMScoringWorker:
    """A frozen teacher served by a vLLM engine in this process (see the module docstring).

    model_path: a Hugging Face model directory, hub id or embedded posttrain model name.
    role: the worker's role, for messages ("teacher").
    dtype: the engine's weight and activation dtype (the teacher section's `dtype`).
    gpu_memory_utilization: fraction of the GPU's memory the engine may take (weights, activations, KV cache); the
        rest is left to the student training on the same GPU.
    max_model_len: the longest row the engine takes, plus the one token it samples (None: the model's maximum).
    max_logprobs: the largest k `topk_logprobs` will be asked for (vLLM refuses more).
    engine_kwargs: any other vLLM engine argument (enforce_eager, ...).
    """

    def __init__(self, model_path: str, *, role: str = "teacher", dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.3, max_model_len: int | None = None, max_logprobs: int = 20,
                 **engine_kwargs: Any) -> None:
        for name, value in vllm_environment(1).items():
            os.environ.setdefault(name, value)  # read when the engine starts; a value set by the user wins
        self._vllm = import_vllm(f"a {role} with backend=vllm")
        self._tokens_prompt = importlib.import_module("vllm.inputs").TokensPrompt
        self.role = role
        self.max_logprobs = max_logprobs
        self.llm = self._vllm.LLM(**vllm_engine_kwargs(
            resolve_model_path(model_path), gpu_memory_utilization=gpu_memory_utilization, dtype=dtype,
            max_model_len=max_model_len, enable_sleep_mode=False, seed=0, tensor_parallel_size=1,
            **{"logprobs_mode": "raw_logprobs", "max_logprobs": max_logprobs, "enable_prefix_caching": False,
               "skip_tokenizer_init": True, **engine_kwargs}))

    def logprobs(self, batch: SFTBatch | RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
        """[N, T] log p(token t | tokens < t) at temperature 1 (the transformers scorer's layout; 0 on padding)."""
        self._refuse_temperature(temperature)
        rows = row_tokens(batch)
        return token_logprobs_from_outputs(rows, self._generate(rows, prompt_logprobs=0, logprobs=None),
                                           tuple(batch.input_ids.shape))

    def topk_logprobs(self, batch: SFTBatch | RolloutBatch, k: int,
                      temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """([N, T, k] log-probabilities, [N, T, k] ids) of the k likeliest next tokens at every real position, at
        temperature 1 (the transformers scorer's layout and order; 0 on padding)."""
        self._refuse_temperature(temperature)
        if not 1 <= k <= self.max_logprobs:
            raise ValueError(f"{self.role}: top-{k} asked of a vLLM engine built for at most {self.max_logprobs} "
                             "log-probabilities per position (loss.topk)")
        rows = row_tokens(batch)
        return topk_from_outputs(rows, self._generate(rows, prompt_logprobs=k, logprobs=k), k,
                                 tuple(batch.input_ids.shape))

    def sequence_scores(self, batch: SFTBatch | RolloutBatch) -> torch.Tensor:
        raise NotImplementedError(f"{self.role} with backend=vllm scores tokens (log-probabilities, top-k); a "
                                  "sequence score needs a reward model's head, which the transformers backend loads")

    def _refuse_temperature(self, temperature: float) -> None:
        if temperature != 1.0:
            raise ValueError(f"{self.role} backend=vllm scores at temperature 1 only, asked for {temperature:g}: "
                             f"{TEMPERATURE_ONE_ONLY}; use backend=transformers")

    def _generate(self, rows: Sequence[Sequence[int]], *, prompt_logprobs: int, logprobs: int | None) -> list[Any]:
        """One RequestOutput per non-empty row: the row as a prompt, one greedy token sampled after it."""
        prompts = [self._tokens_prompt(prompt_token_ids=list(row)) for row in rows if row]
        if not prompts:
            return []
        params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=prompt_logprobs,
                                           logprobs=logprobs, detokenize=False)
        return list(self.llm.generate(prompts, params, use_tqdm=False))
