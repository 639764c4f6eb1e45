"""Stand-ins for vLLM's output types (vllm/outputs.py, vllm/logprobs.py), with the fields posttrain reads, for the
tests that run the vLLM generator and the vLLM teacher against a fake engine on the CPU."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    request_id: str = "0"
    finished: bool = True


def install_fake_vllm(monkeypatch, llm_class):
    """Put a stand-in `vllm` module (and `vllm.inputs`) whose LLM is `llm_class` into sys.modules for one test."""
    import sys
    import types

    vllm = types.ModuleType("vllm")
    vllm.LLM = llm_class
    vllm.SamplingParams = lambda **kwargs: types.SimpleNamespace(kwargs=kwargs)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    return vllm
