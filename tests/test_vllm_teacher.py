"""A teacher served by vLLM (teachers[i].backend=vllm), on the CPU against a stand-in `vllm` module whose engine
computes prompt log-probabilities as vLLM's v1 engine does (the raw logits' log_softmax, each position's mapping the
actual token first with its rank, then torch.topk's k with ranks 1..k) from a real tiny transformers model.

Checked: the vLLM scorer's `logprobs` and `topk_logprobs` equal the transformers scorer's on a padded batch of rows
of different lengths (1e-5), padding left at 0; the top-k is the k largest in order even when the actual token is
outside it or ties with it; the engine and each request are built for raw prompt log-probabilities; temperatures
other than 1, bad layouts and malformed outputs are refused; the config refusals name their keys; a tiny `posttrain
distill` run and a GRPO on-policy distillation run with the vLLM teacher log the transformers teacher's losses.
Whether real vLLM behaves as the stand-in does is HV-8's job (scripts/hardware/hv8_vllm_teacher.py).
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest
import torch

import posttrain.distributed.builders as builders
from posttrain.algorithms.distill import train_distill
from posttrain.algorithms.grpo import train_grpo
from posttrain.config import ConfigError, DistillConfig, load_config
from posttrain.config.schema import GRPOConfig, ModelConfig, TeacherSection, TrainerConfig
from posttrain.data.collate import collate
from posttrain.data.types import SFTBatch, TokenizedExample
from posttrain.errors import RunError
from posttrain.generation.vllm_scorer import (
    VLLMScoringWorker,
    token_logprobs_from_outputs,
    top_entries,
    topk_from_outputs,
)
from posttrain.logging import read_metrics
from posttrain.models.loading import load_causal_lm
from posttrain.workers.base import ScoringWorker
from posttrain.workers.local import LocalScoringWorker

from rl_configs import DIGITS, TINY_RL
from teachers_for_tests import ARITHMETIC_64, TINY_DISTILL, perturbed_tiny_teacher
from vllm_outputs import CompletionOutput, Logprob, RequestOutput, install_fake_vllm

# ---- a stand-in vllm module ---------------------------------------------------------------------------------


def vllm_position(logprobs: torch.Tensor, actual: int, k: int) -> dict[int, Logprob]:
    """One position's mapping as vLLM builds it (Sampler.gather_logprobs, then LogprobsProcessor's dict): the actual
    token first, ranked by the count of log-probabilities ≥ its own, then torch.topk's k with ranks 1..k (an actual
    token among them takes its top-k entry)."""
    top = torch.topk(logprobs, k)
    entries = [(actual, float(logprobs[actual]), int((logprobs >= logprobs[actual]).sum()))]
    entries += [(int(token), float(value), rank) for rank, (value, token) in enumerate(
        zip(top.values, top.indices), start=1)]
    return {token: Logprob(value, rank) for token, value, rank in entries}


class FakeLLM:
    """vllm.LLM computing prompt log-probabilities with a real transformers model, each prompt alone and unpadded,
    as log_softmax of the raw logits whatever the request's temperature (as vLLM does); one greedy token sampled."""

    built: list[FakeLLM] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.requests = kwargs, []
        self.model = load_causal_lm(ModelConfig(name_or_path=kwargs["model"], dtype=kwargs["dtype"])).eval()
        FakeLLM.built.append(self)

    def generate(self, prompts, params, use_tqdm=True):
        request = params.kwargs
        self.requests.append(request)
        assert request["prompt_logprobs"] <= self.kwargs["max_logprobs"]  # vLLM refuses more
        outputs = []
        for prompt in prompts:
            ids = prompt["prompt_token_ids"]
            with torch.no_grad():
                logprobs = torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), dim=-1)
            steps = [None] + [vllm_position(logprobs[s - 1], ids[s], request["prompt_logprobs"])
                              for s in range(1, len(ids))]
            sampled = int(logprobs[-1].argmax())
            sample = None if request["logprobs"] is None else [vllm_position(logprobs[-1], sampled,
                                                                             request["logprobs"])]
            outputs.append(RequestOutput(list(ids), [CompletionOutput(0, "", [sampled], sample, "length")],
                                         prompt_logprobs=steps))
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch):
    """`vllm` (and vllm.inputs) replaced by the stand-in; vLLM's environment variables put back afterwards."""
    names = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION")
    saved = {name: os.environ.pop(name, None) for name in names}
    vllm = install_fake_vllm(monkeypatch, FakeLLM)
    FakeLLM.built = []
    yield vllm
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory) -> Path:
    # Moderate logits: the float32 rounding of a padded row against the same row alone stays near 1e-5.
    return perturbed_tiny_teacher(tmp_path_factory.mktemp("teacher"), scale=0.2)


def padded_rows() -> SFTBatch:
    """Rows of 5, 12, 1 and 9 tokens, right-padded to 12; the last tokens of each row are targets."""
    examples = [TokenizedExample(tuple((7 * n + 3 * i) % 250 + 3 for i in range(n)),
                                 (0,) * (n // 2) + (1,) * (n - n // 2)) for n in (5, 12, 1, 9)]
    return collate(examples, pad_token_id=0, packing=False, max_length=12)


def both_scorers(teacher_dir: Path) -> tuple[VLLMScoringWorker, LocalScoringWorker]:
    served = VLLMScoringWorker(str(teacher_dir), dtype="float32", max_logprobs=8)
    local = LocalScoringWorker(load_causal_lm(ModelConfig(name_or_path=str(teacher_dir))), TrainerConfig())
    return served, local


# ---- the scorer against the transformers scorer -------------------------------------------------------------


def test_logprobs_and_topk_equal_the_transformers_scorers_on_a_padded_batch(fake_vllm, teacher_dir):
    served, local = both_scorers(teacher_dir)
    assert isinstance(served, ScoringWorker)
    batch = padded_rows()
    real = batch.attention_mask.bool()

    logprobs, expected = served.logprobs(batch), local.logprobs(batch)
    assert logprobs.dtype == torch.float32 and logprobs.shape == expected.shape == (4, 12)
    torch.testing.assert_close(logprobs[real], expected[real], rtol=1e-5, atol=1e-5)
    assert (logprobs[~real] == 0).all() and (logprobs[:, 0] == 0).all()

    values, ids = served.topk_logprobs(batch, 8)
    expected_values, expected_ids = local.topk_logprobs(batch, 8)
    assert values.dtype == torch.float32 and ids.dtype == torch.long
    assert values.shape == ids.shape == expected_values.shape == (4, 12, 8)
    torch.testing.assert_close(values[real], expected_values[real], rtol=1e-5, atol=1e-5)
    assert torch.equal(ids[real], expected_ids[real])  # the same tokens in the same order, the last real one too
    assert (values[~real] == 0).all() and (ids[~real] == 0).all()
    assert (values[real].diff(dim=-1) <= 0).all()  # largest first
    # Control: the layout is position s predicts token s + 1; one position off does not match.
    assert not torch.allclose(values[0, 1:5], expected_values[0, 0:4], atol=1e-2)


def test_the_actual_token_is_exact_even_far_outside_the_topk(fake_vllm, teacher_dir):
    served, local = both_scorers(teacher_dir)
    batch = padded_rows()
    values, _ = served.topk_logprobs(batch, 2)
    predicted = batch.attention_mask.bool()[:, 1:]  # token t ≥ 1 of each row, predicted from position t − 1
    tokens = served.logprobs(batch)[:, 1:][predicted]
    assert (tokens < values[:, :-1, -1][predicted]).any()  # the case is exercised: tokens outside the top 2
    torch.testing.assert_close(tokens, local.logprobs(batch)[:, 1:][predicted], rtol=1e-5, atol=1e-5)


def test_topk_is_the_k_largest_in_order_whatever_the_mappings_order():
    # vLLM's order: the actual token (rank 9) first, then the top 3.
    position = {5: Logprob(-4.0, 9), 1: Logprob(-0.5, 1), 2: Logprob(-1.0, 2), 3: Logprob(-2.0, 3)}
    assert top_entries(position, 3, "here") == ([-0.5, -1.0, -2.0], [1, 2, 3])
    # Control: vLLM's first k entries would hold the actual token and miss the third likeliest.
    assert [token for token in list(position)[:3]] != [1, 2, 3]
    # A tied actual token outside vLLM's top-k (rank k + 1) stays outside; ties inside keep vLLM's rank order.
    tied = {7: Logprob(-2.0, 4), 1: Logprob(-0.5, 1), 4: Logprob(-2.0, 2), 3: Logprob(-2.0, 3)}
    assert top_entries(tied, 3, "here") == ([-0.5, -2.0, -2.0], [1, 4, 3])
    with pytest.raises(RuntimeError, match="here: vLLM returned 4 log-probabilities, fewer than k=5"):
        top_entries(position, 5, "here")


def test_engine_and_requests_ask_for_raw_prompt_logprobs(fake_vllm, teacher_dir):
    served = VLLMScoringWorker(str(teacher_dir), dtype="bfloat16", gpu_memory_utilization=0.25, max_model_len=33,
                               max_logprobs=16)
    kwargs = served.llm.kwargs
    assert kwargs["model"] == str(teacher_dir) and kwargs["dtype"] == "bfloat16"
    assert kwargs["logprobs_mode"] == "raw_logprobs"  # prompt values are log-probabilities, not logits
    assert kwargs["max_logprobs"] == 16 and kwargs["max_model_len"] == 33
    assert kwargs["enable_prefix_caching"] is False and kwargs["skip_tokenizer_init"] is True
    assert kwargs["gpu_memory_utilization"] == 0.25 and kwargs["tensor_parallel_size"] == 1
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    batch = padded_rows()
    served.logprobs(batch)
    served.topk_logprobs(batch, 4)
    scoring, topk = served.llm.requests
    assert scoring == {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "logprobs": None,
                       "detokenize": False}
    assert topk["prompt_logprobs"] == 4 and topk["logprobs"] == 4
    with pytest.raises(ValueError, match="top-17 asked of a vLLM engine built for at most 16"):
        served.topk_logprobs(batch, 17)


def test_a_temperature_other_than_one_is_refused_saying_why(fake_vllm, teacher_dir):
    served, local = both_scorers(teacher_dir)
    batch = padded_rows()
    for call in (lambda: served.logprobs(batch, 2.0), lambda: served.topk_logprobs(batch, 4, 0.5)):
        with pytest.raises(ValueError, match="temperature 1 only.*raw logits whatever the request's temperature"):
            call()
    # Why: what vLLM returns (temperature 1) is far from the teacher at temperature 2 that was asked for.
    real = batch.attention_mask.bool()
    assert (served.logprobs(batch)[real] - local.logprobs(batch, 2.0)[real]).abs().max() > 0.1


def test_layouts_it_cannot_score_are_refused(fake_vllm, teacher_dir):
    served, _ = both_scorers(teacher_dir)
    batch = padded_rows()
    packed = SFTBatch(batch.input_ids, batch.loss_mask, batch.position_ids, None, 4, batch.num_tokens)
    with pytest.raises(ValueError, match="packed rows"):
        served.logprobs(packed)
    left = SFTBatch(batch.input_ids, batch.loss_mask, batch.position_ids, batch.attention_mask.flip(1), 4,
                    batch.num_tokens)
    with pytest.raises(ValueError, match="right-padded"):
        served.logprobs(left)
    shifted = SFTBatch(batch.input_ids, batch.loss_mask, batch.position_ids + 1, batch.attention_mask, 4,
                       batch.num_tokens)
    with pytest.raises(ValueError, match="position ids"):
        served.topk_logprobs(shifted, 4)
    with pytest.raises(NotImplementedError, match="reward model"):
        served.sequence_scores(batch)


def test_malformed_outputs_are_errors():
    rows = [[3, 4, 5], [6, 7]]
    good = [RequestOutput([3, 4, 5], [], [None, {4: Logprob(-1.0, 1)}, {5: Logprob(-2.0, 1)}]),
            RequestOutput([6, 7], [], [None, {7: Logprob(-0.5, 1)}])]
    assert token_logprobs_from_outputs(rows, good, (2, 3)).tolist() == [[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]]
    with pytest.raises(RuntimeError, match="out of order"):
        token_logprobs_from_outputs(rows, good[::-1], (2, 3))
    with pytest.raises(RuntimeError, match="1 results for 2 prompts"):
        token_logprobs_from_outputs(rows, good[:1], (2, 3))
    missing = [good[0], RequestOutput([6, 7], [], [None, {8: Logprob(-0.5, 1)}])]
    with pytest.raises(RuntimeError, match="row 1, position 1: .* lack the prompt's own token 7"):
        token_logprobs_from_outputs(rows, missing, (2, 3))
    short = [good[0], RequestOutput([6, 7], [], [None])]
    with pytest.raises(RuntimeError, match="row 1: vLLM returned 1 prompt log-probability entries for 2"):
        token_logprobs_from_outputs(rows, short, (2, 3))
    with pytest.raises(RuntimeError, match="row 0: vLLM returned no log-probabilities for the token after"):
        topk_from_outputs(rows, good, 1, (2, 3))


# ---- config and process refusals ----------------------------------------------------------------------------

DISTILL = [*TINY_DISTILL, ARITHMETIC_64]


VLLM_TEACHER = "teachers=[{name_or_path: t, backend: vllm}]"


@pytest.mark.parametrize(("overrides", "keys", "control"), [
    (["teachers=[{name_or_path: t, backend: vllm, offload: true}]"], ["teachers.0", "backend=vllm", "offload=true"],
     ["teachers=[{name_or_path: t, offload: true}]"]),
    (["teachers=[{name_or_path: t, backend: vllm, precompute: true}]"],
     ["teachers.0", "backend=vllm", "precompute=true"], ["teachers=[{name_or_path: t, precompute: true}]"]),
    (["teachers=[{name_or_path: t, vllm_gpu_memory_utilization: 0.5}]"],
     ["teachers.0", "vllm_gpu_memory_utilization", "backend=vllm"],
     ["teachers=[{name_or_path: t, backend: vllm, vllm_gpu_memory_utilization: 0.5}]"]),
    ([VLLM_TEACHER, "loss.temperature=2"], ["teachers[0].backend=vllm", "loss.temperature=2", "raw logits"],
     [VLLM_TEACHER, "loss.temperature=1"]),
    ([VLLM_TEACHER, "mode=on_policy", "rollout.backend=vllm"],
     ["teachers[0].backend=vllm", "rollout.backend=vllm", "two vLLM engines"],
     [VLLM_TEACHER, "mode=on_policy", "rollout.backend=transformers"]),
    (["teacher_column=task", "teachers=[{name: a, name_or_path: t, backend: vllm, route: [x]}, "
      "{name: b, name_or_path: u, backend: vllm, route: [y]}]"], ["teachers[1].backend=vllm", "teachers[0]"],
     ["teacher_column=task", "teachers=[{name: a, name_or_path: t, backend: vllm, route: [x]}, "
      "{name: b, name_or_path: u, route: [y]}]"]),
])
def test_distill_config_refuses_what_a_vllm_teacher_cannot_do_naming_the_keys(tmp_path, overrides, keys, control):
    with pytest.raises(ConfigError) as refused:
        load_config(DistillConfig, None, [*DISTILL, f"output_dir={tmp_path}", *overrides])
    for key in keys:
        assert key in str(refused.value)
    load_config(DistillConfig, None, [*DISTILL, f"output_dir={tmp_path}", *control])  # control: this one loads


@pytest.mark.parametrize(("overrides", "keys"), [
    (["rollout.temperature=0.7"], ["teacher.backend=vllm", "rollout.temperature=0.7"]),
    (["rollout.backend=vllm"], ["teacher.backend=vllm", "rollout.backend=vllm"]),
    (["teacher.offload=true"], ["teacher", "offload=true"]),
])
def test_grpo_config_refuses_what_a_vllm_opd_teacher_cannot_do_naming_the_keys(tmp_path, overrides, keys):
    base = [*TINY_RL, *DIGITS, f"output_dir={tmp_path}", "advantage.estimator=opd"]
    with pytest.raises(ConfigError) as refused:
        load_config(GRPOConfig, None, [*base, "teacher={name_or_path: t, backend: vllm}", *overrides])
    for key in keys:
        assert key in str(refused.value)
    load_config(GRPOConfig, None, [*base, "teacher={name_or_path: t}", *overrides])  # control: transformers


def test_a_vllm_teacher_is_refused_under_torchrun(fake_vllm, monkeypatch):
    builders.check_teacher_backend(TeacherSection(name_or_path="t", backend="vllm"))  # one process: passes
    monkeypatch.setattr(builders, "is_distributed", lambda: True)
    with pytest.raises(RunError, match="teacher t: backend=vllm runs in one process"):
        builders.check_teacher_backend(TeacherSection(name_or_path="t", backend="vllm"))
    builders.check_teacher_backend(TeacherSection(name_or_path="t"))  # control: transformers passes


def test_without_vllm_installed_the_teacher_says_how_to_install_it_before_any_model_loads(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # what the scorer sets, put back after the test
    with pytest.raises(ImportError, match=r"teacher t with backend=vllm needs the vllm package.*posttrain\[vllm\]"):
        builders.check_teacher_backend(TeacherSection(name_or_path="t", backend="vllm"))
    with pytest.raises(ImportError, match=r"a teacher with backend=vllm needs the vllm package"):
        VLLMScoringWorker("posttrain/tiny")
    builders.check_teacher_backend(TeacherSection(name_or_path="t"))  # control: transformers needs no vllm


# ---- the recipes ---------------------------------------------------------------------------------------------


def distill_losses(output_dir: Path) -> list[dict[str, float]]:
    keys = ("loss", "distill/divergence", "distill/top1_agreement", "distill/teacher_topk_mass",
            "distill/student_topk_mass", "grad_norm")
    return [{key: record[key] for key in keys} for record in read_metrics(output_dir / "metrics.jsonl")]


def test_distill_with_the_vllm_teacher_logs_the_transformers_teachers_losses(fake_vllm, tmp_path, teacher_dir):
    def run(name: str, backend: str) -> list[dict[str, float]]:
        teachers = f"teachers=[{{name_or_path: '{teacher_dir}', backend: {backend}}}]"
        train_distill(load_config(DistillConfig, None, [*DISTILL, teachers, f"output_dir={tmp_path / name}",
                                                        "trainer.max_steps=3"]))
        return distill_losses(tmp_path / name)

    local = run("transformers", "transformers")
    assert FakeLLM.built == []
    served = run("vllm", "vllm")
    (engine,) = FakeLLM.built
    assert len(engine.requests) == 3 * 2  # every micro-batch of the 3 steps was scored by the engine
    assert engine.kwargs["max_logprobs"] == 8 and engine.kwargs["max_model_len"] == 33  # loss.topk, max_length + 1
    assert len(served) == 3
    # The teachers' values differ by float32 rounding (each row alone against padded rows, ~1e-5 relative), which
    # the steps carry into the losses and gradient norms (2e-5 relative seen).
    for a, b in zip(local, served, strict=True):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-6)


def test_grpo_opd_with_the_vllm_teacher_logs_the_transformers_teachers_advantages(fake_vllm, tmp_path, teacher_dir):
    def run(name: str, backend: str) -> list[dict[str, float]]:
        train_grpo(load_config(GRPOConfig, None, [
            *TINY_RL, *DIGITS, f"teacher={{name_or_path: '{teacher_dir}', backend: {backend}}}",
            "advantage.estimator=opd", "rollout.prompts_per_step=4", "trainer.max_steps=2",
            f"output_dir={tmp_path / name}"]))
        keys = ("loss", "opd/advantage_mean", "opd/advantage_min", "opd/advantage_max", "grad_norm")
        return [{key: r[key] for key in keys} for r in read_metrics(tmp_path / name / "metrics.jsonl")]

    local = run("transformers", "transformers")
    served = run("vllm", "vllm")
    (engine,) = FakeLLM.built
    assert [request["prompt_logprobs"] for request in engine.requests] == [0, 0]  # one scoring call per step
    for a, b in zip(local, served, strict=True):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-6)
