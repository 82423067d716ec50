"""Finding tool calls in a model turn: the Qwen / Hermes format `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.

A parser maps the turn's decoded text to `None` (no call: the trajectory is done), a `ToolCall`, or
a `MalformedCall` (the model tried to call and got the format wrong: it sees an error observation).
A parser that raises or returns anything else is counted in `tools/parser_errors`, logged once, and
the model reads an error observation (`vlrft.rollout.multiturn`); the run goes on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from vlrft.tools.types import ToolCall

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class MalformedCall:
    """A call that could not be parsed; `reason` becomes the observation the model reads (after "Error: ")."""

    reason: str
    kind: str = "malformed_calls"  # the ToolStats counter it goes to ("parser_errors": the parser itself failed)


def parse_qwen_tool_call(text: str) -> ToolCall | MalformedCall | None:
    """The first `<tool_call>...</tool_call>` block of `text` (one call per turn)."""
    if TOOL_CALL_OPEN not in text:
        return None
    match = _CALL.search(text)
    if match is None:
        return MalformedCall(f"the tool call is not closed with {TOOL_CALL_CLOSE}")
    try:
        payload = json.loads(match.group(1).strip())
    except json.JSONDecodeError as exc:
        return MalformedCall(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return MalformedCall('the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return MalformedCall("the tool call's arguments are not a JSON object")
    if not isinstance(arguments, dict):
        return MalformedCall("the tool call's arguments are not a JSON object")
    return ToolCall(payload["name"], arguments)
