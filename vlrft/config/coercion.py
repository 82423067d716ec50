"""dict -> dataclasses, strictly typed: unknown keys and wrong types are one `ConfigError` naming the key; and back
(`to_dict`)."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

from vlrft.config.deprecated import DEPRECATED_KEYS, rename_deprecated
from vlrft.config.root import Config
from vlrft.errors import ConfigError


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of {_type_name(typing.get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    return {type(None): "null", bool: "true/false", int: "an integer", float: "a number", str: "a string",
            Any: "any value"}.get(tp, getattr(tp, "__name__", str(tp)))


class _Mismatch(Exception):
    pass


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Return `value` as type `tp` or raise `_Mismatch` (the caller words the message)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch
        return build_dataclass(tp, value, key)
    if origin is Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _Mismatch
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise _Mismatch
        return [_coerce_or_fail(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(tp)
        if not isinstance(value, dict):
            raise _Mismatch
        return {str(k): _coerce_or_fail(item, v, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                return float(value)
            except ValueError:
                raise _Mismatch from None
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise _Mismatch
    raise TypeError(f"config field {key} has an unsupported type {tp!r}")


def _coerce_or_fail(tp: Any, value: Any, key: str) -> Any:
    try:
        return _coerce(tp, value, key)
    except _Mismatch:
        raise ConfigError(f"config: {key}={value!r} is invalid; expected {_type_name(tp)}") from None


def build_dataclass(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from a plain dict, naming the full key of any unknown or mistyped entry."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    if cls is Config or any(old.startswith(f"{prefix}.") for old in DEPRECATED_KEYS):
        data = rename_deprecated(data, prefix)
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""
            where = f"'{prefix}'" if prefix else "the top level"
            raise ConfigError(f"config: unknown key '{full}'{hint}; allowed keys in {where}: {', '.join(names)}")
        kwargs[key] = _coerce_or_fail(hints[key], value, full)
    return cls(**kwargs)


def to_dict(obj: Any, redact_secrets: bool = False) -> Any:
    """Dataclass tree -> plain dict; secret fields become None when `redact_secrets`."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if redact_secrets and f.metadata.get("secret"):
                value = None
            out[f.name] = to_dict(value, redact_secrets)
        return out
    if isinstance(obj, list):
        return [to_dict(v, redact_secrets) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v, redact_secrets) for k, v in obj.items()}
    return obj
