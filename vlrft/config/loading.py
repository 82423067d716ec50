"""Reading a YAML config file strictly, applying `section.key=value` overrides, and saving the resolved config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlrft.config.coercion import build_dataclass, to_dict
from vlrft.config.deprecated import DEPRECATED_KEYS, rename_deprecated
from vlrft.config.root import Config
from vlrft.errors import ConfigError, write_failed


def _strict_loader():
    """A YAML SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently: a second
    `train:` block would replace the first whole), naming both lines."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen: dict[tuple[str, str], int] = {}
                for key_node, _ in node.value:  # before `<<: *anchor` merges (keys written after one override it)
                    if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key, line = (key_node.tag, key_node.value), key_node.start_mark.line + 1
                    if key in seen:
                        raise _DuplicateKey(key_node.value, seen[key], line)
                    seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, second: int):
        super().__init__(key, first, second)
        self.key, self.first, self.second = key, first, second


def _read_yaml(path: Path, shown: str) -> Any:
    """The YAML file's contents; every way it can be unreadable is one `ConfigError` naming the file and where."""
    import yaml

    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise ConfigError(f"config file '{shown}' is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at line {line}); "
                          "save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"config file '{shown}' cannot be read: {exc.strerror or exc}") from None
    try:
        raw = yaml.load(text, Loader=_strict_loader())  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as dup:
        raise ConfigError(f"config file '{shown}': key '{dup.key}' is given twice in one mapping (lines {dup.first} "
                          f"and {dup.second}); the second would silently replace the first. Merge them into one") \
            from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file '{shown}' is not valid YAML{where}: {problem}; fix the file") from None
    except RecursionError:
        raise ConfigError(f"config file '{shown}' is nested too deeply to read; fix the file") from None
    cycle = _cycle_in(raw, "")
    if cycle is not None:
        raise ConfigError(f"config file '{shown}': '{cycle}' refers to a value that contains it (a YAML anchor used "
                          "inside its own value, e.g. `a: &x [*x]`); write the value out instead") from None
    return raw


def _cycle_in(value: Any, key: str, path: tuple[int, ...] = (), clean: set[int] | None = None) -> str | None:
    """The key of the first mapping or list that contains itself (a self-referencing YAML anchor), or None.

    `clean`: containers already walked without finding one (an anchor used many times is walked once)."""
    clean = set() if clean is None else clean
    if not isinstance(value, (dict, list)) or id(value) in clean:
        return None
    if id(value) in path:
        return key
    path = (*path, id(value))
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for k, item in items:
        found = _cycle_in(item, f"{key}.{k}" if key else str(k), path, clean)
        if found is not None:
            return found
    clean.add(id(value))
    return None


def _parse_value(item: str) -> Any:
    """The value of one `key=value` override, read as OmegaConf reads a dotlist value (YAML: numbers, lists, ...)."""
    from omegaconf import OmegaConf

    _, _, text = item.partition("=")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"]), resolve=False)["v"]
    except Exception as exc:
        raise ConfigError(f"config: could not parse override '{item}': {' '.join(str(exc).split())[:200]}") from None


def _override_key(key: str) -> list[str]:
    """The parts of an override's dotted key, a deprecated `section.key` renamed (so an old-name override still
    overrides the file's new-name key); `a[0].b` is taken as `a.0.b`."""
    parts = [p for p in key.replace("[", ".").replace("]", "").split(".")]
    if any(not p for p in parts):
        raise ConfigError(f"config: override key '{key}' has an empty part; write it as section.key=value")
    head = ".".join(parts[:2])
    if head in DEPRECATED_KEYS:
        rename_deprecated({parts[0]: {parts[1]: None}})  # the warning, once
        parts[:2] = DEPRECATED_KEYS[head].split(".")
    return parts


def _merged(old: Any, new: Any) -> Any:
    """A mapping given as an override merges into the one there (as OmegaConf.merge does); anything else replaces."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = dict(old)
        for k, v in new.items():
            out[k] = _merged(out.get(k), v)
        return out
    return new


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`data` with each `section.key=value` applied; a number indexes a list (`reward.functions.0.weight=2`,
    `data.train_files.0=x`). Each problem is one `ConfigError` naming the override."""
    import copy

    given = {item.partition("=")[0].strip() for item in overrides}
    for old, new in DEPRECATED_KEYS.items():
        if old in given and new in given:
            raise ConfigError(f"config: both '{old}' and '{new}' are set; keep only '{new}' ('{old}' is its "
                              "deprecated name)")
    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"config: override '{item}' is not of the form section.key=value (e.g. train.lr=1e-6)")
        key = item.partition("=")[0].strip()
        parts, value = _override_key(key), _parse_value(item)
        node: Any = out
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            where = ".".join(parts[:depth]) or "the top level"
            if isinstance(node, list):
                if not part.lstrip("-").isdigit():
                    raise ConfigError(f"config: override '{item}': '{where}' is a list; index it by number "
                                      f"({where}.0.{'.'.join(parts[depth:])}=...) or give the whole list "
                                      f"({where}=[...])")
                index = int(part)
                if not 0 <= index < len(node):
                    raise ConfigError(f"config: override '{item}': '{where}' has {len(node)} entries (0 to "
                                      f"{len(node) - 1}), so there is no entry {index}; give the whole list "
                                      f"({where}=[...]) to add entries")
                if last:
                    node[index] = _merged(node[index], value)
                else:
                    if node[index] is None:
                        node[index] = {}
                    node = node[index]
                continue
            if not isinstance(node, dict):
                raise ConfigError(f"config: override '{item}': '{where}' is {node!r}, not a mapping or list, so "
                                  f"'{part}' cannot be set inside it")
            if last:
                node[part] = _merged(node.get(part), value)
            else:
                if node.get(part) is None:  # not in the file: a list's default is what an index points into
                    default = _default_at(parts[:depth + 1])
                    node[part] = copy.deepcopy(default) if isinstance(default, list) else {}
                node = node[part]
    return out


def _default_at(parts: list[str]) -> Any:
    """The default value at a dotted key of Config (None where there is none, e.g. inside a list or a mapping)."""
    value: Any = to_dict(Config())
    for part in parts:
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), world_size: int | None = None,
                validate: bool = True) -> Config:
    """Load a YAML config (or defaults when `path` is None), apply `section.key=value` overrides, validate."""
    from omegaconf import OmegaConf

    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' not found; pass the path of a YAML file such as configs/demo.yaml")
        raw = _read_yaml(p, str(path))
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections (model:, data:, ...), not "
                              f"{type(raw).__name__}")
        raw = rename_deprecated(raw)
    if overrides:
        raw = apply_overrides(raw, list(overrides))
    try:
        data = OmegaConf.to_container(OmegaConf.create(raw), resolve=True)
    except RecursionError:
        raise ConfigError("config: an interpolation ${...} refers to itself; fix it") from None
    except Exception as exc:
        text = " ".join(str(exc).split())[:300]
        raise ConfigError(f"config: could not resolve interpolations: {text}") from None
    cfg = build_dataclass(Config, data)
    return cfg.validate(world_size) if validate else cfg


def save_config(cfg: Config, out_dir: str | Path, name: str = "config.yaml") -> Path:
    """Write the resolved config (secrets removed) next to a run's outputs; a failed write is a `UserError`."""
    import yaml

    out = Path(out_dir)
    target = out / name
    try:
        out.mkdir(parents=True, exist_ok=True)
        target.write_text(yaml.safe_dump(to_dict(cfg, redact_secrets=True), sort_keys=False), encoding="utf-8")
    except OSError as exc:  # a full disk or a read-only mount: one line naming the file, not a traceback
        raise write_failed(target, exc) from exc
    return target
