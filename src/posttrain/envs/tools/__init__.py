"""Tool calling: tool declarations (`schema`), the tool-call formats models write (`formats`), the built-in tools
(`builtin`) and the environment that runs them between turns (`environment`). See docs/agents.md."""

from posttrain.envs.tools.environment import ERROR_KINDS, ToolEnvironment
from posttrain.envs.tools.formats import (
    ParsedReply,
    ToolCall,
    detect_tool_call_format,
    parser_of,
)
from posttrain.envs.tools.schema import Tool, ToolContext, ToolFailure, tool_from_function, tool_from_schema

__all__ = ["ERROR_KINDS", "ParsedReply", "Tool", "ToolCall", "ToolContext", "ToolEnvironment", "ToolFailure",
           "detect_tool_call_format", "parser_of", "tool_from_function", "tool_from_schema"]
