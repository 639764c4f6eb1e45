"""posttrain distill on the embedded tiny model: a few steps run and log the loss's metrics; a teacher equal to the
student gives zero divergence; the precomputed top-k is written once, reused on resume, and gives the losses of a
run that scores every micro-batch; the worker path is invariant to micro-batching; bad configs are refused naming
the keys; a teacher with another tokenizer takes the cross-tokenizer path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.algorithms.distill import TEACHER_TOPK_DIR, teacher_batch, train_distill
from posttrain.config import ConfigError, DistillConfig, load_config
from posttrain.config.losses import DistillationLossConfig
from posttrain.config.schema import ModelConfig, TrainerConfig
from posttrain.data.collate import collate
from posttrain.data.types import TokenizedExample
from posttrain.logging import read_metrics
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.workers.local import LocalPolicyWorker, LocalScoringWorker
from posttrain.workers.objectives import DistillationObjective

from teachers_for_tests import ARITHMETIC_64, TINY_DISTILL, perturbed_tiny_teacher

TINY = [*TINY_DISTILL, ARITHMETIC_64]


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return perturbed_tiny_teacher(tmp_path_factory.mktemp("teacher"))


def config(output_dir: Path, teacher: str | Path, *overrides: str, precompute: bool = False) -> DistillConfig:
    teachers = f"teachers=[{{name_or_path: '{teacher}', precompute: {str(precompute).lower()}}}]"
    return load_config(DistillConfig, None, [*TINY, teachers, f"output_dir={output_dir}", *overrides])


def test_a_short_run_logs_the_distillation_metrics_and_exports(tmp_path, teacher_dir):
    result = train_distill(config(tmp_path, teacher_dir, "trainer.max_steps=3", "loss.nll_weight=0.1"))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["loss"] > 0 and r["distill/divergence"] > 0 and r["distill/nll"] > 0
        assert 0 < r["distill/teacher_topk_mass"] <= 1 and 0 < r["distill/student_topk_mass"] <= 1
        # the loss is the mean divergence plus 0.1 × the mean NLL per target token
        assert r["loss"] == pytest.approx(r["distill/divergence"] + 0.1 * r["distill/nll"], rel=1e-5)
    assert (result.final_dir / "config.json").is_file()


def test_a_teacher_equal_to_the_student_gives_zero_divergence(tmp_path, tiny_model_dir):
    train_distill(config(tmp_path, "posttrain/tiny", "trainer.max_steps=1"))
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert record["distill/divergence"] == pytest.approx(0.0, abs=1e-6)
    assert record["distill/top1_agreement"] == 1.0


def test_precomputed_topk_is_written_once_reused_on_resume_and_equals_scoring_each_step(tmp_path, teacher_dir,
                                                                                         capsys):
    live = tmp_path / "live"
    train_distill(config(live, teacher_dir, "trainer.max_steps=4"))

    cached = tmp_path / "cached"
    train_distill(config(cached, teacher_dir, "trainer.max_steps=2", "trainer.save_every=2", precompute=True))
    folder = cached / TEACHER_TOPK_DIR
    assert (folder / "topk.safetensors").is_file() and (folder / "manifest.json").is_file()
    written = (folder / "topk.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    train_distill(config(cached, teacher_dir, "trainer.max_steps=4", "trainer.save_every=2",
                         precompute=True))  # resumes from step 2
    assert (folder / "topk.safetensors").stat().st_mtime_ns == written  # reused, not scored again
    assert "reusing" in capsys.readouterr().out

    live_losses = [r["loss"] for r in read_metrics(live / "metrics.jsonl")]
    cached_losses = [r["loss"] for r in read_metrics(cached / "metrics.jsonl")]
    assert [r["step"] for r in read_metrics(cached / "metrics.jsonl")] == [1, 2, 3, 4]
    assert cached_losses == pytest.approx(live_losses, rel=1e-6, abs=1e-7)


def test_a_corrupt_precomputed_file_is_scored_again(tmp_path, teacher_dir):
    train_distill(config(tmp_path, teacher_dir, "trainer.max_steps=1", precompute=True))
    path = tmp_path / TEACHER_TOPK_DIR / "topk.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    train_distill(config(tmp_path, teacher_dir, "trainer.max_steps=2", precompute=True))
    assert path.read_bytes() != bytes(data)  # rewritten from the teacher


def test_worker_forward_backward_is_invariant_to_the_micro_batch_split(teacher_dir):
    tokenizer = load_tokenizer(ModelConfig(name_or_path="posttrain/tiny"))
    teacher = LocalScoringWorker(load_causal_lm(ModelConfig(name_or_path=str(teacher_dir))), TrainerConfig())
    examples = [TokenizedExample(tuple(range(3, 3 + n)), (0,) * 3 + (1,) * (n - 3)) for n in (6, 9, 5, 12)]
    loss = DistillationObjective(DistillationLossConfig(topk=4, jsd_beta=0.5, nll_weight=0.2))

    def gradients(split: list[list[int]]) -> list[torch.Tensor]:
        torch.manual_seed(0)
        student = LocalPolicyWorker(load_causal_lm(ModelConfig(name_or_path="posttrain/tiny")), tokenizer,
                                    TrainerConfig(learning_rate=1e-3))
        batches = [teacher_batch(teacher, collate([examples[i] for i in part], tokenizer.pad_token_id, False, 32),
                                 loss.config) for part in split]
        student.forward_backward(batches, loss)
        return [p.grad.clone() for p in student.model.parameters() if p.grad is not None]

    whole, split = gradients([[0, 1, 2, 3]]), gradients([[0], [1, 2, 3]])
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("overrides", "message"), [
    (["teachers=[{name_or_path: a}, {name_or_path: b}]"], "need teacher_column"),
    (["teachers=[]"], "at least one teacher"),
    (["teachers=[{name_or_path: a, offload: true, precompute: true}]"], "precompute and offload"),
    (["data.packing=true"], "data.packing"),
    (["loss.kl_type=reverse", "loss.jsd_beta=0.5"], "jsd_beta"),
])
def test_config_refuses_what_is_not_built_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DistillConfig, None, [*TINY, "teachers=[{name_or_path: t}]", f"output_dir={tmp_path}",
                                          *overrides])


def test_a_teacher_with_another_tokenizer_goes_through_the_aligner(tmp_path, tiny_model_dir, teacher_dir):
    # One added token makes the vocabularies differ: the plain top-k loss (ids compared one by one) cannot take this
    # teacher, the cross-tokenizer path does (tests/test_distill_xtoken.py), and here every chunk is one matched token.
    other = tmp_path / "other"
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(teacher_dir)))
    tokenizer.add_tokens(["<extra>"])
    load_causal_lm(ModelConfig(name_or_path=str(teacher_dir))).save_pretrained(other)
    tokenizer.save_pretrained(other)
    train_distill(config(tmp_path / "run", other, "trainer.max_steps=1"))
    (record,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert record["distill/exact_chunk_fraction"] == 1.0


def test_cli_help_lists_the_distillation_keys(capsys):
    from posttrain.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["distill", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for key in ("teachers", "loss.kl_type", "loss.jsd_beta", "loss.outside_topk", "loss.topk", "mode", "lmbda",
                "rollout.max_new_tokens", "rollout.temperature", "teacher_column"):
        assert key in text


def test_the_loss_description_and_the_batch_pickle(teacher_dir):
    """What crosses the worker seam pickles (a Ray actor or a subprocess receives it as it is)."""
    import pickle

    objective = DistillationObjective(DistillationLossConfig(kl_type="mixed", mixed_kl_weight=0.2, topk=4))
    assert pickle.loads(pickle.dumps(objective)) == objective
    tokenizer = load_tokenizer(ModelConfig(name_or_path="posttrain/tiny"))
    teacher = LocalScoringWorker(load_causal_lm(ModelConfig(name_or_path=str(teacher_dir))), TrainerConfig())
    batch = teacher_batch(teacher, collate([TokenizedExample((3, 4, 5, 6), (0, 0, 1, 1))], tokenizer.pad_token_id,
                                           False, 8), objective.config)
    restored = pickle.loads(pickle.dumps(batch))
    assert torch.equal(restored.teacher_topk_ids, batch.teacher_topk_ids)
    assert torch.equal(restored.rows.input_ids, batch.rows.input_ids)


@pytest.mark.parametrize("loss_keys", [
    {"kl_type": "forward"}, {"kl_type": "reverse", "outside_topk": "zero_outside"},
    {"jsd_beta": 0.3, "outside_topk": "tail", "nll_weight": 0.5}, {"kl_type": "mixed", "temperature": 2.0},
])
def test_the_chunked_lm_head_gives_the_full_heads_loss_and_gradients(teacher_dir, loss_keys):
    """trainer.lm_head=chunked: the student's logits exist only chunk_size positions at a time (3 here, so the
    targets span several chunks) and the loss, its metrics and every gradient equal the full head's."""
    tokenizer = load_tokenizer(ModelConfig(name_or_path="posttrain/tiny"))
    teacher = LocalScoringWorker(load_causal_lm(ModelConfig(name_or_path=str(teacher_dir))), TrainerConfig())
    examples = [TokenizedExample(tuple(range(3, 3 + n)), (0,) * 3 + (1,) * (n - 3)) for n in (6, 9, 5, 12)]
    loss = DistillationObjective(DistillationLossConfig(topk=4, **loss_keys))
    batches = [teacher_batch(teacher, collate(examples[:2], tokenizer.pad_token_id, False, 32), loss.config),
               teacher_batch(teacher, collate(examples[2:], tokenizer.pad_token_id, False, 32), loss.config)]

    def run(lm_head: str):
        student = LocalPolicyWorker(load_causal_lm(ModelConfig(name_or_path="posttrain/tiny")), tokenizer,
                                    TrainerConfig(learning_rate=1e-3, lm_head=lm_head, lm_head_chunk_size=3))
        metrics = {name: metric.value for name, metric in student.forward_backward(batches, loss).items()}
        return metrics, [p.grad.clone() for p in student.model.parameters()]

    (full_metrics, full_grads), (chunked_metrics, chunked_grads) = run("full"), run("chunked")
    assert full_metrics.keys() == chunked_metrics.keys()
    for name, value in full_metrics.items():
        assert chunked_metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert full_metrics["target_tokens"] == sum(b.num_target_tokens for b in batches) == 20
    for a, b in zip(full_grads, chunked_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in full_grads)


def test_precomputing_hands_a_group_teacher_its_batches_eight_at_a_time_and_keeps_the_one_by_one_top_k():
    """A teacher that scores several batches at once (a Ray teacher group's `topk_logprobs_each`) gets the
    precompute's batches in windows of 8; the top-k it yields is the top-k of a teacher asked one batch at a time."""
    from posttrain.algorithms.distill import PRECOMPUTE_BATCHES_AT_ONCE, examples_topk

    class ByIds:  # a deterministic stand-in teacher: scores from the token ids alone
        def topk_logprobs(self, batch, k, temperature=1.0):
            ids = batch.input_ids[..., None] + torch.arange(k)
            return -(ids.float() / 100) / temperature, ids

    class Group(ByIds):
        def __init__(self):
            self.windows = []

        def topk_logprobs_each(self, batches, k, temperature=1.0):
            self.windows.append(len(batches))
            return [self.topk_logprobs(batch, k, temperature) for batch in batches]

    examples = [TokenizedExample(tuple(range(3, 3 + n)), (0,) * 3 + (1,) * (n - 3)) for n in range(5, 25)]
    loss = DistillationLossConfig(topk=4)
    group = Group()
    one_by_one = examples_topk(ByIds(), examples, loss, pad_token_id=0, batch_size=2)
    windowed = examples_topk(group, examples, loss, pad_token_id=0, batch_size=2)
    assert PRECOMPUTE_BATCHES_AT_ONCE == 8 and group.windows == [8, 2]  # 20 examples: 10 batches of 2
    assert torch.equal(windowed.logprobs, one_by_one.logprobs) and torch.equal(windowed.ids, one_by_one.ids)
    assert torch.equal(windowed.offsets, one_by_one.offsets) and windowed.offsets[-1] == sum(range(2, 22))
