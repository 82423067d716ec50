"""Where reward functions come from: the `@reward` registry, `module:function` and `path.py:function`.

    @reward("exact_color")
    def exact_color(completions, references, **kwargs):
        return [float(c.strip() == r) for c, r in zip(completions, references)]

A registered *class* is a reward factory: `RewardSet` builds it once with the config's kwargs and
calls the instance (used for stateful rewards such as a reward model or a remote server).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, overload

from vlrft.errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])

_REGISTRY: dict[str, Callable[..., Any]] = {}


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

    def register(fn: F) -> F:
        key = name or fn.__name__
        if ":" in key:
            raise ValueError(f"reward name {key!r} must not contain ':' (that syntax loads module:function)")
        old = _REGISTRY.get(key)
        same = old is not None and _qualified(old) == _qualified(fn)
        if old is not None and not same and not override:
            raise ValueError(
                f"a reward named {key!r} is already registered ({_qualified(old)}); pick another name or pass override=True"
            )
        _REGISTRY[key] = fn
        return fn

    return register


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def registered_rewards() -> list[str]:
    """Names usable in `reward.functions[*].name` without a module path."""
    _load_builtins()
    return sorted(_REGISTRY)


def _load_builtins() -> None:
    import vlrft.rewards  # noqa: F401  (importing the package registers the built-ins)


def resolve_reward(spec: str) -> Callable[..., Any]:
    """The callable (or factory class) named by a registry name, `module:function` or `path.py:function`."""
    _load_builtins()
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if ":" not in spec:
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigError(
            f"reward function {spec!r} is not registered; use one of: {known}; or 'module:function' / 'path/to/file.py:function'"
        )
    where, attr = spec.rsplit(":", 1)
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _load_file(spec, Path(where))
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ConfigError(f"reward function {spec!r}: cannot import module {where!r} ({exc}); check the name and PYTHONPATH") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"reward function {spec!r}: {where!r} has no attribute {attr!r}; check the function name")
    if not callable(fn):
        raise ConfigError(f"reward function {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def _load_file(spec: str, path: Path):
    """Import a Python file by path, once per absolute path (under a private module name)."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"reward function {spec!r}: file {str(path)!r} not found; give a path relative to the working directory or absolute")
    name = f"vlrft_user_rewards_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ConfigError(f"reward function {spec!r}: importing {str(path)!r} failed with {type(exc).__name__}: {exc}") from exc
    return module
