"""Where reward functions come from: the `@reward` registry, `module:function` and `path.py:function`.

    @reward("exact_color")
    def exact_color(completions, references, **kwargs):
        return [float(c.strip() == r) for c, r in zip(completions, references)]

A registered *class* is a reward factory: `RewardSet` builds it once with the config's kwargs and
calls the instance (used for stateful rewards such as a reward model or a remote server). The
registry itself is `vlrft.registry.REWARDS`, with the same duplicate-name rule as advantage
estimators and policy losses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, overload

from vlrft.registry import REWARDS

F = TypeVar("F", bound=Callable[..., Any])


@overload
def reward(name: F) -> F: ...
@overload
def reward(name: str | None = None, *, override: bool = False) -> Callable[[F], F]: ...


def reward(name=None, *, override: bool = False):
    """Register a reward function (or factory class) under `name` (default: its `__name__`).

    Usable as `@reward`, `@reward()` or `@reward("name")`. Registering a different object under a taken
    name is an error unless `override=True`; re-registering the same function (a module loaded twice) is fine.
    """
    if callable(name):
        return reward()(name)
    return REWARDS.register(name, override=override)


def registered_rewards() -> list[str]:
    """Names usable in `reward.functions[*].name` without a module path."""
    return sorted(REWARDS.names())


def resolve_reward(spec: str) -> Callable[..., Any]:
    """The callable (or factory class) named by a registry name, `module:function` or `path.py:function`."""
    return REWARDS.resolve(spec)
