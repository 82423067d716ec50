"""Help for every config key, read from the dataclass fields' `metadata["help"]` in vlrft.config.

`vlrft config --explain KEY` prints one key (or every key of a section); `vlrft config --markdown`
prints docs/config.md, which a test compares with the committed file, so the reference cannot
drift from the code.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import Any

from vlrft.config import DEPRECATED_KEYS, Config, _type_name, range_text
from vlrft.errors import ConfigError


@dataclass(frozen=True)
class KeyHelp:
    """One config key: its dotted name, type in words, default and help text."""

    key: str
    type_name: str
    default: str
    help: str
    section: bool = False  # a nested dataclass (e.g. model.lora): its own keys follow


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return "(section)"
    return json.dumps(value)


def iter_keys(cls: type = Config, prefix: str = "") -> list[KeyHelp]:
    """Every key under `cls` in declaration order, sections before their keys."""
    out: list[KeyHelp] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        nested = dataclasses.is_dataclass(tp)
        type_name = "section" if nested else _type_name(tp)
        if "range" in f.metadata:  # an integer option's declared range, checked at load
            type_name = type_name.replace("an integer", range_text(f.metadata["range"]), 1)
        out.append(KeyHelp(key, type_name, _default_text(f), f.metadata.get("help", ""), section=nested))
        if nested:
            out.extend(iter_keys(tp, key))
        elif typing.get_origin(tp) in (list, dict) and dataclasses.is_dataclass(typing.get_args(tp)[-1]):
            item = typing.get_args(tp)[-1]  # e.g. reward.functions: a list of RewardFunctionConfig
            out.extend(iter_keys(item, f"{key}[*]" if typing.get_origin(tp) is list else f"{key}.<label>[*]"))
    return out


def missing_help() -> list[str]:
    """Keys whose field has no help text (a test keeps this empty)."""
    return [k.key for k in iter_keys() if not k.help.strip()]


def explain(key: str, cfg: Config | None = None) -> str:
    """What `key` means, its type and default (and its value in `cfg`); a section lists all its keys."""
    note = ""
    if key in DEPRECATED_KEYS:
        note = f"'{key}' is the deprecated name of '{DEPRECATED_KEYS[key]}'\n"
        key = DEPRECATED_KEYS[key]
    keys = iter_keys()
    found = [k for k in keys if k.key == key]
    if not found:
        import difflib

        close = difflib.get_close_matches(key, [k.key for k in keys], n=3)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise ConfigError(f"config: no key '{key}'{hint}; `vlrft config --markdown` lists every key")
    lines = [_describe(found[0], cfg)]
    if found[0].section:
        lines += [_describe(k, cfg) for k in keys if k.key.startswith(key + ".") or k.key.startswith(key + "[")]
    return note + "\n".join(lines)


def _describe(k: KeyHelp, cfg: Config | None) -> str:
    if k.section:
        return f"{k.key}: {k.help}"
    head = f"{k.key}  ({k.type_name}; default {k.default})"
    value = _value_in(cfg, k.key) if cfg is not None else None
    if value is not None:
        head += f"; here: {json.dumps(value)}"
    return f"{head}\n    {k.help}"


def _value_in(cfg: Config, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        if "[" in part or not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
    from vlrft.config import to_dict

    return to_dict(obj, redact_secrets=True)


def markdown() -> str:
    """docs/config.md: every key of every section with type, default and meaning."""
    lines = ["# Configuration reference", "",
             "Generated from the help text of the dataclass fields in `vlrft/config/` (`rollout.*` in `rollout.py`, ...) by",
             "`vlrft config --markdown > docs/config.md`; a test keeps this file and the code in step.",
             "`vlrft config --explain KEY` prints one entry.", ""]
    hints = typing.get_type_hints(Config)
    for k in iter_keys():
        if k.section and "." not in k.key:
            lines += ["", f"## `{k.key}`", "", (hints[k.key].__doc__ or k.help).strip(), "",
                      "| key | type | default | meaning |", "|---|---|---|---|"]
        elif k.section:
            lines.append(f"| `{k.key}` | section | | {_cell(k.help)} |")
        else:
            lines.append(f"| `{k.key}` | {_cell(k.type_name)} | `{_cell(k.default)}` | {_cell(k.help)} |")
    lines += ["", "## Deprecated names", "", "| old key | use |", "|---|---|"]
    lines += [f"| `{old}` | `{new}` |" for old, new in DEPRECATED_KEYS.items()]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
