"""posttrain distill with mode=on_policy (GKD's lmbda) and the teacher's memory options.

On-policy: an on-policy step's rows are the dataset's prompts continued by the student's own samples (what a
fresh copy of the starting student samples with the step's seed), the teacher's top-k is scored at those tokens
(what a separately loaded teacher gives), and the logged divergence is the objective on exactly those batches;
lmbda=0 gives off_policy's losses bit for bit; a run stopped and resumed in the middle logs what an uninterrupted
one does; the keys are validated naming them. Teacher memory: a teacher scores without a graph, loads and scores in
bfloat16, and with offload keeps its weights on the CPU between passes (moved to the compute device for each) with
the losses of a resident teacher."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import posttrain.algorithms.distill as distill
import posttrain.distributed.builders as builders
from posttrain.algorithms.distill import is_on_policy_step, sampling_seed, train_distill
from posttrain.config import ConfigError, DistillConfig, load_config
from posttrain.config.losses import DistillationLossConfig
from posttrain.config.schema import ModelConfig, TrainerConfig
from posttrain.data import load_sft_examples
from posttrain.data.collate import collate
from posttrain.data.sampler import EpochSampler
from posttrain.data.types import TokenizedExample
from posttrain.generation.base import SamplingParams
from posttrain.generation.transformers_backend import TransformersGenerator
from posttrain.logging import read_metrics
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.workers import as_floats
from posttrain.workers.local import LocalPolicyWorker, LocalScoringWorker, build_scorer
from posttrain.workers.objectives import DistillationObjective

from teachers_for_tests import ARITHMETIC_64, TINY_DISTILL, perturbed_tiny_teacher

TINY = [*TINY_DISTILL, ARITHMETIC_64, "rollout.max_new_tokens=6"]
OFF_POLICY = [o for o in TINY if not o.startswith("rollout.")]


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return perturbed_tiny_teacher(tmp_path_factory.mktemp("teacher"))


def config(output_dir: Path, teacher: str | Path, *overrides: str, base: list[str] = TINY,
           offload: bool = False) -> DistillConfig:
    teachers = f"teachers=[{{name_or_path: '{teacher}', offload: {str(offload).lower()}}}]"
    return load_config(DistillConfig, None, [*base, teachers, f"output_dir={output_dir}", *overrides])


def losses(folder: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(folder / "metrics.jsonl")]


def test_an_on_policy_step_distills_the_students_own_samples_at_the_teachers_topk(tmp_path, teacher_dir,
                                                                                   monkeypatch):
    scored = []  # every micro-batch the teacher scored, as the loop handed it on

    def recording_teacher_batch(teacher, rows, loss):
        batch = original(teacher, rows, loss)
        scored.append(batch)
        return batch

    original = distill.teacher_batch
    monkeypatch.setattr(distill, "teacher_batch", recording_teacher_batch)
    cfg = config(tmp_path, teacher_dir, "mode=on_policy", "trainer.max_steps=2", "rollout.temperature=1.0")
    train_distill(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["distill/on_policy"] for r in records] == [1.0, 1.0]  # lmbda defaults to 1 with mode=on_policy
    assert all(r["sample_seconds"] > 0 and 1 <= r["distill/sampled_completion_length"] <= 6 for r in records)

    # Step 1's rows: the sampler's first 16 rows, their prompts continued by the starting student's samples.
    tokenizer = load_tokenizer(cfg.model)
    examples, _ = load_sft_examples(cfg.data.train_files, tokenizer, cfg.data)
    rows = [examples[i] for i in EpochSampler(len(examples), seed=cfg.seed, shuffle=cfg.data.shuffle).next_indices(16)]
    prompts = [list(e.input_ids[: e.loss_mask.index(1)]) for e in rows]
    student = load_causal_lm(cfg.model)
    samples = TransformersGenerator(student, tokenizer, seed=cfg.seed).generate(
        prompts, SamplingParams(max_new_tokens=6, temperature=1.0, seed=sampling_seed(cfg.seed, 1)))
    expected = [TokenizedExample((*p, *c[0].token_ids), (0,) * len(p) + (1,) * len(c[0].token_ids))
                for p, c in zip(prompts, samples.completions, strict=True)]
    step_one = scored[:2]
    got = [tuple(ids[mask.bool()].tolist()) for batch in step_one
           for ids, mask in zip(batch.rows.input_ids, batch.rows.attention_mask, strict=True)]
    assert got == [e.input_ids for e in expected]
    assert [tuple(e.input_ids) for e in expected] != [e.input_ids for e in rows]  # not the dataset's completions
    for batch, part in zip(step_one, (expected[:8], expected[8:]), strict=True):
        assert torch.equal(batch.rows.loss_mask, collate(part, tokenizer.pad_token_id, False, 32).loss_mask)

    # The teacher's top-k there is a fresh teacher's, and step 1's divergence is the objective on these batches.
    teacher = LocalScoringWorker(load_causal_lm(ModelConfig(name_or_path=str(teacher_dir))), TrainerConfig())
    for batch in step_one:
        values, ids = teacher.topk_logprobs(batch.rows, 8)
        assert torch.equal(batch.teacher_topk_ids, ids)
        torch.testing.assert_close(batch.teacher_topk_logprobs, values.float())
    policy = LocalPolicyWorker(student.train(), tokenizer, TrainerConfig(micro_batch_size=8))
    objective = DistillationObjective(cfg.loss)
    stats = as_floats(policy.forward_backward(step_one, objective))
    assert stats["divergence"] == pytest.approx(records[0]["distill/divergence"], rel=1e-5)


def test_lmbda_zero_gives_the_off_policy_losses_exactly(tmp_path, teacher_dir):
    train_distill(config(tmp_path / "off", teacher_dir, "trainer.max_steps=3", base=OFF_POLICY))
    train_distill(config(tmp_path / "zero", teacher_dir, "mode=on_policy", "lmbda=0", "trainer.max_steps=3"))
    assert losses(tmp_path / "zero") == losses(tmp_path / "off")
    assert [r["distill/on_policy"] for r in read_metrics(tmp_path / "zero" / "metrics.jsonl")] == [0.0] * 3
    # control: lmbda=1 changes them (the rows are the student's samples)
    train_distill(config(tmp_path / "one", teacher_dir, "mode=on_policy", "lmbda=1", "trainer.max_steps=3"))
    assert losses(tmp_path / "one") != losses(tmp_path / "off")


def test_a_run_resumed_in_the_middle_logs_the_uninterrupted_runs_losses(tmp_path, teacher_dir):
    common = ["mode=on_policy", "lmbda=0.5", "seed=3"]
    train_distill(config(tmp_path / "whole", teacher_dir, *common, "trainer.max_steps=6"))
    train_distill(config(tmp_path / "parts", teacher_dir, *common, "trainer.max_steps=3", "trainer.save_every=3"))
    train_distill(config(tmp_path / "parts", teacher_dir, *common, "trainer.max_steps=6", "trainer.save_every=3"))
    whole, parts = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("whole", "parts"))
    assert [r["step"] for r in parts] == list(range(1, 7))
    flags = [r["distill/on_policy"] for r in whole]
    assert 0.0 in flags[3:] and 1.0 in flags[3:]  # both kinds of step after the resume
    assert [r["distill/on_policy"] for r in parts] == flags
    assert losses(tmp_path / "parts") == pytest.approx(losses(tmp_path / "whole"), rel=1e-6, abs=1e-9)


def test_the_per_step_draw_has_mean_lmbda_and_depends_on_seed_and_step_only():
    draws = [is_on_policy_step(0, step, 0.3) for step in range(1, 4001)]
    assert sum(draws) / len(draws) == pytest.approx(0.3, abs=0.03)
    assert draws == [is_on_policy_step(0, step, 0.3) for step in range(1, 4001)]
    assert draws != [is_on_policy_step(1, step, 0.3) for step in range(1, 4001)]
    assert not any(is_on_policy_step(0, s, 0.0) for s in range(100))
    assert all(is_on_policy_step(0, s, 1.0) for s in range(100))


@pytest.mark.parametrize(("overrides", "message"), [
    (["lmbda=0.5"], "lmbda applies to mode=on_policy"),
    (["rollout.max_new_tokens=8"], "rollout.max_new_tokens: the rollout section applies to mode=on_policy"),
    (["mode=on_policy", "lmbda=1.5"], "lmbda"),
    (["mode=on_policy", "lmbda=-0.1"], "lmbda"),
    (["mode=on_policy", "lmbda=true"], "lmbda.*boolean"),
    (["mode=on_policy", "teachers=[{name_or_path: t, precompute: true}]"], r"teachers\[0\].precompute.*lmbda=1"),
    (["mode=on_policy", "lmbda=0.25", "teachers=[{name_or_path: t, precompute: true}]"],
     r"teachers\[0\].precompute.*lmbda=0.25"),
    (["mode=on_policy", "loss.nll_weight=0.1"], "loss.nll_weight"),
    (["mode=on_policy", "data.completion_only_loss=false"], "data.completion_only_loss"),
    (["mode=on_policy", "rollout.temperature=0"], "rollout.temperature"),
    (["mode=on_policy", "rollout.prompts_per_step=4"], "prompts_per_step"),
])
def test_config_refuses_bad_on_policy_settings_naming_the_keys(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DistillConfig, None, [*OFF_POLICY, "teachers=[{name_or_path: t}]", f"output_dir={tmp_path}",
                                          *overrides])


def test_on_policy_settings_that_load(tmp_path):
    base = [*OFF_POLICY, "teachers=[{name_or_path: t}]", f"output_dir={tmp_path}"]
    assert load_config(DistillConfig, None, base).on_policy_fraction == 0.0
    assert load_config(DistillConfig, None, [*base, "mode=on_policy"]).on_policy_fraction == 1.0
    cfg = load_config(DistillConfig, None, [*base, "mode=on_policy", "lmbda=0",
                                            "teachers=[{name_or_path: t, precompute: true}]"])
    assert cfg.on_policy_fraction == 0.0  # lmbda 0 never samples: precompute can serve it


# ---- the teacher's memory ---------------------------------------------------------------------------------


def scoring_rows(tokenizer):
    examples = [TokenizedExample(tuple(range(3, 3 + n)), (0,) * 3 + (1,) * (n - 3)) for n in (6, 9)]
    return collate(examples, tokenizer.pad_token_id, False, 32)


def test_a_teacher_scores_without_a_graph(teacher_dir):
    teacher = build_scorer(ModelConfig(name_or_path=str(teacher_dir)), TrainerConfig(), torch.device("cpu"))
    assert not any(p.requires_grad for p in teacher.model.parameters())
    with torch.enable_grad():
        values, _ = teacher.topk_logprobs(scoring_rows(load_tokenizer(ModelConfig(name_or_path=str(teacher_dir)))), 4)
    assert not values.requires_grad and values.grad_fn is None


def test_a_bfloat16_teacher_loads_in_bfloat16_and_scores_near_float32(teacher_dir):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(teacher_dir)))
    rows = scoring_rows(tokenizer)
    full = build_scorer(ModelConfig(name_or_path=str(teacher_dir)), TrainerConfig(), torch.device("cpu"))
    half = build_scorer(ModelConfig(name_or_path=str(teacher_dir), dtype="bfloat16"), TrainerConfig(),
                        torch.device("cpu"))
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    batch = distill.teacher_batch(half, rows, DistillationLossConfig(topk=4))
    assert batch.teacher_topk_logprobs.dtype == torch.float32 and torch.isfinite(batch.teacher_topk_logprobs).all()
    reference = distill.teacher_batch(full, rows, DistillationLossConfig(topk=4))
    sources = rows.loss_mask[:, 1:].bool()  # the positions that predict a target
    top1 = batch.teacher_topk_ids[:, :-1, 0][sources] == reference.teacher_topk_ids[:, :-1, 0][sources]
    assert top1.float().mean() >= 0.9
    torch.testing.assert_close(batch.teacher_topk_logprobs[:, :-1, 0][sources],
                               reference.teacher_topk_logprobs[:, :-1, 0][sources], atol=0.1, rtol=0.05)


def test_an_offloaded_teacher_moves_to_its_compute_device_only_while_it_scores(teacher_dir, monkeypatch):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(teacher_dir)))
    model = load_causal_lm(ModelConfig(name_or_path=str(teacher_dir)))
    compute = torch.device("cpu", 0)  # another name for the CPU: the moves are real calls, their effect a no-op
    teacher = LocalScoringWorker(model, TrainerConfig(), "teacher", compute_device=compute)
    moves, seen = [], []
    original_to = model.to

    def recording_to(device):
        moves.append(torch.device(device))
        return original_to(device)

    monkeypatch.setattr(model, "to", recording_to)
    original_forward = model.forward

    def recording_forward(*args, **kwargs):
        seen.append(torch.device(moves[-1]) if moves else None)
        return original_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", recording_forward)
    values, ids = teacher.topk_logprobs(scoring_rows(tokenizer), 4)
    assert moves == [compute, torch.device("cpu")]  # there for the pass, then home
    assert seen and all(device == compute for device in seen)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    resident = LocalScoringWorker(load_causal_lm(ModelConfig(name_or_path=str(teacher_dir))), TrainerConfig())
    reference = resident.topk_logprobs(scoring_rows(tokenizer), 4)
    assert torch.equal(ids, reference[1]) and torch.equal(values, reference[0])
    # control: a resident teacher never moves
    moves.clear()
    LocalScoringWorker(model, TrainerConfig()).topk_logprobs(scoring_rows(tokenizer), 4)
    assert moves == []


def test_teacher_offload_gives_the_resident_teachers_losses(tmp_path, teacher_dir, monkeypatch):
    built = []
    original = builders.build_scorer  # what build_teacher calls for the transformers backend

    def recording_build_scorer(*args, **kwargs):
        built.append(kwargs.get("offload", False))
        return original(*args, **kwargs)

    monkeypatch.setattr(builders, "build_scorer", recording_build_scorer)
    train_distill(config(tmp_path / "resident", teacher_dir, "mode=on_policy", "lmbda=0.5", "trainer.max_steps=3"))
    train_distill(config(tmp_path / "offload", teacher_dir, "mode=on_policy", "lmbda=0.5", "trainer.max_steps=3",
                         offload=True))
    assert built == [False, True]
    assert losses(tmp_path / "offload") == losses(tmp_path / "resident")
