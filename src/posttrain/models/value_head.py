"""A scalar head on any causal LM: reward models today, the critic of PPO with a value model next.

transformers has a `*ForSequenceClassification` class for most decoder architectures (Llama, Qwen2, Mistral, ...),
and for those `scalar_head_model_class` is AutoModelForSequenceClassification, loaded with num_labels=1 exactly as
before: the saved directory is the usual sequence classifier.

For an architecture without one (Granite, for example, has GraniteForCausalLM but no sequence classifier, so
AutoModelForSequenceClassification refuses its config), it builds the same model the way transformers itself
builds its sequence classifiers: `GenericForSequenceClassification` over the architecture's own PreTrainedModel
base. That is the base model (AutoModel) under `model`, nn.Linear(hidden, num_labels=1, bias=False) under `score`,
and the score read at each row's last non-padding token (the rightmost token that is not pad_token_id, so both
padding sides work). From a causal LM checkpoint the base weights load and the head starts fresh, as with the
built-in classes. The class is named after the architecture (GraniteForScalarHead) and saves as a normal Hugging
Face directory whose weights carry the same names as a sequence classifier's; `scalar_head_model_class` finds it
again from the saved config (same rule: no built-in class for this config type), so RewardModel.from_pretrained
loads it. AutoModelForSequenceClassification cannot load it, since transformers has no class to load it into.

`token_scores` reads the head at every position instead of the last one: the per-token values a critic needs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, PretrainedConfig, PreTrainedModel
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING, MODEL_MAPPING

SCALAR_HEAD_SUFFIX = "ForScalarHead"


def has_sequence_classifier(config: PretrainedConfig) -> bool:
    """Whether AutoModelForSequenceClassification has a class for `config` (built in, or named by remote code)."""
    remote = getattr(config, "auto_map", None) or {}
    return type(config) in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING or "AutoModelForSequenceClassification" in remote


def scalar_head_model_class(source: str | Path, trust_remote_code: bool = False) -> type:
    """The class that loads the model directory (or hub id) `source` with a scalar head: AutoModelForSequenceClassification
    where transformers has a sequence classifier for its config, else `scalar_head_class` of that config."""
    config = AutoConfig.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    if has_sequence_classifier(config):
        return AutoModelForSequenceClassification
    return scalar_head_class(config)


def scalar_head_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """`<Architecture>ForScalarHead`: GenericForSequenceClassification over the architecture's PreTrainedModel base
    (the one its AutoModel class derives from), the construction transformers uses for LlamaForSequenceClassification
    and its siblings. ValueError when transformers has no base model for the config."""
    if type(config) not in MODEL_MAPPING:
        raise ValueError(f"transformers has neither a sequence classifier nor a base model (AutoModel) for "
                         f"{type(config).__name__} (model_type {config.model_type!r}), so no scalar head can be put "
                         "on it")
    return _scalar_head_class(MODEL_MAPPING[type(config)])


@functools.cache
def _scalar_head_class(base_model_class: type[PreTrainedModel]) -> type[PreTrainedModel]:
    # One class per architecture, cached, so that repeated loads give the same type.
    pretrained_base = next((c for c in base_model_class.__mro__[1:]
                            if issubclass(c, PreTrainedModel) and c is not PreTrainedModel), None)
    if pretrained_base is None:
        raise ValueError(f"{base_model_class.__name__} has no architecture-specific PreTrainedModel base to put a "
                         "scalar head on")
    name = base_model_class.__name__.removesuffix("Model") + SCALAR_HEAD_SUFFIX
    return type(name, (GenericForSequenceClassification, pretrained_base), {"__module__": __name__})


def token_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """[B, T, num_labels] the scalar head applied at every position (the per-token values of a critic), for a model
    from `scalar_head_model_class` (built-in sequence classifiers with a `score` head included). The last
    non-padding position of each row equals the model's own pooled output.

    Read from the model's own forward, which applies the head at every position before pooling, by a hook on the
    head: so whatever wraps that forward applies too (FSDP2 gathers a sharded model's weights in it)."""
    return head_outputs_during(model, lambda: model(input_ids=input_ids, attention_mask=attention_mask,
                                                     use_cache=False))


def head_outputs_during(model: torch.nn.Module, run) -> torch.Tensor:
    """What the scalar head `model.score` outputs at every position while `run()` calls the model's forward."""
    captured: list[torch.Tensor] = []
    handle = model.score.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        run()
    finally:
        handle.remove()
    return captured[0]
