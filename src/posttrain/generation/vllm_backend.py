"""The vLLM generation backend (GPU extra: ``pip install 'posttrain[vllm]'`` on a CUDA machine).

`VLLMGenerator` runs a vLLM engine in the trainer's process and implements the `Generator`
protocol: token-id prompts in, completions with the logprobs of the sampled tokens out, and
`update_weights` to load the trainer's current weights in place. `sleep` / `wake_up` free the
engine's GPU memory (weights and KV cache) while the trainer runs.

The conversions between posttrain's types and vLLM's (`vllm_sampling_kwargs`,
`completion_from_vllm`, `completions_from_request_outputs`, `vllm_engine_kwargs`) are plain
functions, tested on the CPU with stand-in objects; only `VLLMGenerator` needs vLLM and a GPU.
The module imports without vllm installed; vllm is imported when a `VLLMGenerator` is built.

How posttrain's `SamplingParams` map onto vLLM's:
  - temperature 0 is greedy. vLLM refuses n > 1 for greedy requests, and greedy samples are all
    the same, so one sample is drawn per prompt and repeated `num_samples` times.
  - top_k 0 ("keep all") is not passed at all, so vLLM uses its own "disabled" default: -1 up to
    vLLM 0.8 (which rejected 0), 0 since (where -1 is still accepted). Omitting it is right for both.
  - stop_strings become `stop` with `include_stop_str_in_output=True` (posttrain keeps the stop
    string). The completion's token ids run up to and including the token that completed it.
  - seed: vLLM gives the j-th of n samples of a request the seed `seed + j`; posttrain offsets each
    prompt's seed by `prompt_index * num_samples`, so no two samples of one call share a seed. Per-prompt
    `seeds` are passed as they are: prompt i's request is seeded `seeds[i]`.
  - vLLM raises a temperature in (0, 0.01) to 0.01 (with a warning); logprobs are then under 0.01.

Logprobs: the engine is built with ``logprobs_mode="processed_logprobs"``, so each sampled token's
logprob is taken from the distribution the sampler drew from: after temperature, and after top-k /
top-p truncation and renormalization (log_softmax of the masked, temperature-scaled logits). With
top_k=0 and top_p=1 that is log_softmax(logits / temperature). vLLM's default ("raw_logprobs")
would give the logprobs before temperature. Greedy requests report log_softmax(logits). The values
are computed in float32 from logits of the engine's dtype (bfloat16 by default), so they differ
from the trainer's own logprobs; the loss corrects for that (losses.policy_gradient).

Weight updates: `update_weights` calls the model's own ``load_weights`` on every worker through
``LLM.apply_model``; that method takes Hugging Face parameter names and handles the model's
layout (q/k/v and gate/up projections fused into one matrix, a tied lm_head skipped, rotary
buffers ignored, tensor-parallel sharding); names it does not know raise. The prefix cache is
reset afterwards, since its KV blocks were computed with the old weights. Tensors are copied into
the existing parameters, so CUDA graphs captured at start-up stay valid. This suits unquantized
checkpoints (bf16/fp16/fp32); quantized models need vLLM's weight-transfer API, not used here.

LoRA adapters (Ray generation actors with weight_sync.lora=adapters): the engine is built with ``enable_lora=True``
and `use_adapter` points every later ``generate`` at a peft adapter directory by a ``LoRARequest(name, int_id,
path)``, a new id per policy version; the base weights stay those loaded at start-up.

Process layout: with tensor_parallel_size=1 the engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so `update_weights` hands tensors over by reference with no
copy or serialization. vLLM then initializes torch.distributed (world size 1) in this process if
it is not initialized yet. With tensor_parallel_size > 1 the workers are separate processes: the
weights travel through vLLM's RPC channel (moved to the CPU first), which pickles the loading
function and so needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (a local channel between this process and
its own workers). Both variables are set with `os.environ.setdefault` before the engine starts,
so a value the user set wins. Multi-node, NCCL or CUDA-IPC weight sync belongs to distributed/.

vLLM versions. The calls were checked against vLLM's source (main branch, 2026: `vllm/entrypoints/
llm.py`, `vllm/sampling_params.py`, `vllm/logprobs.py`, `vllm/v1/engine/llm_engine.py`,
`vllm/v1/engine/parallel_sampling.py`, `vllm/v1/worker/worker_base.py`, `vllm/v1/sample/ops/
topk_topp_sampler.py`, `vllm/config/model.py`); the supported floor is vLLM 0.19.1, the first
release that accepts transformers 5 (which posttrain requires). They have not yet run on hardware:
see HV-2 in docs/hardware-deferred-validation.md. The version-sensitive calls, most fragile first:
  - ``LLM(logprobs_mode="processed_logprobs")``: engine argument since the vLLM 0.10 line; before
    it, the v1 engine returned raw (pre-temperature) logprobs with no way to change it.
  - ``LLM.apply_model(fn)`` → ``fn(model)`` on each worker, and ``model.load_weights(weights)``
    taking ``(hf_name, tensor)`` pairs: the in-place refit path used by TRL (colocate mode), verl
    and OpenRLHF. vLLM now also has a weight-transfer API (``init_weight_transfer_engine`` /
    ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` with NCCL or IPC
    backends) that is still changing between releases; it is the path for separate GPUs.
  - ``VLLM_ENABLE_V1_MULTIPROCESSING`` and ``VLLM_ALLOW_INSECURE_SERIALIZATION`` (environment).
  - ``LLM.sleep(level=)`` / ``LLM.wake_up(tags=["weights" | "kv_cache"])`` with
    ``enable_sleep_mode=True``; ``tags`` is absent in the 0.7 line.
  - ``LLM.reset_prefix_cache()``.
  - ``SamplingParams(n, temperature, top_p, top_k, max_tokens, seed, stop, stop_token_ids,
    include_stop_str_in_output, logprobs=0, detokenize, skip_special_tokens)``; top_k's "disabled"
    value (above); greedy with n > 1 rejected.
  - ``LLM.generate([TokensPrompt(prompt_token_ids=...)], [SamplingParams, ...], use_tqdm=False)``
    → ``RequestOutput(prompt_token_ids, outputs=[CompletionOutput(index, text, token_ids,
    logprobs, finish_reason)])``, logprobs a list (or ``FlatLogprobs`` sequence) of
    ``{token_id: Logprob(logprob=...)}``, one per sampled token; finish_reason "stop", "length"
    or "abort".
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from types import ModuleType
from typing import Any

import torch
from transformers import AutoTokenizer

from posttrain.generation.base import (
    Completion,
    FinishReason,
    GenerationOutput,
    SamplingParams,
    weight_buckets,
)
from posttrain.models.loading import resolve_model_path

VLLM_INSTALL_HINT = "pip install 'posttrain[vllm]' on a machine with an NVIDIA GPU (CUDA)"

FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length"}
"""vLLM's finish_reason → posttrain's. Anything else (vLLM's "abort") is an error."""


def import_vllm(user: str = "the vLLM generation backend") -> ModuleType:
    """The vllm package, or an ImportError that says how to install it (`user`: what needs it, for the message)."""
    try:
        return importlib.import_module("vllm")
    except ImportError as err:
        raise ImportError(
            f"{user} needs the vllm package, which is not installed ({err}). "
            f"Install it with: {VLLM_INSTALL_HINT}. On a CPU-only machine use the transformers backend."
        ) from err


def vllm_sampling_kwargs(
    params: SamplingParams,
    num_samples: int,
    *,
    prompt_index: int = 0,
    detokenize: bool = True,
    stop_token_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for prompt `prompt_index` of a `generate` call.

    `detokenize=False` when the engine has no tokenizer (skip_tokenizer_init); stop strings then
    cannot be matched by vLLM and are refused. `stop_token_ids` are extra token ids that end a
    completion (kept in its token ids), for example the eos token when vLLM has no tokenizer.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1, got {num_samples}")
    if params.stop_strings and not detokenize:
        raise ValueError(
            f"stop_strings {params.stop_strings!r} need vLLM's detokenizer, which is off "
            "(skip_tokenizer_init=True); load the engine with its tokenizer or drop the stop strings"
        )
    greedy = params.temperature == 0
    kwargs: dict[str, Any] = {
        "n": 1 if greedy else num_samples,
        "temperature": 0.0 if greedy else params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_new_tokens,
        "logprobs": 0,  # the sampled token's logprob only
        "detokenize": detokenize,
        "skip_special_tokens": True,
    }
    if params.top_k > 0:
        kwargs["top_k"] = params.top_k
    if params.seeds is not None:
        kwargs["seed"] = params.seeds[prompt_index]
    elif params.seed is not None:
        kwargs["seed"] = params.seed + prompt_index * num_samples
    if params.stop_strings:
        kwargs["stop"] = list(params.stop_strings)
        kwargs["include_stop_str_in_output"] = True
    if stop_token_ids:
        kwargs["stop_token_ids"] = list(stop_token_ids)
    return kwargs


def completion_from_vllm(prompt_ids: Sequence[int], output: Any, decode: Callable[[list[int]], str] | None = None) -> Completion:
    """A `Completion` from one vLLM `CompletionOutput` (token_ids, logprobs, text, finish_reason).

    `decode` turns token ids into text when vLLM did not detokenize; otherwise vLLM's text is used.
    """
    token_ids = list(output.token_ids)
    if output.logprobs is None:
        raise ValueError("vLLM returned no logprobs: the request must set logprobs=0")
    steps = list(output.logprobs)
    if len(steps) != len(token_ids):
        raise ValueError(f"vLLM returned {len(steps)} logprob entries for {len(token_ids)} sampled tokens")
    logprobs = [float(step[token].logprob) for step, token in zip(steps, token_ids)]
    if output.finish_reason not in FINISH_REASONS:
        raise RuntimeError(
            f"vLLM ended a completion with finish_reason={output.finish_reason!r} (expected 'stop' or 'length'); "
            "requests are aborted when the engine is put to sleep or shut down during generation"
        )
    return Completion(
        prompt_ids=list(prompt_ids),
        token_ids=token_ids,
        logprobs=logprobs,
        text=decode(token_ids) if decode is not None else output.text,
        finish_reason=FINISH_REASONS[output.finish_reason],
    )


def completions_from_request_outputs(
    prompts: Sequence[Sequence[int]],
    request_outputs: Sequence[Any],
    num_samples: int,
    *,
    greedy: bool,
    decode: Callable[[list[int]], str] | None = None,
) -> list[list[Completion]]:
    """completions[i][j], the j-th sample of prompt i, from vLLM's `RequestOutput`s (one per prompt, in order).

    Greedy requests carry one sample, repeated `num_samples` times (as separate `Completion`s).
    """
    if len(request_outputs) != len(prompts):
        raise RuntimeError(f"vLLM returned {len(request_outputs)} results for {len(prompts)} prompts")
    completions = []
    for i, (prompt, request_output) in enumerate(zip(prompts, request_outputs)):
        if list(request_output.prompt_token_ids) != list(prompt):
            raise RuntimeError(f"vLLM result {i} is for a different prompt than prompt {i}: results out of order")
        samples = sorted(request_output.outputs, key=lambda output: output.index)
        expected = 1 if greedy else num_samples
        if len(samples) != expected:
            raise RuntimeError(f"vLLM returned {len(samples)} samples for prompt {i}, expected {expected}")
        if greedy:
            samples = samples * num_samples
        completions.append([completion_from_vllm(prompt, output, decode) for output in samples])
    return completions


def vllm_engine_kwargs(
    model_path: str,
    *,
    gpu_memory_utilization: float = 0.3,
    dtype: str = "bfloat16",
    max_model_len: int | None = None,
    enable_sleep_mode: bool = False,
    seed: int = 0,
    tensor_parallel_size: int = 1,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM`. `engine_kwargs` (any vLLM engine argument) override the defaults here."""
    kwargs: dict[str, Any] = {
        "model": model_path,
        "gpu_memory_utilization": gpu_memory_utilization,
        "dtype": dtype,
        "enable_sleep_mode": enable_sleep_mode,
        "seed": seed,
        "tensor_parallel_size": tensor_parallel_size,
        "logprobs_mode": "processed_logprobs",
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    kwargs.update(engine_kwargs)
    return kwargs


def vllm_environment(tensor_parallel_size: int) -> dict[str, str]:
    """Environment defaults for the engine (see the module docstring, "Process layout")."""
    if tensor_parallel_size == 1:
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def load_weights_into_model(weights: list[tuple[str, torch.Tensor]], model: torch.nn.Module) -> None:
    """Runs on each vLLM worker (through `LLM.apply_model`): load HF-named weights with the model's own loader.

    Module-level so that it pickles by reference when the workers are other processes.
    """
    model.load_weights(weights)


class VLLMGenerator:
    """`Generator` backed by a vLLM engine in this process (see the module docstring).

    model_path: a Hugging Face model directory, hub id or embedded posttrain model name.
    gpu_memory_utilization: fraction of the GPU's memory vLLM may take for weights, activations and
        KV cache; the rest is left to the trainer on the same GPU.
    dtype: the engine's weight and activation dtype.
    max_model_len: longest prompt + completion (None: the model's maximum).
    enable_sleep_mode: allow `sleep` / `wake_up`, which free and restore the engine's GPU memory.
    seed: seed of the engine's sampling generator, used by calls whose SamplingParams.seed is None.
    tensor_parallel_size: GPUs the engine shards the model over.
    engine_kwargs: any other vLLM engine argument (enforce_eager, enable_prefix_caching,
        skip_tokenizer_init, ...). With skip_tokenizer_init=True vLLM neither detokenizes nor
        matches stop strings; completions are decoded with the model's Hugging Face tokenizer here
        and its eos token is passed as a stop token.
    """

    def __init__(
        self,
        model_path: str,
        *,
        gpu_memory_utilization: float = 0.3,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        enable_sleep_mode: bool = False,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        **engine_kwargs: Any,
    ) -> None:
        for name, value in vllm_environment(tensor_parallel_size).items():
            os.environ.setdefault(name, value)  # read when the engine starts; a value set by the user wins
        self._vllm = import_vllm()
        self._tokens_prompt = importlib.import_module("vllm.inputs").TokensPrompt
        self.model_path = resolve_model_path(model_path)
        self.enable_sleep_mode = enable_sleep_mode
        self.weights_version = 0
        self.in_process = tensor_parallel_size == 1
        self.decode: Callable[[list[int]], str] | None = None
        self.stop_token_ids: tuple[int, ...] = ()
        if engine_kwargs.get("skip_tokenizer_init"):
            tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(engine_kwargs.get("tokenizer") or model_path))
            self.decode = partial(tokenizer.decode, skip_special_tokens=True)
            self.stop_token_ids = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
        self.llm = self._vllm.LLM(**vllm_engine_kwargs(
            self.model_path,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            max_model_len=max_model_len,
            enable_sleep_mode=enable_sleep_mode,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            **engine_kwargs,
        ))
        self.asleep: set[str] = set()
        """Memory pools released by `sleep` and not yet restored: "weights", "kv_cache"."""
        self.weights_discarded = False
        """True after sleep(level=2) until `update_weights`: the engine's weights are garbage."""
        self.lora_request: Any = None
        """The LoRA request every generation goes with (`use_adapter`), or None: the engine's own weights."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1) -> GenerationOutput:
        """`num_samples` completions for each prompt; wakes the engine first if it sleeps."""
        if self.weights_discarded:
            raise RuntimeError("the engine slept with level=2, which discards its weights: call update_weights first")
        params.check_seeds_fit(len(prompts))
        if not prompts:
            return GenerationOutput(completions=[], extra={"backend": "vllm"})
        self._wake(("weights", "kv_cache"))
        detokenize = self.decode is None
        sampling_params = [
            self._vllm.SamplingParams(**vllm_sampling_kwargs(
                params, num_samples, prompt_index=i, detokenize=detokenize, stop_token_ids=self.stop_token_ids,
            ))
            for i in range(len(prompts))
        ]
        start = time.perf_counter()
        adapter = {} if self.lora_request is None else {"lora_request": self.lora_request}
        request_outputs = self.llm.generate(
            [self._tokens_prompt(prompt_token_ids=list(prompt)) for prompt in prompts], sampling_params, use_tqdm=False,
            **adapter,
        )
        seconds = time.perf_counter() - start
        completions = completions_from_request_outputs(
            prompts, request_outputs, num_samples, greedy=params.temperature == 0, decode=self.decode,
        )
        return GenerationOutput(
            completions=completions,
            seconds=seconds,
            num_generated_tokens=sum(len(c.token_ids) for row in completions for c in row),
            extra={"backend": "vllm"},
        )

    def update_weights(self, version: int, weights) -> int:
        """Load Hugging Face-named weights of policy `version` (all of them or a subset) into the engine in place,
        bucket by bucket (WEIGHT_BUCKET_BYTES), so the trainer never holds a second full copy; returns the bytes
        loaded.

        If the engine sleeps, only its weights are woken for this; the KV cache wakes at the next
        `generate`, so the trainer keeps that memory until sampling starts.
        """
        sent = sum(self.load_weights(bucket) for bucket in weight_buckets(weights))
        self.finish_weight_update(version)
        return sent

    def load_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of Hugging Face-named weights into the engine in place (the model's own `load_weights`,
        on every worker); the bytes loaded. A push is buckets, then `finish_weight_update` (Ray generation actors
        receive a push bucket by bucket: distributed/ray_groups.py)."""
        self._wake(("weights",))
        if self.in_process:
            bucket = [(name, tensor.detach()) for name, tensor in bucket]
        else:
            bucket = [(name, tensor.detach().cpu()) for name, tensor in bucket]
        self.llm.apply_model(partial(load_weights_into_model, bucket))
        return sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)

    def finish_weight_update(self, version: int) -> None:
        """End a push of policy `version`: the prefix cache (KV blocks of the old weights) is dropped and the version
        stamped."""
        self.llm.reset_prefix_cache()
        self.weights_discarded = False
        self.weights_version = version

    def use_adapter(self, directory: str, version: int) -> None:
        """Sample from now on with the peft adapter in `directory` over the engine's weights (a LoRA request; the
        engine was built with enable_lora=True and a max_lora_rank of at least the adapter's rank), stamped `version`.
        Each version is a request of its own id, so the engine loads it afresh; with max_loras=1 it evicts the last."""
        lora_request = importlib.import_module("vllm.lora.request").LoRARequest
        self.lora_request = lora_request(f"policy-v{version}", version + 1, directory)
        self.weights_version = version

    def sleep(self, level: int = 1) -> None:
        """Free the engine's GPU memory. level 1: weights kept in CPU memory, KV cache dropped;
        level 2: both dropped (the next `update_weights` must then load every weight)."""
        if not self.enable_sleep_mode:
            raise RuntimeError("sleep needs the engine built with enable_sleep_mode=True")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.llm.sleep(level=level)
        self.asleep = {"weights", "kv_cache"}
        self.weights_discarded = level == 2

    def wake_up(self) -> None:
        """Restore the GPU memory freed by `sleep` (generate and update_weights also do this on their own)."""
        self._wake(("weights", "kv_cache"))

    def _wake(self, tags: Iterable[str]) -> None:
        pending = [tag for tag in tags if tag in self.asleep]
        if pending:
            self.llm.wake_up(tags=pending)
            self.asleep -= set(pending)
