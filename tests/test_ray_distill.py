"""Ray scoring groups for `posttrain distill`'s teachers (cluster.teacher_workers) and for a reward model of its own
(cluster.reward_workers): the loops call the same `ScoringWorker` / `RewardModel` methods, the models load only in
the groups' actors, and the runs log the in-process run's numbers; a killed reward actor is replaced, its call
re-sent and counted; what is not built is refused at load (or, for a teacher with another tokenizer, before any
model loads). One small Ray instance per run; the Ray tests are skipped when ray is not installed."""

import json
from pathlib import Path

import pytest
import torch

from posttrain.algorithms.distill import train_distill
from posttrain.algorithms.grpo import train_grpo
from posttrain.config import ConfigError, DistillConfig, load_config
from posttrain.config.schema import GRPOConfig, PPOConfig
from posttrain.errors import RunError
from posttrain.logging import read_metrics

from ray_for_tests import KillAfterSteps, assert_same_steps, needs_ray
from rl_configs import DIGITS, TINY_RL
from teachers_for_tests import ARITHMETIC_64, TINY_DISTILL, perturbed_tiny_teacher
from test_distill_teachers import write_rows

# Generous deadline: an actor's start took over 120 s on a loaded 2-core machine.
RAY = ["cluster.backend=ray", "cluster.timeout_s=600"]
DISTILL_KEYS = ("loss", "grad_norm", "distill/divergence", "distill/top1_agreement", "distill/teacher_topk_mass")


def distill(output_dir: Path, *overrides: str) -> DistillConfig:
    return load_config(DistillConfig, None, [*TINY_DISTILL, ARITHMETIC_64, "trainer.max_steps=3",
                                             f"output_dir={output_dir}", *overrides])


def no_model_in_the_driver(monkeypatch) -> None:
    """Make building a scorer or a reward model in this (the driver's) process an error: the Ray run must build
    them in its actors."""
    from posttrain.workers import local, reward_model

    def refuse(*args, **kwargs):
        raise AssertionError("a scoring model was built in the driver process")

    monkeypatch.setattr(local, "build_scorer", refuse)
    monkeypatch.setattr(reward_model.RewardModel, "from_pretrained", refuse)


@pytest.fixture(scope="module")
def teacher_dirs(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    return (perturbed_tiny_teacher(tmp_path_factory.mktemp("add"), scale=0.2, seed=0),
            perturbed_tiny_teacher(tmp_path_factory.mktemp("sub"), scale=0.2, seed=1))


@needs_ray
@pytest.mark.slow  # about 40 s: an in-process distill run, then one with a 2-actor teacher group
def test_off_policy_distill_with_a_two_actor_teacher_group_logs_the_in_process_run(tmp_path, teacher_dirs,
                                                                                     monkeypatch):
    """The teacher scores every micro-batch (2 a step) in its actors, each micro-batch whole, in turn."""
    import ray

    teacher = f"teachers=[{{name_or_path: '{teacher_dirs[0]}'}}]"
    train_distill(distill(tmp_path / "local", teacher))
    with monkeypatch.context() as patches:
        no_model_in_the_driver(patches)
        train_distill(distill(tmp_path / "ray", teacher, *RAY, "cluster.teacher_workers=2"))
    assert not ray.is_initialized()
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == 3
    assert_same_steps(local, remote, DISTILL_KEYS)
    assert all(r["distill/divergence"] > 0.01 for r in local)  # the teacher is another model: a real signal
    assert remote[-1]["faults/teacher_restarts"] == 0 and "heartbeat/teacher_seconds" in remote[-1]


@needs_ray
@pytest.mark.slow  # about 60 s: two on-policy MOPD runs, in process and with a group per teacher
def test_on_policy_mopd_with_a_group_per_teacher_logs_the_in_process_run(tmp_path, teacher_dirs, monkeypatch):
    """Two routed teachers, every step on-policy (the student samples in the driver): each teacher's group
    (teacher_add, teacher_sub) scores its rows of each micro-batch; losses and per-teacher metrics as in one
    process."""
    data = write_rows(tmp_path)
    teachers = (f"teachers=[{{name: add, name_or_path: '{teacher_dirs[0]}', route: [add]}}, "
                f"{{name: sub, name_or_path: '{teacher_dirs[1]}', route: [sub]}}]")
    mopd = [f"data.train_files=['{data}']", teachers, "teacher_column=task", "mode=on_policy",
            "rollout.max_new_tokens=6", "loss.kl_type=reverse"]
    train_distill(distill(tmp_path / "local", *mopd))
    with monkeypatch.context() as patches:
        no_model_in_the_driver(patches)
        train_distill(distill(tmp_path / "ray", *mopd, *RAY, "cluster.teacher_workers=1"))
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == 3 and all(r["distill/on_policy"] == 1 for r in local)
    assert_same_steps(local, remote, (*DISTILL_KEYS, "distill/add/divergence", "distill/sub/divergence",
                                      "distill/sampled_completion_length"))
    assert remote[-1]["faults/teacher_add_restarts"] == remote[-1]["faults/teacher_sub_restarts"] == 0


@needs_ray
@pytest.mark.slow  # about 30 s: two precomputing runs
def test_a_precomputed_teacher_group_writes_the_in_process_top_k_and_is_released(tmp_path, teacher_dirs,
                                                                                   monkeypatch):
    """teacher.precompute with a teacher group: the actors score every example once, the file holds the top-k the
    driver computes, and the group is gone before training (no teacher metrics in the steps)."""
    from safetensors.torch import load_file

    teacher = f"teachers=[{{name_or_path: '{teacher_dirs[0]}', precompute: true}}]"
    train_distill(distill(tmp_path / "local", teacher, "trainer.max_steps=2"))
    with monkeypatch.context() as patches:
        no_model_in_the_driver(patches)
        train_distill(distill(tmp_path / "ray", teacher, "trainer.max_steps=2", *RAY, "cluster.teacher_workers=2"))
    files = [load_file(tmp_path / run / "teacher_topk" / "topk.safetensors") for run in ("local", "ray")]
    for name in ("logprobs", "ids", "offsets"):
        assert torch.allclose(files[1][name].double(), files[0][name].double(), rtol=1e-5, atol=1e-5), name
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert_same_steps(local, remote, DISTILL_KEYS)
    assert not any(key.startswith(("faults/", "heartbeat/")) for key in remote[-1])  # released before step 1


@needs_ray
def test_a_teacher_with_another_tokenizer_is_refused_with_ray_before_any_model_loads(tmp_path, tiny_model_dir,
                                                                                        monkeypatch):
    import ray

    from posttrain.distributed import cluster as clusters

    teacher = perturbed_tiny_teacher(tmp_path / "bpe", base="posttrain/tiny-bpe")
    monkeypatch.setattr(clusters, "start_cluster", lambda *args: pytest.fail("the cluster started"))
    with pytest.raises(RunError, match=r"tokenizer differs from the student's: such a teacher scores through the "
                                       r"cross-tokenizer aligner, which runs in the driver process"):
        train_distill(distill(tmp_path / "run", f"teachers=[{{name_or_path: '{teacher}'}}]", *RAY,
                              "cluster.teacher_workers=1"))
    assert not ray.is_initialized()


@pytest.mark.parametrize("overrides, message", [
    (["cluster.backend=ray"], "set cluster.teacher_workers to the actors of each teacher's group"),
    (["cluster.teacher_workers=1"], "cluster.teacher_workers needs cluster.backend=ray"),
    (["cluster.backend=ray", "cluster.teacher_workers=1", "cluster.environment_workers=2"],
     "cluster.environment_workers does not apply to distill"),
    (["cluster.backend=ray", "cluster.teacher_workers=1", "cluster.reward_workers=1"],
     "cluster.reward_workers does not apply to distill"),
    (["cluster.backend=ray", "cluster.teacher_workers=3"],
     r"1 teacher group\(s\) x cluster.teacher_workers=3 x cpus_per_scoring_worker=1 = 3 > cluster.num_cpus=2"),
    (["cluster.backend=ray", "cluster.teacher_workers=1", "teachers=[{name_or_path: posttrain/tiny, backend: vllm}]"],
     r"teachers\[0\].backend=vllm: teacher actors run the transformers backend"),
    (["cluster.backend=ray", "cluster.teacher_workers=1", "loss.cross_tokenizer.align=always"],
     "loss.cross_tokenizer.align=always: these teachers score through the cross-tokenizer aligner"),
    (["cluster.backend=ray", "cluster.teacher_workers=1", "kd_loss_mode=average",
      "teachers=[{name: a, name_or_path: posttrain/tiny}, {name: b, name_or_path: posttrain/tiny}]"],
     "kd_loss_mode=average: these teachers score through the cross-tokenizer aligner"),
    (["cluster.backend=ray", "cluster.teacher_workers=2", "teacher_column=task",
      "teachers=[{name: a, name_or_path: posttrain/tiny, route: [a]}, {name: b, name_or_path: posttrain/tiny, "
      "route: [b]}]"], r"2 teacher group\(s\) x cluster.teacher_workers=2 x cpus_per_scoring_worker=1 = 4"),
])
def test_distill_cluster_settings_that_cannot_work_fail_at_load(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        distill(tmp_path, "teachers=[{name_or_path: posttrain/tiny}]", *overrides)


def test_precomputed_teachers_share_the_cpu_budget_one_group_at_a_time(tmp_path):
    teachers = ("teachers=[{name: a, name_or_path: posttrain/tiny, route: [a], precompute: true}, "
                "{name: b, name_or_path: posttrain/tiny, route: [b], precompute: true}]")
    cfg = distill(tmp_path, teachers, "teacher_column=task", "cluster.backend=ray", "cluster.teacher_workers=2")
    assert cfg.cluster.teacher_workers == 2  # loaded one after the other: 2 CPUs at a time


# ---- the reward-model group ------------------------------------------------------------------------------------


def reward_model_environment(path: Path) -> list[str]:
    return ["environment.kind=reward_model", f"environment.options={{path: '{path}', batch_size: 8}}"]


def grpo(output_dir: Path, *overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, None, [*TINY_RL, f"output_dir={output_dir}", *overrides])


@needs_ray
@pytest.mark.slow  # about 60 s: an in-process GRPO run, then one with a 2-actor reward group, one actor killed
def test_grpo_with_a_two_actor_reward_group_logs_the_in_process_run_and_replaces_a_killed_actor(
        tmp_path, reward_model_dir, monkeypatch):
    """A step's 32 replies are scored in 4 calls of 8 rows, to the reward actors in turn, one call per actor at a
    time (0 and 1 at once, then 0 and 1). After step 2 reward actor 0 is killed (ray.kill, as if its process died):
    step 3's first call to it finds it dead, a replacement loads the reward model and scores the same 8 rows, and
    the next call goes to the replacement. Every step logs the in-process run's rewards, losses and gradient
    norms."""
    import ray

    environment = reward_model_environment(reward_model_dir)
    train_grpo(grpo(tmp_path / "local", *environment, "trainer.max_steps=4"))
    with KillAfterSteps(tmp_path / "ray" / "metrics.jsonl", "reward") as killer, monkeypatch.context() as patches:
        no_model_in_the_driver(patches)
        train_grpo(grpo(tmp_path / "ray", *environment, "trainer.max_steps=4", *RAY, "cluster.num_cpus=3",
                        "cluster.reward_workers=2"))
    assert killer.killed == ["reward worker 0 of 2"]
    assert not ray.is_initialized()
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == 4
    assert_same_steps(local, remote, ("reward/mean", "reward/std", "loss", "grad_norm"))
    assert all(r["reward/std"] > 0 for r in local)  # the reward model tells replies apart
    assert remote[1]["faults/reward_restarts"] == remote[1]["faults/reward_retried_samples"] == 0
    assert remote[3]["faults/reward_restarts"] == 1
    assert remote[3]["faults/reward_retried_samples"] == 8  # the dead actor's call of step 3, re-sent
    assert "heartbeat/environment_seconds" not in remote[-1]  # the environment ran in the driver


@needs_ray
@pytest.mark.slow  # about 60 s: an asynchronous GRPO run with a 2-actor reward group, one actor killed
def test_asynchronous_grpo_scores_through_a_reward_group_from_several_threads_and_replaces_a_killed_actor(
        tmp_path, reward_model_dir, monkeypatch):
    """Asynchronous rounds score their groups from the driver's rollout threads at once, each step's calls spread
    over the reward actors. Reward actor 0 is killed after step 2 and replaced (step 5's round samples from step 3's
    weights or later, so it is scored after the kill whatever ran ahead); every step trains within the staleness
    bound, and every logged sample's reward is what the reward model in this process gives its text."""
    from posttrain.workers.reward_model import RewardModel

    environment = reward_model_environment(reward_model_dir)
    asynchronous = ["rollout.asynchronous=true", "loss.importance_correction=tis", "logging.samples_per_step=32"]
    with KillAfterSteps(tmp_path / "metrics.jsonl", "reward") as killer, monkeypatch.context() as patches:
        no_model_in_the_driver(patches)
        train_grpo(grpo(tmp_path, *environment, "trainer.max_steps=5", *RAY, "cluster.num_cpus=3",
                        "cluster.reward_workers=2", *asynchronous))
    assert killer.killed == ["reward worker 0 of 2"]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(r["rollout/staleness_max"] <= 1 and r["reward/std"] > 0 for r in records)
    assert records[-1]["faults/reward_restarts"] == 1
    retried = records[-1]["faults/reward_retried_samples"]  # the dead actor's calls in flight (8 rows each), re-sent
    assert 0 < retried <= 16 and retried % 8 == 0  # one call at a time per actor per round; two rounds may overlap
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    train = [s for s in samples if s["split"] == "train"]
    assert len(train) == 5 * 32
    reward_model = RewardModel.from_pretrained(reward_model_dir, device="cpu", batch_size=8)
    rescored = reward_model.score([s["prompt"] for s in train], [s["completion"] for s in train])
    assert [s["reward"] for s in train] == pytest.approx(rescored, abs=1e-5)


@needs_ray
@pytest.mark.slow  # about 60 s: PPO-RLHF's mixture (reward model + arithmetic at weight 0), in process and on Ray
def test_ppo_rlhf_mixture_with_a_reward_group_logs_the_in_process_run(tmp_path, reward_model_dir, monkeypatch):
    from posttrain.algorithms.ppo import train_ppo

    mixture = {"kind": "mixture", "normalize_rewards": True, "options": {"components": [
        {"name": "preference", "kind": "reward_model", "weight": 1.0,
         "options": {"path": str(reward_model_dir), "batch_size": 16}},
        {"name": "correct", "kind": "arithmetic", "weight": 0.0}]}}

    def ppo(output_dir: Path, *overrides: str) -> PPOConfig:
        return load_config(PPOConfig, None, [*TINY_RL, f"output_dir={output_dir}", "trainer.max_steps=3",
                                             f"environment={json.dumps(mixture)}", *overrides])

    train_ppo(ppo(tmp_path / "local"))
    with monkeypatch.context() as patches:
        no_model_in_the_driver(patches)
        train_ppo(ppo(tmp_path / "ray", *RAY, "cluster.num_cpus=3", "cluster.reward_workers=2"))
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == 3
    assert_same_steps(local, remote, ("reward/mean", "reward/preference", "reward/correct", "loss", "grad_norm",
                                      "value/loss"))
    assert remote[-1]["faults/reward_restarts"] == 0


@pytest.mark.parametrize("overrides, message", [
    (["cluster.reward_workers=1"], "cluster.reward_workers needs cluster.backend=ray"),
    (["cluster.backend=ray", "cluster.reward_workers=1", *DIGITS],
     "this run has environment.kind=python, which loads no reward model"),
    (["cluster.backend=ray", "cluster.reward_workers=1", "environment.kind=mixture",
      "environment.options={components: [{name: a, kind: reward_model, options: {path: x}}, "
      "{name: b, kind: reward_model, options: {path: y}}]}"], "this run has 2 reward_model components"),
    (["cluster.backend=ray", "cluster.reward_workers=1", "environment.kind=mixture", "rollout.asynchronous=true",
      "loss.importance_correction=tis", "environment.options={components: [{name: a, kind: reward_model, options: "
      "{path: x}}, {name: m, kind: math, options: {num_workers: 0}}]}"],
     "math component 'm' has num_workers=0, which scores in the calling thread"),
    (["cluster.backend=ray", "cluster.reward_workers=1", *reward_model_environment(Path("x")),
      "cluster.environment_workers=2"], "cluster.environment_workers does not apply with cluster.reward_workers=1"),
    (["cluster.backend=ray", "cluster.reward_workers=2", *reward_model_environment(Path("x"))],
     r"cluster.generation_workers x cpus_per_generation_worker = 1 \+ cluster.reward_workers x "
     r"cpus_per_scoring_worker = 2 > cluster.num_cpus=2"),
])
def test_reward_group_settings_that_cannot_work_fail_at_load(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        grpo(tmp_path, *overrides)
