"""Reading pickled files (checkpoints, downloaded datasets) without running code from them.

`torch.load(weights_only=False)` and `pickle.load` rebuild whatever objects a file names: a planted file's
`__reduce__` runs any function with any arguments the moment it is read (a resume, a `vlrft prepare`). Every file
vlrft reads back goes through here instead:

- `load_torch`: `torch.load(weights_only=True)`: tensors, numbers, strings and containers, plus an allow-list of
  classes by name (NumPy's array and dtype, which `np.random.get_state()` returns, are always allowed: the RNG
  files hold them). A file naming anything else is refused with a `UnsafeFileError`, one line naming the file
  and the global, before anything in it runs; a truncated or corrupt file is a `DamagedFileError`.
- `load_plain_pickle`: a `pickle.Unpickler` that refuses every global, so only plain containers, strings and
  numbers come back (RefCOCO's `refs(unc).p`).
- `RestrictedUnpickler`: the same with an explicit allow-list of classes (`torch.distributed.checkpoint`'s
  `.metadata`, which its own reader unpickles unchecked).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from vlrft.errors import UserError


class UnsafeFileError(UserError):
    """A file names a class or function outside the allow-list: it was refused, nothing in it ran."""


class DamagedFileError(UserError):
    """A file that cannot be read back (truncated, corrupt)."""


def _numpy_rng_globals() -> list:
    """What a pickled `np.random.get_state()` names: the array's rebuild function, ndarray, dtype, its dtype class."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import _reconstruct
    kinds = [np.ndarray, np.dtype, _reconstruct, type(np.dtype(np.uint32))]
    return kinds


_RNG_GLOBALS = _numpy_rng_globals()


def _refused_global(exc: BaseException) -> str | None:
    """The global `torch.load(weights_only=True)` refused (from its message), or None when it failed otherwise."""
    text = str(exc)
    if "Weights only load failed" not in text:
        return None
    found = re.search(r"GLOBAL ([\w.]+)", text)
    return found.group(1) if found else "an object outside the allow-list"


def load_torch(path: str | Path | IO[bytes], *, what: str = "file", allowed: Iterable[Any] = (),
               map_location="cpu", mmap: bool = False, name: str | None = None) -> Any:
    """`torch.load(path, weights_only=True)` with `allowed` classes (and NumPy's RNG types) allowed by name.

    Raises `UnsafeFileError` for a file naming anything else (its code never runs) and `DamagedFileError` for a
    truncated or corrupt one; `what` says what the file is in those one-line messages, `name` where it is (the
    path by default; `path` may be an open binary stream)."""
    source = path if hasattr(path, "read") else Path(path)
    path = name or source
    try:
        with torch.serialization.safe_globals([*_RNG_GLOBALS, *allowed]):
            return torch.load(source, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as exc:
        refused = _refused_global(exc)
        if refused is not None:
            raise UnsafeFileError(f"{what} '{path}' names {refused}, which only code, not saved state, needs: "
                                  "refused and nothing in it was run (vlrft writes tensors, numbers and "
                                  "containers only); delete it, or its folder, if you did not put it there") from None
        raise DamagedFileError(f"{what} '{path}' cannot be read ({_short(exc)}): truncated or corrupt") from None
    except (RuntimeError, EOFError, ValueError, OSError, KeyError, AttributeError, TypeError, IndexError) as exc:
        raise DamagedFileError(f"{what} '{path}' cannot be read ({_short(exc)}): truncated or corrupt") from None


def _short(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:160]


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles plain data plus the classes in `allowed` (a set of (module, name)); any other global is refused
    by name before anything is called."""

    allowed: frozenset[tuple[str, str]] = frozenset()

    def find_class(self, module: str, name: str):
        if (module, name) in self.allowed:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def load_plain_pickle(path: str | Path, *, what: str = "file", allowed: Iterable[tuple[str, str]] = (),
                      fix: str = "delete it if you did not put it there", **kwargs) -> Any:
    """Unpickle `path` allowing no global but `allowed` ((module, name) pairs): containers, strings, numbers.

    `kwargs` go to the unpickler (`encoding="latin1"` for Python 2 files). Raises `UnsafeFileError` naming the
    refused global, `DamagedFileError` for a file that is not a whole pickle."""
    path = Path(path)
    unpickler = type("_Restricted", (RestrictedUnpickler,), {"allowed": frozenset(allowed)})
    with path.open("rb") as handle:
        try:
            return unpickler(handle, **kwargs).load()
        except UnicodeDecodeError:  # a Python 2 file read without encoding="latin1": the caller retries
            raise
        except pickle.UnpicklingError as exc:
            if str(exc).startswith("global "):
                raise UnsafeFileError(f"{what} '{path}' names {str(exc).split()[1]}, which only code, not data, "
                                      f"needs: refused and nothing in it was run; {fix}") from None
            raise DamagedFileError(f"{what} '{path}' cannot be read ({_short(exc)}): truncated or corrupt") from None
        except (EOFError, ValueError, IndexError, KeyError, TypeError, AttributeError) as exc:
            raise DamagedFileError(f"{what} '{path}' cannot be read ({_short(exc)}): truncated or corrupt") from None
