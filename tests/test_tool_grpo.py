"""GRPO, PPO and `posttrain eval` with the tools environment on the embedded model: a smoke test that the loop, the
masks and the metrics work with tool calls (learning to call tools is not tested here).

The embedded model has never seen a tool call, so the first turn of every episode is replaced by a calculator call
on the prompt's numbers (with made-up sampler log-probabilities); the second turn, after the tool result, is the
model's own. Everything else is the real recipe: prompts rendered with the tools, the calculator run, its result
appended without loss, the arithmetic task scoring the answer, the update, the metrics."""

import json
import math
import re
import warnings

import pytest

from posttrain.algorithms import evaluate as evaluate_module
from posttrain.algorithms import grpo as grpo_module
from posttrain.algorithms import ppo as ppo_module
from posttrain.algorithms.evaluate import evaluate_files
from posttrain.algorithms.grpo import train_grpo
from posttrain.algorithms.ppo import train_ppo
from posttrain.config import ConfigError, load_config
from posttrain.config.schema import EvalConfig, GRPOConfig, PPOConfig
from posttrain.envs.tools import ToolCall
from posttrain.logging import read_metrics
from forced_tool_calls import FirstTurnForced
from rl_configs import TINY_RL

TOOLS = ["environment.kind=tools", "environment.options={tools: [calculator], task: {kind: arithmetic}}"]


def calculator_call(text: str) -> ToolCall:
    a, b = re.findall(r"(\d+)\+(\d+)", text)[-1]
    return ToolCall("calculator", {"expression": f"{a}+{b}"})


def FirstTurnCallsTheCalculator(inner, tokenizer) -> FirstTurnForced:
    """The policy's generator, except that a first turn is a calculator call on the prompt's two numbers."""
    return FirstTurnForced(inner, tokenizer, calculator_call)


def test_grpo_with_the_calculator_tool_runs_with_masks_and_metrics(tmp_path, tiny_model_dir, monkeypatch):
    generators, batches = [], []

    def forced_generator(cfg, tokenizer, policy, cluster=None):
        generators.append(FirstTurnCallsTheCalculator(policy_generator(cfg, tokenizer, policy), tokenizer))
        return generators[-1]

    def recorded_batch(*args, **kwargs):
        batches.append(rollout_batch(*args, **kwargs))
        return batches[-1]

    policy_generator, rollout_batch = grpo_module.policy_generator, grpo_module.rollout_batch
    monkeypatch.setattr(grpo_module, "policy_generator", forced_generator)
    monkeypatch.setattr(grpo_module, "rollout_batch", recorded_batch)
    cfg = load_config(GRPOConfig, None, [*TINY_RL, *TOOLS, f"output_dir={tmp_path}", "trainer.max_steps=1",
                                         "trainer.save_every=0", "trainer.micro_batch_size=8",
                                         "rollout.max_turns=2", "rollout.max_new_tokens=8", "data.max_length=128",
                                         "rollout.prompts_per_step=4", "rollout.num_generations_per_prompt=2"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_grpo(cfg)
    assert any("does not render tools" in str(w.message) for w in caught)  # the embedded ChatML template
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 1 and generators[0].forced == 8
    for record in records:
        assert record["turns/mean"] == 2.0 and record["tools/calls_mean"] == 1.0
        assert record["tools/errors_mean"] == 0.0 and record["tools/calls_per_turn"] == 0.5
        assert record["tokens/observation_mean"] > 0 and math.isfinite(record["loss"])
    tokenizer = generators[0].tokenizer
    for batch in batches:
        for row, mask in zip(batch.input_ids, batch.loss_mask):
            trained = tokenizer.decode(row[mask.bool()])
            assert trained.count("calculator") == 1  # the model's call carries loss ...
            everything = tokenizer.decode(row[batch.attention_mask[0].new_ones(len(row)).bool()])
            result = everything.split("<|im_start|>tool\n")[1].split("<|im_end|>")[0]
            assert result.isdigit() and "<|im_start|>tool" not in trained  # ... its result does not


def test_ppo_with_the_calculator_tool_runs(tmp_path, tiny_model_dir, monkeypatch):
    """PPO's critic and GAE over episodes whose responses hold tool results (masked tokens inside the response)."""
    policy_generator = ppo_module.policy_generator
    monkeypatch.setattr(ppo_module, "policy_generator", lambda cfg, tokenizer, policy, cluster=None:
                        FirstTurnCallsTheCalculator(policy_generator(cfg, tokenizer, policy), tokenizer))
    cfg = load_config(PPOConfig, None, [*TINY_RL, *TOOLS, f"output_dir={tmp_path}", "trainer.max_steps=1",
                                        "trainer.save_every=0", "critic.learning_rate=1e-3", "critic.warmup_steps=0",
                                        "rollout.max_turns=2", "rollout.max_new_tokens=8", "data.max_length=128",
                                        "rollout.prompts_per_step=4", "rollout.num_generations_per_prompt=2"])
    with pytest.warns(RuntimeWarning, match="does not render tools"):
        train_ppo(cfg)
    record = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert record["tools/calls_mean"] == 1.0 and record["turns/mean"] == 2.0
    assert math.isfinite(record["loss"]) and math.isfinite(record["value/loss"])


def test_eval_with_tools_reports_tool_metrics(tmp_path, tiny_model_dir, monkeypatch):
    build_generator = evaluate_module.build_generator

    def forced(model, backend, tokenizer, policy=None, **kwargs):
        return FirstTurnCallsTheCalculator(build_generator(model, backend, tokenizer, policy, **kwargs), tokenizer)

    monkeypatch.setattr(evaluate_module, "build_generator", forced)
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a, b in [(12, 30), (7, 8), (41, 1)]))
    cfg = load_config(EvalConfig, None, [f"model.name_or_path={tiny_model_dir}", f"data.files=['{data}']",
                                         *TOOLS, "max_turns=2", "max_new_tokens=6"])
    with pytest.warns(RuntimeWarning, match="does not render tools"):
        report = evaluate_files(cfg)
    assert report.metrics["tools/calls_mean"] == 1.0 and report.metrics["turns/mean"] == 2.0


def test_a_tools_environment_needs_a_second_turn(tmp_path):
    with pytest.raises(ConfigError, match="environment.kind=tools with rollout.max_turns=1"):
        load_config(GRPOConfig, None, [*TINY_RL, *TOOLS, f"output_dir={tmp_path}"])
