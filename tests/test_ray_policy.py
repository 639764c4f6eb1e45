"""The policy (and PPO's critic) as a Ray worker group (cluster.policy_workers, distributed/ray_policy.py): two
actors, one per FSDP2 rank in one gloo process group, driven by the same GRPO and PPO loops through the worker
protocols, make the update one process makes; a rank that dies stops the run naming it, and re-running resumes.

Tolerance: 1e-5, as the torchrun comparisons (tests/test_distributed.py): two ranks sum each gradient in another
order than one process, which shows in gradient norms at ~1e-6 relative; rewards agree exactly while the sampled
tokens do. One small Ray instance per run (4 CPU slots on this 2-core machine); the Ray tests are skipped when ray
is not installed."""

from pathlib import Path

import pytest

from posttrain.algorithms.grpo import train_grpo
from posttrain.config import load_config
from posttrain.config.schema import GRPOConfig, PPOConfig
from posttrain.logging import read_metrics

from rl_configs import DIGITS, TINY_RL
from ray_for_tests import assert_same_steps, needs_ray


# Generous deadline: an actor's start took over 120 s on a loaded 2-core machine. Four CPU slots: two policy
# ranks, a generation and an environment actor.
POLICY_GROUP = ["cluster.backend=ray", "cluster.timeout_s=600", "cluster.policy_workers=2", "cluster.num_cpus=4"]
# Two minibatches (π_old from the policy's logprobs) and a KL penalty (the reference sharded over the same ranks):
# every call of the seam crosses to the ranks. One thread per process, as torchrun's ranks in tests/test_distributed.py.
GRPO = [*TINY_RL, *DIGITS, "trainer.num_threads=1", "update.num_minibatches=2", "trainer.micro_batch_size=8",
        "loss.reference_kl_penalty=0.1"]


def grpo(output_dir: Path, *overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, None, [*GRPO, f"output_dir={output_dir}", *overrides])


def no_model_in_the_driver(monkeypatch) -> None:
    """Make building a policy, critic or scorer in this (the driver's) process an error: the Ray run must build
    them on its ranks."""
    from posttrain.workers import local, value

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built in the driver process")

    for module, name in ((local, "build_policy"), (local, "build_scorer"), (value, "build_critic")):
        monkeypatch.setattr(module, name, refuse)


@needs_ray
@pytest.mark.slow  # about 40 s: an in-process run, a Ray run of two policy ranks, a generator and an environment
def test_grpo_on_a_two_rank_ray_policy_group_logs_the_rewards_and_losses_of_the_in_process_run(tmp_path,
                                                                                             tiny_model_dir,
                                                                                             monkeypatch):
    """Steps 1-3 on the Ray policy group, then step 4 resumed in one process from the ranks' sharded checkpoint:
    the in-process run's numbers at every step."""
    import ray

    train_grpo(grpo(tmp_path / "local", "trainer.max_steps=4"))
    with monkeypatch.context() as patches:
        no_model_in_the_driver(patches)
        train_grpo(grpo(tmp_path / "ray", "trainer.max_steps=3", "trainer.save_every=3", *POLICY_GROUP))
    assert not ray.is_initialized()  # the run's Ray instance (and its policy actors) stopped with it
    # The ranks wrote one sharded checkpoint (torch.distributed.checkpoint) in the run directory's layout.
    shards = sorted(p.name for p in (tmp_path / "ray" / "checkpoints" / "step_3" / "policy").iterdir())
    assert ".metadata" in shards and "__0_0.distcp" in shards and "__1_0.distcp" in shards
    assert (tmp_path / "ray" / "final" / "config.json").is_file()
    train_grpo(grpo(tmp_path / "ray", "trainer.max_steps=4"))  # resumed from step 3, in this process
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == 4
    assert_same_steps(local, remote, ("reward/mean", "loss", "grad_norm", "kl", "ratio_max", "generator_logprob_error"))
    assert len({r["reward/mean"] for r in local}) > 1  # the runs learn: rewards move
    for a, b in zip(local[:3], remote[:3]):
        assert b["weight_sync/version"] == a["weight_sync/version"] == 2 * a["step"]  # two optimizer steps each
        assert b["weight_sync/bytes"] > 4 * 2**20 > 0 == a["weight_sync/bytes"]  # the gathered weights were pushed
        assert 0 <= b["heartbeat/policy_seconds"] < 60
    assert remote[3]["weight_sync/version"] == 8  # the resumed run continued the version count


@needs_ray
@pytest.mark.slow  # about 40 s: an in-process run, then a Ray run of two policy ranks sampling on themselves
def test_colocated_generation_on_a_two_rank_policy_group_samples_on_the_ranks_and_logs_the_in_process_run(
        tmp_path, tiny_model_dir, monkeypatch):
    """cluster.colocated=true with a policy group: no generation actor and no generator in the driver; each rank
    samples its half of a round from a copy it refills in its own process after every optimizer step, and the run
    logs the in-process run's numbers."""
    from posttrain.algorithms import rl
    from posttrain.distributed.ray_policy import RankGenerator

    steps = ["rollout.seed_per_group=true", "trainer.max_steps=3"]
    train_grpo(grpo(tmp_path / "local", *steps))
    sampled_by: list[int] = []  # per generation call, the ranks that sampled a share of it
    real = RankGenerator.generate

    def recording(self, prompts, params, num_samples=1):
        output = real(self, prompts, params, num_samples)
        sampled_by.append(len(output.extra["weights_versions"]))
        return output

    with monkeypatch.context() as patches:
        no_model_in_the_driver(patches)
        patches.setattr(rl, "build_generator", no_generator_in_the_driver)
        patches.setattr(RankGenerator, "generate", recording)
        train_grpo(grpo(tmp_path / "ray", *steps, *POLICY_GROUP, "cluster.colocated=true"))
    assert sampled_by[:3] == [2, 2, 2]  # each step's round: both ranks sampled their halves
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == 3
    assert_same_steps(local, remote, ("reward/mean", "loss", "grad_norm", "kl", "generator_logprob_error"))
    assert len({r["reward/mean"] for r in local}) > 1  # the runs learn: rewards move
    for a, b in zip(local, remote):
        assert b["weight_sync/version"] == 2 * a["step"]  # two optimizer steps a step, each rank refilled after both
        assert b["weight_sync/bytes"] > 4 * 2**20  # each rank copied the whole model into its generator
        assert "heartbeat/policy_seconds" in b and "heartbeat/generation_seconds" not in b  # no generation actor


def no_generator_in_the_driver(*args, **kwargs):
    raise AssertionError("a generator was built in the driver process")


@needs_ray
@pytest.mark.slow  # about 40 s: an in-process run, then a Ray run of two policy ranks
def test_lora_grpo_on_a_ray_policy_group_scores_its_reference_on_the_ranks_and_logs_the_in_process_run(
        tmp_path, tiny_model_dir, monkeypatch):
    lora = ["lora.enabled=true", "lora.r=4", "lora.alpha=8", "trainer.learning_rate=1e-2", "trainer.max_steps=2"]
    train_grpo(grpo(tmp_path / "local", *lora))
    no_model_in_the_driver(monkeypatch)
    train_grpo(grpo(tmp_path / "ray", *lora, *POLICY_GROUP))
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    # The KL is to the base model: the ranks' own shards with the adapters off (no second copy, no driver copy).
    assert_same_steps(local, remote, ("reward/mean", "loss", "grad_norm", "kl", "generator_logprob_error"))
    assert remote[-1]["kl"] > 0  # the adapters moved the policy away from its base
    assert (tmp_path / "ray" / "adapter").is_dir() and (tmp_path / "ray" / "final" / "config.json").is_file()


@needs_ray
@pytest.mark.slow  # about 70 s: an in-process PPO run, then one with the policy and the critic on two Ray ranks
def test_ppo_with_policy_and_critic_on_a_two_rank_ray_group_logs_the_in_process_run(tmp_path, tiny_model_dir,
                                                                                    monkeypatch):
    from posttrain.algorithms.ppo import train_ppo

    def ppo(output_dir: Path, *overrides: str) -> PPOConfig:
        return load_config(PPOConfig, None, [*TINY_RL, *DIGITS, f"output_dir={output_dir}", "trainer.num_threads=1",
                                             "trainer.max_steps=3", "update.num_minibatches=2",
                                             "critic.warmup_steps=1", "trainer.save_every=3", *overrides])

    train_ppo(ppo(tmp_path / "local", "loss.reference_kl_penalty=0.1"))
    no_model_in_the_driver(monkeypatch)
    train_ppo(ppo(tmp_path / "ray", "loss.reference_kl_penalty=0.1", *POLICY_GROUP))
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    # The critic's value head is initialised on the ranks from the driver's random stream: the same head, the same
    # values, explained variance and value losses from step 1 on.
    assert_same_steps(local, remote, ("reward/mean", "value/loss", "value/grad_norm", "value/explained_variance"))
    assert_same_steps(local[1:], remote[1:], ("loss", "grad_norm", "kl"))  # the policy waits one warm-up step
    for role in ("policy", "critic"):
        assert (tmp_path / "ray" / "checkpoints" / "step_3" / role / ".metadata").is_file()  # sharded by the ranks


@needs_ray
@pytest.mark.slow  # about 100 s: an in-process run, a Ray run stopped by a killed rank, and its resumption
def test_a_policy_rank_that_dies_stops_the_run_naming_it_and_re_running_resumes(tmp_path, tiny_model_dir,
                                                                                monkeypatch):
    import ray

    from posttrain.checkpoint import list_checkpoints
    from posttrain.distributed.ray_policy import RayPolicyWorker
    from posttrain.errors import RunError

    steps = ["trainer.max_steps=4", "trainer.save_every=1"]
    train_grpo(grpo(tmp_path / "local", *steps))

    real = RayPolicyWorker.forward_backward
    calls = []

    def kill_rank_one_in_step_three(self, batch, loss):
        calls.append(len(batch))
        if len(calls) == 5:  # step 3's first minibatch (two per step)
            ray.kill(self.group.actors[1], no_restart=True)  # as if its process were killed
        return real(self, batch, loss)

    monkeypatch.setattr(RayPolicyWorker, "forward_backward", kill_rank_one_in_step_three)
    with pytest.raises(RunError) as error:
        train_grpo(grpo(tmp_path / "ray", *steps, *POLICY_GROUP))
    message = str(error.value)
    assert ("policy worker 1 of 2 (rank 1) died during `forward_backward` (waiting for forward and backward of 16 "
            "rows)") in message
    assert "re-run the same command to resume from the newest checkpoint" in message
    assert not ray.is_initialized()  # the surviving rank, stuck in a collective, was killed with the instance
    assert [c.step for c in list_checkpoints(tmp_path / "ray")] == [1, 2]

    monkeypatch.setattr(RayPolicyWorker, "forward_backward", real)
    train_grpo(grpo(tmp_path / "ray", *steps, *POLICY_GROUP))  # the same command: resumes from step 2
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert_same_steps(local, remote, ("reward/mean", "loss", "grad_norm", "kl"))


@pytest.mark.parametrize("overrides, message", [
    (["cluster.policy_workers=2"], "cluster.policy_workers needs cluster.backend=ray"),
    (["cluster.backend=ray", "cluster.policy_workers=2"],
     r"cluster.policy_workers x cpus_per_policy_worker = 2 \+ .* > cluster.num_cpus=2; raise cluster.num_cpus"),
    (["cluster.backend=ray", "cluster.policy_workers=2", "cluster.gpus_per_policy_worker=-1"],
     "gpus_per_policy_worker"),
])
def test_policy_group_settings_that_cannot_work_fail_at_load(tmp_path, overrides, message):
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        grpo(tmp_path, *overrides)


@needs_ray
@pytest.mark.slow  # about 15 s, a Ray instance and an environment actor; the placement alone is checked below
def test_a_policy_group_asking_for_gpus_the_cluster_lacks_stops_before_any_rank_starts(tmp_path, tiny_model_dir):
    import ray
    import torch

    from posttrain.errors import RunError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RunError, match=r"cluster.gpus_per_policy_worker=1 asks for 2 GPUs for 2 policy workers; "
                                       r"the Ray cluster offers 0"):
        train_grpo(grpo(tmp_path, "trainer.max_steps=1", *POLICY_GROUP, "cluster.gpus_per_policy_worker=1"))
    assert not ray.is_initialized()


@needs_ray
def test_a_rank_group_names_the_rank_that_died_failed_or_did_not_answer(tmp_path, monkeypatch):
    """The driver's wait on every rank (RankGroup, with stand-in actors): a rank whose actor died is named even while
    another rank is still blocked (as in a collective with the dead one); an error raised on a rank is re-raised
    with the rank named; ranks silent past cluster.timeout_s are named. And the placement refuses at once what a
    one-CPU instance without GPUs cannot hold."""
    import shutil
    import tempfile
    import time

    import ray

    from posttrain.config.schema import ClusterSection
    from posttrain.distributed import ray_policy
    from posttrain.errors import RunError

    @ray.remote(num_cpus=0)
    class StandIn:
        def __init__(self, rank):
            self.rank = rank

        def ready(self):
            return True

        def echo(self, value):
            return self.rank, value

        def fail(self):
            raise ValueError(f"row 3 is malformed (seen on rank {self.rank})")

        def hang(self):
            time.sleep(3600)

    def place(section: ClusterSection):
        return ray_policy.place_actors(ray_policy.group_resources(section)["policy"], section, local_instance=True)

    monkeypatch.setattr(ray_policy, "FAILURE_GRACE_S", 1.0)
    temp_dir = tempfile.mkdtemp(prefix="pt-ray-")  # short: Ray's socket paths must fit in 107 characters
    ray.init(num_cpus=1, _temp_dir=temp_dir, include_dashboard=False)
    try:
        with pytest.raises(RunError, match=r"cluster.gpus_per_policy_worker=1 asks for 2 GPUs for 2 policy workers; "
                                           r"the Ray cluster offers 0"):
            place(ClusterSection(policy_workers=2, gpus_per_policy_worker=1))
        with pytest.raises(RunError, match=r"the policy group needs 2 CPUs \(cluster.policy_workers=2 x "
                                           r"cluster.cpus_per_policy_worker=1\); this run's Ray instance has 1 free"):
            place(ClusterSection(policy_workers=2))

        def group(timeout_s: float) -> ray_policy.RankGroup:
            ranks = ray_policy.RankGroup([StandIn.remote(rank) for rank in range(2)], 600)
            ranks.each("ready", "the stand-ins to start")  # their start (slow on a loaded machine) is not measured
            ranks.timeout_s = timeout_s
            return ranks

        ranks = group(timeout_s=600)
        assert ranks.each("echo", "echoes", "x") == [(0, "x"), (1, "x")]
        with pytest.raises(ValueError, match="row 3 is malformed") as error:
            ranks.each("fail", "nothing")
        assert "(raised by policy worker 0 of 2 (rank 0) during `fail`)" in error.value.__notes__
        assert ranks.failed  # nothing more is sent to a group that failed
        with pytest.raises(RunError, match="the policy group stopped after an earlier failure; `echo` was not sent"):
            ranks.each("echo", "echoes", "y")
        ranks.kill()

        ranks = group(timeout_s=600)
        ray.kill(ranks.actors[1], no_restart=True)
        # Rank 0 blocks (as in a collective with the dead rank 1); the 600 s deadline is not waited out.
        with pytest.raises(RunError, match=r"policy worker 1 of 2 \(rank 1\) died during `hang` \(waiting for a "
                                           r"collective\): .* re-run the same command to resume"):
            ranks.each("hang", "a collective")
        ranks.kill()

        ranks = group(timeout_s=2)
        with pytest.raises(RunError, match=r"policy worker 0 of 2 \(rank 0\), policy worker 1 of 2 \(rank 1\) did "
                                           r"not answer `hang` within cluster.timeout_s=2 s \(waiting for the step\)"):
            ranks.each("hang", "the step")
        ranks.kill()
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@needs_ray
@pytest.mark.slow  # about 40 s: a Ray run with a policy group, stopped by SIGTERM after its second step
def test_sigterm_to_a_ray_run_finishes_the_step_and_checkpoints_the_policy_group(tmp_path, tiny_model_dir):
    """ray.init installs a SIGTERM handler of Ray's own in the driver, which ends it at once; the run puts posttrain's
    back (posttrain.preemption), so a preempted Ray run stops at a step boundary with a checkpoint of every rank."""
    import os
    import signal
    import subprocess
    import sys
    import time

    output_dir = tmp_path / "run"
    command = [sys.executable, "-m", "posttrain", "grpo", *TINY_RL, *DIGITS, "trainer.max_steps=200",
               "trainer.num_threads=1", *POLICY_GROUP, f"output_dir={output_dir}"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        metrics = output_dir / "metrics.jsonl"
        give_up = time.monotonic() + 500  # a deadline for the wait, not a measurement
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert process.poll() is None and time.monotonic() < give_up, process.communicate()[0][-3000:]
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=500)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    step = len(read_metrics(metrics))
    assert 2 <= step < 200 and f"stopped by SIGTERM after step {step} of 200" in output
    assert (output_dir / "checkpoints" / f"step_{step}" / "policy" / ".metadata").is_file()
