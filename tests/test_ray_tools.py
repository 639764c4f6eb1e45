"""Tool-using and SWE environments on Ray environment actors (environment.kind=tools|swe with cluster.backend=ray):
every turn of an episode on the actor holding its state, several episodes' tools running at once on one actor, an
episode whose actor died restarted from its first turn and counted, the tool metrics, rewards and losses of the
in-process run, the deadline of a tool that never answers, a SWE episode scored on an actor, and asynchronous
multi-turn rounds within the staleness bound. Skipped without ray; one small Ray instance per test (run them one at
a time)."""

import importlib.util
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from posttrain.algorithms import grpo as grpo_module
from posttrain.algorithms.environments import build_recipe_environment
from posttrain.algorithms.grpo import train_grpo
from posttrain.algorithms.rollout import PromptRow, rollout_metrics, run_episodes
from posttrain.config import load_config
from posttrain.config.schema import ClusterSection, GRPOConfig, WeightSyncSection
from posttrain.data.tokenize import tokenize_prompt
from posttrain.envs.tools import ToolCall, parser_of
from posttrain.generation.base import Completion, GenerationOutput, SamplingParams
from posttrain.logging import read_metrics
from posttrain.models.tiny import build_tokenizer
from forced_tool_calls import FirstTurnForced
from rl_configs import REWARDS, TINY_RL
from tool_templates import QWEN25

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                reason="cluster.backend=ray needs the ray extra (pip install 'posttrain[ray]')")

TOOL_FNS = str(Path(__file__).with_name("tool_fns_for_tests.py"))
HERMES = parser_of("hermes")


def wait_until_dead(actor) -> None:
    """ray.kill, then wait until the actor is seen dead (the kill is asynchronous)."""
    import ray

    ray.kill(actor, no_restart=True)
    with pytest.raises(ray.exceptions.RayActorError):
        while True:
            ray.get(actor.ready.remote(), timeout=60)


# ---- the actor holding an episode ---------------------------------------------------------------------------------


class ToolScript:
    """A stand-in model: turns 1 to 3 call `call(sample)` (sample: a count of the samples drawn), turn 4 answers;
    `on_turn(turn)` runs before a call whose prompts are at that turn."""

    def __init__(self, tokenizer, on_turn=lambda turn: None, call=lambda sample: ToolCall("process_id", {})):
        self.tokenizer, self.on_turn, self.call = tokenizer, on_turn, call
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.weights_version = 0
        self.samples = 0

    def generate(self, prompts, params, num_samples=1):
        completions = []
        for prompt in prompts:
            turn = self.tokenizer.decode(prompt).count("<|im_start|>assistant")
            self.on_turn(turn)
            samples = []
            for _ in range(num_samples):
                self.samples += 1
                text = HERMES.render([self.call(self.samples)]) if turn < 4 else "777777"
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.im_end]
                samples.append(Completion(prompt, ids, [-0.5] * len(ids), text, "stop"))
            completions.append(samples)
        return GenerationOutput(completions, num_generated_tokens=sum(len(s[0].token_ids) for s in completions))


def tool_answers(episode) -> list[str]:
    return [m["content"] for m in episode.messages if m["role"] == "tool"]


@pytest.mark.slow  # about 30 s: a Ray instance, two environment actors, one killed and replaced
def test_every_turn_of_an_episode_runs_on_the_actor_holding_it_and_a_lost_episode_restarts(tmp_path):
    from posttrain.distributed.ray_groups import HOLDER_KEY, RayCluster

    tokenizer = build_tokenizer()
    tokenizer.chat_template = QWEN25
    section = {"kind": "tools", "options": {"tools": [f"{TOOL_FNS}:process_id", f"{TOOL_FNS}:rendezvous"],
                                            "task": {"kind": "arithmetic"}, "tool_call_format": "hermes",
                                            "timeout_s": 60}}
    temp_dir = tempfile.mkdtemp(prefix="pt-ray-")  # short: Ray's socket paths must fit in 107 characters
    meeting = f"m{os.getpid()}-{time.monotonic_ns()}"
    cluster = RayCluster(ClusterSection(backend="ray", environment_workers=2, num_cpus=2, timeout_s=120),
                         WeightSyncSection(), Path(temp_dir))
    try:
        environment = cluster.environment(build_recipe_environment, section, tokenizer, concurrency=8)
        # The prompts offer the tools the actors built: one description, rendered by the driver.
        assert [tool["function"]["name"] for tool in environment.tool_use.tools] == ["process_id", "rendezvous"]
        question = [{"role": "user", "content": "What is 123456 + 654321?"}]
        row = PromptRow(question, tokenize_prompt(question, tokenizer, environment.tool_use.tools),
                        {"answer": "777777"})
        params = SamplingParams(max_new_tokens=50, seed=1)

        episodes, _ = run_episodes([row, row], 0, 2, ToolScript(tokenizer), environment, tokenizer, params,
                                   max_turns=4)
        pids = [set(tool_answers(e)) for e in episodes]
        assert all(len(e.messages) == 8 and e.reward == 1.0 and e.restarts == 0 for e in episodes)
        assert all(len(p) == 1 for p in pids)  # three tool calls, one process: the actor holding the episode
        assert len(set.union(*pids)) == 2 and str(os.getpid()) not in set.union(*pids)  # both actors, not here
        assert not any(HOLDER_KEY in e.metadata for e in episodes)  # removed when the episode ended
        metrics = rollout_metrics(episodes, {})
        assert metrics["tools/calls_mean"] == 3.0 and metrics["tools/errors_mean"] == 0.0

        # An actor answers several episodes' calls at once: each of its two episodes' tool waits for the other's.
        script = ToolScript(tokenizer, call=lambda sample: ToolCall("rendezvous", {"meeting": meeting,
                                                                                   "party": str(sample)}))
        episodes, _ = run_episodes([row, row], 8, 2, script, environment, tokenizer, params, max_turns=2)
        assert [tool_answers(e) for e in episodes] == [["met"]] * 4

        # Worker 0 dies while its episodes wait for their third turn: they start again from their first turn.
        killed = []

        def kill_worker_0(turn: int) -> None:
            if turn == 3 and not killed:
                killed.append(cluster.groups[0].actors[0])
                wait_until_dead(killed[0])

        episodes, _ = run_episodes([row, row], 4, 2, ToolScript(tokenizer, kill_worker_0), environment,
                                   tokenizer, params, max_turns=4)
        group = cluster.groups[0]
        restarted = [e for e in episodes if e.restarts]
        assert killed and group.restarts == 1 and group.actors[0] is not killed[0]
        assert len(restarted) == 2 == group.retried_samples  # worker 0's two episodes, each restarted once
        assert all(e.restarts == 1 for e in restarted)
        for episode in episodes:  # every episode, restarted or not, whole and on one live actor
            assert len(episode.messages) == 8 and episode.reward == 1.0 and len(set(tool_answers(episode))) == 1
        assert rollout_metrics(episodes, {})["faults/restarted_episodes"] == 2
        environment.close()
    finally:
        cluster.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
        for folder in Path(tempfile.gettempdir()).glob(f"posttrain-rendezvous-{meeting}-*"):
            shutil.rmtree(folder, ignore_errors=True)


# ---- GRPO with the calculator on Ray -------------------------------------------------------------------------------


def word_problem_call(text: str) -> ToolCall:
    """The forced first turn on a word problem: the calculator on its two numbers, except for problems whose first
    number is divisible by 3, which call a tool that does not exist (an unknown_tool error to count)."""
    a, b = re.findall(r"\d{5}", text)[-2:]
    if int(a) % 3 == 0:
        return ToolCall("abacus", {"expression": f"{a}+{b}"})
    return ToolCall("calculator", {"expression": f"{a}{'+' if 'more' in text else '-'}{b}"})


TOOLS = ["model.name_or_path=posttrain/tiny", "data.train_files=['posttrain/arithmetic-tools:train[:64]']",
         "data.max_length=128", "environment.kind=tools",
         "environment.options={tools: [calculator], tool_call_format: hermes, task: {kind: python, options: "
         f"{{functions: ['{REWARDS}:digit_fraction'], num_workers: 0}}}}}}",
         "rollout.max_turns=2", "rollout.max_new_tokens=8", "rollout.prompts_per_step=4",
         "rollout.num_generations_per_prompt=2", "trainer.micro_batch_size=8", "trainer.learning_rate=1e-3",
         "trainer.lr_scheduler=constant", "trainer.save_every=0", "logging.progress=none", "logging.plot=false"]
RAY = ["cluster.backend=ray", "cluster.timeout_s=600", "cluster.environment_workers=2", "cluster.num_cpus=3"]
COMPARED = ("reward/mean", "loss", "grad_norm", "generator_logprob_error", "turns/mean", "tokens/model_mean",
            "tokens/observation_mean", "tools/calls_mean", "tools/errors_mean", "tools/calls_per_turn",
            "tools/budget_stop_rate", "tools/errors/unknown_tool", "tools/errors/malformed")


def forced_first_turns(monkeypatch, on_later_turn=lambda: None, call_for=word_problem_call,
                       with_version: bool = False) -> list:
    """Every run's generator, the policy's (the Ray generation workers on Ray) with a forced first turn
    (`call_for(prompt text)`, or with `with_version` `call_for(prompt text, the version that sampled it)`);
    `on_later_turn()` runs before each call that samples a later turn."""
    generators = []
    policy_generator = grpo_module.policy_generator

    class Forced(FirstTurnForced):
        def generate(self, prompts, params, num_samples=1):
            if any("<|im_start|>tool" in self.tokenizer.decode(prompt) for prompt in prompts):
                on_later_turn()
            return super().generate(prompts, params, num_samples)

    def forced(cfg, tokenizer, policy, cluster=None):
        generators.append(Forced(policy_generator(cfg, tokenizer, policy, cluster), tokenizer, call_for,
                                 with_version))
        return generators[-1]

    monkeypatch.setattr(grpo_module, "policy_generator", forced)
    return generators


@pytest.mark.slow  # about 60 s: an in-process run and a Ray run with two environment actors
def test_ray_grpo_with_the_calculator_logs_the_in_process_rewards_tool_metrics_and_losses(tmp_path, tiny_model_dir,
                                                                                         monkeypatch):
    import ray

    generators = forced_first_turns(monkeypatch)
    for name, extra in (("local", []), ("ray", RAY)):
        with pytest.warns(RuntimeWarning, match="does not render tools"):  # the embedded ChatML template
            train_grpo(load_config(GRPOConfig, None, [*TOOLS, *extra, f"output_dir={tmp_path / name}",
                                                      "trainer.max_steps=3"]))
    assert not ray.is_initialized()
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == len(remote) == 3 and [g.forced for g in generators] == [24, 24]
    for a, b in zip(local, remote):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], abs=1e-5), key
        assert b["turns/mean"] == 2.0 and b["tools/calls_mean"] == 1.0
        assert b["weight_sync/bytes"] > 0 == a["weight_sync/bytes"]  # later turns sampled by the Ray generators
        assert b["faults/environment_restarts"] == 0 and "faults/restarted_episodes" not in b
    assert any(record["tools/errors/unknown_tool"] > 0 for record in local)  # the error kinds are compared too
    assert len({record["reward/mean"] for record in local}) > 1 and all(r["grad_norm"] > 0 for r in local)


@pytest.mark.slow  # about 60 s: an in-process run, then a Ray run one of whose environment actors dies in step 2
def test_an_environment_actor_killed_mid_episode_is_replaced_and_its_episodes_restarted_and_counted(
        tmp_path, tiny_model_dir, monkeypatch):
    from posttrain.distributed import cluster as clusters

    killed = []
    steps_seen = []

    def kill_in_step_two() -> None:
        """Before the later turns of step 2 are sampled: environment worker 0 holds half of its episodes."""
        steps_seen.append(1)
        metrics = tmp_path / "ray" / "metrics.jsonl"
        if killed or not metrics.is_file() or len(metrics.read_text().splitlines()) != 1:
            return
        (group,) = [g for g in clusters._started[0].groups if g.name == "environment"]
        killed.append(group.actors[0])
        wait_until_dead(killed[0])

    forced_first_turns(monkeypatch, kill_in_step_two)
    for name, extra in (("local", []), ("ray", RAY)):
        with pytest.warns(RuntimeWarning, match="does not render tools"):
            train_grpo(load_config(GRPOConfig, None, [*TOOLS, *extra, f"output_dir={tmp_path / name}",
                                                      "trainer.max_steps=3"]))
    assert killed
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == len(remote) == 3
    for a, b in zip(local, remote):  # the restarted episodes sampled and scored what the lost ones had
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], abs=1e-5), key
    assert remote[0]["faults/environment_restarts"] == 0 and "faults/restarted_episodes" not in remote[0]
    restarted = remote[1]["faults/restarted_episodes"]
    assert 1 <= restarted <= 4  # worker 0's episodes of step 2 (4 of 8) that it held when it died
    assert remote[-1]["faults/environment_restarts"] == 1
    assert remote[-1]["faults/environment_retried_samples"] == restarted
    assert "faults/restarted_episodes" not in remote[2]


@pytest.mark.slow  # about 40 s: a Ray run whose tool never answers, stopped at the 20 s deadline
def test_a_tool_that_never_answers_stops_the_run_within_the_deadline_naming_the_environment_worker(
        tmp_path, tiny_model_dir, monkeypatch):
    import time

    import ray

    from posttrain.errors import RunError

    policy_generator = grpo_module.policy_generator
    monkeypatch.setattr(grpo_module, "policy_generator", lambda cfg, tokenizer, policy, cluster=None: FirstTurnForced(
        policy_generator(cfg, tokenizer, policy, cluster), tokenizer,
        lambda text: ToolCall("never_returns", {"question": "?"})))
    hangs = [f"environment.options={{tools: ['{TOOL_FNS}:never_returns'], timeout_s: 3600}}"]
    cfg = load_config(GRPOConfig, None, [*TOOLS, *hangs, f"output_dir={tmp_path}", "trainer.max_steps=2",
                                         "cluster.backend=ray", "cluster.timeout_s=20"])
    started = []

    def step_started(*args, **kwargs):
        started.append(time.monotonic())
        return run_episodes_of_grpo(*args, **kwargs)

    from posttrain.algorithms import rollout_source

    run_episodes_of_grpo = rollout_source.run_episodes
    monkeypatch.setattr(rollout_source, "run_episodes", step_started)
    with pytest.warns(RuntimeWarning, match="does not render tools"), pytest.raises(RunError) as error:
        train_grpo(cfg)  # without the deadline this call would never return
    waited = time.monotonic() - started[0]
    message = str(error.value)
    assert "environment worker 0 of 1 did not answer `step` within cluster.timeout_s=20 s" in message
    assert "waiting for the environment's answer to turn 1 of an episode" in message
    assert waited < 20 + 30  # the deadline, plus the first turn's sampling
    assert not ray.is_initialized()


# ---- SWE on Ray ----------------------------------------------------------------------------------------------------


@pytest.mark.slow  # about 60 s: the embedded model's step on 1,000-token prompts, with a Ray instance
def test_ray_grpo_with_the_swe_environment_scores_the_gold_edit_1_on_the_environment_actors(tmp_path, tiny_model_dir,
                                                                                           monkeypatch):
    import json

    from posttrain.envs import sandbox
    from posttrain.envs.swe.bundled import ensure_bundled_tasks
    from posttrain.envs.swe.environment import prompt_rows
    from posttrain.envs.swe.tasks import load_tasks

    if not sandbox.sandbox_info().namespaces:
        pytest.skip("SWE episodes run only inside the sandbox's namespaces")
    (task,) = [t for t in load_tasks(ensure_bundled_tasks()) if t.instance_id == "posttrain__clamp-1"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in prompt_rows([task]) * 2))
    gold_edit = ToolCall("str_replace", {"path": "numbers_util.py", "old_str": "        return low\n",
                                         "new_str": "        return low\n    if value > high:\n        return high\n"})
    policy_generator = grpo_module.policy_generator
    monkeypatch.setattr(grpo_module, "policy_generator", lambda cfg, tokenizer, policy, cluster=None: FirstTurnForced(
        policy_generator(cfg, tokenizer, policy, cluster), tokenizer, lambda text: gold_edit))
    cfg = load_config(GRPOConfig, None, [*TINY_RL, f"data.train_files=['{prompts}']", "environment.kind=swe",
                                         "environment.options={tool_call_format: hermes}", f"output_dir={tmp_path}/run",
                                         "trainer.max_steps=1", "trainer.save_every=0", "trainer.micro_batch_size=4",
                                         "rollout.max_turns=2", "rollout.max_new_tokens=4", "data.max_length=1024",
                                         "rollout.prompts_per_step=2", "rollout.num_generations_per_prompt=2", *RAY])
    with pytest.warns(RuntimeWarning, match="does not render tools"):  # the embedded ChatML template
        train_grpo(cfg)
    (record,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert record["reward/mean"] == 1.0 and record["tools/calls_mean"] == 1.0 and record["tools/errors_mean"] == 0.0
    assert record["turns/mean"] == 2.0 and record["faults/environment_restarts"] == 0


# ---- asynchronous multi-turn rounds ------------------------------------------------------------------------------


@pytest.mark.slow  # about 60 s: a 4-step asynchronous Ray run with tool calls
def test_asynchronous_multi_turn_rounds_stay_within_the_staleness_bound_counted_from_the_oldest_version(
        tmp_path, tiny_model_dir, monkeypatch):
    """Each episode's first turn calls a tool that, once the run has logged a step, answers only when the weights
    are newer than those that sampled the first turn (the step after them is logged): the rounds sent ahead at
    steps 2 and 3 sample their first turns from the weights of before the push that ends that step and their second
    turns from the weights after it (however slowly the first turns come). Their age still counts from the first
    turn's version, so every step stays within max_staleness=1."""
    metrics = tmp_path / "metrics.jsonl"
    generators = forced_first_turns(monkeypatch, with_version=True, call_for=lambda text, version: ToolCall(
        "wait_for_the_version_after", {"metrics": str(metrics), "version": version}))
    slow = [f"environment.options={{tools: ['{TOOL_FNS}:wait_for_the_version_after'], timeout_s: 120}}"]
    cfg = load_config(GRPOConfig, None, [*TOOLS, *slow, *RAY, f"output_dir={tmp_path}", "trainer.max_steps=4",
                                         "rollout.asynchronous=true", "loss.importance_correction=tis",
                                         "rollout.max_staleness=1"])
    with pytest.warns(RuntimeWarning, match="does not render tools"):
        train_grpo(cfg)
    records = read_metrics(metrics)
    assert len(records) == 4 and generators[0].forced >= 4 * 8  # round 5, sent at step 4, may be sampled too
    for step, record in enumerate(records, start=1):
        assert record["turns/mean"] == 2.0 and record["tools/calls_mean"] == 1.0
        assert record["rollout/stale_groups_dropped"] == 0 and record["rollout/staleness_max"] <= 1
        assert 0 <= record["rollout/in_flight_updated_fraction"] <= 1
        assert record["grad_norm"] > 0
    assert [r["rollout/staleness_max"] for r in records] == [0, 1, 1, 1]  # rounds 2-4 began a version behind
    # Rounds 3 and 4: every episode's second turn sampled by newer weights than its first. (Round 2's second turns
    # come before or after the push that ends step 1, as the cores allow; round 1's all before it.)
    fractions = [r["rollout/in_flight_updated_fraction"] for r in records]
    assert fractions[0] == 0 and 0 <= fractions[1] <= 1 and fractions[2:] == [1, 1]


@pytest.mark.slow  # about 60 s: a 3-step asynchronous multi-turn Ray run, one group's tool straggling 60 s
def test_an_asynchronous_multi_turn_group_whose_tool_straggles_on_its_actor_is_dropped_and_counted(
        tmp_path, tiny_model_dir, monkeypatch):
    """The first prompt of round 1 calls a tool that sleeps 60 s on its environment actor, past the 20 s group
    timeout: its group is dropped and counted at step 1 and never trained; the round's other groups, whose tools
    answer at once on the same actors, are trained, and later rounds drop nothing. (The first turns go through the
    generation actor's blocks, `submit_blocks`, as every asynchronous multi-turn round under a group timeout.)"""
    import json

    slow: list[str] = []

    def call_for(text: str) -> ToolCall:
        slow.append(slow[0] if slow else text)  # the first prompt the run samples
        return ToolCall("sleep_for", {"seconds": 60.0 if text == slow[0] else 0.0})

    forced_first_turns(monkeypatch, call_for=call_for)
    tools = [f"environment.options={{tools: ['{TOOL_FNS}:sleep_for'], timeout_s: 90}}"]
    cfg = load_config(GRPOConfig, None, [*TOOLS, *tools, *RAY, f"output_dir={tmp_path}", "trainer.max_steps=3",
                                         "rollout.asynchronous=true", "loss.importance_correction=tis",
                                         "rollout.group_timeout_s=20", "logging.samples_per_step=8"])
    with pytest.warns(RuntimeWarning, match="does not render tools"):
        train_grpo(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["rollout/timed_out_groups"] for r in records] == [1, 0, 0]
    assert records[-1]["rollout/timed_out_groups_total"] == 1
    assert all(r["rollout/generation_timed_out_groups"] == 0 for r in records)  # it straggled in its tool
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    by_step = {step: [s for s in samples if s["step"] == step] for step in (1, 2, 3)}
    assert len(by_step[1]) == 6 and len(by_step[2]) == len(by_step[3]) == 8  # 3 groups of 2, then 4
    assert all(slow[0] not in s["prompt"] for s in samples)  # the dropped group was never trained
    assert all(s["completion"].count("awake") >= 1 for s in samples)  # every trained episode's tool answered


@pytest.mark.slow  # about 70 s: an asynchronous multi-turn Ray run stopped after step 2, then resumed to step 4
def test_an_asynchronous_multi_turn_run_resumes_with_the_round_in_flight_and_its_versions(tmp_path, tiny_model_dir,
                                                                                        monkeypatch):
    """The checkpoint of step 2 waits for round 3 (sent ahead: its first turns from version 1, its second turns, held
    by the tool until step 2 is logged, from version 2) and keeps its episodes with their versions; the resumed run
    trains on them at step 3, then on a round it samples itself."""
    import json

    metrics = tmp_path / "metrics.jsonl"
    forced_first_turns(monkeypatch, with_version=True, call_for=lambda text, version: ToolCall(
        "wait_for_the_version_after", {"metrics": str(metrics), "version": version}))
    slow = [f"environment.options={{tools: ['{TOOL_FNS}:wait_for_the_version_after'], timeout_s: 120}}"]
    for steps in (2, 4):
        with pytest.warns(RuntimeWarning, match="does not render tools"):
            train_grpo(load_config(GRPOConfig, None, [
                *TOOLS, *slow, *RAY, f"output_dir={tmp_path}", f"trainer.max_steps={steps}", "trainer.save_every=2",
                "rollout.asynchronous=true", "loss.importance_correction=tis", "rollout.max_staleness=1",
                "logging.samples_per_step=8"]))
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["rollout/staleness_max"] for r in records] == [0, 1, 1, 1]
    assert [r["rollout/in_flight_updated_fraction"] for r in records][2:] == [1, 1]  # round 3's spans kept
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    by_step = {}
    for sample in samples:
        by_step.setdefault(sample["step"], []).append(sample)
    for step in (1, 2, 3, 4):  # each step its own round's four groups, none twice
        assert sorted({s["group_id"] for s in by_step[step]}) == list(range(4 * (step - 1), 4 * step)), step
    assert {s["policy_version"] for s in by_step[3]} == {1} and {s["policy_version"] for s in by_step[4]} == {2}


@pytest.mark.slow  # about 60 s: a 3-step asynchronous Ray run with tool calls
def test_asynchronous_multi_turn_rounds_with_chunks_stop_strings_a_group_timeout_and_dynamic_sampling(
        tmp_path, tiny_model_dir, monkeypatch):
    """Every asynchronous multi-turn device at once on the actors: the second turns (the model's own, after a forced
    calculator call) are sampled in chunks of 3 tokens, each ended at the first of the stop strings (digits: a byte
    each, frequent in the embedded model's samples) wherever it falls, every span's version recorded; the group
    timeout is generous (nothing dropped) and dynamic sampling keeps only groups with reward variance."""
    import json

    forced_first_turns(monkeypatch)
    digits = [str(d) for d in range(10)]
    cfg = load_config(GRPOConfig, None, [
        *TOOLS, *RAY, f"output_dir={tmp_path}", "trainer.max_steps=3", "rollout.asynchronous=true",
        "loss.importance_correction=tis", "rollout.in_flight_updates=true", "rollout.in_flight_chunk_tokens=3",
        f"rollout.stop_strings={digits}", "rollout.group_timeout_s=120", "rollout.dynamic_sampling=true",
        "rollout.max_sampling_rounds=3", "logging.samples_per_step=8"])
    with pytest.warns(RuntimeWarning, match="does not render tools"):
        train_grpo(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["turns/mean"] == 2.0 and record["rollout/timed_out_groups"] == 0
        assert record["rollout/staleness_max"] <= 1 and record["rollout/stale_groups_dropped"] == 0
        assert record["sampling/groups_kept"] > 0 and record["grad_norm"] > 0
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    groups: dict[int, list[float]] = {}
    stopped = 0
    for sample in samples:
        groups.setdefault(sample["group_id"], []).append(sample["reward"])
        reply = sample["completion"].rsplit("<|im_start|>assistant\n", 1)[-1].removesuffix("<|im_end|>")
        # Ended at its first stop string, if it holds one: no digit before its last character.
        assert not any(d in reply[:-1] for d in digits), reply
        stopped += bool(reply) and reply[-1] in digits
        spans = sample["version_spans"]
        assert all(a[0] < b[0] and a[1] < b[1] for a, b in zip(spans, spans[1:])), spans
        assert sample["policy_version"] == min((v for _, v in spans), default=sample["policy_version"])
    assert stopped > 0  # some second turns were ended by a stop string
    assert all(max(rewards) > min(rewards) for rewards in groups.values())  # only groups with variance trained
