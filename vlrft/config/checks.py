"""Value checks shared by the sections and `Config.validate`: one `ConfigError` line naming the key, the value and
what is allowed; every float finite, every integer within the range its `option` declares."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from vlrft.errors import ConfigError


# (key, test, what is allowed) for numbers whose range no other check covers; every float must also be finite.
_NUMBER_RANGES: tuple[tuple[str, typing.Callable[[Any], bool], str], ...] = (
    ("train.lr", lambda v: v > 0, "a number > 0, e.g. 1e-6"),
    ("train.weight_decay", lambda v: v >= 0, "a number >= 0"),
    ("train.max_grad_norm", lambda v: v >= 0, "a number >= 0 (0 turns clipping off)"),
    ("train.eval_temperature", lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    ("train.dist_timeout_minutes", lambda v: v > 0, "a number of minutes > 0, e.g. 30"),
    ("rollout.temperature", lambda v: v >= 0,
     "a number >= 0 (0 = greedy, which makes every completion of a group the same)"),
    ("rollout.top_p", lambda v: 0 < v <= 1, "a fraction in (0, 1] (1 = off)"),
    ("rollout.min_p", lambda v: 0 <= v <= 1, "a fraction in [0, 1] (0 = off)"),
    ("rollout.repetition_penalty", lambda v: v > 0, "a number > 0 (1 = off)"),
    ("model.lora.dropout", lambda v: 0 <= v < 1, "a fraction in [0, 1)"),
    ("algorithm.entropy_coef", lambda v: v >= 0, "a number >= 0"),
    ("algorithm.router_aux_loss_coef", lambda v: v >= 0, "a number >= 0"),
    ("algorithm.value_coef", lambda v: v >= 0, "a number >= 0"),
    ("algorithm.overlong_penalty", lambda v: v >= 0, "a number >= 0"),
    ("reward.timeout_s", lambda v: v > 0, "a number of seconds > 0"),
    ("reward.grader_timeout_s", lambda v: v > 0, "a number of seconds > 0"),
)


def _non_finite_numbers(obj: Any, prefix: str) -> typing.Iterator[tuple[str, float]]:
    """(key, value) of every NaN/inf float in a dataclass tree (lists and mappings included)."""
    import math

    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _non_finite_numbers(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name)
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            yield from _non_finite_numbers(item, f"{prefix}[{i}]")
    elif isinstance(obj, dict):  # reward recipes; free-form kwargs (values of any type) are the callee's to check
        for key, item in obj.items():
            if isinstance(item, list) or dataclasses.is_dataclass(item):
                yield from _non_finite_numbers(item, f"{prefix}.{key}")
    elif isinstance(obj, float) and not math.isfinite(obj):
        yield prefix, obj


def range_text(bounds: tuple[int | None, int | None]) -> str:
    """An integer range in words: 'a positive integer', 'an integer >= 0', 'an integer in [2, 3]'."""
    lo, hi = bounds
    if hi is not None:
        return f"an integer in [{lo}, {hi}]" if lo is not None else f"an integer <= {hi}"
    return "a positive integer" if lo == 1 else f"an integer >= {lo}"


def declared_ranges(obj: Any, prefix: str = "") -> typing.Iterator[tuple[str, Any, tuple[int | None, int | None]]]:
    """(key, value, (minimum, maximum)) of every option declared with a range in a dataclass tree (list items each)."""
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from declared_ranges(value, key)
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                yield from declared_ranges(item, f"{key}[{i}]")
        elif "range" in f.metadata:
            if isinstance(value, list):
                for i, item in enumerate(value):
                    yield f"{key}[{i}]", item, f.metadata["range"]
            elif value is not None:
                yield key, value, f.metadata["range"]


def validate_numbers(cfg: Any) -> None:
    """Every float of `cfg` (a `Config`) finite (a NaN learning rate or temperature trains garbage silently), every
    integer in its declared range, and the other ranges respected."""
    for key, value in _non_finite_numbers(cfg, ""):
        _fail(key, value, "a finite number (not nan or inf)")
    for key, value, (lo, hi) in declared_ranges(cfg):
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            _fail(key, value, range_text((lo, hi)))
    for key, ok, allowed in _NUMBER_RANGES:
        section, *rest = key.split(".")
        value = getattr(cfg, section)
        for name in rest:
            value = getattr(value, name)
        if not ok(value):
            _fail(key, value, allowed)
    for i, beta in enumerate(cfg.train.adam_betas):
        if not 0 <= beta < 1:
            _fail(f"train.adam_betas[{i}]", beta, "a number in [0, 1), e.g. [0.9, 0.999]")


def _fail(key: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"config: {key}={value!r} is not allowed; expected {allowed}")


def _positive(key: str, value: int) -> None:
    if value <= 0:
        _fail(key, value, "a positive integer")
