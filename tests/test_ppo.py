"""PPO with a learned critic on the embedded tiny model: value alignment, critic warm-up, learning, resume and
config validation. (GAE and the value loss themselves: tests/test_gae.py and tests/test_value_loss.py.)"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.advantages import RunningRewardNorm
from posttrain.algorithms.ppo import train_ppo
from posttrain.algorithms.rollout import Episode, to_batch
from posttrain.config import ConfigError, load_config
from posttrain.config.schema import GRPOConfig, PPOConfig, TrainerConfig
from posttrain.logging import read_metrics
from posttrain.algorithms.rl import normalize_batch_rewards
from posttrain.envs.rewards import RewardErrorBudget
from posttrain.errors import RunError
from posttrain.models.loading import load_tokenizer
from posttrain.models.value_head import token_scores
from posttrain.workers.value import build_critic

from rl_configs import DIGITS, TINY_RL

BASE = [*TINY_RL, "critic.learning_rate=1e-3", *DIGITS]


def config(output_dir: Path, *overrides: str) -> PPOConfig:
    return load_config(PPOConfig, None, [*BASE, f"output_dir={output_dir}", *overrides])


def test_values_are_the_head_before_each_token(tiny_model_dir):
    """values[:, t] is V(s_t), read at position t - 1, so that it lines up with logprobs[:, t]; 0 at t = 0."""
    cfg = config(Path("unused"))
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    critic = build_critic("policy", cfg.model, TrainerConfig(), tokenizer, torch.device("cpu"))
    episodes = [Episode(0, [], {}, list(range(5, 12)), 3, [True] * 4, [0.0] * 4, 1.0),
                Episode(1, [], {}, list(range(5, 10)), 3, [True] * 2, [0.0] * 2, 0.0)]
    batch = to_batch(episodes, tokenizer.pad_token_id, {}, False, [0.0, 0.0])
    values = critic.values(batch)
    with torch.no_grad():
        scores = token_scores(critic.model, batch.input_ids, batch.attention_mask)[..., 0]
    assert values.shape == batch.input_ids.shape
    assert torch.equal(values[:, 0], torch.zeros(2))
    torch.testing.assert_close(values[:, 1:], scores[:, :-1], rtol=0, atol=0)


def test_the_policy_waits_for_the_critic_warm_up(tmp_path, tiny_model_dir):
    train_ppo(config(tmp_path, "trainer.max_steps=3", "critic.warmup_steps=2", "trainer.save_every=2"))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert ["loss" in r for r in records] == [False, False, True]
    assert all(r["value/loss"] > 0 and r["value/grad_norm"] > 0 for r in records)
    policy = load_file(tmp_path / "checkpoints" / "step_2" / "policy" / "model.safetensors")
    start = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert all(torch.equal(policy[name], start[name]) for name in start)  # untouched during the warm-up
    assert (tmp_path / "checkpoints" / "step_2" / "critic" / "model.safetensors").is_file()


def test_ppo_raises_a_learnable_reward_and_the_critic_learns_its_returns(tmp_path, tiny_model_dir):
    # The random tiny model writes mostly non-digits; a dense reward for digits is learned in a few dozen steps,
    # and the critic's values come to predict the returns. Measured over seeds 0-2 x both CPU code paths: mean
    # reward of the first 5 steps 0.04-0.05, of the last 5 >= 0.998; value loss 0.31-0.36 -> at most 0.00044.
    # (Explained variance is no criterion here: once every reward is 1 the returns have nothing left to explain.)
    train_ppo(config(tmp_path, "trainer.max_steps=40", "trainer.learning_rate=3e-3", "critic.learning_rate=3e-3"))
    records = read_metrics(tmp_path / "metrics.jsonl")
    rewards = [r["reward/mean"] for r in records]
    value_losses = [r["value/loss"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.5, (first, last)
    assert sum(value_losses[-5:]) < 0.1 * sum(value_losses[:5]), value_losses


def test_resume_repeats_the_uninterrupted_run(tmp_path, tiny_model_dir):
    # With running reward normalization on, so its statistics are part of what must come back.
    keys = ("reward/mean", "loss", "grad_norm", "value/loss", "value/grad_norm", "value/explained_variance",
            "reward/running_mean", "reward/running_std")
    common = ("trainer.save_every=2", "critic.warmup_steps=1", "environment.normalize_rewards=true")
    train_ppo(config(tmp_path / "full", "trainer.max_steps=4", *common))
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    train_ppo(config(tmp_path / "resumed", "trainer.max_steps=2", *common))
    train_ppo(config(tmp_path / "resumed", "trainer.max_steps=4", *common))
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full[1:], resumed[1:]):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    # The statistics run over every step's rewards (32 valid samples a step), also across the resume.
    assert full[0]["reward/running_mean"] == pytest.approx(full[0]["reward/mean"])
    for records in (full, resumed):
        assert records[-1]["reward/running_mean"] == pytest.approx(sum(r["reward/mean"] for r in records) / 4)
        assert records[-1]["reward/running_std"] > 0


def test_normalized_rewards_are_what_the_batch_carries_and_gdpo_refuses_them(tmp_path):
    episodes = [Episode(0, [], {}, [1, 2, 3], 2, [True], [-0.5], reward) for reward in (1.0, 3.0, None, 5.0)]
    batch = to_batch(episodes, 0, {}, False, [0.0] * 4)
    metrics: dict[str, float] = {}
    assert normalize_batch_rewards(batch, None, metrics) is batch and not metrics
    normalized = normalize_batch_rewards(batch, RunningRewardNorm(), metrics)
    std = (8 / 3) ** 0.5  # of the valid 1, 3, 5
    assert normalized.rewards.tolist() == pytest.approx([-2 / std, 0.0, 0.0, 2 / std])
    assert metrics == pytest.approx({"reward/running_mean": 3.0, "reward/running_std": std})
    with pytest.raises(ConfigError, match="normalize_rewards does not apply to advantage.estimator='gdpo'"):
        load_config(GRPOConfig, None, [*TINY_RL, *DIGITS, f"output_dir={tmp_path}", "advantage.estimator=gdpo",
                                       "environment.normalize_rewards=true"])


def test_normalized_rewards_cannot_resume_a_checkpoint_without_their_statistics(monkeypatch):
    from types import SimpleNamespace

    from posttrain.algorithms import rl

    cfg = config(Path("unused"))
    errors = RewardErrorBudget()
    errors.record([None, "a reward failed"])
    state = {"reward_errors": errors.state_dict(), "next_group_id": 8}  # written with normalize_rewards off
    # The checkpoint to resume (its reading of the RNG and sampler position stubbed: this trainer state).
    monkeypatch.setattr(rl, "resume_trainer_state", lambda resume, sampler: (2, state))

    def resumed_run(reward_norm):
        data = SimpleNamespace(prompts=[None] * 4, environment=None, tokenizer=None)
        return rl.RLRun(Path("unused"), [], torch.device("cpu"), data, object(), reward_norm, None, None)

    run = resumed_run(None)
    source, start_step = run.rollout_source(cfg, None, {})
    assert start_step == 2 and source.next_group_id == 8 and source.budget.run_errors == 1
    assert run.trainer_state(source) == state  # what the next checkpoint keeps: the same keys, no statistics
    with pytest.raises(RunError, match="normalize_rewards is on, but the checkpoint"):
        resumed_run(RunningRewardNorm()).rollout_source(cfg, None, {})
    # With the statistics in the checkpoint they come back, and the next checkpoint keeps them.
    norm = RunningRewardNorm()
    norm.update(torch.tensor([1.0, 3.0, 5.0]))
    state["reward_norm"] = norm.state_dict()
    run = resumed_run(RunningRewardNorm())
    source, _ = run.rollout_source(cfg, None, {})
    assert run.reward_norm.state_dict() == norm.state_dict()
    assert run.trainer_state(source) == state


def test_lora_ppo_trains_the_policy_adapter_beside_a_full_critic(tmp_path, tiny_model_dir):
    train_ppo(config(tmp_path, "trainer.max_steps=3", "trainer.save_every=3", "lora.enabled=true", "lora.r=4",
                     "gae.kl_coef=0.1"))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[0]["kl_in_reward"] == 0.0  # the reference is the policy with its adapters off
    step = tmp_path / "checkpoints" / "step_3"
    assert (step / "policy" / "adapter_model.safetensors").is_file()
    assert not (step / "policy" / "model.safetensors").exists()
    assert (step / "critic" / "model.safetensors").is_file()
    assert (tmp_path / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("override, message", [
    ("advantage.estimator=rloo", "advantage.* does not apply to PPO"),
    ("rollout.dynamic_sampling=true", "rollout.dynamic_sampling"),
    ("critic.warmup_steps=10", "leaves no step"),
    ("critic.value_clip=true", "critic.value_clip"),
])
def test_incompatible_settings_fail_at_load(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, "trainer.max_steps=10", override)
