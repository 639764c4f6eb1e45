"""trainer.packing: padded micro-batches (SFT rows, DPO/RM pairs in both layouts, RL rollouts) run packed and give
the padded results to 1e-5 (values and gradients), for every architecture whose custom masks are verified; others
are refused by name."""

import copy
from dataclasses import dataclass

import pytest
import torch
import transformers as T

from posttrain.algorithms import dpo
from posttrain.config.schema import TrainerConfig
from posttrain.data.collate import collate_padded
from posttrain.data.preference import collate_preference, collate_shared_prompt
from posttrain.data.types import PreferenceExample, RolloutBatch, TokenizedExample
from posttrain.errors import RunError
from posttrain.workers.forward import target_mask
from posttrain.workers.local import LocalPolicyWorker, LocalScoringWorker
from posttrain.workers.packed import pack_batch
from posttrain.workers.metrics import Metric
from posttrain.workers.value import ValueWorker
from test_architecture_masks import CONFIGS, SIZES, V, random_ids


def examples(g, lengths=(5, 11, 3, 8, 2)):
    return [TokenizedExample(ids, (0,) * 2 + (1,) * (len(ids) - 2), "x") for ids in
            (random_ids(n, g) for n in lengths)]


def pairs(g):
    return [PreferenceExample(random_ids(p, g), random_ids(c, g), random_ids(r, g), "x")
            for p, c, r in ((4, 3, 5), (9, 2, 2), (2, 6, 3), (3, 1, 1), (2, 2, 2))]  # the last two share a row


def rollouts(g, lengths=(6, 12, 4, 9)):
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    loss_mask = torch.zeros(len(lengths), width)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.tensor(random_ids(n, g))
        loss_mask[row, 3:n] = 1.0  # a 3-token prompt, then sampled tokens
    n = len(lengths)
    return RolloutBatch(ids, (torch.arange(width) < torch.tensor(lengths)[:, None]).long(), loss_mask,
                        torch.zeros(n, width), torch.zeros(n), {}, torch.ones(n, dtype=torch.bool),
                        torch.arange(n), torch.zeros(n, dtype=torch.bool), torch.tensor(lengths) - 3)


def batches(g):
    return {"sft": collate_padded(examples(g), 0), "pair_rows": collate_preference(pairs(g), 0),
            "shared_prompt": collate_shared_prompt(pairs(g), 0), "rollout": rollouts(g)}


def policy(model, **trainer):
    return LocalPolicyWorker(copy.deepcopy(model), None, TrainerConfig(micro_batch_size=8, **trainer))


@dataclass(frozen=True)
class SumOfTargets:
    """The summed target log-probabilities of a batch over a fixed normalizer of 10 (a loss description)."""

    outputs: str = "target_logprobs"
    temperature: float = 1.0

    def normalizer(self, micro_batches) -> float:
        return 10.0

    def __call__(self, outputs, batch, normalizer):
        logprobs = outputs.logprobs if hasattr(outputs, "logprobs") else outputs
        return -(logprobs * target_mask(batch)).sum() / (normalizer or 10.0), {}


@dataclass(frozen=True)
class TargetEntropies:
    """Evaluation only: the entropy at every target position, one metric each (entropy/0, entropy/1, ...)."""

    outputs: str = "target_scores"
    temperature: float = 1.0

    def normalizer(self, micro_batches) -> float:
        return 1.0

    def __call__(self, scores, batch, normalizer):
        return torch.zeros(()), {f"entropy/{i}": Metric.sum(value)
                                 for i, value in enumerate(scores.entropy[target_mask(batch)])}


def target_entropies(metrics) -> torch.Tensor:
    """The entropies TargetEntropies reported, in target order."""
    count = sum(name.startswith("entropy/") for name in metrics)
    return torch.tensor([metrics[f"entropy/{i}"].value for i in range(count)])


def minibatch(batch):
    """A batch as forward_backward takes it: a rollout batch whole (the worker splits it), others as the step's
    one micro-batch."""
    return batch if isinstance(batch, RolloutBatch) else [batch]


def test_the_packed_layout_fits_rows_no_wider_than_the_widest():
    g = torch.Generator().manual_seed(0)
    batch = collate_padded(examples(g, (5, 11, 3, 8, 2)), 0)
    packed = pack_batch(batch)
    assert packed.input_ids.shape == (3, 11)  # 11 | 8 + 3 | 5 + 2
    real = batch.attention_mask > 0
    assert torch.equal(packed.gather(packed.input_ids)[real], batch.input_ids[real])
    assert torch.equal(packed.gather(packed.position_ids)[real], batch.position_ids[real])
    assert torch.equal(packed.gather(packed.blocks)[real], torch.arange(5)[:, None].expand(5, 11)[real])


@pytest.mark.parametrize("lm_head", ["full", "chunked"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_batches_give_the_padded_logprobs_entropies_and_gradients(attention, lm_head):
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(T.LlamaConfig(**SIZES), attn_implementation=attention)
    g = torch.Generator().manual_seed(1)
    for name, batch in batches(g).items():
        assert pack_batch(batch).input_ids.shape[0] < batch.input_ids.shape[0], name  # rows do share rows
        results = {}
        for packing in (False, True):
            worker = policy(model, packing=packing, lm_head=lm_head, lm_head_chunk_size=5)
            targets = target_mask(batch)
            logprobs = worker.logprobs(batch, temperature=0.7)
            worker.forward_backward(minibatch(batch), SumOfTargets())
            grads = [p.grad.clone() for p in worker.model.parameters()]
            entropies = target_entropies(worker.evaluate(batch, TargetEntropies()))
            assert len(entropies) == int(targets.sum()), name
            results[packing] = logprobs[targets], entropies, grads
        (lp, entropy, grads), (packed_lp, packed_entropy, packed_grads) = results[False], results[True]
        torch.testing.assert_close(packed_lp, lp, atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(packed_entropy, entropy, atol=1e-5, rtol=1e-5, msg=name)
        for a, b in zip(packed_grads, grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_pairs_give_the_padded_completion_scores():
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(T.LlamaConfig(**SIZES)).eval()
    g = torch.Generator().manual_seed(2)
    data = pairs(g)
    for collate in (collate_preference, collate_shared_prompt):
        batch = collate(data, 0)
        scored = [dpo.completion_logps(LocalScoringWorker(model, TrainerConfig(packing=packing)).logprobs(batch),
                                       batch, average=False) for packing in (False, True)]
        torch.testing.assert_close(scored[1].chosen, scored[0].chosen, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(scored[1].rejected, scored[0].rejected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_every_verified_architecture_packs_exactly(model_type):
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[model_type](), attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(3)
    for name in ("shared_prompt", "rollout"):
        batch = batches(g)[name]
        assert pack_batch(batch).input_ids.shape[0] < batch.input_ids.shape[0], name
        padded, packed = (LocalScoringWorker(model, TrainerConfig(packing=packing)).logprobs(batch)
                          for packing in (False, True))
        targets = target_mask(batch)
        torch.testing.assert_close(packed[targets], padded[targets], atol=1e-5, rtol=1e-5, msg=name)


def test_packed_reward_model_scores_are_read_where_the_classifier_pools():
    torch.manual_seed(0)
    model = T.AutoModelForSequenceClassification.from_config(T.LlamaConfig(**SIZES, num_labels=1, pad_token_id=0))
    g = torch.Generator().manual_seed(4)
    rows = examples(g)
    # A real last token equal to the pad id: the classifier reads the token before it, and so must packing.
    rows[1] = TokenizedExample(rows[1].input_ids[:-1] + (0,), rows[1].loss_mask, "x")
    batch = collate_padded(rows, 0)
    assert pack_batch(batch).input_ids.shape[0] < batch.input_ids.shape[0]
    padded, packed = (LocalScoringWorker(model, TrainerConfig(packing=packing), role="reward").sequence_scores(batch)
                      for packing in (False, True))
    assert padded.shape == (5,)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)


def test_packed_critic_values_match_the_padded_ones_up_to_the_bootstrap_position():
    torch.manual_seed(0)
    model = T.AutoModelForSequenceClassification.from_config(T.LlamaConfig(**SIZES, num_labels=1, pad_token_id=0))
    batch = rollouts(torch.Generator().manual_seed(5))
    assert pack_batch(batch).input_ids.shape[0] < batch.input_ids.shape[0]
    padded, packed = (ValueWorker(copy.deepcopy(model), None, TrainerConfig(packing=packing)).values(batch)
                      for packing in (False, True))
    # V(s_t) for t = 1 .. length: every state an episode passes through, the one after its last token included.
    read = torch.arange(batch.input_ids.shape[1]) <= batch.attention_mask.sum(-1, keepdim=True)
    read[:, 0] = False
    torch.testing.assert_close(packed[read], padded[read], atol=1e-5, rtol=1e-5)


def test_packing_is_refused_by_name_for_an_unverified_architecture():
    config = T.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    for build in (lambda trainer: LocalScoringWorker(model, trainer), lambda trainer: LocalPolicyWorker(model, None, trainer)):
        with pytest.raises(RunError, match="trainer.packing=true would not be exact: architecture 'bloom'"):
            build(TrainerConfig(packing=True))
    worker = LocalScoringWorker(model, TrainerConfig(packing=False))
    worker.trainer = TrainerConfig(packing=True)  # the forward pass's own guard, past construction
    with pytest.raises(RunError, match="trainer.packing=true would not be exact: architecture 'bloom'"):
        worker.logprobs(batches(torch.Generator().manual_seed(6))["rollout"])


def test_dpo_rm_and_ppo_train_alike_packed(tmp_path, tiny_model_dir, monkeypatch):
    # The recipes' workers (policy, reference, reward model, critic) pack every padded micro-batch: the same
    # losses step by step, to float32 rounding. The rows' lengths spread 4-fold, so rows do share packed rows.
    import json
    import random

    import posttrain.workers.packed as packed_module
    import posttrain.workers.value as value_module
    from posttrain.algorithms.dpo import train_dpo
    from posttrain.algorithms.ppo import train_ppo
    from posttrain.algorithms.rm import train_rm
    from posttrain.config import DPOConfig, RMConfig, load_config
    from posttrain.config.schema import PPOConfig
    from posttrain.logging import read_metrics
    from rl_configs import DIGITS, TINY_RL
    from test_dpo import BASE as DPO_BASE
    from test_rm import BASE as RM_BASE

    def records(directory, key):
        return [r[key] for r in read_metrics(directory / "metrics.jsonl") if key in r]

    rng = random.Random(0)

    def text(low, high):
        return "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(low, high)))

    pairs_file, prompts_file = tmp_path / "pairs.jsonl", tmp_path / "prompts.jsonl"
    pairs_file.write_text("".join(json.dumps({"prompt": text(2, 12), "chosen": text(1, 8) + "1",
                                              "rejected": text(1, 8) + "2"}) + "\n" for _ in range(64)))
    prompts_file.write_text("".join(json.dumps({"prompt": text(2, 20)}) + "\n" for _ in range(64)))
    shared_rows = []
    original = packed_module.pack_batch

    def spy(batch):
        layout = original(batch)
        shared_rows.append(layout.input_ids.shape[0] < batch.input_ids.shape[0])
        return layout

    monkeypatch.setattr(packed_module, "pack_batch", spy)
    monkeypatch.setattr(value_module, "pack_batch", spy)
    runs = {
        "dpo": (train_dpo, DPOConfig, [*DPO_BASE, f"data.train_files=['{pairs_file}']", "trainer.max_steps=3"]),
        "rm": (train_rm, RMConfig, [*RM_BASE, f"data.train_files=['{pairs_file}']", "trainer.max_steps=3"]),
        "ppo": (train_ppo, PPOConfig, [*TINY_RL, *DIGITS, f"data.train_files=['{prompts_file}']",
                                       "critic.learning_rate=1e-3", "trainer.max_steps=2", "rollout.temperature=0.8"]),
    }
    for name, (train, schema, overrides) in runs.items():
        for packing in (False, True):
            shared_rows.clear()
            train(load_config(schema, None, [*overrides, f"output_dir={tmp_path / name / str(packing)}",
                                             f"trainer.packing={str(packing).lower()}"]))
            assert any(shared_rows) == packing, name  # packing on: some micro-batch did pack rows together
        rl_keys = ("value/loss", "value/mean", "entropy", "reward/mean") if name == "ppo" else ()
        for key in ("loss", "grad_norm", *rl_keys):
            padded, packed = (records(tmp_path / name / str(packing), key) for packing in (False, True))
            assert len(padded) == (2 if name == "ppo" else 3), (name, key)
            assert packed == pytest.approx(padded, rel=1e-4, abs=1e-5), (name, key)


@pytest.mark.parametrize("packing", [False, True])
def test_chunked_topk_is_the_full_topk_at_the_positions_that_predict_a_target(packing):
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(T.LlamaConfig(**SIZES)).eval()
    g = torch.Generator().manual_seed(7)
    for name, batch in batches(g).items():
        full_values, full_ids = LocalScoringWorker(model, TrainerConfig(lm_head="full")).topk_logprobs(
            batch, k=4, temperature=0.8)
        values, ids = LocalScoringWorker(model, TrainerConfig(lm_head="chunked", lm_head_chunk_size=3,
                                                              packing=packing)).topk_logprobs(batch, k=4,
                                                                                               temperature=0.8)
        rows, columns = target_mask(batch).nonzero(as_tuple=True)
        sources = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
        sources[rows, columns - 1] = True
        if name == "shared_prompt":  # the first rejected token is predicted from the prompt's last position
            sources[torch.arange(len(batch.prompt_ends)), batch.rejected_starts - 1] = False
            sources[torch.arange(len(batch.prompt_ends)), batch.prompt_ends] = True
        torch.testing.assert_close(values[sources], full_values[sources], atol=1e-5, rtol=1e-5, msg=name)
        assert torch.equal(ids[sources], full_ids[sources]), name
        assert (values[~sources] == 0).all() and (ids[~sources] == 0).all(), name


def test_compile_is_refused_where_it_is_not_available():
    from posttrain.config import ConfigError, load_config
    from posttrain.config.schema import GRPOConfig
    from posttrain.distributed.fsdp import FSDP2PolicyWorker, FSDP2ScoringWorker
    from rl_configs import TINY_RL

    from posttrain.config.schema import SFTConfig

    with pytest.raises(ConfigError, match="trainer.compile=true is not available to the RL recipes"):
        load_config(GRPOConfig, None, [*TINY_RL, "output_dir=unused", "trainer.compile=true"])
    sft = ["model.name_or_path=posttrain/tiny", "data.train_files=['posttrain/arithmetic']", "trainer.compile=true"]
    load_config(SFTConfig, None, sft)
    with pytest.raises(ConfigError, match="trainer.compile=true cannot be combined with evaluation sets"):
        load_config(SFTConfig, None, [*sft, "evaluation=[{name: a, data: {files: ['posttrain/arithmetic']}}]"])
    model = T.AutoModelForCausalLM.from_config(T.LlamaConfig(**SIZES))
    for build in (lambda: FSDP2PolicyWorker(model, None, TrainerConfig(compile=True)),
                  lambda: FSDP2ScoringWorker(model, TrainerConfig(compile=True))):
        with pytest.raises(RunError, match="trainer.compile=true is not available with several processes"):
            build()


@pytest.mark.slow
@pytest.mark.parametrize("lm_head", ["full", "chunked"])
def test_a_compiled_policy_computes_what_an_eager_one_does(lm_head):
    # trainer.compile compiles the module in place: the same losses and gradients (to float32 rounding, inductor
    # reorders some reductions), the chunked head's identity-head pass included, and unchanged parameter names.
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(T.LlamaConfig(**SIZES))
    g = torch.Generator().manual_seed(8)
    # Two shapes: dynamic, not one graph per shape.
    data = [collate_padded(examples(g, lengths), 0) for lengths in ((5, 11, 3, 8, 2), (7, 4, 9, 13, 6))]
    results = {}
    for compiled in (False, True):
        worker = policy(model, compile=compiled, lm_head=lm_head, lm_head_chunk_size=5)
        losses = []
        for batch in data:
            losses.append(worker.forward_backward([batch], SumOfTargets())["loss"])
        results[compiled] = [float(loss.total) for loss in losses], [p.grad.clone() for p in worker.model.parameters()]
        assert set(worker.model.state_dict()) == set(model.state_dict())
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-5, abs=1e-6)
    for a, b in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_flash_attention_gets_packed_rows_as_one_row():
    # transformers' flash-attention-2 path finds example boundaries from position ids only in a batch of one row:
    # packed rows are laid end to end for the call, and the outputs cut back into rows.
    from types import SimpleNamespace

    from posttrain.workers.forward import call_with_positions

    calls = []

    class Recorder(torch.nn.Module):
        config = SimpleNamespace(_attn_implementation="flash_attention_2")

        def forward(self, input_ids, position_ids, attention_mask=None, use_cache=False):
            calls.append((tuple(input_ids.shape), position_ids.clone(), attention_mask))
            return SimpleNamespace(logits=input_ids.float()[..., None].expand(*input_ids.shape, 3))

    ids = torch.arange(12).view(2, 6)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    out = call_with_positions(Recorder(), ids, positions, None)
    assert calls[0][0] == (1, 12) and calls[0][2] is None
    assert torch.equal(calls[0][1], positions.view(1, -1))
    assert out.shape == (2, 6, 3) and torch.equal(out[..., 0], ids.float())
    call_with_positions(Recorder(), ids, positions, torch.ones(2, 1, 6, 6, dtype=torch.bool))  # a mask: rows as given
    assert calls[1][0] == (2, 6)
