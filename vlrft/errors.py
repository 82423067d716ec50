"""User-facing errors.

A `UserError` is a mistake the user can fix (bad config, missing file, bad sample). The CLI prints
it as one line and exits non-zero; `--debug` shows the traceback. Anything else is a bug.
"""


class UserError(Exception):
    """An error caused by user input; its message says what is wrong and how to fix it."""


class ConfigError(UserError):
    """A config file or override that cannot be loaded or does not validate."""


class DivergedError(UserError):
    """Training diverged (weights or logits exploded): the run stops before saving; the message names the way out.

    A UserError because its cause is a setting (a learning rate too high): one line, exit 2, not a traceback."""


class MissingDependencyError(UserError):
    """An optional package is needed for the requested feature; the message names the extra."""


def require(module: str, feature: str, extra: str | None = None):
    """Import an optional module or raise a `MissingDependencyError` naming what to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        hint = f"pip install 'vlrft[{extra}]'" if extra else f"pip install {module.split('.')[0]}"
        raise MissingDependencyError(f"{feature} needs the package '{module.split('.')[0]}' ({exc}); install it with: {hint}") from exc


def write_failed(path, exc: OSError, setting: str = "train.output_dir") -> UserError:
    """One line for a file that could not be written (a full disk, a read-only mount, no permission): the file, why,
    and the way out (free space there, or point `setting` at another folder)."""
    import errno

    reasons = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
               errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
               errno.EPERM: "permission denied"}
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    fix = f"free space there or choose another {setting}" if full else f"choose a writable {setting}"
    detail = exc.strerror or str(exc) or type(exc).__name__
    return UserError(f"cannot write '{exc.filename or path}': {reasons.get(exc.errno, 'the write failed')} ({detail}); "
                     f"{fix}")
