"""The driver seam: recipe loops talk to workers only through their protocols, with whole minibatches and loss
descriptions that pickle, so the same loop can direct workers in another process; weights reach generators
versioned; multi-turn episodes advance independently."""

import pickle
import threading
import time
from pathlib import Path

import pytest
import torch

from posttrain.algorithms.grpo import train_grpo
from posttrain.algorithms.ppo import train_ppo
from posttrain.algorithms.rollout import PromptRow, run_episodes
from posttrain.config import load_config
from posttrain.config.schema import GRPOConfig, ModelConfig, PPOConfig
from posttrain.envs.base import EnvStep
from posttrain.errors import RunError
from posttrain.generation.base import SamplingParams, weight_buckets
from posttrain.generation.transformers_backend import TransformersGenerator
from posttrain.logging import read_metrics
from posttrain.losses.policy_gradient import PolicyLossConfig
from posttrain.losses.preference import PreferenceLossConfig
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.workers import CriticWorker, PolicyWorker, ScoringWorker
from posttrain.workers.objectives import (
    BradleyTerryObjective,
    NLLObjective,
    PolicyGradientObjective,
    PreferenceObjective,
    ValueObjective,
)

from pickled_workers import pickle_every_worker
from rl_configs import DIGITS, TINY_RL

PROTOCOL_NAMES = {name for protocol in (PolicyWorker, ScoringWorker, CriticWorker)
                  for name in dir(protocol) if not name.startswith("_")}
OFF_POLICY_WITH_KL = ["update.num_minibatches=2", "loss.reference_kl_penalty=0.1", "trainer.micro_batch_size=8"]


def grpo_config(output_dir: Path, *overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, None, [*TINY_RL, *DIGITS, f"output_dir={output_dir}", *overrides])


def ppo_config(output_dir: Path, *overrides: str) -> PPOConfig:
    return load_config(PPOConfig, None, [*TINY_RL, *DIGITS, f"output_dir={output_dir}", "critic.learning_rate=1e-3",
                                         *overrides])


def test_loss_descriptions_pickle_to_equal_values():
    losses = [NLLObjective(), PreferenceObjective(PreferenceLossConfig(type="ipo", beta=0.3, average_logprobs=True)),
              BradleyTerryObjective(use_margin=True), PolicyGradientObjective(PolicyLossConfig(ratio_clip_high=0.28), 0.7),
              ValueObjective(clip=0.2)]
    for loss in losses:
        assert pickle.loads(pickle.dumps(loss)) == loss


@pytest.mark.parametrize("train, config, extra", [(train_grpo, grpo_config, OFF_POLICY_WITH_KL),
                                                   (train_ppo, ppo_config, ["gae.kl_coef=0.1"])])
def test_rl_loops_use_only_protocol_calls_and_equal_local_workers_through_pickle(train, config, extra, tmp_path,
                                                                                 tiny_model_dir, monkeypatch):
    """Every worker call of train_grpo / train_ppo crosses pickle (a stand-in for an actor) and is a protocol
    method; the run then equals one with local workers (the generator keeps its own copy, filled by weight pushes)."""
    local = train(config(tmp_path / "local", "trainer.max_steps=3", *extra))
    calls = pickle_every_worker(monkeypatch)
    remote = train(config(tmp_path / "pickled", "trainer.max_steps=3", *extra))
    assert set(calls) <= PROTOCOL_NAMES, sorted(set(calls) - PROTOCOL_NAMES)
    assert {"forward_backward", "optim_step", "logprobs", "push_weights", "save", "export"} <= set(calls)
    keys = ("loss", "grad_norm", "reward/mean", "kl")
    for a, b in zip(read_metrics(local.output_dir / "metrics.jsonl"), read_metrics(remote.output_dir / "metrics.jsonl")):
        assert {k: a.get(k) for k in keys} == pytest.approx({k: b.get(k) for k in keys}, rel=1e-5, abs=1e-7)
        assert a["weight_sync/bytes"] == 0 < b["weight_sync/bytes"]  # shared module: nothing read; a copy: all


def test_weight_pushes_are_versioned_by_optimizer_steps_and_episodes_record_theirs(tmp_path, tiny_model_dir,
                                                                                  monkeypatch):
    from posttrain.algorithms import rl

    versions = []
    real = rl.to_batch

    def recording(episodes, *args, **kwargs):
        batch = real(episodes, *args, **kwargs)
        versions.append(sorted(set(batch.policy_versions.tolist())))
        return batch

    monkeypatch.setattr(rl, "to_batch", recording)
    pickle_every_worker(monkeypatch)  # the generator keeps its own copy: the version arrives with the weights
    train_grpo(grpo_config(tmp_path, "trainer.max_steps=3", "update.num_minibatches=2"))
    assert versions == [[0], [2], [4]]  # two optimizer steps per RL step, every episode sampled by the newest


def test_weight_buckets_keep_order_and_size():
    weights = [(f"w{i}", torch.zeros(i + 1)) for i in range(6)]  # 4..24 bytes each
    buckets = list(weight_buckets(iter(weights), bucket_bytes=20))
    assert [name for bucket in buckets for name, _ in bucket] == [name for name, _ in weights]
    # A bucket closes once it reaches 20 bytes: 4+8+12, then 16+20, then 24.
    assert [[name for name, _ in bucket] for bucket in buckets] == [["w0", "w1", "w2"], ["w3", "w4"], ["w5"]]


def test_an_incomplete_weight_update_is_refused(tiny_model_dir):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    model = load_causal_lm(cfg)
    generator = TransformersGenerator(load_causal_lm(cfg), load_tokenizer(cfg), owns_weights=True)
    some = list(model.state_dict().items())[:-1]
    with pytest.raises(ValueError, match="left weights unset"):
        generator.update_weights(1, iter(some))
    assert generator.weights_version == 0


class SlowFirstEpisode:
    """Two turns; the first episode's first call sleeps, and records when every call starts and ends."""

    def __init__(self, delay: float):
        self.delay, self.events, self.lock = delay, [], threading.Lock()

    def step(self, message_logs, metadata):
        (log,), (meta,) = message_logs, metadata
        turn = sum(m["role"] == "assistant" for m in log)
        with self.lock:
            self.events.append(("start", meta["id"], turn, time.perf_counter()))
        if meta["id"] == 0 and turn == 1:
            time.sleep(self.delay)
        with self.lock:
            self.events.append(("end", meta["id"], turn, time.perf_counter()))
        if turn == 1:
            return EnvStep([0.0], [False], [{"role": "user", "content": "again"}], [None], [dict(meta)])
        return EnvStep([1.0], [True], [None], [None], [dict(meta)])


def _rows(tokenizer, count):
    rows = []
    for i in range(count):
        prompt = [{"role": "user", "content": f"{i}+1="}]
        ids = tokenizer(tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)["input_ids"]
        rows.append(PromptRow(prompt, ids, {"id": i}))
    return rows


def test_a_slow_environment_call_holds_back_only_its_own_episode(tiny_model_dir):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    tokenizer, model = load_tokenizer(cfg), load_causal_lm(cfg)
    environment = SlowFirstEpisode(delay=6.0)  # far longer than the others' second turn, even on a busy machine
    episodes, _ = run_episodes(_rows(tokenizer, 4), 0, 1, TransformersGenerator(model, tokenizer), environment,
                               tokenizer, SamplingParams(max_new_tokens=3, seed=1), max_turns=2)
    assert all(e.num_turns == 2 and e.reward == 1.0 for e in episodes)
    slow_end = next(t for kind, i, turn, t in environment.events if (kind, i, turn) == ("end", 0, 1))
    others_done = [t for kind, i, turn, t in environment.events if kind == "end" and turn == 2 and i != 0]
    assert len(others_done) == 3 and max(others_done) < slow_end  # they finished both turns meanwhile


def test_multi_turn_sampling_does_not_depend_on_which_episodes_share_a_call(tiny_model_dir):
    """Later turns draw from per-episode streams: the slow episode's timing changes who shares a generation call,
    not what anyone samples."""
    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    tokenizer, model = load_tokenizer(cfg), load_causal_lm(cfg)
    rows = _rows(tokenizer, 4)

    def tokens(delay):
        episodes, _ = run_episodes(rows, 0, 2, TransformersGenerator(model, tokenizer), SlowFirstEpisode(delay),
                                   tokenizer, SamplingParams(max_new_tokens=4, seed=3), max_turns=2)
        return [e.token_ids for e in episodes]

    assert tokens(0.0) == tokens(0.5)


def test_an_environment_call_that_never_returns_fails_naming_the_episode(tiny_model_dir):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    tokenizer, model = load_tokenizer(cfg), load_causal_lm(cfg)
    with pytest.raises(RunError, match=r"returned nothing within 0.3 s for 1 episode\(s\) \(group, sample\) \[\(0, 0\)\]"):
        run_episodes(_rows(tokenizer, 2), 0, 1, TransformersGenerator(model, tokenizer), SlowFirstEpisode(3.0),
                     tokenizer, SamplingParams(max_new_tokens=2, seed=1), max_turns=2, step_deadline=0.3)
