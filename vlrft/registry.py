"""Named plug-ins (advantage estimators, policy losses, reward functions) behind one registry type.

One rule for every kind: a name is taken by the first object registered under it; registering a
*different* object under a taken name raises `ValueError` unless `override=True`, and registering
the same object again (a module imported twice) is a no-op. A config names a plug-in by its
registered name, `module:function` or `path/to/file.py:function`; `Registry.resolve` accepts all
three, so a custom estimator, loss or reward works from the command line without registering it.

This module sits at the bottom of the layers (beside vlrft.errors), so vlrft.config can check names
at load time. Each registry knows its built-in names and the module that registers them (its
`provider`, imported by name only when a name outside the built-ins is looked up): built-ins are
plug-ins too, and the config layer never imports the algorithm or reward layers directly.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

from vlrft.errors import ConfigError

T = TypeVar("T")


def qualified_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


class Registry(Generic[T]):
    """Name -> object for one kind of plug-in.

    `kind` names it in messages ("advantage estimator"), `config_key` is the key that selects one
    ("algorithm.advantage"), `builtins` are the names `provider` registers (checked without importing
    it), and `decorator` is the public way to register ("vlrft.algo.register_advantage").
    """

    def __init__(self, kind: str, config_key: str, provider: str, builtins: tuple[str, ...], decorator: str):
        self.kind, self.config_key, self.provider = kind, config_key, provider
        self.builtins, self.decorator_name = builtins, decorator
        self.entries: dict[str, T] = {}

    def add(self, name: str, obj: T, *, override: bool = False) -> T:
        """Register `obj` under `name` by the rule above; returns `obj`."""
        if not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r} must be non-empty without ':' (that syntax loads "
                             "module:function)")
        old = self.entries.get(name)
        if old is not None and qualified_name(old) != qualified_name(obj) and not override:
            raise ValueError(f"a {self.kind} named {name!r} is already registered ({qualified_name(old)}); "
                             "pick another name or pass override=True")
        self.entries[name] = obj
        return obj

    def register(self, name: str | None = None, *, override: bool = False) -> Callable[[T], T]:
        """Decorator: `@registry.register("name")` (default name: the object's `__name__`)."""

        def add(obj: T) -> T:
            return self.add(name or obj.__name__, obj, override=override)  # type: ignore[attr-defined]

        return add

    def load_builtins(self) -> None:
        importlib.import_module(self.provider)

    def names(self) -> list[str]:
        """Every registered name, built-ins first."""
        self.load_builtins()
        return [*self.builtins, *sorted(set(self.entries) - set(self.builtins))]

    def is_known(self, spec: str) -> bool:
        """Whether `spec` resolves, without importing the provider for a built-in name."""
        if spec in self.builtins:
            return True
        self.resolve(spec)
        return True

    def resolve(self, spec: str) -> T:
        """The object named by a registered name, `module:function` or `path.py:function`."""
        self.load_builtins()
        if spec in self.entries:
            return self.entries[spec]
        if ":" not in spec:
            names = self.names()
            close = difflib.get_close_matches(spec, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"config: {self.config_key}={spec!r}: {self.kind} {spec!r} is not registered{hint}; "
                              f"expected one of: {', '.join(names)}; or 'module:function' / "
                              f"'path/to/file.py:function' (or register it with {self.decorator_name})")
        return load_reference(spec, f"{self.config_key}={spec!r}")


def load_reference(spec: str, what: str) -> Any:
    """The callable named by `module:function` or `path/to/file.py:function`; `what` prefixes errors."""
    where, attr = spec.rsplit(":", 1)
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _load_file(Path(where), what)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ConfigError(f"config: {what}: cannot import module {where!r} ({exc}); check the name and "
                              "PYTHONPATH") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"config: {what}: {where!r} has no attribute {attr!r}; check the function name")
    if not callable(fn):
        raise ConfigError(f"config: {what}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def _load_file(path: Path, what: str):
    """Import a Python file by path, once per absolute path (under a private module name)."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"config: {what}: file {str(path)!r} not found; give a path relative to the working "
                          "directory or absolute")
    name = f"vlrft_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ConfigError(f"config: {what}: importing {str(path)!r} failed with {type(exc).__name__}: {exc}") from exc
    return module


ADVANTAGES: Registry = Registry(
    "advantage estimator", "algorithm.advantage", "vlrft.algo.advantages",
    ("grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "cpgd"), "vlrft.algo.register_advantage")
POLICY_LOSSES: Registry = Registry(
    "policy loss", "algorithm.policy_loss", "vlrft.algo.losses", ("ppo", "gspo", "cpgd"),
    "vlrft.algo.register_policy_loss")
REWARDS: Registry = Registry(
    "reward function", "reward.functions[*].name", "vlrft.rewards",
    ("accuracy", "math_accuracy", "exact_match", "choice", "numeric", "format", "iou", "remote", "reward_model"),
    "vlrft.rewards.reward")
TOOLS: Registry = Registry(
    "tool", "rollout.tools[*].name", "vlrft.tools.builtin", ("zoom", "crop"), "vlrft.tools.tool")
