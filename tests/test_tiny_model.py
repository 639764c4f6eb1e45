import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.models.loading import resolve_model_path
from posttrain.models.tiny import EMBEDDED_MODELS, build_model, build_tokenizer

SAMPLES = [
    "what is 12+3",
    "  leading and trailing spaces  ",
    "héllo wörld — 日本語 • emoji 🙂🚀\n\ttabs\r\nand CRLF",
    "code: def f(x):\n    return x ** 2  # comment",
    "special-looking <|im_start|> text",
    "\x00\x07 control bytes \u200b zero width",
]


def test_roundtrip_after_save_and_autotokenizer_reload(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.unk_token_id is None
    for text in SAMPLES:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    # Byte-level: digits are single tokens, and token id i is byte i.
    assert tokenizer("12+34=", add_special_tokens=False)["input_ids"] == list(b"12+34=")


def test_reloaded_tokenizer_matches_the_built_one(tiny_model_dir):
    built, reloaded = build_tokenizer(), AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in SAMPLES:
        assert built(text)["input_ids"] == reloaded(text)["input_ids"]
    assert (reloaded.eos_token, reloaded.pad_token) == ("<|endoftext|>", "<|pad|>")
    assert reloaded.eos_token_id != reloaded.pad_token_id


def test_chat_template():
    tokenizer = build_tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_model_loads_with_automodel_and_is_small(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "llama"
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 3_000_000
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, len(build_tokenizer()))


def test_build_is_deterministic_and_does_not_touch_global_rng():
    tokenizer = build_tokenizer()
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(EMBEDDED_MODELS["posttrain/tiny"], tokenizer)
    after = torch.rand(1)
    b = build_model(EMBEDDED_MODELS["posttrain/tiny"], tokenizer)
    assert torch.equal(before, after)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name


def test_embedded_name_resolves_and_other_names_pass_through(tiny_model_dir):
    assert resolve_model_path("posttrain/tiny") == str(tiny_model_dir)
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"


def test_the_large_vocabulary_benchmark_model_has_qwen_like_shapes():
    tokenizer = build_tokenizer()
    with torch.device("meta"):  # shapes only: the real build writes 89M parameters
        model = build_model(EMBEDDED_MODELS["posttrain/bench-vocab152k"], tokenizer)
    config = model.config
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (151_936, 512, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (8, 2, 1408)
    assert config.tie_word_embeddings and model.get_output_embeddings().weight.shape == (151_936, 512)
    assert len(tokenizer) < config.vocab_size  # every id the tokenizer writes fits
    assert 85e6 < sum(p.numel() for p in model.parameters()) < 95e6
    # The small models keep the tokenizer's vocabulary and full KV heads (their cached builds stay valid).
    with torch.device("meta"):
        tiny = build_model(EMBEDDED_MODELS["posttrain/tiny"], tokenizer)
    assert tiny.config.vocab_size == len(tokenizer) and tiny.config.num_key_value_heads == 4


def test_the_bpe_teacher_tokenizer_is_deterministic_round_trips_and_merges_digits():
    from posttrain.models.tiny import build_bpe_tokenizer, ensure_embedded_model

    first, second = build_bpe_tokenizer(), build_bpe_tokenizer()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()  # training is deterministic
    folder = ensure_embedded_model("posttrain/tiny-bpe")
    reloaded = AutoTokenizer.from_pretrained(folder)
    for text in [*SAMPLES, "26+84=110"]:
        ids = reloaded(text, add_special_tokens=False)["input_ids"]
        assert reloaded.decode(ids) == text
        assert ids == first(text, add_special_tokens=False)["input_ids"]
    assert reloaded.convert_ids_to_tokens(reloaded("69+72=141")["input_ids"]) == [
        "6", "9", "+", "7", "2", "=", "14", "1"]
    assert (reloaded.eos_token, reloaded.pad_token, reloaded.chat_template) == ("<|endoftext|>", "<|pad|>",
                                                                               build_tokenizer().chat_template)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.model_type == "llama" and model.config.vocab_size == len(reloaded) == 280


def test_a_chat_turn_ends_at_im_end(tiny_model_dir):
    """The embedded model's generation_config ends a completion at <|im_end|> (the end of a chat turn) as well as
    at <|endoftext|>: a model that answers `<|im_end|>` stops there instead of running to the token budget."""
    from posttrain.generation.base import SamplingParams
    from posttrain.generation.transformers_backend import TransformersGenerator

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    eos = model.generation_config.eos_token_id
    # A head whose every logit favours <|im_end|>: the greedy completion is that token, then nothing.
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    torch.nn.init.zeros_(head.weight)
    with torch.no_grad():
        head.bias.copy_(torch.nn.functional.one_hot(torch.tensor(im_end), model.config.vocab_size).float())
    model.lm_head = head
    text = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    [[completion]] = TransformersGenerator(model, tokenizer).generate(
        [prompt], SamplingParams(max_new_tokens=8, temperature=0.0)).completions
    assert completion.token_ids == [im_end] and completion.finish_reason != "length"
    assert set(eos if isinstance(eos, list) else [eos]) == {tokenizer.eos_token_id, im_end}
    assert EMBEDDED_MODELS["posttrain/tiny"].version >= 2  # the cached v1 builds lack it: a new cache entry
