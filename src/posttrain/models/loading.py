"""Loading causal LMs and tokenizers from hub ids, local directories or embedded model names."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from posttrain.config.schema import LoraSection, ModelConfig
from posttrain.errors import RunError
from posttrain.models.errors import ModelNotFoundError
from posttrain.models.packing import custom_mask_problem
from posttrain.models.lora import (
    TaskKind,
    add_lora,
    load_lora,
    prepare_for_gradient_checkpointing,
)
from posttrain.models.tiny import EMBEDDED_MODELS, ensure_embedded_model, is_embedded
from posttrain.models.trained import (
    TRAINED_MODELS,
    ensure_trained_model,
    is_trained_embedded,
)
from posttrain.models.value_head import scalar_head_model_class

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_model_path(name_or_path: str) -> str:
    """Embedded names (posttrain/tiny, posttrain/tiny-arithmetic-sft) become their cached directory; directories and hub ids pass through.

    Something that can only be a local path (absolute, relative with ./ or ~, or with more than one
    slash, which hub ids never have) and does not exist fails here with a clear message, instead of
    as a hub lookup error.
    """
    if is_embedded(name_or_path):
        return str(ensure_embedded_model(name_or_path))
    if is_trained_embedded(name_or_path):
        return str(ensure_trained_model(name_or_path))
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not Path(name_or_path).expanduser().exists():
        raise ModelNotFoundError(
            f"model not found: {name_or_path!r} is not an existing directory (embedded models: "
            f"{', '.join(sorted([*EMBEDDED_MODELS, *TRAINED_MODELS]))}; hub ids look like org/name)"
        )
    local = Path(name_or_path).expanduser()
    if local.exists():
        _check_model_folder(local)
    return str(local) if looks_local else name_or_path


def _check_model_folder(path: Path) -> None:
    """A local path that is no Hugging Face model directory fails here naming what it is and, for a posttrain run
    or checkpoint, the folder that holds its model (not later, as a tokenizer error)."""
    if path.is_file():
        raise ModelNotFoundError(f"model {str(path)!r} is a file; give the model's folder (the one holding "
                                 "config.json)")
    if any((path / name).is_file() for name in ("config.json", "adapter_config.json", "tokenizer_config.json")):
        return
    hint = ""
    if (path / "final" / "config.json").is_file():
        hint = f": it looks like a posttrain run directory, whose model is {path / 'final'}"
    elif (path / "policy" / "config.json").is_file():
        hint = f": it looks like a posttrain checkpoint, whose model is {path / 'policy'}"
    elif (path / "policy").is_dir():
        hint = (": it looks like a sharded posttrain checkpoint, which only a run resumes; use the run's final/ or "
                "a checkpoint written by one process")
    elif (path / "checkpoints").is_dir():
        hint = f": it looks like a posttrain run directory without final/ yet; its checkpoints are in {path / 'checkpoints'}"
    raise ModelNotFoundError(f"model {str(path)!r} is a folder without config.json, so no Hugging Face model "
                             f"directory{hint}")


def load_tokenizer(cfg: ModelConfig, padding_side: str = "right") -> PreTrainedTokenizerBase:
    """The model's tokenizer, with a pad token and the requested padding side.

    padding_side is not restored by from_pretrained, so it is always set here: right for training,
    left for generation.
    """
    source = resolve_model_path(cfg.tokenizer_name_or_path or cfg.name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer of {source} has neither a pad nor an eos token; set one before training")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    return tokenizer


def load_causal_lm(cfg: ModelConfig, path: str | Path | None = None, device: str | torch.device = "cpu") -> PreTrainedModel:
    """Load the model of `cfg` (or the checkpoint directory `path`, when resuming) for training."""
    return _from_pretrained(AutoModelForCausalLM, cfg, path).to(device)


def load_reward_backbone(cfg: ModelConfig, pad_token_id: int, path: str | Path | None = None,
                         device: str | torch.device = "cpu") -> PreTrainedModel:
    """`cfg`'s model (or checkpoint `path`) with a scalar head: AutoModelForSequenceClassification, num_labels=1, or
    for an architecture transformers has no sequence classifier for, the same construction over its base model
    (posttrain.models.value_head).

    From a causal LM checkpoint the backbone weights load and the score head starts fresh (normal init with the
    model's initializer_range). The head reads the hidden state of each row's last non-pad token, so the config
    gets the tokenizer's pad id.
    """
    source = path if path is not None else resolve_model_path(cfg.name_or_path)
    model = _from_pretrained(scalar_head_model_class(source, cfg.trust_remote_code), cfg, path, num_labels=1)
    model.config.pad_token_id = pad_token_id
    return model.to(device)


def load_trainable_model(cfg: ModelConfig, lora: LoraSection, resume: str | Path | None, device: torch.device,
                         task: TaskKind = "causal_lm", pad_token_id: int | None = None) -> torch.nn.Module:
    """The model a recipe trains: the starting model, or the checkpoint `resume`; with lora.enabled the starting
    model with fresh adapters, or with the adapter saved in `resume`."""
    def load(path: str | Path | None) -> PreTrainedModel:
        if task == "reward":
            assert pad_token_id is not None, "a reward model needs the tokenizer's pad id"
            return load_reward_backbone(cfg, pad_token_id, path, device)
        return load_causal_lm(cfg, path, device)

    if not lora.enabled:
        return load(resume)
    base = load(None)
    base.requires_grad_(False)
    if cfg.gradient_checkpointing:
        prepare_for_gradient_checkpointing(base)
    return load_lora(base, resume) if resume is not None else add_lora(base, lora, task)


def _from_pretrained(auto_class: type, cfg: ModelConfig, path: str | Path | None, **kwargs) -> PreTrainedModel:
    source = str(path) if path is not None else resolve_model_path(cfg.name_or_path)
    try:
        model = auto_class.from_pretrained(
            source,
            dtype=DTYPES[cfg.dtype],
            attn_implementation=None if cfg.attn_implementation == "auto" else cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
            **kwargs,
        )
    except ValueError as err:
        if "does not support" not in str(err) or "attention" not in str(err).lower():
            raise
        raise RunError(f"model.attn_implementation={cfg.attn_implementation}: {source} has no such attention path in "
                       f"transformers ({err}); set model.attn_implementation=auto, which picks sdpa where the "
                       "architecture has it and eager otherwise") from None
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable()
        model.config.use_cache = False
    return model


def weight_specs_of(cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor of the state dict `load_causal_lm` would give for `cfg`, read from the
    model's config alone: the model is built on the meta device, no weight is read or allocated. What a generator
    that keeps its weights in another layout (a vLLM engine) expects a full weight push to bring."""
    source = resolve_model_path(cfg.name_or_path)
    config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.dtype],
                                                 trust_remote_code=cfg.trust_remote_code)
    return [(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
            for name, tensor in model.state_dict().items()]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def custom_mask_problem_of(cfg: ModelConfig, max_length: int) -> str | None:
    """Why packed or shared-prompt rows would not be exact for this model (see models/packing.py), or None; reads
    only the model's config, so it can stop a run before any weights load."""
    source = resolve_model_path(cfg.name_or_path)
    return custom_mask_problem(AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code), max_length)
