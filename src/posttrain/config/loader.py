"""Load a recipe config: YAML file(s), then dotted command-line overrides, then validation.

    cfg = load_config(SFTConfig, "configs/sft_arithmetic.yaml", ["trainer.max_steps=50", "data.train_files=[a.jsonl,b.jsonl]"])

A YAML file may start with ``defaults: [base.yaml, ...]`` (paths relative to the file): those are
loaded first and this file's keys are merged over them. Every error names the key path; an unknown
key comes with a did-you-mean suggestion. All of this happens before any model is loaded.
"""

from __future__ import annotations

import difflib
import os
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, Tag, ValidationError

from posttrain.config.environments import EnvironmentOptions
from posttrain.config.trl import TRL_NAMES

C = TypeVar("C", bound=BaseModel)


class ConfigError(ValueError):
    """A config that cannot be used; the message names every offending key path."""


MAX_OVERRIDE_CHARS = 100_000
"""The longest `key=value` override the command line may give (a longer one is refused, naming this limit)."""
MAX_CONFIG_BYTES = 10_000_000
"""The largest YAML config file read."""


def _too_many_digits(error: ValueError) -> str:
    if "integer string conversion" not in str(error):
        raise error
    return f"a number with more than {sys.get_int_max_str_digits():,} digits, the most Python reads"


def _shortened(item: str, limit: int = 80) -> str:
    return repr(item if len(item) <= limit else item[:limit] + "...")


def load_config(schema: type[C], path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None, flags: dict[str, Any] | None = None) -> C:
    """Validate `base` <- YAML file at `path` <- `overrides` (each "dotted.key=value") <- `flags` against `schema`.

    `flags` is a tree of keys set by command-line options (`posttrain eval --data a.jsonl`): their values are taken
    as given, never parsed as override text, so a prompt or a file name may hold any character."""
    tree: dict[str, Any] = dict(base or {})
    if path is not None:
        tree = deep_merge(tree, read_yaml_with_defaults(Path(path)))
    if overrides:
        tree = deep_merge(tree, parse_overrides(overrides))
    if flags:
        tree = deep_merge(tree, flags)
    return validate(schema, tree, source=str(path) if path else "config")


def read_yaml_with_defaults(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in _seen:
        raise ConfigError(f"{path}: circular `defaults` include ({' -> '.join(str(p) for p in _seen + (path,))})")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {size:,} bytes, more than the {MAX_CONFIG_BYTES:,} a config file may have "
                          "(MAX_CONFIG_BYTES)")
    return _yaml_tree(path.read_text(), str(path), path.parent, _seen + (path,))


def read_yaml_text(text: str, directory: Path = Path(".")) -> dict[str, Any]:
    """A config given as YAML text rather than a file (the Python API's `posttrain.train("sft", "trainer: ...")`);
    its `defaults:` paths are relative to `directory`. Errors name the text's line as "config text:LINE"."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config text: {len(text):,} characters, more than the {MAX_CONFIG_BYTES:,} a config may "
                          "have (MAX_CONFIG_BYTES)")
    return _yaml_tree(text, "config text", directory, ())


def _yaml_tree(text: str, where: str, directory: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    """The tree of YAML `text` (read from `where`), its `defaults:` includes (relative to `directory`) merged
    under it."""
    try:
        tree = yaml.safe_load(text) or {}
    except ValueError as err:  # a number of more digits than Python converts (sys.get_int_max_str_digits)
        raise ConfigError(f"{where}: {_too_many_digits(err)}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        located = f"{where}:{mark.line + 1}" if mark is not None else where
        raise ConfigError(f"{located}: invalid YAML: {getattr(err, 'problem', err)}") from err
    if not isinstance(tree, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of keys, got {type(tree).__name__}")
    includes = tree.pop("defaults", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"{where}: `defaults` must be a list of YAML paths relative to this file")
    merged: dict[str, Any] = {}
    for include in includes:
        merged = deep_merge(merged, read_yaml_with_defaults(directory / include, seen))
    return deep_merge(merged, tree)


def overrides_tree(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """{"trainer.max_steps": 10, "data.train_files": [...]} as a nested tree, for the Python API. Values are taken
    as given (Python values, never parsed as override text); a path object becomes its string. Unknown keys are
    left to `validate`, which names them as it does for the command line's overrides."""
    tree: dict[str, Any] = {}
    for key, value in overrides.items():
        if not isinstance(key, str) or not all(key.split(".")):
            raise ConfigError(f"bad override key {key!r}: expected a dotted key such as trainer.max_steps")
        nested: Any = os.fspath(value) if isinstance(value, os.PathLike) else value
        for part in reversed(key.split(".")):
            nested = {part: nested}
        tree = deep_merge(tree, nested)
    return tree


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ["a.b=1", "c=[x,y]"] into a nested dict, with YAML-style value typing (OmegaConf grammar)."""
    for item in overrides:
        key, sep, _ = item.partition("=")
        if len(item) > MAX_OVERRIDE_CHARS:
            raise ConfigError(f"override {_shortened(item)} is {len(item):,} characters long, more than the "
                              f"{MAX_OVERRIDE_CHARS:,} an override may have (MAX_OVERRIDE_CHARS); put long values in "
                              "the YAML file")
        if not sep or not key or key.startswith(".") or key.endswith("."):
            raise ConfigError(f"bad override {_shortened(item)}: expected dotted.key=value, for example "
                              "trainer.max_steps=100")
    tree: dict[str, Any] = {}
    for item in overrides:
        try:
            parsed = OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=True)
        except ValueError as err:  # a number of more digits than Python converts (sys.get_int_max_str_digits)
            raise ConfigError(f"bad override {_shortened(item)}: {_too_many_digits(err)}") from None
        except (OmegaConfBaseException, yaml.YAMLError) as err:
            hint = " (quote values with brackets or commas: key=['name[:10]'])" if "[" in item.partition("=")[2] else ""
            raise ConfigError(f"bad override {item!r}: {str(err).splitlines()[0]}{hint}") from err
        tree = deep_merge(tree, parsed)  # type: ignore[arg-type]
    return tree


def deep_merge(base: dict[str, Any], update: dict[str, Any], _path: str = "") -> dict[str, Any]:
    """Recursively merge `update` over `base` (mappings merge, everything else replaces).

    Keys set inside a section that `base` holds as a scalar or a list (`trainer: 5` in the YAML, then
    trainer.max_steps=3) are a ConfigError naming the section: replacing it by the new keys would drop the bad
    value without a word. An empty section (`trainer:`, which YAML reads as null) takes the keys.
    """
    out = dict(base)
    for key, value in update.items():
        where = f"{_path}.{key}" if _path else str(key)
        current = out.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            out[key] = deep_merge(current, value, where)
        elif isinstance(value, dict) and current is not None:
            first = f"{where}.{next(iter(value))}" if value else where
            raise ConfigError(f"{where}: is {current!r} ({type(current).__name__}), not a section of keys, so "
                              f"{first} cannot be set in it; write {where} as a mapping (e.g. {where}: "
                              "{key: value}) or remove the value")
        else:
            out[key] = value
    return out


def validate(schema: type[C], tree: dict[str, Any], source: str = "config") -> C:
    try:
        return schema.model_validate(tree)
    except ValidationError as err:
        problems = [_describe(schema, e) for e in err.errors()]
        header = f"{source}: {len(problems)} invalid setting{'s' if len(problems) > 1 else ''}"
        raise ConfigError(header + "\n" + "\n".join(f"  - {p}" for p in problems)) from None


def _describe(schema: type[BaseModel], error: dict[str, Any]) -> str:
    shown, parent, annotation = _walk(schema, error["loc"])
    key = ".".join(shown) or "(top level)"
    name = shown[-1] if shown else ""
    options_of = parent.kind if isinstance(parent, type) and issubclass(parent, EnvironmentOptions) else None
    if error["type"] == "extra_forbidden":
        known = list(parent.model_fields) if parent is not None else []
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        if options_of is not None:
            hint = f" (did you mean {close[0]}?)" if close else ""
            return (f"{key}: the {options_of} environment has no option {name!r}{hint}; its options are "
                    f"{', '.join(known) or 'none'}")
        message = f"{key}: unknown key"
        recipe = RECIPE_OF_SCHEMA.get(schema.__name__, "")
        if name in TRL_NAMES and TRL_NAMES[name].applies_to(recipe):  # a TRL habit: where it goes, not a spelling
            return f"{message}; {TRL_NAMES[name].explain(name, recipe)}"
        if parent is not None:
            prefix = ".".join(shown[:-1] + [close[0]]) if close else None
            message += f"; did you mean {prefix}?" if close else f"; known keys here: {', '.join(known)}"
        return message
    if error["type"] == "missing":
        missing_options = _strip(annotation)
        if isinstance(missing_options, type) and issubclass(missing_options, EnvironmentOptions):
            fields = missing_options.model_fields
            required = [name for name, info in fields.items() if info.is_required()]
            where = f"{key}.{required[0]}" if required else key
            return f"{where}: required by the {missing_options.kind} environment (its options are {', '.join(fields)})"
        if options_of is not None:
            return f"{key}: required by the {options_of} environment (its options are {', '.join(parent.model_fields)})"
        return f"{key}: required key is missing"
    if error["type"] == "environment_kind":
        given = error.get("input")
        if not isinstance(given, dict):
            return f"{key}: expected a mapping {{kind, options, ...}}, got {given!r} ({type(given).__name__})"
        return f"{key}: {error['msg']}, got {given.get('kind')!r}"
    if not error["loc"] or error["type"] == "value_error":
        return f"{key}: {error['msg'].removeprefix('Value error, ')}"
    got = error.get("input")
    if error["type"] in _BOUND_ERRORS:  # the type is right, the value out of range: say only that
        return f"{key}: got {got!r}: {error['msg']}"
    expected = type_name(annotation) if annotation is not None else "a valid value"
    if options_of is not None:
        return f"{key}: the {options_of} environment expects {expected}, got {got!r} ({type(got).__name__})"
    return f"{key}: expected {expected}, got {got!r} ({type(got).__name__}): {error['msg']}"


RECIPE_OF_SCHEMA = {"SFTConfig": "sft", "DPOConfig": "dpo", "RMConfig": "rm", "GRPOConfig": "grpo",
                    "PPOConfig": "ppo", "DistillConfig": "distill", "EvalConfig": "eval", "GenerateConfig": "generate"}
"""The recipe a schema is the config of, for the TRL names whose posttrain key depends on it."""

_BOUND_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of",
                           "too_short", "too_long", "finite_number"})


def _walk(schema: type[BaseModel], loc: tuple[Any, ...]) -> tuple[list[str], type[BaseModel] | None, Any]:
    """Follow an error's location through the schema: (the key path as the user writes it, without the tags of
    discriminated unions such as environment's kind; the model that holds the last key, or None; that key's
    annotation, or None)."""
    shown: list[str] = []
    parent: type[BaseModel] | None = None
    annotation: Any = schema
    for part in loc:
        tagged = _tagged_members(annotation)
        if part in tagged:  # the union's tag, which the user wrote as `kind`, not as a key
            annotation = tagged[part]
            continue
        model = _model_in(annotation)
        shown.append(str(part))
        if isinstance(part, str) and model is not None and part in model.model_fields:
            parent, annotation = model, model.model_fields[part].annotation
        elif isinstance(part, int) and _item_type(annotation) is not None:
            annotation = _item_type(annotation)
        else:
            parent, annotation = (model, None) if model is not None else (None, None)
    return shown, parent, annotation


def _strip(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def tagged_members(annotation: Any) -> dict[str, Any]:
    """{tag: member model} of a union discriminated on a tag (the environment section's kinds), else {}."""
    return _tagged_members(annotation)


def _tagged_members(annotation: Any) -> dict[str, Any]:
    """{tag: member} of a discriminated union with tags (environment's kinds), else {}."""
    annotation = _strip(annotation)
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return {}
    members = {}
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is typing.Annotated:
            for meta in arg.__metadata__:
                if isinstance(meta, Tag):
                    members[meta.tag] = typing.get_args(arg)[0]
    return members


def _item_type(annotation: Any) -> Any:
    """The item type of a list annotation (possibly optional), else None."""
    annotation = _strip(annotation)
    if typing.get_origin(annotation) is list:
        return typing.get_args(annotation)[0]
    for arg in typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ():
        if typing.get_origin(_strip(arg)) is list:
            return typing.get_args(_strip(arg))[0]
    return None


def _model_in(annotation: Any) -> type[BaseModel] | None:
    annotation = _strip(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if _tagged_members(annotation):
        return None
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def type_name(annotation: Any) -> str:
    """Readable type for messages and --help: int, float, list[str], one of 'a', 'b', ..."""
    annotation = _strip(annotation)
    tagged = _tagged_members(annotation)
    if tagged:
        return f"a mapping with kind one of {', '.join(repr(tag) for tag in tagged)}"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(annotation)).replace("NoneType", "null")
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(annotation))
        return f"{origin.__name__}[{args}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))
