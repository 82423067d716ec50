"""`option`: a config field with its help text, integer range and secrecy, read by the loader, the checks and docs."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Callable

SECRET = {"secret": True}  # field metadata: never written to the saved config


def option(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
           secret: bool = False, minimum: int | None = None, maximum: int | None = None) -> Any:
    """A dataclass field with its help text, which `vlrft config --explain` and docs/config.md show.

    `factory` builds a mutable default (a list or dict); `secret` keeps the value out of saved configs.
    `minimum` / `maximum`: the range of an integer option (of each item of a list of integers; null stays
    allowed where the type allows it), checked at load (`validate_numbers`) and shown in docs/config.md.
    Every integer option states one (a test checks), so `eval_batch_prompts=0` fails at load, not at the
    first evaluation.
    """
    metadata: dict[str, Any] = {"help": help}
    if secret:
        metadata.update(SECRET)
    if minimum is not None or maximum is not None:
        metadata["range"] = (minimum, maximum)
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)
