"""The embedded tiny models: built offline, deterministically, as real Hugging Face directories.

`posttrain/tiny` is a ~1M-parameter Llama-architecture causal LM with a byte-level tokenizer.
Every UTF-8 string tokenizes (256 byte tokens, no unknown token), digits are single tokens
(which is what lets so small a model learn arithmetic), and the tokenizer carries a ChatML
chat template so conversational datasets work too.

`posttrain/tiny-bpe` is the same architecture with ANOTHER tokenizer, for cross-tokenizer distillation: a byte-level
BPE with 20 merges trained with the `tokenizers` library on the text of every 2-digit addition ("26+84=110"), so
the most frequent digit pairs merge ("26+84=110" -> 2|6|+|8|4|=|1|10, "69+72=141" -> 6|9|+|7|2|=|14|1) while every
byte still tokenizes. Its ids differ from the
byte-level tokenizer's (the special tokens come first); the special tokens and the chat template are the same.

The directory is built on first use under the cache directory (``POSTTRAIN_CACHE_DIR`` or the
user cache dir) in a temporary folder that is renamed into place, so a build interrupted at any
point never leaves a half-written model behind. Building takes about a second.

Why Llama and not Qwen2: transformers 5 maps ``model_type: qwen2`` to its own ``Qwen2Tokenizer``
whatever ``tokenizer_config.json`` says, which would replace this tokenizer's pre-tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import platformdirs
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, IM_START, IM_END)

# ChatML. The assistant's turn ends with <|im_end|>, which is therefore a training target.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Architecture of one embedded model. Bump `version` whenever the build changes."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int = 512
    seed: int = 0
    version: int = 2
    """2: generation_config.json ends a completion on <|im_end|> too (the end of a chat turn)."""
    num_key_value_heads: int | None = None
    """Grouped KV heads; None: as many as attention heads."""
    vocab_size: int | None = None
    """The LM head's size; None: the byte-level tokenizer's. A larger one gives a real model's LM-head cost (the
    tokenizer's ids all fit; the ids above them are never produced by it)."""
    tokenizer: Literal["bytes", "bpe-arithmetic"] = "bytes"
    """bytes: the byte-level tokenizer (build_tokenizer); bpe-arithmetic: the small BPE trained on additions
    (build_bpe_tokenizer)."""


EMBEDDED_MODELS: dict[str, TinySpec] = {
    "posttrain/tiny": TinySpec(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4),
    "posttrain/tiny-2m": TinySpec(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=6),
    # For benchmarks at a real vocabulary: Qwen2.5-0.5B-like widths and its 151,936-token LM head (tied), 4 layers,
    # 8 heads / 2 KV heads; 89M parameters, most of them the embedding.
    "posttrain/bench-vocab152k": TinySpec(hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                          num_attention_heads=8, num_key_value_heads=2, vocab_size=151_936,
                                          max_position_embeddings=4096),
    # A teacher with another tokenizer than posttrain/tiny's (cross-tokenizer distillation).
    "posttrain/tiny-bpe": TinySpec(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                                   tokenizer="bpe-arithmetic"),
}

BPE_MERGES = 20
"""How many merges the arithmetic BPE learns: enough that many sums split into pieces whose boundaries the
byte-level tokenizer does not share ("110" -> 1|10), few enough that the tiny model still learns addition through
them (with 60 merges, most 2-digit numbers one token, it reached 81.5% held-out after configs/sft_arithmetic.yaml's
schedule)."""


def cache_dir() -> Path:
    """Root of posttrain's cache: POSTTRAIN_CACHE_DIR, else the platform's user cache dir."""
    return Path(os.environ.get("POSTTRAIN_CACHE_DIR") or platformdirs.user_cache_dir("posttrain"))


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: 256 byte tokens, then the special tokens. No merges, so no training and no drift."""
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    # use_regex=False: the regex split only guides merges, and there are none.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return _embedded_tokenizer(backend, "posttrain/tiny")


def build_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """The small byte-level BPE of posttrain/tiny-bpe: the 256 byte tokens and the special tokens (first), then
    BPE_MERGES merges learned by `tokenizers`' BpeTrainer on "a+b=c" for every a, b in 0..99, split by the GPT-2
    pre-tokenizer regex (digits group apart from signs). Training is deterministic (tested), so the cache entry needs
    no stored vocabulary."""
    backend = Tokenizer(models.BPE(fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + len(SPECIAL_TOKENS) + BPE_MERGES, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(SPECIAL_TOKENS))
    backend.train_from_iterator((f"{a}+{b}={a + b}" for a in range(100) for b in range(100)), trainer)
    return _embedded_tokenizer(backend, "posttrain/tiny-bpe")


def _embedded_tokenizer(backend: Tokenizer, model: str) -> PreTrainedTokenizerFast:
    """`backend` as the transformers tokenizer of embedded model `model`: its special tokens, chat template and
    context length."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=EMBEDDED_MODELS[model].max_position_embeddings,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


TOKENIZER_BUILDERS: dict[str, Callable[[], PreTrainedTokenizerFast]] = {
    "bytes": build_tokenizer, "bpe-arithmetic": build_bpe_tokenizer}


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's byte-to-unicode table, so token id i is byte i."""
    code = ord(ch)
    if 33 <= code <= 126 or 161 <= code <= 172 or 174 <= code <= 255:
        return code
    # The remaining 68 bytes are mapped, in order, to code points 256, 257, ...
    missing = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
    return missing[code - 256]


def build_model(spec: TinySpec, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=spec.vocab_size or len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads or spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )
    # Initialization draws from the global RNG: fork it so building never disturbs the caller's stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    # A completion ends at <|endoftext|> (plain text) or at <|im_end|>, where a chat-trained model ends its turn;
    # with <|endoftext|> alone every chat sample would run on to the token budget.
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)]
    model.generation_config.bos_token_id = None
    return model


def ensure_embedded_model(name: str) -> Path:
    """Return the directory of embedded model `name`, building it on first use."""
    if name not in EMBEDDED_MODELS:
        raise KeyError(f"unknown embedded model {name!r}; embedded models: {', '.join(sorted(EMBEDDED_MODELS))}")
    spec = EMBEDDED_MODELS[name]

    def build(staging: Path) -> Path:
        tokenizer = TOKENIZER_BUILDERS[spec.tokenizer]()
        build_model(spec, tokenizer).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        return staging

    return build_into_cache(name, spec.version, build)


def build_into_cache(name: str, version: int, build: Callable[[Path], Path], **metadata: Any) -> Path:
    """The cache directory of model `name` (version `version`), running `build` on first use.

    `build(staging)` writes a Hugging Face model directory somewhere inside the empty folder `staging`
    and returns it; that directory is renamed into place only once complete, so an interrupted build
    never leaves a model that looks finished.
    """
    target = cache_dir() / "models" / f"{name.replace('/', '--')}-v{version}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        built = build(staging)
        (built / "posttrain_embedded.json").write_text(json.dumps({"name": name, "version": version, **metadata}) + "\n")
        try:
            os.rename(built, target)
        except OSError:
            # Another process finished the same build first; its copy is equivalent.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target

def is_embedded(name_or_path: str) -> bool:
    return name_or_path in EMBEDDED_MODELS
