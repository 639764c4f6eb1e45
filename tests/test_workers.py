"""The worker seam: metrics that carry their reduction, and the local workers' state round trips."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.config.schema import LoraSection, ModelConfig, TrainerConfig
from posttrain.data.collate import collate_padded
from posttrain.data.types import TokenizedExample
from posttrain.models.loading import load_tokenizer
from posttrain.workers import Metric, as_floats, reduce_metrics
from posttrain.workers.local import LocalScoringWorker, build_policy, load_weights
from posttrain.workers.objectives import NLLObjective


def test_each_metric_reduces_its_own_way():
    # Two micro-batches: a loss already divided by the step's count adds up; a per-token mean over 3 and 1 tokens
    # is (0.5 * 3 + 2.0 * 1) / 4 = 0.875, not (0.5 + 2.0) / 2; extremes stay extremes.
    records = [
        {"loss": Metric.sum(0.25), "entropy": Metric.mean(0.5, 3), "ratio_min": Metric.min(0.9), "ratio_max": Metric.max(1.1)},
        {"loss": Metric.sum(0.5), "entropy": Metric.mean(2.0, 1), "ratio_min": Metric.min(0.7), "ratio_max": Metric.max(1.05)},
    ]
    assert as_floats(reduce_metrics(records)) == {"loss": 0.75, "entropy": 0.875, "ratio_min": 0.7, "ratio_max": 1.1}
    # Folding in two halves and then together gives the same as folding all four at once.
    halves = [reduce_metrics(records[:1]), reduce_metrics(records[1:])]
    assert as_floats(reduce_metrics(halves)) == as_floats(reduce_metrics(records))
    with pytest.raises(ValueError, match="cannot merge"):
        Metric.sum(1.0).merge(Metric.mean(1.0))
    assert Metric.mean(3.0, 0.0).value == 0.0  # nothing counted: no division by zero


def _batch(tokenizer) -> object:
    rows = [TokenizedExample(tuple(range(3, 3 + n)), (0,) + (1,) * (n - 1)) for n in (4, 9, 6)]
    return collate_padded(rows, tokenizer.pad_token_id)


def test_policy_save_and_load_restore_weights_and_optimizer(tmp_path, tiny_model_dir):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(cfg)
    trainer = TrainerConfig(learning_rate=1e-2)
    device = torch.device("cpu")
    policy = build_policy(cfg, LoraSection(), trainer, tokenizer, device)
    batch = _batch(tokenizer)
    nll = NLLObjective()

    policy.forward_backward([batch], nll)
    policy.optim_step()
    policy.save(tmp_path / "policy")
    restored = build_policy(cfg, LoraSection(), trainer, tokenizer, device, resume_dir=tmp_path / "policy")
    for (name, a), (_, b) in zip(policy.named_weights(), restored.named_weights()):
        assert torch.equal(a, b), name
    # One more identical update from both: the AdamW moments and the schedule came back too.
    for worker in (policy, restored):
        worker.forward_backward([batch], nll)
    assert policy.optim_step() == restored.optim_step()
    assert policy.logprobs(batch).equal(restored.logprobs(batch))


def test_load_weights_names_what_does_not_fit(tmp_path, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_weights(model, tmp_path / "empty")
    from safetensors.torch import save_file

    (tmp_path / "other").mkdir()
    save_file({"not.a.weight": torch.zeros(2)}, tmp_path / "other" / "model.safetensors")
    with pytest.raises(ValueError, match="does not match the model"):
        load_weights(model, tmp_path / "other")


def test_lora_named_weights_are_the_merged_model_and_training_goes_on(tiny_model_dir):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(cfg)
    lora = LoraSection(enabled=True, r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    policy = build_policy(cfg, lora, TrainerConfig(learning_rate=5e-2), tokenizer, torch.device("cpu"))
    batch = _batch(tokenizer)

    for _ in range(2):  # move the adapters off zero
        policy.forward_backward([batch], NLLObjective())
        policy.optim_step()
    merged = dict(policy.named_weights())
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert set(merged) == set(plain.state_dict())  # Hugging Face names, no adapter tensors
    plain.load_state_dict(merged)
    with torch.no_grad():
        expected = policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        got = plain(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert any(not torch.equal(merged[n], t) for n, t in AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().items())
    adapters = dict(policy.named_weights(adapters_only=True))
    assert adapters and all("lora_" in name for name in adapters)
    # The base the reference scores is still the unmerged, frozen one.
    base = policy.base_model_scorer().logprobs(batch)
    frozen = LocalScoringWorker(AutoModelForCausalLM.from_pretrained(tiny_model_dir), policy.trainer).logprobs(batch)
    torch.testing.assert_close(base, frozen, atol=1e-6, rtol=0)


def test_scorer_topk_and_sequence_scores(tiny_model_dir):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(cfg)
    scorer = LocalScoringWorker(AutoModelForCausalLM.from_pretrained(tiny_model_dir), TrainerConfig())
    batch = _batch(tokenizer)
    values, indices = scorer.topk_logprobs(batch, k=3)
    assert values.shape == indices.shape == (*batch.input_ids.shape, 3)
    assert (values[..., 0] >= values[..., 1]).all() and (values <= 0).all()
    # The top token at position t is the argmax of the logits that predict token t + 1.
    with torch.no_grad():
        logits = scorer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert torch.equal(indices[..., 0], logits.argmax(-1))
    # logprobs(t) reads the distribution at t - 1: where that token is the top one, the two agree.
    logps = scorer.logprobs(batch)
    top_of_previous = values[:, :-1, 0]
    hit = indices[:, :-1, 0] == batch.input_ids[:, 1:]
    torch.testing.assert_close(logps[:, 1:][hit], top_of_previous[hit])


def test_micro_batches_never_wait_for_the_device(tiny_model_dir, monkeypatch):
    # Reading a tensor back to Python (item, float, bool, tolist, ...) waits for the device on a GPU. posttrain's
    # own code must not do it per micro-batch: metrics stay tensors until the step's end. Spied here on every
    # such call made from posttrain's source, through SFT, DPO and GRPO micro-batches. The one exception is the
    # step's normalizer, which the worker counts on the minibatch's CPU tensors before any micro-batch moves to
    # the device (the objectives' `normalizer`).
    import os
    import sys

    import posttrain
    from posttrain.algorithms.dpo import Reference, reference_inputs
    from posttrain.data.preference import collate_shared_prompt
    from posttrain.data.types import PreferenceExample, RolloutBatch
    from posttrain.losses.policy_gradient import PolicyLossConfig
    from posttrain.losses.preference import PreferenceLossConfig
    from posttrain.workers.objectives import PolicyGradientObjective, PreferenceObjective

    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(cfg)
    # Two rows per micro-batch: the rollout minibatch below is two micro-batches.
    policy = build_policy(cfg, LoraSection(), TrainerConfig(micro_batch_size=2), tokenizer, torch.device("cpu"))
    sft_batch = _batch(tokenizer)
    pairs = collate_shared_prompt([PreferenceExample((5, 6, 7), (8, 9, 2), (10, 2)),
                                   PreferenceExample((5, 11), (12, 2), (13, 14, 2))], tokenizer.pad_token_id)
    pair_batch = reference_inputs(Reference(table=torch.tensor([[-3.0, -4.0], [-2.0, -5.0]])), False)(pairs, [0, 1])
    ids = torch.tensor([[5, 6, 7, 8, 2], [5, 9, 10, 2, 0], [5, 6, 7, 8, 2], [5, 9, 10, 2, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 1, 1, 0]]).float()
    rollouts = RolloutBatch(ids, (ids != 0).long(), mask, torch.full((4, 5), -5.0) * mask,
                            torch.tensor([1.0, 0.0, 1.0, 0.0]), {}, torch.ones(4, dtype=torch.bool),
                            torch.tensor([0, 0, 1, 1]), torch.zeros(4, dtype=torch.bool), torch.tensor([3, 2, 3, 2]),
                            advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                            old_logprobs=torch.full((4, 5), -5.0) * mask)
    pg_loss = PolicyGradientObjective(PolicyLossConfig(importance_correction="tis"), temperature=0.9)

    # posttrain's own source files, by the package's location: not by "posttrain" in the path, which a checkout
    # in a folder named posttrain shares with every library file of its .venv.
    source_dir = os.path.dirname(posttrain.__file__) + os.sep
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "nonzero"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(source_dir) and not _in_normalizer(sys._getframe(1)):
                reads.append((_name, caller, sys._getframe(1).f_lineno))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    records = [policy.forward_backward([sft_batch], NLLObjective()),
               policy.forward_backward([pair_batch], PreferenceObjective(PreferenceLossConfig())),
               policy.forward_backward(rollouts, pg_loss)]
    monkeypatch.undo()
    assert reads == []
    # ...and the step's metrics are all there, read back at once.
    values = as_floats(reduce_metrics(records))
    assert {"loss", "nll_sum", "reward_accuracy", "margin", "entropy", "ratio_max", "is_raw_weight_min"} <= set(values)
    assert all(isinstance(v, float) for v in values.values()) and values["loss"] > 0


def _in_normalizer(frame) -> bool:
    """Whether `frame` runs inside an objective's `normalizer` (the step's count, taken on CPU tensors)."""
    while frame is not None:
        if frame.f_code.co_name == "normalizer" and frame.f_code.co_filename.endswith("objectives.py"):
            return True
        frame = frame.f_back
    return False


def _rollouts(rows: int = 5) -> object:
    """`rows` episodes of different lengths with per-episode advantages and slightly off-policy π_old."""
    from dataclasses import replace

    from posttrain.data.types import RolloutBatch

    g = torch.Generator().manual_seed(3)
    width = 9
    lengths = torch.tensor([9, 5, 7, 4, 8, 6, 9, 5][:rows])
    ids = torch.randint(3, 200, (rows, width), generator=g) * (torch.arange(width) < lengths[:, None])
    attention = (torch.arange(width) < lengths[:, None]).long()
    loss_mask = ((torch.arange(width) >= 2) & (torch.arange(width) < lengths[:, None])).float()
    batch = RolloutBatch(ids, attention, loss_mask, torch.zeros(rows, width), torch.zeros(rows), {},
                         torch.ones(rows, dtype=torch.bool), torch.arange(rows), torch.zeros(rows, dtype=torch.bool),
                         loss_mask.sum(-1).long())
    return replace(batch, advantages=torch.randn(rows, generator=g),
                   old_logprobs=-5.0 + 0.1 * torch.randn(rows, width, generator=g) * loss_mask)


def test_micro_batches_of_divides_a_rollout_minibatch_evenly_over_ranks():
    from posttrain.workers.local import micro_batches_of

    batch = _rollouts(5)
    assert [len(piece) for piece in micro_batches_of(batch, 2, ranks=1)] == [2, 2, 1]
    assert [len(piece) for piece in micro_batches_of(batch, 2, ranks=2)] == [2, 1, 1, 1]  # 4 pieces: 2 per rank
    assert [len(piece) for piece in micro_batches_of(batch, 8, ranks=1)] == [5]
    pieces = micro_batches_of(batch, 2, ranks=1)
    assert torch.equal(torch.cat([piece.advantages for piece in pieces]), batch.advantages)  # rows keep their inputs
    assert torch.equal(torch.cat([piece.old_logprobs for piece in pieces]), batch.old_logprobs)
    collated = [_rollouts(2), _rollouts(3)]
    assert micro_batches_of(collated, 1, ranks=1) == collated  # collated micro-batches are taken as given


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_a_rollout_minibatch_gives_one_loss_and_gradient_however_the_worker_splits_it(tiny_model_dir, aggregation):
    # The worker normalizes the policy-gradient loss over the whole minibatch, so 5, 2 or 1 micro-batches of it
    # accumulate the same loss, metrics and gradients.
    from posttrain.losses.policy_gradient import PolicyLossConfig
    from posttrain.workers.objectives import PolicyGradientObjective

    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(cfg)
    batch = _rollouts(5)
    loss = PolicyGradientObjective(PolicyLossConfig(aggregation=aggregation), temperature=0.8)
    results = {}
    for micro_batch_size in (1, 3, 8):
        torch.manual_seed(0)
        policy = build_policy(cfg, LoraSection(), TrainerConfig(micro_batch_size=micro_batch_size), tokenizer,
                              torch.device("cpu"))
        passes = []
        policy.model.register_forward_hook(lambda module, args, output: passes.append(1))
        metrics = as_floats(policy.forward_backward(batch, loss))
        results[micro_batch_size] = (len(passes), metrics,
                                     {name: p.grad.clone() for name, p in policy.model.named_parameters()})
    assert [results[size][0] for size in (1, 3, 8)] == [5, 2, 1]  # the splits do differ
    _, whole, whole_grads = results[8]
    assert abs(whole["loss"]) > 1e-3
    for size in (1, 3):
        _, metrics, grads = results[size]
        assert metrics.keys() == whole.keys()
        for key, value in whole.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (size, key)
        for name, grad in whole_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=f"{size} {name}")


def test_evaluate_gives_the_training_loss_of_one_micro_batch_without_a_graph(tiny_model_dir):
    from posttrain.losses.policy_gradient import PolicyLossConfig
    from posttrain.workers.objectives import PolicyGradientObjective

    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(cfg)
    policy = build_policy(cfg, LoraSection(), TrainerConfig(), tokenizer, torch.device("cpu"))
    batch = _rollouts(4)
    loss = PolicyGradientObjective(PolicyLossConfig(), temperature=0.8)
    evaluated = as_floats(policy.evaluate(batch, loss))
    assert all(p.grad is None for p in policy.model.parameters()) and policy.model.training  # no graph, mode back
    trained = as_floats(policy.forward_backward(batch, loss))
    assert evaluated.keys() == trained.keys()
    for key, value in trained.items():
        assert evaluated[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_evaluate_reports_the_mean_nll_per_target_token(tiny_model_dir):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(cfg)
    policy = build_policy(cfg, LoraSection(), TrainerConfig(), tokenizer, torch.device("cpu"))
    metrics = as_floats(policy.evaluate(_batch(tokenizer), NLLObjective()))
    assert metrics["target_tokens"] > 1
    assert metrics["loss"] == pytest.approx(metrics["nll_sum"] / metrics["target_tokens"], rel=1e-6)


def test_a_pair_batch_moves_to_the_device_whole():
    # The meta device stands in for a GPU: batch_to leaves batches alone only on the CPU.
    from posttrain.data.preference import collate_shared_prompt
    from posttrain.data.types import PairBatch, PreferenceExample
    from posttrain.workers.forward import batch_to

    rows = collate_shared_prompt([PreferenceExample((5, 6, 7), (8, 9, 2), (10, 2))], 0)
    moved = batch_to(PairBatch(rows, torch.tensor([-3.0]), torch.tensor([-4.0])), torch.device("meta"))
    assert moved.reference_chosen_logps.device.type == "meta"
    assert moved.rows.input_ids.device.type == "meta" and moved.rows.chosen_mask.device.type == "meta"
