"""On-policy distillation in the GRPO loop (advantage.estimator=opd): a tiny run trains, and the advantages the
policy receives equal the per-token log-ratio of a separately loaded teacher and the starting student on the
sampled tokens; the config pairs the estimator with a teacher."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.algorithms import grpo
from posttrain.algorithms.grpo import train_grpo
from posttrain.config import ConfigError, load_config
from posttrain.config.schema import GRPOConfig, ModelConfig, TrainerConfig
from posttrain.logging import read_metrics
from posttrain.models.loading import load_causal_lm
from posttrain.workers.local import LocalScoringWorker

from rl_configs import DIGITS, TINY_RL
from teachers_for_tests import perturbed_tiny_teacher


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return perturbed_tiny_teacher(tmp_path_factory.mktemp("teacher"), scale=0.2)


def config(output_dir: Path, teacher: Path | None, *overrides: str) -> GRPOConfig:
    teacher_keys = [f"teacher={{name_or_path: '{teacher}'}}", "advantage.estimator=opd"] if teacher else []
    return load_config(GRPOConfig, None, [*TINY_RL, *DIGITS, *teacher_keys, f"output_dir={output_dir}",
                                          "rollout.prompts_per_step=4", *overrides])


def test_opd_advantages_are_the_teachers_log_ratio_to_the_student(tmp_path, teacher_dir, monkeypatch):
    seen = []
    real_build_policy = grpo.build_policy

    def recording_policy(*args, **kwargs):
        policy = real_build_policy(*args, **kwargs)
        forward_backward = policy.forward_backward

        def record(batch, loss):
            seen.append(batch)
            return forward_backward(batch, loss)

        policy.forward_backward = record
        return policy

    monkeypatch.setattr(grpo, "build_policy", recording_policy)
    train_grpo(config(tmp_path, teacher_dir, "trainer.max_steps=2"))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 2 and all("opd/advantage_mean" in r for r in records)

    # Step 1's batch was sampled by the starting student: score it afresh with the teacher and posttrain/tiny.
    batch = seen[0]
    temperature = 1.0
    teacher = LocalScoringWorker(load_causal_lm(ModelConfig(name_or_path=str(teacher_dir))), TrainerConfig())
    student = LocalScoringWorker(load_causal_lm(ModelConfig(name_or_path="posttrain/tiny")), TrainerConfig())
    expected = (teacher.logprobs(batch, temperature) - student.logprobs(batch, temperature)) * batch.loss_mask
    assert batch.advantages.shape == batch.loss_mask.shape
    torch.testing.assert_close(batch.advantages, expected, rtol=1e-4, atol=1e-5)
    assert batch.advantages.abs().max() > 0.01  # a teacher that differs gives a signal
    assert records[0]["opd/advantage_mean"] == pytest.approx(float(expected[batch.loss_mask.bool()].mean()),
                                                             rel=1e-4, abs=1e-5)


def test_opd_with_a_reward_weight_adds_the_grpo_advantage(tmp_path, teacher_dir):
    train_grpo(config(tmp_path, teacher_dir, "trainer.max_steps=1", "advantage.opd_reward_weight=0.5"))
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 1


@pytest.mark.parametrize(("overrides", "message"), [
    (["advantage.estimator=opd"], "teacher"),
    (["teacher={name_or_path: t}"], "teacher"),
    (["advantage.opd_reward_weight=0.5"], "opd_reward_weight"),
    (["teacher={name_or_path: t, precompute: true}", "advantage.estimator=opd"], "precompute"),
])
def test_config_pairs_the_opd_estimator_with_a_teacher(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, None, *overrides)
