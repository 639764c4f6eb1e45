"""Weighted mixtures of environments: one named reward component per environment, a failing component masks the
sample, options checked at load, and the GRPO loop logging reward/<name>."""

from pathlib import Path

import pytest
from test_judge import JudgeServer

from posttrain.algorithms.grpo import train_grpo
from posttrain.algorithms.rollout import scalar_reward
from posttrain.config import ConfigError, load_config
from posttrain.config.schema import GRPOConfig
from posttrain.algorithms.environments import build_recipe_environment
from posttrain.logging import read_metrics
from posttrain.workers import RewardModel

REWARDS = str(Path(__file__).with_name("reward_fns_for_tests.py"))


def logs(*replies: str, prompt: str = "1+1=") -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}] for reply in replies]


def python_component(name: str, function: str, weight: float = 1.0) -> dict:
    return {"name": name, "kind": "python", "weight": weight,
            "options": {"functions": [f"{REWARDS}:{function}"], "num_workers": 0}}


def test_arithmetic_reward_model_and_judge_each_give_a_named_component(reward_model_dir):
    server = JudgeServer()
    server.default = ("reply_fn", lambda body: "Score: 10" if "A: 2" in body["messages"][-1]["content"] else "Score: 1")
    try:
        mixture = build_recipe_environment({"kind": "mixture", "options": {"components": [
            {"name": "correct", "kind": "arithmetic", "weight": 1.0},
            {"name": "preference", "kind": "reward_model", "weight": 0.5, "options": {"path": str(reward_model_dir)}},
            {"name": "judge", "kind": "judge", "weight": 0.25,
             "options": {"base_url": server.url, "model": "m", "template": "Q: {prompt}\nA: {response}"}},
        ]}})
        step = mixture.step(logs("2", "3"), [{"answer": "2"}, {"answer": "2"}])
    finally:
        server.close()
    assert mixture.reward_weights == {"correct": 1.0, "preference": 0.5, "judge": 0.25}
    preference = RewardModel.from_pretrained(reward_model_dir).score(["1+1=", "1+1="], ["2", "3"])
    assert step.errors == [None, None] and step.done == [True, True]
    assert step.rewards[0] == pytest.approx({"correct": 1.0, "preference": preference[0], "judge": 1.0}, abs=1e-6)
    assert step.rewards[1] == pytest.approx({"correct": 0.0, "preference": preference[1], "judge": 0.0}, abs=1e-6)
    # The loop's weighted sum of the components; the row's metadata and every component's, merged.
    assert scalar_reward(step.rewards[0], mixture.reward_weights) == pytest.approx(1.0 + 0.5 * preference[0] + 0.25)
    assert step.metadata[0] == {"answer": "2", "correct": True, "extracted_answer": "2", "judge_score": 10.0}
    mixture.close()


def test_a_failing_component_masks_the_sample_and_names_itself():
    # raises_on_bad raises on the reply "bad" (scored 1.0 otherwise): that sample is masked, whatever arithmetic
    # says, and its error names the component.
    mixture = build_recipe_environment({"kind": "mixture", "options": {"components": [
        {"name": "correct", "kind": "arithmetic"}, python_component("checked", "raises_on_bad", 0.1),
    ]}})
    step = mixture.step(logs("2", "bad", "3"), [{"answer": "2"}] * 3)
    assert step.rewards == [{"correct": 1.0, "checked": 1.0}, None, {"correct": 0.0, "checked": 1.0}]
    assert step.errors[0] is None and step.errors[2] is None
    assert step.errors[1].startswith("checked: ") and "cannot score 'bad'" in step.errors[1]
    assert step.metadata[1]["correct"] is False  # metadata is still merged for a masked sample
    mixture.close()


def test_a_component_with_its_own_components_contributes_their_weighted_sum():
    # Two python functions make a component with parts {exact, digits} weighted 1 and 0.5 by its own weights.
    mixture = build_recipe_environment({"kind": "mixture", "options": {"components": [{
        "name": "python", "kind": "python", "options": {"num_workers": 0, "functions": [
            {"name": "exact", "path": f"{REWARDS}:exact", "weight": 1.0},
            {"name": "digits", "path": f"{REWARDS}:digit_fraction", "weight": 0.5}]}}]}})
    step = mixture.step(logs("2", "2a"), [{"answer": "2"}, {"answer": "2"}])
    assert step.rewards == [{"python": 1.0 + 0.5 * 1.0}, {"python": 0.0 + 0.5 * 0.5}]


@pytest.mark.parametrize("components, message", [
    ([], "non-empty list"),
    ([{"name": "a", "kind": "arithmetic"}, {"name": "a", "kind": "arithmetic"}], r"components\[1\] \(a\).name.*two"),
    ([{"name": "mean", "kind": "arithmetic"}], "reward/mean"),
    ([{"name": "a/b", "kind": "arithmetic"}], "without '/'"),
    ([{"name": "a", "kind": "mixture"}], "mixtures do not nest"),
    ([{"name": "a", "kind": "arithmetic", "weight": True}], r"components.0.weight: expected a finite number"),
    ([{"name": "a", "kind": "arithmetic", "wieght": 2}], "components.0.wieght: unknown key; did you mean .*weight"),
    ([{"name": "a", "kind": "math", "options": {"timeout": 1}}],
     r"components.0.options.timeout: the math environment has no option 'timeout' \(did you mean timeout_s"),
    ([{"name": "a", "kind": "math", "options": {"worker_memory_mb": 1}}], "environment.worker_memory_mb"),
])
def test_bad_components_are_named_at_config_load(components, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GRPOConfig, None, ["data.train_files=[x]", "environment.kind=mixture"],
                    base={"environment": {"options": {"components": components}}})


def test_grpo_logs_each_component_and_trains_on_their_weighted_sum(tmp_path, tiny_model_dir):
    cfg = load_config(GRPOConfig, None, [
        "model.name_or_path=posttrain/tiny", "data.train_files=['posttrain/arithmetic[:64]']", "data.max_length=32",
        "rollout.prompts_per_step=4", "rollout.num_generations_per_prompt=4", "rollout.max_new_tokens=6",
        "trainer.max_steps=2", "trainer.micro_batch_size=16", "logging.progress=none", "logging.plot=false",
        f"output_dir={tmp_path}", "environment.kind=mixture",
    ], base={"environment": {"options": {"components": [
        {"name": "correct", "kind": "arithmetic", "weight": 1.0}, python_component("digits", "digit_fraction", 0.5),
    ]}}})
    assert cfg.environment.worker_memory_mb == 4096  # passed on to the python component
    train_grpo(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 2
    for record in records:
        assert {"reward/correct", "reward/digits", "accuracy"} <= set(record) and record["reward/errors"] == 0
        assert record["reward/mean"] == pytest.approx(record["reward/correct"] + 0.5 * record["reward/digits"])
        assert record["accuracy"] == record["reward/correct"]
    # GDPO normalizes each component on its own.
    gdpo = cfg.model_copy(update={"output_dir": str(tmp_path / "gdpo"),
                                  "advantage": cfg.advantage.model_copy(update={"estimator": "gdpo"}),
                                  "trainer": cfg.trainer.model_copy(update={"max_steps": 1})})
    train_grpo(gdpo)
    assert "reward/digits" in read_metrics(tmp_path / "gdpo" / "metrics.jsonl")[0]
