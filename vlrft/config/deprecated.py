"""Old key names that still load: each renamed to its new key, with one warning naming it."""

from __future__ import annotations

import dataclasses
import os
import sys
import typing

from vlrft.config.root import Config
from vlrft.errors import ConfigError


# Old key -> new key. Batch sizes now say what they count and over which ranks; the old keys still
# load, with a warning naming the new one.
DEPRECATED_KEYS: dict[str, str] = {
    "rollout.batch_size": "rollout.global_batch_completions",
    "train.mini_batch_size": "train.global_mini_batch_completions",
    "train.micro_batch_size": "train.micro_batch_completions_per_rank",
    "train.eval_batch_size": "train.eval_batch_prompts",
}
_warned: set[str] = set()


def rename_deprecated(data: dict, prefix: str = "") -> dict:
    """A copy of the mapping at `prefix` (recursively for the top level) with deprecated keys renamed.

    Prints one warning per old key per process; giving both the old and the new key is an error.
    """
    out = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if full in DEPRECATED_KEYS:
            new_full = DEPRECATED_KEYS[full]
            new_key = new_full.rsplit(".", 1)[1]
            if new_key in data:
                raise ConfigError(f"config: both '{full}' and '{new_full}' are set; keep only '{new_full}' "
                                  f"('{full}' is its deprecated name)")
            if full not in _warned and os.environ.get("RANK", "0") == "0":
                _warned.add(full)
                print(f"vlrft: config key '{full}' is deprecated; use '{new_full}' ({_help_of(new_full)})",
                      file=sys.stderr)
            key = new_key
        elif not prefix and isinstance(value, dict):
            value = rename_deprecated(value, full)
        out[key] = value
    return out


def _help_of(key: str) -> str:
    section, name = key.split(".", 1)
    owner = typing.get_type_hints(Config)[section]
    return next(f.metadata.get("help", "") for f in dataclasses.fields(owner) if f.name == name)

