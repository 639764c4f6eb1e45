"""Tool calls in the text models write: one parser per format models actually emit, chosen per model.

- hermes (Qwen2.5, Qwen3, Hermes, many fine-tunes): each call is ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, one or more per reply, with free text around them.
- llama3_json (Llama 3.1 / 3.2 / 3.3 with custom tools): the whole reply is one JSON object ``{"name": ...,
  "parameters": {...}}`` (several joined by ``;``), optionally after ``<|python_tag|>``; a reply that does not start
  with ``{`` is a plain answer.
- mistral (Mistral v3-style templates): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}, ...]``. In
  Mistral tokenizers ``[TOOL_CALLS]`` is a control token, which decoding with special tokens skipped removes: a reply
  that starts with a JSON list of calls counts as calls with or without the marker.

`detect_tool_call_format` picks the format from the chat template's text (the markers its tool section writes) and
else from the model type; `environment.options.tool_call_format` overrides it.

A call that cannot be read (invalid JSON, no name, arguments that are not an object, an unclosed tag) is kept as a
malformed entry with the reason, so the environment answers it with an error observation and counts it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

ToolCallFormatName = Literal["hermes", "llama3_json", "mistral"]
FORMAT_NAMES: tuple[ToolCallFormatName, ...] = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for."""

    name: str
    arguments: Any
    """The arguments as decoded from JSON (checked against the tool's schema before the call)."""
    id: str | None = None
    """The id the model gave the call (Mistral), else None."""


@dataclass(frozen=True)
class ParsedReply:
    """What a reply says: its free text, the calls it makes and the calls that could not be read."""

    content: str
    """The reply without its tool calls."""
    calls: tuple[ToolCall, ...] = ()
    malformed: tuple[str, ...] = ()
    """Why each unreadable call could not be read."""

    @property
    def calls_tools(self) -> bool:
        """Whether the reply asks for any tool (readable or not): then the episode goes on with tool results."""
        return bool(self.calls or self.malformed)


def _json_error(text: str, error: json.JSONDecodeError) -> str:
    excerpt = text if len(text) <= 120 else text[:120] + "..."
    return f"the tool call is not valid JSON ({error.msg} at character {error.pos}): {excerpt!r}"


def _call_of(value: Any, arguments_keys: tuple[str, ...]) -> ToolCall | str:
    """A ToolCall from a decoded JSON object, or why it is not one."""
    if not isinstance(value, dict):
        return f"a tool call must be a JSON object with a name, got {json.dumps(value)[:120]}"
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return f"a tool call needs a string 'name', got keys {sorted(value)}"
    arguments: Any = {}
    for key in arguments_keys:
        if key in value:
            arguments = value[key]
            break
    if isinstance(arguments, str):  # some models write the arguments as a JSON string (OpenAI's wire format)
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return f"the arguments of {name} are a string that is not JSON: {error.msg}"
    call_id = value.get("id")
    return ToolCall(name=name, arguments=arguments, id=call_id if isinstance(call_id, str) else None)


class HermesFormat:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

    name: ToolCallFormatName = "hermes"
    _BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedReply:
        calls: list[ToolCall] = []
        malformed: list[str] = []
        for match in self._BLOCK.finditer(text):
            body, closing = match.group(1).strip(), match.group(2)
            if not closing:
                malformed.append("a <tool_call> block is not closed by </tool_call>")
                continue
            try:
                parsed = _call_of(json.loads(body), ("arguments", "parameters"))
            except json.JSONDecodeError as error:
                parsed = _json_error(body, error)
            (calls if isinstance(parsed, ToolCall) else malformed).append(parsed)
        content = self._BLOCK.sub("", text).strip()
        return ParsedReply(content, tuple(calls), tuple(malformed))

    def render(self, calls: list[ToolCall], content: str = "") -> str:
        blocks = [f'<tool_call>\n{{"name": "{c.name}", "arguments": {json.dumps(c.arguments)}}}\n</tool_call>'
                  for c in calls]
        return "\n".join([content, *blocks] if content else blocks)


class Llama3JsonFormat:
    """The reply as one JSON object ``{"name": ..., "parameters": {...}}`` (or several joined by ';')."""

    name: ToolCallFormatName = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedReply:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].strip()
        if not body.startswith("{"):
            return ParsedReply(text.strip())
        calls: list[ToolCall] = []
        malformed: list[str] = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                value, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError as error:
                malformed.append(_json_error(body[position:], error))
                break
            parsed = _call_of(value, ("parameters", "arguments"))
            (calls if isinstance(parsed, ToolCall) else malformed).append(parsed)
            position = end
            rest = body[position:].lstrip()
            if not rest:
                break
            if not rest.startswith(";"):
                malformed.append(f"text after a JSON tool call: {rest[:80]!r} (several calls are joined by ';')")
                break
            position = len(body) - len(rest[1:].lstrip())
        return ParsedReply("", tuple(calls), tuple(malformed))

    def render(self, calls: list[ToolCall], content: str = "") -> str:
        return "; ".join(f'{{"name": "{c.name}", "parameters": {json.dumps(c.arguments)}}}' for c in calls)


class MistralFormat:
    """``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}]`` (the marker may be absent, see above)."""

    name: ToolCallFormatName = "mistral"
    MARKER = "[TOOL_CALLS]"

    def parse(self, text: str) -> ParsedReply:
        stripped = text.strip()
        marked = self.MARKER in stripped
        if marked:
            content, _, body = stripped.partition(self.MARKER)
        elif stripped.startswith("[{"):
            content, body = "", stripped
        else:
            return ParsedReply(stripped)
        body = body.strip()
        try:
            value, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError as error:
            return ParsedReply(content.strip(), (), (_json_error(body, error),))
        values = value if isinstance(value, list) else [value]
        calls: list[ToolCall] = []
        malformed: list[str] = []
        for item in values:
            parsed = _call_of(item, ("arguments", "parameters"))
            (calls if isinstance(parsed, ToolCall) else malformed).append(parsed)
        if not values:
            malformed.append("[TOOL_CALLS] is followed by an empty list")
        return ParsedReply((content + body[end:]).strip(), tuple(calls), tuple(malformed))

    def render(self, calls: list[ToolCall], content: str = "") -> str:
        items = []
        for c in calls:
            item = {"name": c.name, "arguments": c.arguments}
            if c.id is not None:
                item["id"] = c.id
            items.append(item)
        return f"{self.MARKER} {json.dumps(items)}"


ToolCallFormat = HermesFormat | Llama3JsonFormat | MistralFormat

FORMATS: dict[str, type[HermesFormat] | type[Llama3JsonFormat] | type[MistralFormat]] = {
    "hermes": HermesFormat, "llama3_json": Llama3JsonFormat, "mistral": MistralFormat}

_MODEL_TYPES = {"qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
                "llama": "llama3_json", "mistral": "mistral", "mixtral": "mistral"}
"""Model types whose chat template did not say: the format of their family's instruct models."""


def parser_of(name: str) -> ToolCallFormat:
    """The parser of format `name` (hermes, llama3_json, mistral)."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; expected one of {', '.join(FORMAT_NAMES)}")
    return FORMATS[name]()


def detect_tool_call_format(chat_template: str | None, model_type: str | None = None) -> tuple[ToolCallFormatName, str]:
    """The tool-call format of a model, and why: from the markers its chat template writes for tool calls
    (``<tool_call>``, ``[TOOL_CALLS]``, Llama 3's ``ipython`` role), else hermes for a ChatML template (such as the
    embedded models'), else from its model type, else hermes (the most widely used)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral", "the chat template writes [TOOL_CALLS]"
    if "<tool_call>" in template:
        return "hermes", "the chat template writes <tool_call>"
    if "ipython" in template or "<|python_tag|>" in template:
        return "llama3_json", "the chat template has Llama 3's ipython role"
    if "<|im_start|>" in template:
        return "hermes", "the chat template is ChatML, as Hermes-format models' are"
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type], f"the model type is {model_type}"  # type: ignore[return-value]
    return "hermes", "neither the chat template nor the model type names a format (the default)"
