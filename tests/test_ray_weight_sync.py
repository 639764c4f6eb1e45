"""Weight sync by collective broadcast (weight_sync.method=broadcast, distributed/weight_broadcast.py) and
cluster.colocated: the bucket plan every member computes, the broadcast itself between members of a gloo group, and
Ray runs that sync by broadcast from the driver and from a 2-rank policy group (bitwise weights and
log-probabilities, the same metrics as the object-store path, a stuck member named within the deadline, a replaced
actor catching up from a peer). The Ray tests are skipped when ray is not installed."""

import threading
import time
from pathlib import Path

import pytest
import torch

from posttrain.algorithms.grpo import train_grpo
from posttrain.config import load_config
from posttrain.config.schema import GRPOConfig
from posttrain.logging import read_metrics

from rl_configs import DIGITS, TINY_RL
from ray_for_tests import needs_ray


RAY = ["cluster.backend=ray", "cluster.timeout_s=600"]
BROADCAST = ["weight_sync.method=broadcast"]
POLICY_GROUP = ["cluster.policy_workers=2", "cluster.num_cpus=4", "trainer.num_threads=1"]
CHECK = ["model.name_or_path=posttrain/tiny", "data.train_files=['posttrain/arithmetic[:16]']", "data.max_length=32",
         "rollout.max_new_tokens=6"]


def config(output_dir: Path, *overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, None, [*TINY_RL, *DIGITS, f"output_dir={output_dir}", *overrides])


# ---- the plan and the broadcast, without Ray ------------------------------------------------------------------


def test_the_bucket_plan_is_sorted_grouped_by_dtype_and_independent_of_the_order_given():
    from posttrain.distributed.weight_broadcast import bucket_plan, first_difference, plan_digest

    specs = [("b.weight", "float32", (4, 4)), ("a.weight", "float32", (4, 4)), ("norm", "bfloat16", (8,)),
             ("c.bias", "float32", (4,)), ("big", "float32", (100,))]
    plan = bucket_plan(specs, bucket_bytes=100)
    # bfloat16 first (dtypes sorted), then float32 names sorted; a bucket closes once it reaches 100 bytes.
    assert [(b.dtype, [name for name, _ in b.tensors], b.nbytes) for b in plan] == [
        ("bfloat16", ["norm"], 16), ("float32", ["a.weight", "b.weight"], 128), ("float32", ["big"], 400),
        ("float32", ["c.bias"], 16)]
    assert plan_digest(bucket_plan(reversed(specs), 100)) == plan_digest(plan)
    changed = [*specs[:4], ("big", "float32", (101,))]
    assert plan_digest(bucket_plan(changed, 100)) != plan_digest(plan)
    assert first_difference(specs, changed) == "big: float32 [100] on the holder, float32 [101] on the generator"
    assert first_difference(specs, specs[1:]) == "b.weight: float32 [4, 4] on the holder, absent on the generator"


def _members(count: int, timeout_s: float, target) -> list:
    """Run target(rank, port) in `count` threads, each a member of one gloo weight-sync group; their results."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results: list = [None] * count

    def run(rank: int) -> None:
        try:
            results[rank] = target(rank, port)
        except RuntimeError as error:
            results[rank] = error

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s + 30)  # a deadline for the test itself, beyond the group's own
    return results


def test_a_broadcast_fills_every_members_model_bitwise_and_a_member_that_stops_answering_is_a_timeout():
    """Three members of one gloo group in threads: the holder's float32 and bfloat16 weights reach two models bit for
    bit through the plan's buckets; then, with one member never taking part, the others fail past the timeout."""
    import datetime

    from posttrain.distributed.weight_broadcast import SyncGroup, WeightLoader, WeightSender

    torch.manual_seed(0)
    holder = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8).to(torch.bfloat16))
    copies = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8).to(torch.bfloat16)) for _ in range(2)]

    def member(rank: int, port: int) -> int:
        group = SyncGroup("127.0.0.1", port, rank, 3, "gloo", timeout_s=60)
        side = WeightSender(holder.state_dict().items(), 40) if rank == 0 else WeightLoader(copies[rank - 1], 40)
        for index in range(len(side.plan)):
            if rank == 0:
                side.send(group, index).wait(datetime.timedelta(seconds=60))
            else:
                side.receive(group, index, timeout_s=60)
        return len(side.plan)

    # Buckets of 40 bytes: the two bfloat16 tensors (16 bytes each), then float32 0.bias (32) with 0.weight (256).
    assert _members(3, 60, member) == [2, 2, 2]
    for copy in copies:
        for (name, a), b in zip(holder.state_dict().items(), copy.state_dict().values()):
            assert a.dtype == b.dtype and torch.equal(a, b), name

    def member_two_stops(rank: int, port: int):
        group = SyncGroup("127.0.0.1", port, rank, 3, "gloo", timeout_s=2)
        if rank == 2:  # alive and connected, but past the others' timeout before it takes part
            time.sleep(5)
            return "stopped answering" if group is not None else None
        if rank == 0:
            return WeightSender(holder.state_dict().items(), 40).send(group, 0).wait(datetime.timedelta(seconds=2))
        return WeightLoader(copies[0], 40).receive(group, 0, timeout_s=2)

    results = _members(3, 5, member_two_stops)
    assert results[2] == "stopped answering"
    assert isinstance(results[0], RuntimeError) and "timed out" in str(results[0]).lower()  # waiting for member 2


# ---- config --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["weight_sync.method=nccl"], "weight_sync.method"),
    (["cluster.colocated=true"], "cluster.colocated applies to cluster.backend=ray"),
    ([*RAY, "cluster.colocated=true", *POLICY_GROUP], "cluster.policy_workers=2 needs rollout.seed_per_group=true: "
                                                      "each rank samples its share of a round"),
    ([*RAY, "cluster.colocated=true", "cluster.generation_workers=2", "rollout.seed_per_group=true"],
     "cluster.generation_workers does not apply with cluster.colocated=true"),
    ([*RAY, "cluster.colocated=true", *BROADCAST], "weight_sync.method does not apply with cluster.colocated=true"),
    ([*RAY, "cluster.colocated=true", "rollout.asynchronous=true", "loss.importance_correction=tis"],
     "cannot run ahead of training"),
])
def test_weight_sync_and_colocation_settings_that_cannot_work_fail_at_load(tmp_path, overrides, message):
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        config(tmp_path, *overrides)


# ---- Ray runs ------------------------------------------------------------------------------------------------


def no_object_store_push(monkeypatch) -> None:
    """Make the object-store path an error in this (the driver's) process: the push must go by broadcast."""
    from posttrain.distributed import ray_groups

    def refuse(*args, **kwargs):
        raise AssertionError("the weights went through the object store")

    monkeypatch.setattr(ray_groups.RayGenerator, "_push", refuse)
    monkeypatch.setattr(ray_groups, "bucket_payload", refuse)


@needs_ray
@pytest.mark.parametrize("holder", [
    pytest.param([], id="driver"),
    pytest.param(POLICY_GROUP, id="policy-group", marks=pytest.mark.slow),  # about 20 s: two policy ranks as well
])
def test_broadcast_sync_gives_the_generators_bitwise_weights_and_log_probabilities(tmp_path, tiny_model_dir,
                                                                                  monkeypatch, holder):
    """--check-weight-sync by broadcast, in buckets of 64 KiB (the tiny model's 4.3 MiB in many), to two generation
    actors, from the driver's weights or from the gathered shards of a 2-rank policy group."""
    import ray

    from posttrain.algorithms.weight_check import check_weight_sync

    no_object_store_push(monkeypatch)
    cfg = config(tmp_path, *CHECK, *RAY, *BROADCAST, *holder, "cluster.generation_workers=2",
                 "rollout.seed_per_group=true", "weight_sync.bucket_mb=0.0625",
                 *(["cluster.num_cpus=5"] if holder else []))
    check = check_weight_sync(cfg)
    assert not ray.is_initialized()
    assert check.passed, check.summary()
    assert check.workers == 2 and check.generator_versions == [1, 1] and check.tensors == 39
    assert not check.differing_tensors and check.bytes_sent > 4 * 2**20
    assert check.logprobs_bitwise_equal and check.logprob_max_difference == 0.0


@needs_ray
@pytest.mark.slow  # about 45 s: two Ray runs of 3 steps with two generation actors
def test_a_run_synced_by_broadcast_logs_the_metrics_of_the_same_run_synced_through_the_object_store(
        tmp_path, tiny_model_dir):
    two = ["cluster.generation_workers=2", "rollout.seed_per_group=true", "cluster.num_cpus=3",
           "weight_sync.bucket_mb=1", "trainer.max_steps=3"]
    train_grpo(config(tmp_path / "store", *RAY, *two))
    train_grpo(config(tmp_path / "broadcast", *RAY, *two, *BROADCAST))
    store = read_metrics(tmp_path / "store" / "metrics.jsonl")
    broadcast = read_metrics(tmp_path / "broadcast" / "metrics.jsonl")
    assert len(store) == len(broadcast) == 3
    for step, (a, b) in enumerate(zip(store, broadcast), start=1):
        assert a["weight_sync/version"] == b["weight_sync/version"] == step
        assert a["weight_sync/bytes"] == b["weight_sync/bytes"] > 4 * 2**20
        for key in ("reward/mean", "loss", "grad_norm", "response_length/mean", "generator_logprob_error",
                    "generator_logprob_error_max"):
            assert a[key] == b[key], (step, key)  # the same weights: the same numbers, bit for bit
    assert len({r["loss"] for r in store}) > 1


@needs_ray
@pytest.mark.slow  # about 25 s: an in-process run, then a Ray run with a 2-rank LoRA policy group
def test_a_lora_policy_group_syncs_its_merged_weights_by_broadcast(tmp_path, tiny_model_dir, monkeypatch):
    """The generators receive the merged weights (base + B·A, gathered from the ranks' shards): their
    log-probabilities, the rewards and losses are the in-process run's."""
    lora = ["lora.enabled=true", "lora.r=4", "lora.alpha=8", "trainer.learning_rate=1e-2", "trainer.max_steps=2",
            "trainer.num_threads=1"]
    train_grpo(config(tmp_path / "local", *lora))
    no_object_store_push(monkeypatch)
    train_grpo(config(tmp_path / "ray", *lora, *RAY, *BROADCAST, *POLICY_GROUP))
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    for step, (a, b) in enumerate(zip(local, remote), start=1):
        assert b["weight_sync/version"] == step and b["weight_sync/bytes"] > 4 * 2**20
        for key in ("reward/mean", "loss", "grad_norm", "generator_logprob_error"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (step, key)
    assert remote[-1]["generator_logprob_error"] < 1e-5  # the generators sample from the merged weights


@needs_ray
@pytest.mark.slow  # about 35 s each: a Ray run of one step, then the 20 s deadline of the second push
@pytest.mark.parametrize("holder", [pytest.param([], id="driver"), pytest.param(POLICY_GROUP, id="policy-group")])
def test_a_generation_actor_that_stops_answering_a_broadcast_stops_the_run_within_the_deadline_naming_it(
        tmp_path, tiny_model_dir, monkeypatch, holder):
    import ray

    from posttrain.checkpoint import list_checkpoints
    from posttrain.distributed import ray_groups
    from posttrain.errors import RunError

    class StopsAnsweringAtVersionTwo(ray_groups.GenerationWorker):
        """Takes part in the broadcasts of versions 0 and 1, then never answers the first bucket of version 2."""

        def receive_bucket(self, index):
            if self.generator.weights_version == 1:
                time.sleep(3600)
            return super().receive_bucket(index)

    monkeypatch.setattr(ray_groups, "GenerationActor", ray.remote(StopsAnsweringAtVersionTwo))
    cfg = config(tmp_path, "cluster.backend=ray", "cluster.timeout_s=20", *BROADCAST, *holder, "trainer.max_steps=4",
                 "trainer.save_every=1")
    with pytest.raises(RunError) as error:  # without the deadline this call would never return
        train_grpo(cfg)
    message = str(error.value)
    assert ("generation worker 0 of 1 did not answer `receive_bucket` within cluster.timeout_s=20 s (waiting for "
            "broadcast bucket 0 of 1 (4.26 MiB of float32, 39 tensors) of version 2)") in message
    assert "re-run the same command to resume from the newest checkpoint" in message
    assert not ray.is_initialized()  # the stuck actor was killed with the run's Ray instance
    assert [c.step for c in list_checkpoints(tmp_path)] == [1]  # step 2's push failed: step 1 is the newest


@needs_ray
@pytest.mark.slow  # about 60 s: an in-process run, then a Ray run whose second generation actor is killed
def test_a_replaced_generation_actor_copies_a_peers_weights_and_rejoins_the_broadcast(tmp_path, tiny_model_dir):
    """Under broadcast sync no push stays in the object store: the replacement of a killed generation actor copies
    the weights and version of the live one, the next push re-forms the group with it, and the run samples and
    trains what an undisturbed in-process run does."""
    import ray

    from posttrain.distributed import cluster as clusters

    two = ["rollout.seed_per_group=true", "trainer.max_steps=4"]
    killed = []

    def kill_generation_actor_one_after_step_two() -> None:
        metrics = tmp_path / "ray" / "metrics.jsonl"
        give_up = time.monotonic() + 300  # a deadline for the wait, not a measurement
        while time.monotonic() < give_up:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                for group in clusters._started[0].groups:
                    if group.name == "generation":
                        ray.kill(group.actors[1], no_restart=True)  # as if its process were killed
                        killed.append(group.name)
                return
            time.sleep(0.02)

    train_grpo(config(tmp_path / "local", *two))
    killer = threading.Thread(target=kill_generation_actor_one_after_step_two, daemon=True)
    killer.start()
    train_grpo(config(tmp_path / "ray", *two, *RAY, *BROADCAST, "cluster.generation_workers=2", "cluster.num_cpus=3"))
    killer.join(timeout=5)
    assert killed == ["generation"]
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == len(remote) == 4
    for a, b in zip(local, remote):
        assert b["weight_sync/version"] == a["step"]
        for key in ("reward/mean", "loss", "grad_norm", "generator_logprob_error"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), (a["step"], key)
    assert remote[1]["faults/generation_restarts"] == 0 and remote[-1]["faults/generation_restarts"] == 1


@needs_ray  # about 10 s: an in-process run, then a Ray run with colocated generation (an environment actor)
def test_colocated_generation_samples_from_the_trained_module_and_logs_the_in_process_run(tmp_path, tiny_model_dir):
    train_grpo(config(tmp_path / "local", "trainer.max_steps=3"))
    train_grpo(config(tmp_path / "ray", "trainer.max_steps=3", *RAY, "cluster.colocated=true"))
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == len(remote) == 3
    for a, b in zip(local, remote):
        assert b["weight_sync/bytes"] == 0 and b["weight_sync/version"] == a["step"]  # nothing copied
        for key in ("reward/mean", "loss", "grad_norm", "generator_logprob_error"):
            assert b[key] == a[key], (a["step"], key)
        assert "heartbeat/environment_seconds" in b and "heartbeat/generation_seconds" not in b  # no generation actor


def test_check_weight_sync_says_a_colocated_generator_has_no_copy_to_compare(tmp_path):
    from posttrain.algorithms.weight_check import check_weight_sync
    from posttrain.errors import RunError

    with pytest.raises(RunError, match="cluster.policy_workers=0: the generator samples from the trained module "
                                       "itself"):
        check_weight_sync(config(tmp_path, *CHECK, *RAY, "cluster.colocated=true"))


@needs_ray
@pytest.mark.slow  # about 30 s: a Ray instance, two policy ranks and an environment actor
def test_check_weight_sync_compares_the_copy_each_colocated_policy_rank_keeps(tmp_path, tiny_model_dir):
    """With a policy group, colocated generation samples from a copy on each rank: both copies are the trainer's
    weights bit for bit after the push, and give the trainer's log-probabilities."""
    from posttrain.algorithms.weight_check import check_weight_sync

    result = check_weight_sync(config(tmp_path, *CHECK, *RAY, "cluster.colocated=true", *POLICY_GROUP,
                                      "rollout.seed_per_group=true"))
    assert result.passed, result.summary()
    assert result.workers == 2 and result.generator_versions == [1, 1] and result.version == 1
    assert result.bytes_sent > 4 * 2**20 and result.tensors > 10 and result.tokens > 0
