"""What the installed vision stack can do: torchvision gives video (and the fast image processors).

Without torchvision, images still work through transformers' PIL image processors; anything that
needs video raises `MissingDependencyError` naming torchvision.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

from vlrft.errors import MissingDependencyError


@lru_cache(maxsize=1)
def has_torchvision() -> bool:
    """True when torchvision imports and works with the installed torch (a broken install counts as absent)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
        from torchvision.transforms.v2 import functional  # noqa: F401
    except Exception:  # a torchvision built for another torch raises at import; treat it as missing
        return False
    return True


def require_video_support(what: str = "video input") -> None:
    """Raise a clear error when video cannot be processed on this install."""
    if not has_torchvision():
        raise MissingDependencyError(
            f"{what} needs the package 'torchvision' (the transformers video processors are built on it); "
            "install it with: pip install torchvision (matching your torch build), or drop the videos from the data"
        )
