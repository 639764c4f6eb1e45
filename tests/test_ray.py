"""Ray worker groups (cluster.backend=ray): the same GRPO and PPO loops driving generation and environment actors,
weight sync to them, deadlines, replaced actors, asynchronous rollouts. One small Ray instance per test (2 CPUs; run
them one at a time); the Ray tests are skipped when ray is not installed."""

import math
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from posttrain.algorithms.grpo import train_grpo
from posttrain.config import load_config
from posttrain.config.schema import GRPOConfig, ModelConfig
from posttrain.logging import read_metrics
from posttrain.models.loading import load_causal_lm

from rl_configs import DIGITS, TINY_RL
from ray_for_tests import needs_ray


RAY = ["cluster.backend=ray", "cluster.timeout_s=600"]  # generous: actors start slowly on a loaded 2-core machine


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


@needs_ray
@pytest.mark.slow  # about 45 s: two PPO runs, one starting a Ray instance and two actors
def test_ray_ppo_logs_the_rewards_and_losses_of_the_in_process_run(tmp_path, tiny_model_dir):
    from posttrain.algorithms.ppo import train_ppo
    from posttrain.config.schema import PPOConfig

    def ppo(output_dir: Path, *overrides: str) -> PPOConfig:
        return load_config(PPOConfig, None, [*TINY_RL, *DIGITS, f"output_dir={output_dir}", "trainer.max_steps=3",
                                             *overrides])

    train_ppo(ppo(tmp_path / "local"))
    train_ppo(ppo(tmp_path / "ray", *RAY))
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == len(remote) == 3
    for a, b in zip(local, remote):
        for key in ("reward/mean", "loss", "grad_norm", "value/loss", "generator_logprob_error"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), key


@pytest.mark.parametrize("override, message", [
    (["rollout.backend=vllm"], "needs cluster.gpus_per_generation_worker > 0"),
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


@needs_ray
def test_the_groups_of_a_straggling_generation_actor_are_dropped_past_the_group_timeout(tmp_path):
    """RayGenerator.submit_blocks over two stand-in generation actors (no model), the second of which takes 60 s: its
    groups are dropped once group_timeout_s (2 s) has passed since the first actor's share arrived, the others
    scored, and the next call goes whole to the first actor, which is idle. The bounds on the waits leave room for a
    loaded machine's slow answers, far below the straggler's."""
    import ray

    from posttrain.algorithms.rollout import PromptRow, sample_and_score_within
    from posttrain.config.schema import ClusterSection
    from posttrain.distributed.ray_groups import RayGenerator
    from posttrain.envs.base import EnvStep
    from posttrain.generation.base import Completion, GenerationOutput, SamplingParams

    @ray.remote
    class StandIn:
        def __init__(self, index: int):
            self.index = index

        def ready(self):
            return True

        def generate(self, prompts, params, num_samples):
            if self.index == 1:
                time.sleep(60)
            return GenerationOutput([[Completion(list(p), [5], [-0.5], "5", "stop")] * num_samples for p in prompts],
                                    num_generated_tokens=len(prompts) * num_samples, extra={"weights_version": 3})

    class Rows:
        def step(self, message_logs, metadata):
            n = len(metadata)
            return EnvStep([float(m["row"]) for m in metadata], [True] * n, [None] * n, [None] * n,
                           [dict(m) for m in metadata])

    temp_dir = tempfile.mkdtemp(prefix="pt-ray-")
    ray.init(num_cpus=2, _temp_dir=temp_dir, include_dashboard=False)
    try:
        made = iter(range(2))
        generator = RayGenerator(lambda: StandIn.remote(next(made)), 2, ClusterSection(timeout_s=60), 2**20)
        rows = [PromptRow(f"p{i}", [10 + i], {"row": i}) for i in range(4)]
        blocks = generator.submit_blocks([r.prompt_ids for r in rows], SamplingParams(max_new_tokens=1,
                                                                                      seeds=(1, 2, 3, 4)), 2)
        assert [(b.start, b.stop) for b in blocks] == [(0, 2), (2, 4)]
        started = time.monotonic()
        within = sample_and_score_within(rows, 100, 2, blocks, Rows(), None, timeout_s=2)
        assert time.monotonic() - started < 30  # the straggler was not waited for
        assert within.generation_timed_out == [102, 103] and within.scoring_timed_out == []
        assert [(e.group_id, e.reward, e.policy_version) for e in within.episodes] == [
            (100, 0.0, 3), (100, 0.0, 3), (101, 1.0, 3), (101, 1.0, 3)]
        # The next call (a later turn) goes to the actor with no call outstanding, not to the straggler's queue.
        started = time.monotonic()
        again = generator.submit_blocks([r.prompt_ids for r in rows], SamplingParams(max_new_tokens=1,
                                                                                     seeds=(5, 6, 7, 8)), 1)
        assert [(b.start, b.stop) for b in again] == [(0, 4)]
        assert len(again[0].wait().completions) == 4 and time.monotonic() - started < 30
        generator.group.kill()  # the straggler, still in its call, goes before the shutdown
        del generator, blocks
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


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
                                         "trainer.save_every=1", "cluster.backend=ray", "cluster.timeout_s=20"])
    with pytest.raises(RunError) as error:  # without the deadline this call would never return
        train_grpo(cfg)
    message = str(error.value)
    assert "environment worker 0 of 1 did not answer `step` within cluster.timeout_s=20 s" in message
    assert "waiting for the rewards of 32 episodes" in message
    assert not ray.is_initialized()  # the run's Ray instance was shut down on the way out
    # Steps 1 and 2 finished and were saved; step 3's scoring hung: the newest checkpoint is step 2, intact.
    checkpoints = list_checkpoints(tmp_path)
    assert [c.step for c in checkpoints] == [1, 2]
    assert verify_checkpoint(checkpoints[-1].path) is None
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2


# ---- faults ------------------------------------------------------------------------------------------------------


@needs_ray
@pytest.mark.slow  # about 60 s: an in-process run, then a Ray run whose two actors are killed after step 2
def test_killed_actors_are_replaced_resynced_and_the_run_trains_what_an_undisturbed_one_does(tmp_path,
                                                                                           tiny_model_dir):
    import threading
    import time

    import ray

    from posttrain.distributed import cluster as clusters

    killed = []

    def kill_both_after_step_two() -> None:
        metrics = tmp_path / "ray" / "metrics.jsonl"
        give_up = time.monotonic() + 300
        while time.monotonic() < give_up:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                for group in clusters._started[0].groups:
                    ray.kill(group.actors[0], no_restart=True)  # as if its process were killed
                    killed.append(group.name)
                return
            time.sleep(0.02)

    train_grpo(config(tmp_path / "local", "trainer.max_steps=4"))
    killer = threading.Thread(target=kill_both_after_step_two, daemon=True)
    killer.start()
    train_grpo(config(tmp_path / "ray", "trainer.max_steps=4", *RAY))
    killer.join(timeout=5)
    assert killed == ["environment", "generation"]
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == len(remote) == 4
    for a, b in zip(local, remote):  # the replacements sampled and scored what the killed actors would have
        for key in ("reward/mean", "loss", "grad_norm", "generator_logprob_error"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), key
    assert remote[1]["faults/generation_restarts"] == remote[1]["faults/environment_restarts"] == 0
    last = remote[-1]
    assert last["faults/generation_restarts"] == last["faults/environment_restarts"] == 1
    assert last["faults/environment_retried_samples"] == 32  # step 3's scoring call, re-sent
    assert last["faults/generation_retried_samples"] in (0, 32)  # 0 when the death was found by the weight push


@needs_ray
def test_a_worker_group_replaces_dead_actors_up_to_max_restarts_and_times_out_a_stuck_one(tmp_path):
    import ray

    from posttrain.distributed.ray_groups import Call, WorkerGroup
    from posttrain.errors import RunError

    @ray.remote(num_cpus=0)
    class Echo:
        def ready(self):
            return True

        def echo(self, value):
            return value

        def hang(self):
            import time

            time.sleep(3600)

    def kill(actor) -> None:
        """ray.kill, then wait until the actor is seen dead (the kill is asynchronous)."""
        ray.kill(actor, no_restart=True)
        with pytest.raises(ray.exceptions.RayActorError):
            while True:
                ray.get(actor.ready.remote(), timeout=30)

    temp_dir = tempfile.mkdtemp(prefix="pt-ray-")  # short: Ray's socket paths must fit in 107 characters
    ray.init(num_cpus=1, _temp_dir=temp_dir, include_dashboard=False)
    try:
        caught_up = []
        # 10 s: room for an actor's start (a new process) on a busy 2-core machine.
        group = WorkerGroup("echo", Echo.remote, 2, timeout_s=10, max_restarts=1,
                            on_restart=lambda index: caught_up.append(index) or [Call(index, "echo", ("synced",))])
        assert group.call([Call(0, "echo", ("a",)), Call(1, "echo", ("b",))], "echoes") == ["a", "b"]
        first = group.actors[1]
        kill(first)
        assert group.call([Call(0, "echo", ("a",)), Call(1, "echo", ("b",), samples=4)], "echoes") == ["a", "b"]
        assert group.actors[1] is not first and caught_up == [1]
        assert group.restarts == 1 and group.retried_samples == 4

        kill(group.actors[0])
        with pytest.raises(RunError, match=r"echo worker 0 of 2 died during `echo` \(waiting for echoes\): The "
                                           r"actor died .*killed by `ray.kill`.*cluster.max_restarts=1 restarts"):
            group.call([Call(0, "echo", ("a",))], "echoes")

        with pytest.raises(RunError, match=r"echo worker 1 of 2 did not answer `hang` within cluster.timeout_s=10 s "
                                           r"\(waiting for nothing in particular\)"):
            group.call([Call(1, "hang")], "nothing in particular")
        assert group.failed
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


# ---- asynchronous rollouts ---------------------------------------------------------------------------------------


ASYNC = [*RAY, "rollout.asynchronous=true", "loss.importance_correction=tis"]


@needs_ray
@pytest.mark.slow  # about 90 s: three Ray runs
def test_asynchronous_rollouts_stay_within_the_staleness_bound_and_resume_exactly(tmp_path, tiny_model_dir):
    keys = ("reward/mean", "loss", "grad_norm", "generator_logprob_error", "rollout/staleness_max")
    train_grpo(config(tmp_path / "full", "trainer.max_steps=4", "trainer.save_every=2", *ASYNC))
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    # Every batch: sampled at most one version behind the policy that trains on it; from step 2 on exactly one
    # (generation ran ahead while step 1 trained).
    assert [r["rollout/staleness_max"] for r in full] == [0, 1, 1, 1]
    assert all(r["rollout/stale_groups_dropped"] == 0 for r in full)
    assert all(r["is_weight_mean"] > 0 for r in full)  # the importance correction weighed the older samples
    assert full[1]["generator_logprob_error"] > 1e-4 > full[0]["generator_logprob_error"]  # one version behind

    # Stopped after step 2 (its checkpoint keeps the round already sampled for step 3) and resumed: the same run.
    train_grpo(config(tmp_path / "resumed", "trainer.max_steps=2", "trainer.save_every=2", *ASYNC))
    train_grpo(config(tmp_path / "resumed", "trainer.max_steps=4", "trainer.save_every=2", *ASYNC))
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        for key in keys:
            assert b[key] == pytest.approx(a[key], abs=1e-5), (a["step"], key)


@needs_ray
@pytest.mark.slow  # about 50 s: a Ray run, then the episodes' log-probabilities under every checkpointed version
def test_in_flight_weight_updates_sample_in_chunks_and_stay_within_the_staleness_bound(tmp_path, tiny_model_dir,
                                                                                     monkeypatch):
    import ray

    from posttrain.algorithms import grpo
    from posttrain.distributed import ray_groups
    from posttrain.logging.samples import read_samples

    class SlowerGenerationWorker(ray_groups.GenerationWorker):
        """The transformers generation actor, 0.1 s slower per call (as a larger model is): a round of one-token
        chunks then outlasts a training step of the tiny model, so the push that ends a step reaches a round in the
        middle of its completions whatever the machine's load."""

        def generate(self, prompts, params, num_samples):
            time.sleep(0.1)
            return super().generate(prompts, params, num_samples)

    monkeypatch.setattr(ray_groups, "GenerationActor", ray.remote(SlowerGenerationWorker))
    trained = []  # (step, token ids, prompt length, generator log-probabilities, version spans, policy version)
    real_rollout_batch = grpo.rollout_batch

    def recording(episodes, cfg, run, weights, metrics):  # called once per step that trains
        step = len({t[0] for t in trained}) + 1
        trained.extend((step, list(e.token_ids), e.prompt_length, list(e.generator_logprobs), list(e.version_spans),
                        e.policy_version) for e in episodes)
        return real_rollout_batch(episodes, cfg, run, weights, metrics)

    monkeypatch.setattr(grpo, "rollout_batch", recording)
    # Completions of up to 12 tokens sampled one token per call.
    steps, chunk = 4, 1
    cfg = config(tmp_path, f"trainer.max_steps={steps}", "trainer.save_every=1", "trainer.keep_last=10",
                 "logging.samples_per_step=32", *ASYNC, "rollout.in_flight_updates=true", "rollout.max_new_tokens=12",
                 f"rollout.in_flight_chunk_tokens={chunk}")
    train_grpo(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:  # every batch within the bound, counted from each episode's oldest token
        assert record["rollout/staleness_max"] <= 1 and record["rollout/stale_groups_dropped"] == 0
        assert 0 <= record["rollout/in_flight_updated_fraction"] <= 1
        assert record["is_weight_mean"] > 0
        assert all(math.isfinite(record[key]) for key in ("reward/mean", "loss", "grad_norm", "is_weight_mean"))
    samples = read_samples(tmp_path / "samples.jsonl")
    assert len(samples) == 4 * 32 == len(trained)
    assert all(s["step"] - 2 <= s["policy_version"] <= s["step"] - 1 for s in samples)

    # The weights of every version: 0 is the starting model, k the policy checkpointed after step k.
    versions = {0: load_causal_lm(ModelConfig(name_or_path="posttrain/tiny")).eval()}
    for k in range(1, steps):
        versions[k] = load_causal_lm(ModelConfig(name_or_path=str(tmp_path / "checkpoints" / f"step_{k}" / "policy")
                                                 )).eval()
    changed = 0
    for (step, ids, prompt_length, logprobs, spans, version), sample in zip(trained, samples, strict=True):
        assert sample["step"] == step and sample["policy_version"] == version
        assert sample["version_spans"] == [list(span) for span in spans]
        completion = len(ids) - prompt_length
        starts = [start for start, _ in spans]
        # Spans start at chunk boundaries, in order, inside the completion; each later span a newer version, every
        # one within the bound of the step that trains on it; the episode's age counts from its oldest token.
        assert starts[0] == 0 and starts == sorted(set(starts)) and all(s % chunk == 0 and s < completion
                                                                        for s in starts)
        span_versions = [v for _, v in spans]
        assert span_versions == sorted(set(span_versions)) and step - 2 <= span_versions[0] <= span_versions[-1]
        assert span_versions[-1] <= step - 1 and version == span_versions[0]
        changed += len(spans) > 1
        # Each span's tokens were sampled by the version it names: the sampler's log-probabilities are that
        # version's (to float32 rounding of the KV-cached decode) and no other version explains them better.
        with torch.no_grad():
            logits = {v: model(torch.tensor([ids])).logits[0, prompt_length - 1:-1].float() / cfg.rollout.temperature
                      for v, model in versions.items()}
        for (start, span_version), end in zip(spans, starts[1:] + [completion]):
            tokens = torch.tensor(ids[prompt_length + start:prompt_length + end])
            sampler = torch.tensor(logprobs[start:end])
            error = {v: float((torch.log_softmax(l[start:end], -1).gather(1, tokens[:, None])[:, 0] - sampler)
                              .abs().max()) for v, l in logits.items()}
            assert error[span_version] < 1e-4, (step, spans, error)
            assert error[span_version] == min(error.values()), (step, spans, error)
    # The weights changed mid-generation: some episodes have tokens of two versions.
    assert changed > 0, [r["rollout/in_flight_updated_fraction"] for r in records]


def test_asynchronous_rollouts_need_ray_and_the_importance_correction(tmp_path):
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match="needs cluster.backend=ray, loss.importance_correction other than none"):
        config(tmp_path, "rollout.asynchronous=true")
    assert config(tmp_path, *ASYNC, "rollout.dynamic_sampling=true").rollout.dynamic_sampling  # pipelined
    assert config(tmp_path, *ASYNC, "rollout.max_turns=2", "rollout.dynamic_sampling=true").rollout.dynamic_sampling
    with pytest.raises(ConfigError, match="cluster.environment_concurrency needs cluster.backend=ray"):
        config(tmp_path, "cluster.environment_concurrency=4")
    with pytest.raises(ConfigError, match="cluster.environment_concurrency=4 with environment.kind=tools"):
        load_config(GRPOConfig, "configs/grpo_arithmetic.yaml",
                    ["cluster.backend=ray", "environment.kind=tools", "rollout.max_turns=2",
                     "cluster.environment_concurrency=4",
                     "environment.options={tools: [calculator], task: {kind: arithmetic}}"])
    assert config(tmp_path, *ASYNC, "rollout.max_turns=2").rollout.max_turns == 2  # multi-turn rounds pipelined
    turns = config(tmp_path, *ASYNC, "rollout.max_turns=2", "rollout.in_flight_updates=true",
                   "rollout.group_timeout_s=5", "rollout.stop_strings=[END]").rollout  # multi-turn, chunked, timed
    assert turns.in_flight_updates and turns.group_timeout_s == 5 and turns.stop_strings == ["END"]
    cua = ["cluster.backend=ray", "environment.kind=cua", "environment.options={}", "rollout.max_turns=10"]
    assert load_config(GRPOConfig, "configs/grpo_arithmetic.yaml", cua).environment.kind == "cua"  # desktops on actors
    with pytest.raises(ConfigError, match="cluster.environment_concurrency=2 with environment.kind=cua: the actors of "
                                          "an environment whose episodes live in it"):
        load_config(GRPOConfig, "configs/grpo_arithmetic.yaml", [*cua, "cluster.environment_concurrency=2"])
    tools = load_config(GRPOConfig, "configs/grpo_arithmetic.yaml",  # tool-using episodes run on the actors
                        ["cluster.backend=ray", "environment.kind=tools", "rollout.max_turns=2",
                         "environment.options={tools: [calculator], task: {kind: arithmetic}}"])
    assert tools.environment.kind == "tools"
    with pytest.raises(ConfigError, match=r"update.num_minibatches = 2 optimizer steps per rollout batch"):
        config(tmp_path, *ASYNC, "update.num_minibatches=2")  # versions would count 2 per step: all rounds dropped
    with pytest.raises(ConfigError, match="rollout.max_staleness applies only with rollout.asynchronous=true"):
        config(tmp_path, "rollout.max_staleness=2")
    for key in ("in_flight_updates=true", "group_timeout_s=5"):
        with pytest.raises(ConfigError, match=f"rollout.{key.split('=')[0]} applies only with rollout.asynchronous"):
            config(tmp_path, f"rollout.{key}")
    with pytest.raises(ConfigError, match="rollout.in_flight_chunk_tokens applies only with rollout.in_flight_updates"):
        config(tmp_path, *ASYNC, "rollout.in_flight_chunk_tokens=4")
    with pytest.raises(ConfigError, match="cluster.on_actor_failure=mask needs rollout.max_turns=1"):
        config(tmp_path, *RAY, "cluster.on_actor_failure=mask", "rollout.max_turns=2")


@needs_ray
@pytest.mark.slow  # about 60 s: a Ray run whose environment straggles for 12 s once
def test_groups_whose_scoring_straggles_past_the_group_timeout_are_dropped_counted_and_not_sampled_again(
        tmp_path, tiny_model_dir):
    from posttrain.logging.samples import read_samples

    from rl_configs import REWARDS

    straggles = ["environment.kind=python", "environment.options={functions: ['" + REWARDS +
                 ":digit_fraction_third_call_straggles'], num_workers: 0}"]
    steps = 6
    cfg = load_config(GRPOConfig, None, [*TINY_RL, *straggles, *ASYNC, f"output_dir={tmp_path}",
                                         f"trainer.max_steps={steps}", "rollout.group_timeout_s=4",
                                         "logging.samples_per_step=32"])
    train_grpo(cfg)  # returns: nothing waits on the straggler past its group's timeout
    records = read_metrics(tmp_path / "metrics.jsonl")
    trained = {}
    for sample in read_samples(tmp_path / "samples.jsonl"):
        trained.setdefault(sample["step"], set()).add(sample["group_id"])
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    total = 0
    for record in records:
        groups = trained.get(record["step"], set())
        # Whole groups only: every step trains on the groups that were not dropped, all 4 samples of each.
        assert len(groups) + record["rollout/timed_out_groups"] == 8, record["step"]
        total += record["rollout/timed_out_groups"]
        assert record["rollout/timed_out_groups_total"] == total
    # The straggling group at least; the groups queued behind it on the one environment worker (this round's and
    # the next rounds') time out with it, until it answers: then the run trains again.
    assert 1 <= total < steps * 8 and trained
    ids = sorted(g for groups in trained.values() for g in groups)
    assert len(ids) == len(set(ids)) == steps * 8 - total and set(ids) <= set(range(steps * 8))


@needs_ray
@pytest.mark.slow  # about 50 s: a Ray run whose environment straggles for 12 s once
def test_an_environment_actor_scoring_several_groups_at_once_drops_only_the_straggling_group(tmp_path,
                                                                                            tiny_model_dir):
    from posttrain.logging.samples import read_samples

    from rl_configs import REWARDS

    straggles = ["environment.kind=python", "environment.options={functions: ['" + REWARDS +
                 ":digit_fraction_third_call_straggles'], num_workers: 0}"]
    steps = 4
    cfg = load_config(GRPOConfig, None, [*TINY_RL, *straggles, *ASYNC, f"output_dir={tmp_path}",
                                         f"trainer.max_steps={steps}", "rollout.group_timeout_s=4",
                                         "cluster.environment_concurrency=4", "logging.samples_per_step=32"])
    train_grpo(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    # One environment actor, four calls at once: the straggler holds one thread for 12 s while the groups queued
    # behind it are scored by the others, so it alone is dropped (with one call at a time they time out with it).
    assert [r["rollout/timed_out_groups"] for r in records] == [1, 0, 0, 0]
    assert [r["rollout/generation_timed_out_groups"] for r in records] == [0] * steps
    assert records[-1]["rollout/timed_out_groups_total"] == 1
    ids = sorted({s["group_id"] for s in read_samples(tmp_path / "samples.jsonl")})
    assert len(ids) == steps * 8 - 1 and set(ids) <= set(range(steps * 8))


@needs_ray
def test_a_worker_group_masks_the_samples_of_a_dead_actor_when_asked_and_resends_calls_without_samples(tmp_path):
    import ray

    from posttrain.distributed.ray_groups import Call, WorkerGroup

    @ray.remote(num_cpus=0)
    class Echo:
        def ready(self):
            return True

        def echo(self, value):
            return value

    def kill(actor) -> None:
        """ray.kill, then wait until the actor is seen dead (the kill is asynchronous)."""
        ray.kill(actor, no_restart=True)
        with pytest.raises(ray.exceptions.RayActorError):
            while True:
                ray.get(actor.ready.remote(), timeout=30)

    temp_dir = tempfile.mkdtemp(prefix="pt-ray-")
    ray.init(num_cpus=1, _temp_dir=temp_dir, include_dashboard=False)
    try:
        group = WorkerGroup("echo", Echo.remote, 1, timeout_s=60, max_restarts=2,
                            mask=lambda call, why: ("masked", call.args[0], why))
        first = group.actors[0]
        kill(first)
        answer = group.call([Call(0, "echo", ("a",), samples=4)], "echoes")[0]
        assert answer[:2] == ("masked", "a") and "echo worker 0 of 1 died during `echo`" in answer[2]
        assert group.restarts == 1 and group.masked_samples == 4 and group.retried_samples == 0
        assert group.actors[0] is not first
        kill(group.actors[0])  # a call that carries no samples (a weight bucket) is re-sent
        assert group.call([Call(0, "echo", ("b",))], "echoes") == ["b"]
        assert group.restarts == 2 and group.masked_samples == 4 and group.retried_samples == 0
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@needs_ray
@pytest.mark.slow  # about 60 s: a Ray run one of whose environment actors is killed after step 2, then its resume
def test_the_samples_of_a_killed_actor_are_masked_and_counted_and_the_counts_survive_a_resume(tmp_path,
                                                                                            tiny_model_dir):
    import threading
    import time

    import ray

    from posttrain.distributed import cluster as clusters

    def kill_one_after_step_two() -> None:
        metrics = tmp_path / "metrics.jsonl"
        give_up = time.monotonic() + 300
        while time.monotonic() < give_up:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                environment = next(g for g in clusters._started[0].groups if g.name == "environment")
                ray.kill(environment.actors[0], no_restart=True)
                return
            time.sleep(0.02)

    # Two environment actors, each scoring half of a step's 32 episodes.
    masked = [*RAY, "cluster.on_actor_failure=mask", "cluster.environment_workers=2",
              "cluster.cpus_per_environment_worker=0.5", "trainer.save_every=1", "environment.max_error_fraction=1.0"]
    killer = threading.Thread(target=kill_one_after_step_two, daemon=True)
    killer.start()
    train_grpo(config(tmp_path, "trainer.max_steps=3", *masked))
    killer.join(timeout=5)
    train_grpo(config(tmp_path, "trainer.max_steps=4", *masked))  # resumed from step 3's checkpoint
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[1]["faults/environment_restarts"] == records[1]["faults/environment_masked_samples"] == 0
    third, fourth = records[2], records[3]
    # Step 3's scoring call to the dead actor: its 16 episodes masked and counted as reward errors, not re-sent.
    assert third["faults/environment_restarts"] == 1 and third["faults/environment_masked_samples"] == 16
    assert third["faults/environment_retried_samples"] == 0 and third["reward/errors"] == 16
    assert third["faults/generation_restarts"] == third["faults/generation_masked_samples"] == 0
    # The resumed run goes on from the checkpoint's counts (max_restarts bounds the whole run) and scores normally.
    assert fourth["faults/environment_restarts"] == 1 and fourth["faults/environment_masked_samples"] == 16
    assert fourth["reward/errors"] == 0 and fourth["reward/errors_total"] == 16
