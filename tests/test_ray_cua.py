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
    it samples with is odd; later replies follow the script (then DONE). `on_call(turn)` runs before each call,
    with the turn its prompts are at (0: the first)."""

    def __init__(self, tokenizer, inner=None, on_call=lambda turn: None):
        self.tokenizer, self.inner, self.on_call = tokenizer, inner, on_call
        self.tasks = [task for task in load_tasks() if task.id in TASKS]
        self.policy = ScriptedPolicy(load_scripts())
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.calls = 0

    @property
    def weights_version(self):
        return self.inner.weights_version if self.inner is not None else 0

    def update_weights(self, version, weights):
        return self.inner.update_weights(version, weights)

    def generate(self, prompts, params, num_samples=1):
        self.calls += 1
        completions = []
        for index, prompt in enumerate(prompts):
            text = self.tokenizer.decode(prompt, skip_special_tokens=True)
            task = next(task for task in self.tasks if f"Task: {task.instruction}" in text)
            turn = text.count("The screen's accessibility tree:") - 1  # the prompt's tree, then one per observation
            self.on_call(turn)
            messages = [{"role": "assistant", "content": ""}] * turn + [{"role": "user", "content": text}]
            samples = []
            for sample in range(num_samples):
                seed = params.seeds[index] + sample if params.seeds is not None else 0
                reply = "FAIL" if turn == 0 and seed % 2 else self.policy.reply(task.id, messages)
                ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.im_end]
                samples.append(Completion(prompt, ids, [-1.0] * len(ids), reply, "stop"))
            completions.append(samples)
        return GenerationOutput(completions, 0.0, sum(len(c.token_ids) for s in completions for c in s))


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


def episode_metrics(episodes) -> dict[str, float]:
    """The rollout's cua and turn metrics (actions, errors by kind, turns)."""
    metrics = {k: v for k, v in rollout_metrics(episodes, {}).items() if k.startswith(("cua/", "turns/"))}
    assert metrics["cua/actions_mean"] > 1
    return metrics


CUA_METRICS = ("reward/mean", "correct_rate", "cua/actions_mean", "cua/action_errors_mean", "turns/mean",
               "turns/max", "tokens/observation_mean")


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

    def run(environment, first_group_id, on_call=lambda turn: None):
        return run_episodes(rows, first_group_id, 2, SeededScript(tokenizer, on_call=on_call), environment,
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

        # A worker crashes while episodes of its wait for their third step, their desktops running.
        group = cluster.groups[0]
        tokens = [owner_token(folder) for folder in folders]
        dead, orphans, left_behind = [], [], []

        def crash_a_worker_with_desktops(turn: int) -> None:
            if turn == 2 and not dead:
                index = next(i for i, token in enumerate(tokens) if scratch.processes_of(token))
                dead.append(index)
                crash(group.actors[index])
                # what outlived it (an episode may have ended, and stopped its desktop, until the kill)
                orphans.extend(scratch.processes_of(tokens[index]))
                left_behind.extend((folders[index] / "tmp").iterdir())

        episodes = run(environment, 2, crash_a_worker_with_desktops)
        (index,) = dead
        assert group.restarts == 1 and group.incarnations == [index == 0, index == 1]
        restarted = [e for e in episodes if e.restarts]
        assert restarted and all(e.restarts == 1 for e in restarted)
        assert len(restarted) == group.retried_samples == rollout_metrics(episodes, {})["faults/restarted_episodes"]
        # the restarted episodes replied, and scored, what the lost ones would have: the in-process results
        assert [(e.reward, e.num_turns) for e in episodes] == [(e.reward, e.num_turns) for e in expected[2]]
        # the crash orphaned the worker's desktops (an X server and an app per open episode); its replacement
        # stopped them and removed the folders they used
        assert len(orphans) >= 2
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
