"""The Python API: the command line's recipes as functions, for notebooks and scripts (docs/python-api.md).

    import posttrain
    rows = [{"prompt": "12+30=", "completion": "42"}, ...]
    result = posttrain.train("sft", "configs/sft_arithmetic.yaml", train_data=rows,
                             overrides={"trainer.max_steps": 200, "output_dir": "runs/notebook"})
    print(result.final_loss, result.final_dir)

`train(recipe, config, overrides=..., train_data=..., eval_data=...)` builds the same validated config as
`posttrain RECIPE --config FILE key=value ...` and runs the same recipe function, so a run is the one the command
line makes of that config, step for step. The config is a YAML file, YAML text, a dict or a config object;
`overrides` maps dotted keys to values, as the command line's `key=value` does, and an unknown key is the same
ConfigError. Wherever a config takes data files (data.train_files, data.eval_files, data.files, an evaluation set's
data.files) it also takes rows in memory: a list of dicts or a `datasets.Dataset` (posttrain.data.memory), read
and validated as a file's rows are, each error naming the row's index.

While a recipe runs, the libraries' own progress bars (loading weights, writing shards, preparing a hub dataset) and
advisory warnings are off, as on the command line, so the run's one progress bar (logging.progress: a tqdm widget
in a notebook, a rich bar on a terminal, plain lines otherwise) is the only one; their settings come back after.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, Union

import datasets
import huggingface_hub.utils
import transformers
from pydantic import BaseModel

from posttrain.algorithms.distill import DistillResult, train_distill
from posttrain.algorithms.dpo import DPOResult, train_dpo
from posttrain.algorithms.evaluate import EvalReport, EvalResult, run_eval
from posttrain.algorithms.generate import GeneratedSample
from posttrain.algorithms.generate import generate as generate_samples
from posttrain.algorithms.grpo import train_grpo
from posttrain.algorithms.ppo import train_ppo
from posttrain.algorithms.rl import RLResult
from posttrain.algorithms.rm import RMResult, train_rm
from posttrain.algorithms.sft import SFTResult, train_sft
from posttrain.config import (
    ConfigError,
    DistillConfig,
    DPOConfig,
    EvalConfig,
    GenerateConfig,
    RMConfig,
    SFTConfig,
    deep_merge,
    validate,
)
from posttrain.config.loader import overrides_tree, read_yaml_text, read_yaml_with_defaults
from posttrain.config.schema import GRPOConfig, PPOConfig
from posttrain.data.errors import DataError
from posttrain.data.memory import in_memory_sources, unused_name
from posttrain.errors import RunError

C = TypeVar("C", bound=BaseModel)

ConfigSource = Union[str, os.PathLike, Mapping[str, Any], BaseModel, None]
"""A YAML file (a path), YAML text (a string holding a newline or a `key: value`), a dict tree, or a config object
(SFTConfig, ...); None: the recipe's defaults."""

DataSource = Union[str, os.PathLike, list, tuple, datasets.Dataset, datasets.IterableDataset]
"""A file or dataset name (as in a config), rows in memory (a list of dicts, a datasets.Dataset or
IterableDataset), or a list of those."""

TrainResult = Union[SFTResult, DPOResult, RMResult, RLResult, DistillResult]


@dataclass(frozen=True)
class Trainer:
    schema: type[BaseModel]
    run: Callable[[Any], Any]


TRAINERS: dict[str, Trainer] = {
    "sft": Trainer(SFTConfig, train_sft),
    "dpo": Trainer(DPOConfig, train_dpo),
    "rm": Trainer(RMConfig, train_rm),
    "grpo": Trainer(GRPOConfig, train_grpo),
    "ppo": Trainer(PPOConfig, train_ppo),
    "distill": Trainer(DistillConfig, train_distill),
}
"""The training recipes of `posttrain RECIPE` (cli.RECIPES): each one's config schema and loop."""

DATA_SOURCE_KEYS = ("train_files", "eval_files", "files")
"""The keys of a `data` section that list data sources, which may hold rows in memory."""


def train(recipe: str, config: ConfigSource = None, *, overrides: Mapping[str, Any] | None = None,
          train_data: DataSource | None = None, eval_data: DataSource | None = None) -> TrainResult:
    """Run a training recipe, as `posttrain RECIPE --config FILE key=value ...` does, and return its result.

    recipe: sft, dpo (and its loss variants: loss.type), rm, grpo (and its family: advantage.estimator, ...), ppo
        or distill.
    config: a YAML file, YAML text, a dict tree or a config object of the recipe (SFTConfig for sft, ...); None
        for the recipe's defaults.
    overrides: {"dotted.key": value} merged over the config, as the command line's key=value overrides; values are
        Python values taken as given (a list is a list, a string is never parsed).
    train_data, eval_data: data.train_files and data.eval_files: rows in memory (a list of dicts, a
        datasets.Dataset), a file or dataset name, or a list of those. They replace what the config names.

    Returns the recipe's result (docs/python-api.md): SFTResult, DPOResult, RMResult, RLResult (grpo, ppo) or
    DistillResult, each with output_dir and final_dir (the Hugging Face model directory). Raises ConfigError
    before anything loads when the config is invalid (naming the key), DataError for a bad row (naming the file
    and line, or the in-memory row's index), RunError for a run that cannot go on.
    """
    if recipe not in TRAINERS:
        raise ConfigError(f"unknown recipe {recipe!r}: one of {', '.join(TRAINERS)}")
    trainer = TRAINERS[recipe]
    data = {"data.train_files": ("train_data", train_data), "data.eval_files": ("eval_data", eval_data)}
    cfg, rows = resolve_config(trainer.schema, config, overrides, data)
    with in_memory_sources(rows), quiet_libraries():
        return trainer.run(cfg)


def evaluate(config: ConfigSource = None, *, overrides: Mapping[str, Any] | None = None,
             data: DataSource | None = None) -> EvalReport | EvalResult:
    """`posttrain eval`: the prompts of data.files (or `data`: rows in memory, files, ...) scored by the config's
    environment, returned as an EvalReport (metrics, every sample); with no data, the built-in task's greedy exact
    match, an EvalResult. The model is model.name_or_path (for example a run's result.final_dir)."""
    cfg, rows = resolve_config(EvalConfig, config, overrides, {"data.files": ("data", data)})
    with in_memory_sources(rows), quiet_libraries():
        return run_eval(cfg)


def generate(config: ConfigSource = None, *, overrides: Mapping[str, Any] | None = None,
             data: DataSource | None = None) -> list[GeneratedSample]:
    """`posttrain generate`: num_samples completions of each of `prompts` (a config key) or of the `prompt` column
    of data.files (or `data`), as GeneratedSample (prompt, completion, num_tokens, finish_reason)."""
    cfg, rows = resolve_config(GenerateConfig, config, overrides, {"data.files": ("data", data)})
    with in_memory_sources(rows), quiet_libraries():
        return generate_samples(cfg)


def resolve_config(schema: type[C], config: ConfigSource, overrides: Mapping[str, Any] | None = None,
                   data: Mapping[str, tuple[str, DataSource | None]] | None = None) -> tuple[C, dict[str, Any]]:
    """The validated config of `schema` from `config` <- `overrides` <- `data` ({dotted key: (its label in row
    locations, source or None)}), and the rows in memory it names ({memory:LABEL: rows}), to be registered with
    data.memory.in_memory_sources while the recipe runs."""
    tree, source = _config_tree(schema, config)
    tree = deep_merge(tree, overrides_tree(overrides or {}))
    given = {key: value for key, (_, value) in (data or {}).items() if value is not None}
    for key in given:
        if key in (overrides or {}):
            raise ConfigError(f"{key} is set twice, by overrides and by the {data[key][0]} argument; give one")
    rows: dict[str, Any] = {}
    tree = _rows_to_names(tree, "", rows)
    for key, value in given.items():
        label = data[key][0]
        value = [os.fspath(value)] if isinstance(value, (str, os.PathLike)) else value  # one file, as a list
        tree = deep_merge(tree, overrides_tree({key: _sources_as_names(value, label, rows)}))
    return validate(schema, tree, source=source), rows


def _config_tree(schema: type[BaseModel], config: ConfigSource) -> tuple[dict[str, Any], str]:
    """(the config's tree, its name in error messages)."""
    if config is None:
        return {}, "config"
    if isinstance(config, BaseModel):
        if not isinstance(config, schema):
            raise ConfigError(f"config is a {type(config).__name__}; this recipe takes a {schema.__name__}")
        # Only what was set: the defaults are the schema's again, and validators that ask what was set see the same.
        return config.model_dump(exclude_unset=True), "config"
    if isinstance(config, Mapping):
        return dict(config), "config"
    if isinstance(config, os.PathLike) or (isinstance(config, str) and _names_a_file(config)):
        return read_yaml_with_defaults(Path(config)), os.fspath(config)
    if isinstance(config, str):
        return read_yaml_text(config), "config text"
    raise ConfigError(f"config: expected a YAML file, YAML text, a dict or a {schema.__name__}, got "
                      f"{type(config).__name__}")


def _names_a_file(text: str) -> bool:
    """A config string is a file's path unless it holds a newline or a `key: value` (then it is YAML text)."""
    return "\n" not in text and (text.endswith((".yaml", ".yml")) or Path(text).is_file() or ": " not in text)


def _rows_to_names(tree: Any, path: str, rows: dict[str, Any]) -> Any:
    """`tree` with rows in memory under data source keys (data.train_files, ...) replaced by their names."""
    if isinstance(tree, Mapping):
        out = {}
        for key, value in tree.items():
            where = f"{path}.{key}" if path else str(key)
            if key in DATA_SOURCE_KEYS and path.split(".")[-1].partition("[")[0] == "data" and value is not None:
                out[key] = _sources_as_names(value, where, rows)
            else:
                out[key] = _rows_to_names(value, where, rows)
        return out
    if isinstance(tree, list) and any(isinstance(item, Mapping) for item in tree):  # evaluation: [{name, data}, ...]
        return [_rows_to_names(item, f"{path}[{index}]", rows) for index, item in enumerate(tree)]
    return tree


def _sources_as_names(value: Any, label: str, rows: dict[str, Any]) -> Any:
    """A data source list with each in-memory source replaced by its registered name.

    A list of dicts (or a list whose first item is a dict) is one source of rows; a Dataset is one source; a list
    of names, datasets and row lists is several. What is neither is left for the schema to reject by key (a lone
    file name, as on the command line)."""
    if _is_rows(value, label):
        return [_register(value, label, rows)]
    if isinstance(value, (list, tuple)):
        return [os.fspath(item) if isinstance(item, os.PathLike)
                else _register(item, f"{label}[{index}]", rows) if _is_rows(item, f"{label}[{index}]") else item
                for index, item in enumerate(value)]
    return value


def _is_rows(value: Any, label: str) -> bool:
    if isinstance(value, datasets.DatasetDict | datasets.IterableDatasetDict):
        raise ConfigError(f"{label}: a DatasetDict (splits {', '.join(value)}); give one split of it, e.g. "
                          f"dataset[{next(iter(value), 'train')!r}]")
    if isinstance(value, datasets.Dataset | datasets.IterableDataset):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], Mapping)


def _register(value: Any, label: str, rows: dict[str, Any]) -> str:
    name = unused_name(label)
    rows[name] = value
    return name


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """transformers', huggingface_hub's and datasets' progress bars and transformers' advisory warnings off while
    the block runs (the command line turns them off for good); each library's setting restored afterwards."""
    hf_logging = transformers.utils.logging
    verbosity, transformers_bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hub_bars = not huggingface_hub.utils.are_progress_bars_disabled()
    dataset_bars = not datasets.utils.are_progress_bars_disabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # huggingface_hub's too
    if dataset_bars:
        datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if transformers_bars:
            hf_logging.enable_progress_bar()  # which turns huggingface_hub's on as well
        if hub_bars:
            huggingface_hub.utils.enable_progress_bars()
        elif transformers_bars:
            huggingface_hub.utils.disable_progress_bars()
        if dataset_bars:
            datasets.utils.enable_progress_bars()


__all__ = [
    "ConfigError",
    "DataError",
    "RunError",
    "TRAINERS",
    "evaluate",
    "generate",
    "quiet_libraries",
    "resolve_config",
    "train",
]
