"""Typed tools (`@tool(typed=True)`): the call's arguments as the function's parameters, the schema from its signature.

    @tool("count", typed=True)
    def count(color: Literal["red", "blue"], min_size: int = 0, *, context) -> str:
        '''Count the objects of one colour.

        Args:
            color: the colour to count
            min_size: smallest size counted, in pixels
        '''

The JSON schema the model is shown comes from the annotations (str, int, float, bool, list[...],
tuple, dict, Literal[...], Optional[...]; anything else, or none, accepts any value) and the
defaults (a parameter without one is required); the description is the docstring's first paragraph,
each argument's from its `Args:` section (Google style; `:param name:` lines work too). A parameter
named `context` receives the ToolContext and is not shown to the model. Values are not type-checked:
arguments that do not fit the signature (a missing or unknown name) are an error the model reads.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from typing import Any, Callable

CONTEXT = "context"
_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array",
           tuple: "array"}
_SECTIONS = re.compile(r"^\s*(Args|Arguments|Parameters|Params|Returns?|Raises|Yields|Examples?|Notes?)\s*:\s*$")
_ARG = re.compile(r"^(\s*)(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")
_PARAM = re.compile(r"^\s*:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


def typed_parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """The parameters the model fills (all but `context`); *args / **kwargs are not allowed."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != CONTEXT]
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise TypeError(f"a typed tool's parameters must be named ones the model can fill; {p} is not")
    return params


def schema_from_signature(fn: Callable[..., Any]) -> tuple[str, dict[str, Any]]:
    """(description, JSON-schema parameters) of a typed tool, from its docstring and signature."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: fall back to what is written
        hints = {}
    summary, documented = _docstring(inspect.getdoc(fn) or "")
    properties, required = {}, []
    for p in typed_parameters(fn):
        prop = _json_type(hints.get(p.name, p.annotation))
        if p.default is p.empty:
            required.append(p.name)
        elif _is_json(p.default):
            prop["default"] = p.default
        if p.name in documented:
            prop["description"] = documented[p.name]
        properties[p.name] = prop
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return summary, parameters


def typed_call(fn: Callable[..., Any]) -> Callable[[Any, Any], Any]:
    """`fn` as a `(call, context)` tool: the call's arguments bound to its parameters (TypeError naming them when
    they do not fit), the context passed as `context` when it takes one. An async `fn` gives an awaitable."""
    signature = inspect.signature(fn)
    names = [p.name for p in typed_parameters(fn)]
    takes_context = CONTEXT in signature.parameters

    def run(call, context):
        arguments = dict(call.arguments)
        unknown = [k for k in arguments if k not in names]
        if unknown:
            raise TypeError(f"{fn.__name__}() has no argument {', '.join(map(repr, unknown))}; its arguments are "
                            f"{', '.join(names)}")
        if takes_context:
            arguments[CONTEXT] = context
        try:
            bound = signature.bind(**arguments)
        except TypeError as exc:
            raise TypeError(f"{fn.__name__}(): {exc}; its arguments are {', '.join(names)}") from None
        return fn(*bound.args, **bound.kwargs)

    run.__name__ = getattr(fn, "__name__", "tool")
    run.__doc__ = fn.__doc__
    return run


def _json_type(annotation: Any) -> dict[str, Any]:
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    if annotation in _SIMPLE:
        return {"type": _SIMPLE[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        kinds = {type(a) for a in args}
        out: dict[str, Any] = {"enum": list(args)}
        if len(kinds) == 1 and next(iter(kinds)) in _SIMPLE:
            out = {"type": _SIMPLE[next(iter(kinds))], **out}
        return out
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return _json_type(options[0]) if len(options) == 1 else {"anyOf": [_json_type(a) for a in options]}
    if origin in (list, tuple, set, frozenset):
        out = {"type": "array"}
        if args and args[-1] is not Ellipsis and (origin is not tuple or len(set(args)) == 1):
            item = _json_type(args[0])
            if item:
                out["items"] = item
        return out
    if origin is dict:
        return {"type": "object"}
    return {}


def _docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(the first paragraph on one line, {argument: its description}) of a Google-style or `:param:` docstring."""
    lines = doc.splitlines()
    summary = []
    for line in lines:
        if not line.strip() or _SECTIONS.match(line) or _PARAM.match(line):
            break
        summary.append(line.strip())
    documented: dict[str, str] = {}
    section, current, indent = None, None, None
    for line in lines:
        param = _PARAM.match(line)
        if param:
            current, section = param.group(1), None
            documented[current] = param.group(2).strip()
            continue
        if line.strip().startswith(":"):  # :returns:, :raises: ... end a :param: description
            current = None
            continue
        header = _SECTIONS.match(line)
        if header:
            section, current, indent = header.group(1), None, None
            continue
        if section not in ("Args", "Arguments", "Parameters", "Params") and current is None:
            continue
        if not line.strip():
            current = None
            continue
        arg = _ARG.match(line)
        if arg and section and (indent is None or len(arg.group(1)) <= indent):
            indent, current = len(arg.group(1)), arg.group(2).lstrip("*")
            documented[current] = arg.group(4).strip()
        elif current is not None:  # a continuation line
            documented[current] = f"{documented[current]} {line.strip()}".strip()
    return " ".join(summary), documented


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
