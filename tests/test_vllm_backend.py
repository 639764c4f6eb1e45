"""The vLLM backend's CPU-testable parts: SamplingParams → vLLM kwargs, vLLM outputs → Completions, engine
arguments, the install hint, and VLLMGenerator's bookkeeping against a stand-in `vllm` module.

The stand-ins mimic vLLM's RequestOutput / CompletionOutput / Logprob as of the versions named in the
module docstring; whether real vLLM behaves as they do is HV-2's job (scripts/hardware/hv2_vllm_generation.py).
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import pytest
import torch

from posttrain.generation.base import Generator, SamplingParams
from posttrain.generation.vllm_backend import (
    VLLMGenerator,
    completion_from_vllm,
    completions_from_request_outputs,
    import_vllm,
    vllm_engine_kwargs,
    vllm_environment,
    vllm_sampling_kwargs,
)

from vllm_outputs import CompletionOutput, Logprob, RequestOutput, install_fake_vllm

# Fields of vllm.SamplingParams (vllm/sampling_params.py) that the backend may set.
VLLM_SAMPLING_FIELDS = {
    "n", "temperature", "top_p", "top_k", "max_tokens", "logprobs", "seed", "stop", "stop_token_ids",
    "include_stop_str_in_output", "detokenize", "skip_special_tokens",
}


def sample(index: int, token_ids: list[int], logprobs: list[float], finish_reason: str = "length", text: str = "") -> CompletionOutput:
    """A CompletionOutput whose logprob dicts also hold a higher-ranked token besides the sampled one (as with logprobs=k)."""
    steps = [{token: Logprob(lp, rank=2), 999: Logprob(-0.01, rank=1)} for token, lp in zip(token_ids, logprobs)]
    return CompletionOutput(index=index, text=text, token_ids=token_ids, logprobs=steps, finish_reason=finish_reason)


# --- SamplingParams → vllm.SamplingParams kwargs ---------------------------------------------------------------


def test_sampling_kwargs_for_sampling():
    params = SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=0)
    kwargs = vllm_sampling_kwargs(params, 4)
    assert kwargs == {
        "n": 4, "temperature": 0.7, "top_p": 0.9, "max_tokens": 7, "logprobs": 0,
        "detokenize": True, "skip_special_tokens": True,
    }
    # top_k 0 ("keep all") is left to vLLM's own disabled default (-1 before 0.9, 0 since).
    assert "top_k" not in kwargs
    assert set(kwargs) <= VLLM_SAMPLING_FIELDS


def test_sampling_kwargs_top_k_passes_through_when_set():
    assert vllm_sampling_kwargs(SamplingParams(top_k=5), 2)["top_k"] == 5


def test_temperature_zero_is_one_greedy_sample():
    kwargs = vllm_sampling_kwargs(SamplingParams(temperature=0.0, top_p=0.5), 8)
    assert kwargs["temperature"] == 0.0
    assert kwargs["n"] == 1  # vLLM refuses n > 1 for greedy requests


def test_stop_strings_are_kept_in_the_output():
    kwargs = vllm_sampling_kwargs(SamplingParams(stop_strings=("\n\n", "</answer>")), 2)
    assert kwargs["stop"] == ["\n\n", "</answer>"]
    assert kwargs["include_stop_str_in_output"] is True
    assert set(kwargs) <= VLLM_SAMPLING_FIELDS


def test_seeds_differ_across_prompts_and_samples():
    # vLLM seeds the j-th of n samples with seed + j; prompt i starts at seed + i * n.
    params = SamplingParams(seed=100)
    seeds = [vllm_sampling_kwargs(params, 3, prompt_index=i)["seed"] for i in range(4)]
    assert seeds == [100, 103, 106, 109]
    all_sample_seeds = {s + j for s in seeds for j in range(3)}
    assert len(all_sample_seeds) == 12
    assert "seed" not in vllm_sampling_kwargs(SamplingParams(seed=None), 3, prompt_index=2)


def test_per_prompt_seeds_seed_each_request_as_given():
    # The transformers backend's convention too: sample j of prompt i draws from seeds[i] + j.
    params = SamplingParams(seeds=(7, 1000, 42))
    assert [vllm_sampling_kwargs(params, 4, prompt_index=i)["seed"] for i in range(3)] == [7, 1000, 42]


def test_without_detokenizer_stop_strings_are_refused_and_eos_is_a_stop_token():
    kwargs = vllm_sampling_kwargs(SamplingParams(), 2, detokenize=False, stop_token_ids=(256,))
    assert kwargs["detokenize"] is False
    assert kwargs["stop_token_ids"] == [256]
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        vllm_sampling_kwargs(SamplingParams(stop_strings=("\n",)), 2, detokenize=False)


def test_num_samples_must_be_positive():
    with pytest.raises(ValueError, match="num_samples"):
        vllm_sampling_kwargs(SamplingParams(), 0)


# --- vLLM outputs → Completions ----------------------------------------------------------------------------------


def test_completion_takes_the_sampled_tokens_logprob():
    output = sample(0, [5, 6, 256], [-1.25, -0.5, -2.0], finish_reason="stop", text="ab")
    completion = completion_from_vllm([1, 2, 3], output)
    assert completion.prompt_ids == [1, 2, 3]
    assert completion.token_ids == [5, 6, 256]
    assert completion.logprobs == [-1.25, -0.5, -2.0]  # not the rank-1 token's -0.01
    assert completion.text == "ab"
    assert completion.finish_reason == "stop" and not completion.truncated


def test_completion_length_is_truncated():
    completion = completion_from_vllm([1], sample(0, [7, 8], [-0.1, -0.2], finish_reason="length"))
    assert completion.finish_reason == "length" and completion.truncated


def test_completion_decodes_when_vllm_did_not():
    output = sample(0, [104, 105], [-0.1, -0.2], text="")
    completion = completion_from_vllm([1], output, decode=lambda ids: bytes(ids).decode())
    assert completion.text == "hi"


def test_aborted_completion_is_an_error():
    with pytest.raises(RuntimeError, match="abort"):
        completion_from_vllm([1], sample(0, [7], [-0.1], finish_reason="abort"))


def test_missing_or_short_logprobs_are_errors():
    no_logprobs = CompletionOutput(index=0, text="", token_ids=[7], logprobs=None, finish_reason="length")
    with pytest.raises(ValueError, match="logprobs=0"):
        completion_from_vllm([1], no_logprobs)
    short = sample(0, [7, 8], [-0.1, -0.2])
    short.logprobs = short.logprobs[:1]
    with pytest.raises(ValueError, match="1 logprob entries for 2"):
        completion_from_vllm([1], short)


def test_request_outputs_are_ordered_by_sample_index():
    prompts = [[1, 2], [3]]
    outputs = [
        RequestOutput([1, 2], [sample(1, [11], [-1.0]), sample(0, [10], [-0.5])]),
        RequestOutput([3], [sample(0, [20], [-0.1]), sample(1, [21], [-0.2])]),
    ]
    completions = completions_from_request_outputs(prompts, outputs, 2, greedy=False)
    assert [[c.token_ids for c in row] for row in completions] == [[[10], [11]], [[20], [21]]]
    assert completions[0][0].prompt_ids == [1, 2] and completions[1][1].prompt_ids == [3]


def test_greedy_sample_is_repeated():
    outputs = [RequestOutput([1], [sample(0, [10, 11], [-0.5, -0.25])])]
    completions = completions_from_request_outputs([[1]], outputs, 3, greedy=True)
    assert len(completions[0]) == 3
    assert all(c.token_ids == [10, 11] and c.logprobs == [-0.5, -0.25] for c in completions[0])
    assert completions[0][0] is not completions[0][1]
    assert completions[0][0].token_ids is not completions[0][1].token_ids


def test_request_outputs_are_checked_against_the_prompts():
    with pytest.raises(RuntimeError, match="out of order"):
        completions_from_request_outputs([[1], [2]], [RequestOutput([2], [sample(0, [5], [-1.0])]),
                                                      RequestOutput([1], [sample(0, [5], [-1.0])])], 1, greedy=False)
    with pytest.raises(RuntimeError, match="2 samples for prompt 0, expected 3"):
        completions_from_request_outputs([[1]], [RequestOutput([1], [sample(0, [5], [-1.0]), sample(1, [6], [-1.0])])],
                                         3, greedy=False)
    with pytest.raises(RuntimeError, match="1 results for 2 prompts"):
        completions_from_request_outputs([[1], [2]], [RequestOutput([1], [sample(0, [5], [-1.0])])], 1, greedy=False)


# --- engine arguments and environment -------------------------------------------------------------------------


def test_engine_kwargs_ask_for_logprobs_under_temperature():
    kwargs = vllm_engine_kwargs("/models/m")
    assert kwargs == {
        "model": "/models/m", "gpu_memory_utilization": 0.3, "dtype": "bfloat16", "enable_sleep_mode": False,
        "seed": 0, "tensor_parallel_size": 1, "logprobs_mode": "processed_logprobs",
    }


def test_engine_kwargs_pass_max_model_len_and_overrides():
    kwargs = vllm_engine_kwargs("m", max_model_len=1024, enforce_eager=True, logprobs_mode="raw_logprobs")
    assert kwargs["max_model_len"] == 1024
    assert kwargs["enforce_eager"] is True
    assert kwargs["logprobs_mode"] == "raw_logprobs"


def test_environment_in_process_for_one_gpu_rpc_pickling_for_several():
    assert vllm_environment(1) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert vllm_environment(2) == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


# --- the import ----------------------------------------------------------------------------------------------


@pytest.fixture
def vllm_environment_restored():
    """VLLMGenerator sets vLLM's environment variables; put them back as they were after the test."""
    names = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION")
    saved = {name: os.environ.pop(name, None) for name in names}
    yield
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


def test_module_imports_without_vllm_and_says_how_to_install_it(monkeypatch, vllm_environment_restored):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    module = importlib.reload(importlib.import_module("posttrain.generation.vllm_backend"))
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[vllm\]'.*CUDA"):
        import_vllm()
    with pytest.raises(ImportError, match=r"posttrain\[vllm\]"):
        module.VLLMGenerator("posttrain/tiny")


# --- VLLMGenerator against a stand-in vllm module -------------------------------------------------------------


class FakeModel:
    def __init__(self) -> None:
        self.loaded: list[list[tuple[str, torch.Tensor]]] = []

    def load_weights(self, weights):
        self.loaded.append(list(weights))
        return {name for name, _ in weights}


class FakeLLM:
    """Records calls; each sample's tokens are [100 + prompt index, j] with logprobs [-1, -2]."""

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.calls, self.model = kwargs, [], FakeModel()

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append(("generate", [sp.kwargs for sp in sampling_params]))
        return [
            RequestOutput(prompt["prompt_token_ids"], [sample(j, [100 + i, j], [-1.0, -2.0], text=f"{i}/{j}")
                                                       for j in range(sp.kwargs["n"])])
            for i, (prompt, sp) in enumerate(zip(prompts, sampling_params))
        ]

    def apply_model(self, func):
        self.calls.append(("apply_model",))
        return [func(self.model)]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))


@pytest.fixture
def fake_vllm(monkeypatch, vllm_environment_restored, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # tmp_path stands for a model directory; the fake engine reads none
    vllm = install_fake_vllm(monkeypatch, FakeLLM)
    return vllm


def test_generator_builds_the_engine_in_process(fake_vllm, tmp_path):
    generator = VLLMGenerator(str(tmp_path), max_model_len=256, enable_sleep_mode=True, enforce_eager=True)
    assert isinstance(generator, Generator)
    assert generator.llm.kwargs["model"] == str(tmp_path)
    assert generator.llm.kwargs["max_model_len"] == 256
    assert generator.llm.kwargs["enforce_eager"] is True
    assert generator.llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_generate_maps_params_and_outputs(fake_vllm, tmp_path):
    generator = VLLMGenerator(str(tmp_path))
    out = generator.generate([[1, 2], [3]], SamplingParams(max_new_tokens=2, temperature=1.0, seed=7), num_samples=2)
    (_, per_prompt), = generator.llm.calls
    assert [kw["seed"] for kw in per_prompt] == [7, 9]
    assert [[c.token_ids for c in row] for row in out.completions] == [[[100, 0], [100, 1]], [[101, 0], [101, 1]]]
    assert out.completions[1][0].prompt_ids == [3]
    assert out.completions[0][1].text == "0/1"
    assert out.num_generated_tokens == 8
    assert out.extra["backend"] == "vllm"


def test_generate_refuses_seeds_that_are_not_one_per_prompt(fake_vllm, tmp_path):
    generator = VLLMGenerator(str(tmp_path))
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        generator.generate([[1], [2], [3]], SamplingParams(seeds=(1, 2)))
    assert generator.llm.calls == []  # refused before the engine was asked


def test_generate_greedy_asks_for_one_sample_and_repeats_it(fake_vllm, tmp_path):
    generator = VLLMGenerator(str(tmp_path))
    out = generator.generate([[1]], SamplingParams(temperature=0.0), num_samples=3)
    assert generator.llm.calls[0][1][0]["n"] == 1
    assert [c.token_ids for c in out.completions[0]] == [[100, 0]] * 3
    assert out.num_generated_tokens == 6


def test_generate_with_no_prompts_skips_the_engine(fake_vllm, tmp_path):
    generator = VLLMGenerator(str(tmp_path))
    assert generator.generate([], SamplingParams()).completions == []
    assert generator.llm.calls == []


def test_update_weights_loads_in_place_then_resets_the_prefix_cache(fake_vllm, tmp_path):
    generator = VLLMGenerator(str(tmp_path))
    weight = torch.ones(2, 2, requires_grad=True)
    assert generator.update_weights(3, [("model.embed_tokens.weight", weight)]) == 16
    assert generator.weights_version == 3
    assert generator.llm.calls == [("apply_model",), ("reset_prefix_cache",)]
    (loaded,) = generator.llm.model.loaded
    assert [name for name, _ in loaded] == ["model.embed_tokens.weight"]
    assert not loaded[0][1].requires_grad
    assert loaded[0][1].data_ptr() == weight.data_ptr()  # in process: handed over by reference, no copy


def test_sleeping_engine_wakes_weights_for_an_update_and_kv_cache_for_generation(fake_vllm, tmp_path):
    generator = VLLMGenerator(str(tmp_path), enable_sleep_mode=True)
    generator.sleep(level=1)
    generator.update_weights(1, [("lm_head.weight", torch.zeros(1))])
    generator.generate([[1]], SamplingParams())
    generator.generate([[1]], SamplingParams())
    names = [call[0] if call[0] != "wake_up" else call for call in generator.llm.calls]
    assert names == ["sleep", ("wake_up", ("weights",)), "apply_model", "reset_prefix_cache",
                     ("wake_up", ("kv_cache",)), "generate", "generate"]


def test_level_two_sleep_needs_new_weights_before_generating(fake_vllm, tmp_path):
    generator = VLLMGenerator(str(tmp_path), enable_sleep_mode=True)
    generator.sleep(level=2)
    with pytest.raises(RuntimeError, match="update_weights"):
        generator.generate([[1]], SamplingParams())
    generator.update_weights(1, [("lm_head.weight", torch.zeros(1))])
    generator.generate([[1]], SamplingParams())


def test_sleep_needs_sleep_mode(fake_vllm, tmp_path):
    generator = VLLMGenerator(str(tmp_path))
    with pytest.raises(RuntimeError, match="enable_sleep_mode=True"):
        generator.sleep()


def test_several_gpus_send_weights_through_the_cpu(fake_vllm, tmp_path):
    generator = VLLMGenerator(str(tmp_path), tensor_parallel_size=2)
    assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    weight = torch.ones(2, 2)
    generator.update_weights(1, [("model.norm.weight", weight)])
    (loaded,) = generator.llm.model.loaded
    assert loaded[0][1].device.type == "cpu" and torch.equal(loaded[0][1], weight)


def test_without_vllm_tokenizer_the_hf_tokenizer_decodes(fake_vllm, tiny_model_dir):
    generator = VLLMGenerator(str(tiny_model_dir), skip_tokenizer_init=True)
    out = generator.generate([[104]], SamplingParams(max_new_tokens=2), num_samples=1)
    kwargs = generator.llm.calls[0][1][0]
    assert kwargs["detokenize"] is False
    assert kwargs["stop_token_ids"] == [256]  # the tiny tokenizer's eos, <|endoftext|>
    assert out.completions[0][0].text == "d\x00"  # tokens [100, 0] decoded by the byte-level HF tokenizer


def test_an_adapter_in_use_goes_with_every_generation_as_a_lora_request_of_its_version(fake_vllm, tmp_path,
                                                                                         monkeypatch):
    """use_adapter (Ray generation actors with weight_sync.lora=adapters): later generate calls carry a LoRA request
    naming the adapter's folder, a new id per version; a push bucket by bucket loads each bucket, then drops the
    prefix cache and stamps the version."""
    import sys
    import types

    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda name, int_id, path: (name, int_id, path)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)

    class LoRAFakeLLM(FakeLLM):
        def generate(self, prompts, sampling_params, use_tqdm=True, lora_request=None):
            self.calls.append(("lora_request", lora_request))
            return super().generate(prompts, sampling_params, use_tqdm)

    fake_vllm.LLM = LoRAFakeLLM
    generator = VLLMGenerator(str(tmp_path))
    generator.generate([[1]], SamplingParams(max_new_tokens=2))
    generator.use_adapter(str(tmp_path / "v3"), 3)
    generator.generate([[1]], SamplingParams(max_new_tokens=2))
    requests = [call[1] for call in generator.llm.calls if call[0] == "lora_request"]
    assert requests == [None, ("policy-v3", 4, str(tmp_path / "v3"))]
    assert generator.weights_version == 3

    weights = [("a", torch.zeros(2)), ("b", torch.ones(3))]
    assert generator.load_weights(weights[:1]) + generator.load_weights(weights[1:]) == 20
    generator.finish_weight_update(4)
    assert [name for bucket in generator.llm.model.loaded for name, _ in bucket] == ["a", "b"]
    assert generator.llm.calls[-1] == ("reset_prefix_cache",) and generator.weights_version == 4
