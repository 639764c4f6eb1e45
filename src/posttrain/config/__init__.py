"""Validated config trees (pydantic) loaded from YAML with dotted command-line overrides."""

from posttrain.config.environments import EnvironmentSection, environment_section
from posttrain.config.losses import DistillationLossConfig, PolicyLossConfig, PreferenceLossConfig
from posttrain.config.loader import (
    ConfigError,
    deep_merge,
    load_config,
    parse_overrides,
    validate,
)
from posttrain.config.schema import (
    DataConfig,
    DistillConfig,
    DPOConfig,
    EvalConfig,
    EvaluationSet,
    GenerateConfig,
    LoggingConfig,
    LoraSection,
    ModelConfig,
    QuickstartConfig,
    RecipeConfig,
    RMConfig,
    SFTConfig,
    TrainerConfig,
)

__all__ = [
    "ConfigError",
    "DPOConfig",
    "DataConfig",
    "DistillConfig",
    "DistillationLossConfig",
    "EnvironmentSection",
    "EvalConfig",
    "EvaluationSet",
    "GenerateConfig",
    "LoggingConfig",
    "LoraSection",
    "ModelConfig",
    "PolicyLossConfig",
    "PreferenceLossConfig",
    "QuickstartConfig",
    "RMConfig",
    "RecipeConfig",
    "SFTConfig",
    "TrainerConfig",
    "deep_merge",
    "environment_section",
    "load_config",
    "parse_overrides",
    "validate",
]
