"""Tools an agent may call: a name, a JSON schema of its arguments, and the function that runs it.

A tool is declared either as a JSON schema in the OpenAI function format (the format chat templates render with
`tools=`: ``{"type": "function", "function": {"name", "description", "parameters"}}``) paired with the function that
runs it, or as a plain Python function whose signature and Google-style docstring become that schema
(transformers' `get_json_schema`, which TRL's environments use too).

Arguments the model sends are checked against the schema with `jsonschema` before the function is called, so a
wrong type or a missing argument is the model's error, answered with an error observation, not an exception inside
the tool.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

DEFAULT_TOOL_TIMEOUT_S = 10.0
"""How long one tool call may run unless its tool says otherwise."""


class ToolFailure(Exception):
    """A tool refusing its input (division by zero, a path outside the work directory): the model's error, shown
    to it as the tool's answer and counted."""


class ToolTimeout(ToolFailure):
    """A tool stopping its own work at its time limit (the sandbox stopping a program): counted as a timeout."""


class ToolInfrastructureError(RuntimeError):
    """A tool could not run for reasons that are not the model's (the sandbox did not start): masks the episode."""


@dataclass(frozen=True)
class ToolContext:
    """What a tool call may use besides its arguments: the episode's own work directory."""

    workdir: Path | None
    """A directory of this episode alone, created empty when it first calls a tool that `uses_workdir` and removed
    when it ends; the file tools read and write only below it. None for calls of other tools before that."""


@dataclass(frozen=True)
class Tool:
    """One tool: its schema (what the model is shown) and how to run it."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments object ({"type": "object", "properties": ..., "required": [...]})."""
    run: Callable[[dict[str, Any], ToolContext], str] = field(compare=False)
    """Runs one call with checked arguments; returns the text the model reads (raises on failure)."""
    timeout_s: float = DEFAULT_TOOL_TIMEOUT_S
    """How long one call may run; a call still running then is answered with a timeout error."""
    uses_workdir: bool = False
    """Whether `run` reads `context.workdir` (the file tools): an episode's work directory is created only when it
    first calls such a tool."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"a tool name is letters, digits, '_' and '-', got {self.name!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"tool {self.name!r}: timeout_s must be positive, got {self.timeout_s}")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema of type 'object', "
                             f"got {self.parameters!r}")
        jsonschema.Draft202012Validator.check_schema(self.parameters)

    @property
    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it (`tokenizer.apply_chat_template(..., tools=[tool.schema])`)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def argument_error(self, arguments: Any) -> str | None:
        """Why `arguments` do not fit the schema (the first problem, with its path), or None when they do."""
        if not isinstance(arguments, Mapping):
            return f"the arguments of {self.name} must be a JSON object, got {type(arguments).__name__}"
        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(self.parameters).iter_errors(
            dict(arguments)))
        if error is None:
            return None
        where = "/".join(str(part) for part in error.absolute_path)
        return f"argument {where!r}: {error.message}" if where else error.message


def tool_from_function(function: Callable[..., Any], *, timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
                       name: str | None = None) -> Tool:
    """A tool from a Python function with type hints and a Google-style docstring (a description, then an Args:
    section naming every parameter), as transformers' `get_json_schema` reads them. The function is called with the
    arguments as keywords; what it returns is shown to the model as text (str() of it)."""
    try:
        schema = get_json_schema(function)["function"]
    except (DocstringParsingException, TypeHintParsingException) as error:
        raise ValueError(f"tool function {function.__qualname__}: {error} (a tool function needs type hints and a "
                         "docstring with an Args: section describing every parameter)") from error
    return Tool(name=name or schema["name"], description=schema.get("description", ""),
                parameters=schema.get("parameters", {"type": "object", "properties": {}}),
                run=lambda arguments, context: str(function(**arguments)), timeout_s=timeout_s)


def tool_from_schema(schema: Mapping[str, Any], function: Callable[..., Any], *,
                     timeout_s: float = DEFAULT_TOOL_TIMEOUT_S) -> Tool:
    """A tool from a JSON schema, in the OpenAI function format or as its inner {name, description, parameters},
    run by `function` called with the arguments as keywords."""
    inner = schema["function"] if "function" in schema else schema
    missing = {"name", "parameters"} - set(inner)
    if missing:
        raise ValueError(f"a tool schema needs {sorted(missing)}; got keys {sorted(inner)}")
    return Tool(name=inner["name"], description=inner.get("description", ""), parameters=dict(inner["parameters"]),
                run=lambda arguments, context: str(function(**arguments)), timeout_s=timeout_s)
