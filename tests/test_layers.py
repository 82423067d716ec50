"""The import graph points down: no module in vlrft/ imports from a layer above it (docs/design.md, "Layers")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "vlrft"


def layers() -> dict[str, int]:
    """Top-level module or package of vlrft -> its layer, as written in docs/design.md."""
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    found = {name.strip(): int(n) for n, names in re.findall(r"^layer (\d+): (.+)$", text, flags=re.M)
             for name in names.split(",")}
    assert found, "docs/design.md lists no 'layer N: a, b' lines"
    return found


def _unit(module: str) -> str:
    """vlrft.models.actor -> models; vlrft -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every vlrft import in `path`, at any depth (inside functions too)."""
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative import: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([target] if target else []))
            out.append((node.lineno, target))
    return [(line, name) for line, name in out if name == "vlrft" or name.startswith("vlrft.")]


def test_every_module_is_placed_in_a_layer():
    order = layers()
    units = {p.stem if p.parent == PACKAGE else p.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("*.py")}
    assert units - set(order) == set(), "add these to the 'layer N:' lines of docs/design.md"


def test_no_module_imports_from_a_layer_above_it():
    order = layers()
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _unit(".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"))
        for line, name in imports_of(path):
            if order[_unit(name)] > order[me]:
                upward.append(f"{path.relative_to(REPO)}:{line} imports {name} "
                              f"(layer {order[_unit(name)]} > {me}'s layer {order[me]})")
    assert upward == []


def test_the_check_sees_imports_inside_functions():
    nested = PACKAGE / "data" / "processor.py"  # imports vlrft.vision_stack inside a method
    assert any(name == "vlrft.vision_stack" for _, name in imports_of(nested))


def test_no_two_units_import_each_other_even_within_a_layer():
    """Sideways imports within a layer are allowed, cycles are not: the unit graph of vlrft/ (top-level modules and
    packages) has no cycle, so each unit can be read, tested and replaced below the ones that use it."""
    edges: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _unit(".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"))
        edges.setdefault(me, set()).update(_unit(name) for _, name in imports_of(path) if _unit(name) != me)
    cycles = []

    def visit(unit: str, trail: list[str]) -> None:
        for nxt in sorted(edges.get(unit, ())):
            if nxt in trail:
                cycles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]))
            elif len(trail) < len(edges):
                visit(nxt, trail + [nxt])

    for unit in sorted(edges):
        visit(unit, [unit])
    assert cycles == []
