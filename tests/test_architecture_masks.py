"""Packed rows and shared-prompt rows against separate padded rows, for every architecture posttrain lets take
custom masks (models/packing.py VERIFIED_MASK_MODEL_TYPES), each a tiny random model built here; and the refusal
for one that is not verified."""

from pathlib import Path

import pytest
import torch
import transformers as T

from posttrain.algorithms import dpo
from posttrain.algorithms.dpo import resolve_share_prompt
from posttrain.config import load_config
from posttrain.config.schema import DPOConfig, ModelConfig, SFTConfig
from posttrain.data.collate import collate_packed, collate_padded, pack_rows
from posttrain.data.preference import collate_preference, collate_shared_prompt
from posttrain.data.types import PreferenceExample, TokenizedExample
from posttrain.errors import RunError
from posttrain.models.loading import custom_mask_problem_of, load_causal_lm
from posttrain.models.packing import VERIFIED_MASK_MODEL_TYPES, custom_mask_problem
from posttrain.workers.forward import forward_logits, token_logprobs_of

V = 64
SIZES = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
GQA = dict(SIZES, num_key_value_heads=2)
CONFIGS = {
    "llama": lambda: T.LlamaConfig(**GQA),
    "qwen2": lambda: T.Qwen2Config(**GQA),
    "qwen3": lambda: T.Qwen3Config(**GQA, head_dim=8),
    "mistral": lambda: T.MistralConfig(**GQA, sliding_window=None),
    "gemma3_text": lambda: T.Gemma3TextConfig(**GQA, head_dim=8),
    "phi3": lambda: T.Phi3Config(**GQA, pad_token_id=0),
    "gpt2": lambda: T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4),
    "granite": lambda: T.GraniteConfig(**GQA),
    "mixtral": lambda: T.MixtralConfig(**GQA, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: T.Qwen2MoeConfig(**GQA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=32),
}


def random_ids(n: int, g: torch.Generator) -> tuple[int, ...]:
    return tuple(torch.randint(1, V, (n,), generator=g).tolist())


def test_every_verified_architecture_is_tested():
    assert set(CONFIGS) == VERIFIED_MASK_MODEL_TYPES


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_packed_and_shared_prompt_rows_score_like_padded_rows(model_type, attention):
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[model_type](), attn_implementation=attention).eval()
    assert model.config.model_type == model_type
    g = torch.Generator().manual_seed(1)

    examples = [TokenizedExample(ids, (0,) + (1,) * (len(ids) - 1), "x") for ids in
                (random_ids(n, g) for n in (5, 9, 3, 12, 7))]
    padded, packed = collate_padded(examples, 0), collate_packed(examples, 0, 24)
    assert packed.input_ids.shape[0] < padded.input_ids.shape[0]
    with torch.no_grad():
        padded_lp = token_logprobs_of(forward_logits(model, padded).float(), padded)
        packed_lp = token_logprobs_of(forward_logits(model, packed).float(), packed)
    for r, row in enumerate(pack_rows([len(e.input_ids) for e in examples], 24)):
        start = 0
        for i in row:
            n = len(examples[i].input_ids)
            in_row = packed.loss_mask[r, start : start + n] > 0
            torch.testing.assert_close(packed_lp[r, start : start + n][in_row], padded_lp[i][padded.loss_mask[i] > 0],
                                       atol=1e-5, rtol=1e-5)
            start += n

    pairs = [PreferenceExample(random_ids(p, g), random_ids(c, g), random_ids(r, g), "x")
             for p, c, r in ((4, 3, 5), (7, 2, 2), (2, 6, 3))]
    scores = {}
    for name, collate in (("rows", collate_preference), ("shared", collate_shared_prompt)):
        batch = collate(pairs, 0)
        with torch.no_grad():
            scores[name] = dpo.completion_logps(token_logprobs_of(forward_logits(model, batch).float(), batch),
                                                batch, average=False)
    torch.testing.assert_close(scores["shared"].chosen, scores["rows"].chosen, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores["shared"].rejected, scores["rows"].rejected, atol=1e-5, rtol=1e-5)


def test_unverified_architectures_and_short_sliding_windows_are_refused(tmp_path: Path, tiny_model_dir):
    bloom = tmp_path / "bloom"
    T.BloomForCausalLM(T.BloomConfig(vocab_size=300, hidden_size=32, n_layer=2, n_head=4)).save_pretrained(bloom)
    T.AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(bloom)
    assert "architecture 'bloom' is not among" in custom_mask_problem_of(ModelConfig(name_or_path=str(bloom)), 64)
    window = T.MistralConfig(**GQA, sliding_window=16)
    assert "sliding window of 16 tokens" in custom_mask_problem(window, 32)
    assert custom_mask_problem(window, 16) is None
    assert custom_mask_problem(T.Qwen2Config(**GQA, sliding_window=16, use_sliding_window=False), 32) is None

    # SFT with packing stops before any weights load; DPO falls back to two rows unless share_prompt was asked for.
    common = [f"model.name_or_path={bloom}", f"output_dir={tmp_path / 'run'}", "data.max_length=32"]
    sft = load_config(SFTConfig, None, [*common, "data.train_files=['posttrain/arithmetic[:16]']", "data.packing=true"])
    from posttrain.algorithms.sft import train_sft
    with pytest.raises(RunError, match="data.packing=true would not be exact: architecture 'bloom'"):
        train_sft(sft)
    # And the forward pass itself refuses such rows, whatever calls it.
    model = load_causal_lm(ModelConfig(name_or_path=str(bloom)))
    examples = [TokenizedExample((1, 2, 3), (0, 1, 1), "x"), TokenizedExample((4, 5), (0, 1), "x")]
    with pytest.raises(RunError, match="packed or shared-prompt rows would not be exact: architecture 'bloom'"):
        forward_logits(model, collate_packed(examples, 0, 8))
    assert forward_logits(model, collate_padded(examples, 0)).shape[:2] == (2, 3)
    pairs = [*common, "data.train_files=['posttrain/arithmetic-preference[:16]']"]
    assert not resolve_share_prompt(load_config(DPOConfig, None, pairs)).shares_prompt
    with pytest.raises(RunError, match="share_prompt=true would not be exact"):
        resolve_share_prompt(load_config(DPOConfig, None, [*pairs, "share_prompt=true"]))


def test_auto_attention_picks_what_the_architecture_has(tmp_path: Path):
    bloom, llama = tmp_path / "bloom", tmp_path / "llama"
    T.BloomForCausalLM(T.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4)).save_pretrained(bloom)
    T.LlamaForCausalLM(T.LlamaConfig(**GQA)).save_pretrained(llama)
    assert ModelConfig(name_or_path="x").attn_implementation == "auto"
    assert load_causal_lm(ModelConfig(name_or_path=str(bloom))).config._attn_implementation == "eager"
    assert load_causal_lm(ModelConfig(name_or_path=str(llama))).config._attn_implementation == "sdpa"
    for explicit in ("sdpa", "flash_attention_2"):
        with pytest.raises(RunError, match=f"model.attn_implementation={explicit}: .* set model.attn_implementation=auto"):
            load_causal_lm(ModelConfig(name_or_path=str(bloom), attn_implementation=explicit))
