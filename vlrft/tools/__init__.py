"""Tool API for multi-turn rollouts: a tool is a plain sync or async callable `tool(call, context)`.

It receives the parsed `ToolCall` (name + JSON arguments) and a `ToolContext` (the trajectory's
images, the sample's columns, the turn) and returns text and/or images (or a `ToolOutput` with an
optional reward part and a done flag). Declare tools in `rollout.tools` by built-in name, `module:function`
or `path.py:function`; see docs/multiturn.md. `@tool(typed=True)`: a function taking the call's arguments as
its parameters, its schema from its signature and docstring (`vlrft.tools.signature`).
"""

from vlrft.tools.parsing import MalformedCall, parse_qwen_tool_call
from vlrft.tools.toolset import Tool, ToolSet, load_tool, tool
from vlrft.tools.types import ToolCall, ToolConfigError, ToolContext, ToolOutput, ToolStats

__all__ = ["MalformedCall", "Tool", "ToolCall", "ToolConfigError", "ToolContext", "ToolOutput", "ToolSet",
           "ToolStats", "load_tool", "parse_qwen_tool_call", "tool"]
