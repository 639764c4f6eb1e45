"""Ray worker groups (cluster.backend=ray): the same GRPO loop driving generation and environment actors, weight
sync to them, deadlines. One small Ray instance per test (2 CPUs); skipped when ray is not installed."""

import importlib.util
from pathlib import Path

import pytest
import torch

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
    for step, (a, b) in enumerate(zip(local, remote), start=1):
        assert a["weight_sync/version"] == b["weight_sync/version"] == step  # one optimizer step per RL step
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


# ---- weight sync -------------------------------------------------------------------------------------------------


CHECK = ["model.name_or_path=posttrain/tiny", "data.train_files=['posttrain/arithmetic[:16]']", "data.max_length=32",
         "rollout.max_new_tokens=6"]


def test_check_weight_sync_passes_for_an_in_process_copy_and_fails_when_the_push_is_wrong(tiny_model_dir, capsys,
                                                                                         monkeypatch):
    from posttrain.cli import main
    from posttrain.distributed.weight_check import InProcessCopy

    assert main(["grpo", "--check-weight-sync", *CHECK]) == 0
    out = capsys.readouterr().out
    assert "weight sync ok: backend=local" in out and "39/39 tensors bitwise equal" in out
    assert "policy version 1 (generators hold [1])" in out and "bitwise equal" in out

    # Control: a push that loses the last bit of one tensor is caught by both comparisons.
    real = InProcessCopy.update_weights

    def flipped(self, version, weights):
        return real(self, version, ((name, tensor.nextafter(torch.full_like(tensor, 1e9))
                                     if name.endswith("lm_head.weight") or name == "model.norm.weight" else tensor)
                                    for name, tensor in weights))

    monkeypatch.setattr(InProcessCopy, "update_weights", flipped)
    assert main(["grpo", "--check-weight-sync", *CHECK]) == 1
    out = capsys.readouterr().out
    assert "weight sync MISMATCH" in out and "model.norm.weight" in out and "differ, max |difference|" in out


@needs_ray
def test_ray_weight_sync_is_versioned_bucketed_and_bitwise_and_the_actors_logprobs_equal_the_trainers(
        tmp_path, tiny_model_dir):
    import ray

    from posttrain.algorithms.weight_check import check_weight_sync

    # Two generation actors, buckets of 64 KiB (the tiny model's 4.3 MiB in many pieces).
    cfg = config(tmp_path, *CHECK, *RAY, "cluster.generation_workers=2", "rollout.seed_per_group=true",
                 "weight_sync.bucket_mb=0.0625")
    check = check_weight_sync(cfg)
    assert not ray.is_initialized()
    assert check.passed, check.summary()
    assert check.backend == "ray" and check.workers == 2 and check.generator_versions == [1, 1]
    assert check.tensors == 39 and not check.differing_tensors and check.bytes_sent > 4 * 2**20
    assert check.logprobs_bitwise_equal and check.logprob_max_difference == 0.0
    assert check.sampled_mismatch_max < 1e-4  # the sampler's KV-cached decode, not bitwise but close


# ---- deadlines ---------------------------------------------------------------------------------------------------


@needs_ray
@pytest.mark.slow  # about 35 s: a Ray instance, two actors, two steps, then the deadline
def test_an_environment_worker_that_stops_answering_stops_the_run_within_the_deadline_naming_it(
        tmp_path, tiny_model_dir):
    import ray

    from posttrain.checkpoint import list_checkpoints, verify_checkpoint
    from posttrain.errors import RunError

    from rl_configs import REWARDS

    hangs = ["environment.kind=python",
             f"environment.options={{functions: ['{REWARDS}:digit_fraction_then_never_answers'], num_workers: 0}}"]
    cfg = load_config(GRPOConfig, None, [*TINY_RL, *hangs, f"output_dir={tmp_path}", "trainer.max_steps=4",
                                         "trainer.save_every=1", "cluster.backend=ray", "cluster.timeout_s=10"])
    with pytest.raises(RunError) as error:  # without the deadline this call would never return
        train_grpo(cfg)
    message = str(error.value)
    assert "environment worker 0 of 1 did not answer `step` within cluster.timeout_s=10 s" in message
    assert "waiting for the rewards of 32 episodes" in message
    assert not ray.is_initialized()  # the run's Ray instance was shut down on the way out
    # Steps 1 and 2 finished and were saved; step 3's scoring hung: the newest checkpoint is step 2, intact.
    checkpoints = list_checkpoints(tmp_path)
    assert [c.step for c in checkpoints] == [1, 2]
    assert verify_checkpoint(checkpoints[-1].path) is None
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2
