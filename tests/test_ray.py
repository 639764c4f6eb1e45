"""Ray worker groups (cluster.backend=ray): the same GRPO loop driving generation and environment actors, weight
sync to them, deadlines. One small Ray instance per test (2 CPUs); skipped when ray is not installed."""

import importlib.util
from pathlib import Path

import pytest

from posttrain.algorithms.grpo import train_grpo
from posttrain.config import load_config
from posttrain.config.schema import GRPOConfig
from posttrain.logging import read_metrics

from rl_configs import DIGITS, TINY_RL

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="cluster.backend=ray needs the ray extra (pip install 'posttrain[ray]')")

RAY = ["cluster.backend=ray", "cluster.timeout_s=120"]


def config(output_dir: Path, *overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, None, [*TINY_RL, *DIGITS, f"output_dir={output_dir}", *overrides])


@needs_ray
@pytest.mark.slow  # about 40 s: two runs, one starting a Ray instance and two actors
def test_ray_grpo_logs_the_rewards_and_losses_of_the_in_process_run(tmp_path, tiny_model_dir):
    import ray

    train_grpo(config(tmp_path / "local", "trainer.max_steps=3"))
    train_grpo(config(tmp_path / "ray", "trainer.max_steps=3", *RAY))
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert not ray.is_initialized()  # the run's Ray instance stopped with it
    assert len(local) == len(remote) == 3
    for a, b in zip(local, remote):
        for key in ("reward/mean", "loss", "grad_norm", "response_length/mean", "generator_logprob_error"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), key
        assert b["weight_sync/bytes"] > 0 == a["weight_sync/bytes"]  # the actor's own copy was refreshed
        assert 0 <= b["heartbeat/generation_seconds"] < 60 and 0 <= b["heartbeat/environment_seconds"] < 60


@pytest.mark.parametrize("override, message", [
    (["rollout.backend=vllm"], "Ray generation workers run the transformers backend"),
    (["cluster.generation_workers=2"], "needs rollout.seed_per_group=true"),
    (["cluster.timeout_s=0"], "cluster.timeout_s"),
])
def test_ray_settings_that_cannot_work_fail_at_load(tmp_path, override, message):
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        config(tmp_path, *RAY, *override)
