"""Computer use on Ray environment actors (environment.kind=cua with cluster.backend=ray): every step of a desktop
episode on the actor that started its desktop, episodes of both actors scoring what one process scores, an actor
killed (SIGKILL, as the out-of-memory killer would) mid-episode replaced, its episodes restarted from their first
step and counted, and its orphaned desktops (Xvfb and the app) stopped and its folders removed by its replacement;
a GRPO run whose environment actor is killed in step 2 logging the in-process run's rewards, losses and cua metrics.

The policy is the scripted one (the embedded models have not learned to operate a desktop): its first reply is the
task's script, or FAIL for the samples whose sampling seed is odd, so a restarted episode, whose first turn draws
from its own stream again, replies what the lost one did. Skipped without ray, Xvfb or xdotool."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from posttrain.algorithms import grpo as grpo_module
from posttrain.algorithms.environments import build_recipe_environment
from posttrain.algorithms.grpo import train_grpo
from posttrain.algorithms.rollout import PromptRow, rollout_metrics, run_episodes
from posttrain.config import load_config
from posttrain.config.schema import ClusterSection, GRPOConfig, WeightSyncSection
from posttrain.data.tokenize import tokenize_prompt
from posttrain.envs.cua.desktop import missing_programs
from posttrain.envs.cua.environment import prompt_rows
from posttrain.envs.cua.scripted import ScriptedPolicy, load_scripts
from posttrain.envs.cua.tasks import load_tasks
from posttrain.generation.base import Completion, GenerationOutput, SamplingParams
from posttrain.logging import read_metrics
from posttrain.models.tiny import build_tokenizer
from ray_for_tests import assert_same_steps, needs_ray
from rl_configs import TINY_RL

pytestmark = [needs_ray, pytest.mark.skipif(bool(missing_programs()), reason=(
    f"no {' or '.join(missing_programs())} on PATH (Debian/Ubuntu: apt-get install -y xvfb xdotool)"))]

TASKS = ("contact-name", "contact-subscribe-work")
SECTION = {"kind": "cua", "options": {"max_steps": 5}}


class SeededScript:
    """A stand-in generator: each sample's first reply is its task's first scripted action, or FAIL when the seed
    it samples with is odd; later replies follow the script (then DONE)."""

    def __init__(self, tokenizer, inner=None):
        self.tokenizer, self.inner = tokenizer, inner
        self.tasks = [task for task in load_tasks() if task.id in TASKS]
        self.policy = ScriptedPolicy(load_scripts())
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    @property
    def weights_version(self):
        return self.inner.weights_version if self.inner is not None else 0

    def update_weights(self, version, weights):
        return self.inner.update_weights(version, weights)

    def generate(self, prompts, params, num_samples=1):
        completions = []
        for index, prompt in enumerate(prompts):
            text = self.tokenizer.decode(prompt, skip_special_tokens=True)
            task = next(task for task in self.tasks if f"Task: {task.instruction}" in text)
            turn = text.count("The screen's accessibility tree:") - 1  # the prompt's tree, then one per observation
            messages = [{"role": "assistant", "content": ""}] * turn + [{"role": "user", "content": text}]
            samples = []
            for sample in range(num_samples):
                seed = params.seeds[index] + sample if params.seeds is not None else 0
                reply = "FAIL" if turn == 0 and seed % 2 else self.policy.reply(task.id, messages)
                ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.im_end]
                samples.append(Completion(prompt, ids, [-1.0] * len(ids), reply, "stop"))
            completions.append(samples)
        return GenerationOutput(completions, 0.0, sum(len(c.token_ids) for s in completions for c in s))


class CrashBeforeStep:
    """An environment passing every call on to `inner` (a RayEnvironment), except that before a call for an
    episode's step `step` it runs `crash(index of the actor holding the episode, the episode's metadata)`, until
    that returns True."""

    def __init__(self, inner, step: int, crash):
        self.inner, self.step_number, self.crash = inner, step, crash
        self._lock = threading.Lock()
        self._crashed = False

    def before(self, message_logs, metadata) -> None:
        from posttrain.distributed.ray_groups import HOLDER_KEY

        with self._lock:
            steps = sum(message["role"] == "assistant" for message in message_logs[0])
            if not self._crashed and steps == self.step_number and HOLDER_KEY in metadata[0]:
                self._crashed = self.crash(metadata[0][HOLDER_KEY][0], metadata[0])

    def step(self, message_logs, metadata):
        self.before(message_logs, metadata)
        return self.inner.step(message_logs, metadata)


def actor_pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def crash(actor) -> None:
    """SIGKILL the actor's process (no exit handler runs, its programs are orphaned), then wait until Ray sees it
    dead."""
    import ray

    os.kill(actor_pid(actor), 9)
    with pytest.raises(ray.exceptions.RayActorError):
        while True:
            ray.get(actor.ready.remote(), timeout=60)


def owner_token(folder: Path) -> str:
    return json.loads((folder / "owner.json").read_text())["token"]


def desktop_of(token: str, workdir: str) -> list[int]:
    """The processes of worker `token` that serve the episode in `workdir`: its X server (whose framebuffer is in
    that folder) and its app (which saves there)."""
    from posttrain.distributed import scratch

    def serves(pid: int) -> bool:
        arguments = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        return any(argument == workdir or argument.startswith(workdir + "/") for argument in arguments)

    return [pid for pid in scratch.processes_of(token) if serves(pid)]


def episode_metrics(episodes) -> dict[str, float]:
    """The rollout's cua and turn metrics (actions, errors by kind, turns)."""
    metrics = {k: v for k, v in rollout_metrics(episodes, {}).items() if k.startswith(("cua/", "turns/"))}
    assert metrics["cua/actions_mean"] > 1
    return metrics


CUA_METRICS = ("accuracy", "cua/actions_mean", "cua/action_errors_mean", "turns/mean", "turns/max",
               "tokens/observation_mean")


@pytest.mark.slow  # about 40 s: a Ray instance, two environment actors with desktops, one crashed and replaced
def test_desktop_episodes_stay_on_their_actor_and_a_crashed_actors_episodes_restart_and_its_desktops_are_stopped(
        tmp_path):
    from posttrain.distributed import scratch
    from posttrain.distributed.ray_groups import HOLDER_KEY, Call, RayCluster

    tokenizer = build_tokenizer()
    rows = []
    for row in prompt_rows([task for task in load_tasks() if task.id in TASKS]):
        question = [{"role": "user", "content": row["prompt"]}]
        rows.append(PromptRow(question, tokenize_prompt(question, tokenizer), {"task_id": row["task_id"]}))
    params = SamplingParams(max_new_tokens=50)

    def run(environment, first_group_id):
        return run_episodes(rows, first_group_id, 2, SeededScript(tokenizer), environment,
                            tokenizer, params, max_turns=5, group_seed=7)[0]

    local = build_recipe_environment(SECTION)
    try:
        expected = {first: run(local, first) for first in (0, 2)}
    finally:
        local.close()
    for episodes in expected.values():  # the scripts solve both tasks; FAIL scores 0
        assert {e.reward for e in episodes} == {0.0, 1.0}

    temp_dir = tempfile.mkdtemp(prefix="pt-ray-")  # short: Ray's socket paths must fit in 107 characters
    cluster = RayCluster(ClusterSection(backend="ray", environment_workers=2, num_cpus=2, timeout_s=120),
                         WeightSyncSection(), Path(temp_dir))
    folders = [Path(temp_dir).resolve() / "environments" / f"worker-{i}" for i in (0, 1)]
    try:
        environment = cluster.environment(build_recipe_environment, SECTION, concurrency=8)
        assert environment.holds_episodes and environment.tool_use is None
        episodes = run(environment, 0)
        assert [(e.reward, e.num_turns, e.restarts) for e in episodes] == \
               [(e.reward, e.num_turns, 0) for e in expected[0]]
        workdirs = [Path(e.metadata["cua_workdir"]) for e in episodes]
        # every episode's folder in one actor's scratch folder, both actors used, none in this process's
        assert {folder for w in workdirs for folder in folders if folder in w.parents} == set(folders)
        assert not any(HOLDER_KEY in e.metadata for e in episodes)  # removed when the episode ended
        assert episode_metrics(episodes) == episode_metrics(expected[0])

        # A worker crashes as an episode of its is about to take its third step (its desktop running).
        group = cluster.groups[0]
        tokens = [owner_token(folder) for folder in folders]
        dead, orphans, left_behind = [], [], []

        def crash_the_holder(index: int, row: dict) -> bool:
            dead.append(index)
            # the desktop of the episode about to step: it cannot stop before this step is sent
            orphans.extend(desktop_of(tokens[index], row["cua_workdir"]))
            left_behind.extend((folders[index] / "tmp").iterdir())
            crash(group.actors[index])
            return True

        episodes = run(CrashBeforeStep(environment, 3, crash_the_holder), 2)
        (index,) = dead
        assert group.restarts == 1 and group.incarnations == [index == 0, index == 1]
        restarted = [e for e in episodes if e.restarts]
        assert restarted and all(e.restarts == 1 for e in restarted)
        assert len(restarted) == group.retried_samples == rollout_metrics(episodes, {})["faults/restarted_episodes"]
        # the restarted episodes replied, and scored, what the lost ones would have: the in-process results
        assert [(e.reward, e.num_turns) for e in episodes] == [(e.reward, e.num_turns) for e in expected[2]]
        # the crash orphaned the worker's desktops (an X server and an app per open episode); its replacement
        # stopped them and removed the folders they used
        assert len(orphans) == 2
        (cleanup,) = group.call([Call(index, "cleaned_up")], "what its start cleaned up")
        assert cleanup.removed_folder and set(orphans) <= set(cleanup.stopped_processes)
        assert not any(scratch._running(pid) for pid in orphans) and scratch.processes_of(tokens[index]) == []
        assert owner_token(folders[index]) != tokens[index]
        assert left_behind and not any(path.exists() for path in left_behind)  # its episodes' folders, gone
        environment.close()
        assert not any(folder.exists() for folder in folders)  # a closed actor removes its folder
    finally:
        cluster.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


# ---- GRPO ------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # about 150 s: an in-process run, then a Ray run whose environment actor crashes in step 2
def test_ray_grpo_on_cua_tasks_logs_the_in_process_run_also_when_an_environment_actor_crashes(
        tmp_path, tiny_model_dir, monkeypatch):
    from posttrain.distributed import cluster as clusters
    from posttrain.distributed import ray_groups, scratch

    data = tmp_path / "cua.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in prompt_rows(
        [task for task in load_tasks() if task.id in TASKS])))
    crashed, orphans = [], []

    def crash_in_step_two(index: int, row: dict) -> bool:
        """In step 2, as an episode is about to take its third step: crash the environment worker holding it."""
        if len((tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()) != 1:
            return False
        (group,) = [g for g in clusters._started[0].groups if g.name == "environment"]
        crashed.append(owner_token(tmp_path / "ray" / "environments" / f"worker-{index}"))
        orphans.extend(desktop_of(crashed[0], row["cua_workdir"]))
        crash(group.actors[index])
        return True

    hook = CrashBeforeStep(None, 3, crash_in_step_two)
    step = ray_groups.RayEnvironment.step

    def step_after_the_hook(self, message_logs, metadata):
        hook.before(message_logs, metadata)
        return step(self, message_logs, metadata)

    monkeypatch.setattr(ray_groups.RayEnvironment, "step", step_after_the_hook)
    policy_generator = grpo_module.policy_generator
    monkeypatch.setattr(grpo_module, "policy_generator", lambda cfg, tokenizer, policy, cluster=None: SeededScript(
        tokenizer, policy_generator(cfg, tokenizer, policy, cluster)))
    common = [*TINY_RL, f"data.train_files=['{data}']", "data.max_length=2048", "environment.kind=cua",
              "environment.options={max_steps: 5}", "rollout.max_turns=5", "rollout.max_new_tokens=4",
              "rollout.prompts_per_step=2", "rollout.num_generations_per_prompt=2", "rollout.seed_per_group=true",
              "trainer.max_steps=2", "trainer.save_every=0", "trainer.micro_batch_size=4"]
    ray_keys = ["cluster.backend=ray", "cluster.timeout_s=600", "cluster.environment_workers=2", "cluster.num_cpus=3"]
    for name, extra in (("local", []), ("ray", ray_keys)):
        train_grpo(load_config(GRPOConfig, None, [*common, *extra, f"output_dir={tmp_path / name}"]))
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert crashed and len(orphans) == 2
    # the restarted episodes sampled and scored what the lost ones had, so every step trains on the same episodes
    assert_same_steps(local, remote, ("reward/mean", "loss", "grad_norm", "generator_logprob_error", *CUA_METRICS))
    assert {record["reward/mean"] for record in local} - {0.0, 1.0}  # both outcomes within a step: advantages
    assert "faults/restarted_episodes" not in remote[0] and remote[0]["faults/environment_restarts"] == 0
    assert 1 <= remote[1]["faults/restarted_episodes"] <= 2  # the crashed worker's open episodes of step 2
    assert remote[1]["faults/environment_restarts"] == 1
    assert remote[1]["faults/environment_retried_samples"] == remote[1]["faults/restarted_episodes"]
    # the crashed worker's desktops were stopped by its replacement, the live ones by close; no folder stays
    assert not any(scratch._running(pid) for pid in orphans) and scratch.processes_of(crashed[0]) == []
    assert not (tmp_path / "ray" / "environments").exists()
