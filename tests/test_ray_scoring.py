"""Reference and teacher groups of their own on Ray (cluster.reference_workers, teacher_workers; RayScoringGroup in
distributed/ray_groups.py): the GRPO loop calls the same `ScoringWorker` methods, the actors score contiguous runs
of a batch's micro-batches, and the runs log the in-process run's numbers; a killed scoring actor is replaced and
its share re-sent; a silent one stops the run within the deadline, naming it; what cannot work is refused at load,
GPUs the cluster lacks at start-up. One small Ray instance per test (4 CPU slots on this 2-core machine); the Ray
tests are skipped when ray is not installed."""

import gc
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from posttrain.algorithms.grpo import train_grpo
from posttrain.config import ConfigError, load_config
from posttrain.config.schema import GRPOConfig, PPOConfig
from posttrain.logging import read_metrics

from rl_configs import DIGITS, TINY_RL
from ray_for_tests import KillAfterSteps, assert_same_steps, needs_ray
from teachers_for_tests import perturbed_tiny_teacher


# Generous deadline: an actor's start took over 120 s on a loaded 2-core machine. Four CPU slots: a generation, an
# environment and two scoring actors.
RAY = ["cluster.backend=ray", "cluster.timeout_s=600", "cluster.num_cpus=4"]
# A KL penalty (the reference scores every step) and micro-batches of 8 rows: a step's 32 rows are 4 micro-batches,
# two per reference actor.
GRPO = [*TINY_RL, *DIGITS, "trainer.micro_batch_size=8", "loss.reference_kl_penalty=0.1"]


def grpo(output_dir: Path, *overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, None, [*GRPO, f"output_dir={output_dir}", *overrides])


def no_scorer_in_the_driver(monkeypatch) -> None:
    """Make building a scorer in this (the driver's) process an error: the Ray run must build it in its actors."""
    from posttrain.workers import local

    def refuse(*args, **kwargs):
        raise AssertionError("a scorer was built in the driver process")

    monkeypatch.setattr(local, "build_scorer", refuse)


@needs_ray
@pytest.mark.slow  # about 60 s: an in-process run, then a Ray run with a 2-actor reference group
def test_grpo_with_a_two_actor_reference_group_logs_the_in_process_run_and_replaces_a_killed_actor(
        tmp_path, tiny_model_dir, monkeypatch):
    """Steps 1-2 undisturbed; then reference actor 0 is killed (ray.kill, as if its process died): step 3's
    reference call finds it dead, a replacement loads the model and scores the same 16 rows. Every step logs the
    in-process run's rewards, losses, gradient norms and KL."""
    import ray

    train_grpo(grpo(tmp_path / "local", "trainer.max_steps=4"))
    with KillAfterSteps(tmp_path / "ray" / "metrics.jsonl", "reference") as killer, monkeypatch.context() as patches:
        no_scorer_in_the_driver(patches)
        train_grpo(grpo(tmp_path / "ray", "trainer.max_steps=4", *RAY, "cluster.reference_workers=2"))
    assert killer.killed == ["reference worker 0 of 2"]
    assert not ray.is_initialized()
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == 4
    assert_same_steps(local, remote, ("reward/mean", "loss", "grad_norm", "kl", "generator_logprob_error"))
    assert all(r["kl"] > 0 for r in local[1:])  # the policy moved away from the reference: the KL is not trivial
    assert remote[1]["faults/reference_restarts"] == remote[1]["faults/reference_retried_samples"] == 0
    assert remote[3]["faults/reference_restarts"] == 1
    assert remote[3]["faults/reference_retried_samples"] == 16  # the dead actor's share of step 3, re-sent
    assert all(0 <= r["heartbeat/reference_seconds"] < 60 for r in remote)


@needs_ray
@pytest.mark.slow  # about 45 s: an in-process on-policy distillation run, then one with a 2-actor teacher group
def test_on_policy_distillation_with_a_two_actor_teacher_group_logs_the_in_process_run(tmp_path, tiny_model_dir,
                                                                                       monkeypatch):
    teacher = perturbed_tiny_teacher(tmp_path / "teacher", scale=0.2)
    opd = [f"teacher={{name_or_path: '{teacher}'}}", "advantage.estimator=opd", "loss.reference_kl_penalty=0",
           "trainer.max_steps=3"]
    train_grpo(grpo(tmp_path / "local", *opd))
    with monkeypatch.context() as patches:
        no_scorer_in_the_driver(patches)
        train_grpo(grpo(tmp_path / "ray", *opd, *RAY, "cluster.teacher_workers=2"))
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == 3
    assert_same_steps(local, remote, ("reward/mean", "loss", "grad_norm", "opd/advantage_mean"))
    assert all(r["opd/advantage_mean"] != 0 for r in local)  # the teacher differs from the student
    assert remote[-1]["faults/teacher_restarts"] == 0


@needs_ray
@pytest.mark.slow  # about 60 s: an in-process PPO run, then one with a 2-actor reference group
def test_ppo_with_the_kl_in_its_reward_and_a_two_actor_reference_group_logs_the_in_process_run(tmp_path,
                                                                                               tiny_model_dir,
                                                                                               monkeypatch):
    from posttrain.algorithms.ppo import train_ppo

    def ppo(output_dir: Path, *overrides: str) -> PPOConfig:
        return load_config(PPOConfig, None, [*TINY_RL, *DIGITS, f"output_dir={output_dir}", "trainer.max_steps=3",
                                             "trainer.micro_batch_size=8", "gae.kl_coef=0.05",
                                             *overrides])

    train_ppo(ppo(tmp_path / "local"))
    with monkeypatch.context() as patches:
        no_scorer_in_the_driver(patches)
        train_ppo(ppo(tmp_path / "ray", *RAY, "cluster.reference_workers=2"))
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == 3
    assert_same_steps(local, remote, ("reward/mean", "loss", "grad_norm", "value/loss", "kl_in_reward"))
    assert local[-1]["kl_in_reward"] != 0  # the policy moved: the reference's log-probabilities enter the reward


def rollouts(rows: int, width: int = 5):
    """A rollout batch whose row i holds token i + 3 at every position (so each row's answer names the row)."""
    from posttrain.data.types import RolloutBatch

    ids = (torch.arange(rows)[:, None] + 3).expand(rows, width).clone()
    ones = torch.ones(rows, width)
    return RolloutBatch(ids, ones.long(), ones, torch.zeros(rows, width), torch.zeros(rows), {},
                        torch.ones(rows, dtype=torch.bool), torch.arange(rows), torch.zeros(rows, dtype=torch.bool),
                        torch.full((rows,), width))


@needs_ray
def test_a_scoring_group_splits_on_micro_batches_joins_in_order_and_names_an_actor_that_does_not_answer():
    """Stand-in scoring actors: a 10-row batch in micro-batches of 3 goes to two actors as rows 0-5 and 6-9 (whole
    micro-batches), the answers come back in row order; a batch of another type goes whole to the actors in turn;
    an actor that never answers stops the call at the deadline, naming the group, the actor and the call."""
    import ray

    from posttrain.distributed.ray_groups import Call, RayScoringGroup, WorkerGroup
    from posttrain.errors import RunError

    @ray.remote(num_cpus=0)
    class StandIn:
        def __init__(self, index, hangs):
            self.index, self.hangs = index, hangs

        def ready(self):
            return True

        def logprobs(self, batch, temperature):
            if self.hangs:
                time.sleep(3600)
            return batch.input_ids.float() * temperature

        def topk_logprobs(self, batch, k, temperature):
            return batch.input_ids[..., None].expand(*batch.input_ids.shape, k).float(), torch.full(
                (*batch.input_ids.shape, k), self.index)

        def sequence_scores(self, batch):
            return torch.full((len(batch),), float(self.index))

    temp_dir = tempfile.mkdtemp(prefix="pt-ray-")  # short: Ray's socket paths must fit in 107 characters
    ray.init(num_cpus=1, _temp_dir=temp_dir, include_dashboard=False)
    groups: list[WorkerGroup] = []
    try:
        def group(hanging: bool) -> RayScoringGroup:
            started = iter([StandIn.remote(0, False), StandIn.remote(1, hanging)])
            workers = WorkerGroup("reference", lambda: next(started), 2, timeout_s=600, max_restarts=0)
            groups.append(workers)
            workers.call([Call(i, "ready") for i in range(2)], "the stand-ins to start")  # not timed
            # Not timed either: an actor's first batch imports posttrain's types there, over 2 s on a loaded machine.
            workers.call([Call(0, "logprobs", (rollouts(1), 1.0))], "a first batch")
            workers.timeout_s = 2
            return RayScoringGroup(workers, "reference", micro_batch_size=3)

        scorer = group(hanging=False)
        batch = rollouts(10)
        assert torch.equal(scorer.logprobs(batch, 0.5), batch.input_ids.float() * 0.5)
        values, ids = scorer.topk_logprobs(batch, 2)
        assert torch.equal(values[..., 0], batch.input_ids.float())
        assert ids[:, 0, 0].tolist() == [0] * 6 + [1] * 4  # two micro-batches each, whole
        assert scorer.sequence_scores(rollouts(5)).tolist() == [0.0] * 3 + [1.0] * 2
        assert scorer.sequence_scores(rollouts(2)).tolist() == [0.0, 0.0]  # one micro-batch: one actor scores it
        # Rows that are not a rollout batch (here a stand-in list) go whole to the next actor in turn.
        assert [scorer.sequence_scores(["a", "b"]).tolist() for _ in range(3)] == [[0.0] * 2, [1.0] * 2, [0.0] * 2]
        # Several batches at once (a distillation step's micro-batches, a reward step's calls): sent together, to
        # the actors in turn (going on from where the last call left), answered in the batches' order.
        parts = [rollouts(2), rollouts(3), rollouts(1)]
        answers = scorer.topk_logprobs_each(parts, 2)
        assert [ids[0, 0, 0].item() for _, ids in answers] == [1, 0, 1]
        assert [tuple(values.shape) for values, _ in answers] == [(2, 5, 2), (3, 5, 2), (1, 5, 2)]
        assert [s.tolist() for s in scorer.sequence_scores_each([["a"], ["b", "c"]])] == [[0.0], [1.0, 1.0]]

        silent = group(hanging=True)
        started = time.monotonic()
        with pytest.raises(RunError, match=r"reference worker 1 of 2 did not answer `logprobs` within "
                                           r"cluster.timeout_s=2 s \(waiting for the log-probabilities of 10 rows\)"):
            silent.logprobs(batch)
        assert time.monotonic() - started < 60  # the deadline, not the hour the actor sleeps
        assert silent.group.failed
    finally:
        # The actors (one still sleeping in a call) and every handle to them go before Ray does: a handle or a call's
        # reference collected after ray.shutdown can bring the test process down.
        for workers in groups:
            for actor in workers.actors:
                ray.kill(actor, no_restart=True)
        groups.clear()
        scorer = silent = None
        gc.collect()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.parametrize("overrides, message", [
    (["cluster.reference_workers=2"], "cluster.reference_workers needs cluster.backend=ray"),
    (["cluster.gpus_per_generation_worker=1"], "cluster.gpus_per_generation_worker needs cluster.backend=ray"),
    (["cluster.backend=ray", "cluster.reference_workers=2"],
     r"cluster.generation_workers x cpus_per_generation_worker = 1 \+ cluster.environment_workers x "
     r"cpus_per_environment_worker = 1 \+ cluster.reference_workers x cpus_per_scoring_worker = 2 > "
     r"cluster.num_cpus=2"),
    (["cluster.backend=ray", "cluster.num_cpus=4", "cluster.reference_workers=1", "cluster.policy_workers=2",
      "cluster.cpus_per_scoring_worker=0.5"], r"cluster.reference_workers x cpus_per_scoring_worker = 0.5 > "),
    (["cluster.backend=ray", "cluster.num_cpus=4", "cluster.reference_workers=2", "loss.reference_kl_penalty=0"],
     "this run has no KL term to the reference"),
    (["cluster.backend=ray", "cluster.num_cpus=4", "cluster.reference_workers=2", "lora.enabled=true"],
     "a LoRA policy's reference is its own weights with the adapters off"),
    (["cluster.backend=ray", "cluster.num_cpus=4", "cluster.teacher_workers=2"], "this run has no teacher"),
    (["cluster.backend=ray", "cluster.num_cpus=4", "cluster.teacher_workers=2", "advantage.estimator=opd",
      "teacher={name_or_path: posttrain/tiny, backend: vllm}"], "teacher actors run the transformers backend"),
    (["cluster.backend=ray", "cluster.colocated=true", "cluster.gpus_per_generation_worker=1"],
     "cluster.gpus_per_generation_worker does not apply with cluster.colocated=true"),
    (["cluster.backend=ray", "cluster.gpus_per_scoring_worker=-1"], "gpus_per_scoring_worker"),
])
def test_scoring_group_settings_that_cannot_work_fail_at_load(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        grpo(tmp_path, *overrides)


def test_a_ppo_reference_group_needs_a_kl_term_and_ppo_has_no_teacher_group(tmp_path):
    def ppo(*overrides: str) -> PPOConfig:
        return load_config(PPOConfig, None, [*TINY_RL, *DIGITS, f"output_dir={tmp_path}", "cluster.backend=ray",
                                             "cluster.num_cpus=4", *overrides])

    with pytest.raises(ConfigError, match="no KL term to the reference"):
        ppo("cluster.reference_workers=1")
    assert ppo("cluster.reference_workers=1", "gae.kl_coef=0.05").cluster.reference_workers == 1  # a KL in the reward
    with pytest.raises(ConfigError, match="this run has no teacher"):
        ppo("cluster.teacher_workers=1")


@needs_ray
@pytest.mark.parametrize("overrides, message", [
    (["cluster.gpus_per_generation_worker=1"],
     r"cluster.gpus_per_generation_worker=1 asks for 1 GPUs for 1 generation workers; the Ray cluster offers 0"),
    (["cluster.num_cpus=4", "cluster.reference_workers=2", "cluster.gpus_per_scoring_worker=0.5"],
     r"cluster.gpus_per_scoring_worker=0.5 asks for 1 GPUs for 2 reference workers; the Ray cluster offers 0"),
    (["cluster.gpus_per_environment_worker=2"],
     r"cluster.gpus_per_environment_worker=2 asks for 2 GPUs for 1 environment workers"),
])
def test_gpus_the_cluster_lacks_stop_the_run_when_the_cluster_starts_before_any_actor(tmp_path, tiny_model_dir,
                                                                                      overrides, message,
                                                                                      monkeypatch):
    import ray

    from posttrain.distributed import ray_groups
    from posttrain.errors import RunError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    started = []
    monkeypatch.setattr(ray_groups.WorkerGroup, "__init__",
                        lambda *args, **kwargs: started.append(args) or pytest.fail("an actor group started"))
    with pytest.raises(RunError, match=message):
        train_grpo(grpo(tmp_path, "trainer.max_steps=1", "cluster.backend=ray", *overrides))
    assert not ray.is_initialized() and not started
