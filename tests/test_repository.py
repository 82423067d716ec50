"""The repository is self-contained: nothing in it points at files outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A design document elsewhere (the project carries docs/design.md), or a local path outside the repository.
OUTSIDE = re.compile(r"\.\./shared|/work/|DESIGN\.md|shared/DESIGN")
THIS_FILE = Path(__file__).resolve()


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    files = []
    for name in out:
        path = REPO / name
        if path.is_file() and path.resolve() != THIS_FILE and path.suffix in (".py", ".md", ".yaml", ".yml", ".txt",
                                                                              ".ini", ".cfg", ".toml", ".sh"):
            files.append(path)
    return files


def test_nothing_points_outside_the_repository():
    hits = []
    for path in tracked_text_files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert hits == [], "cite docs/design.md (or a paper / upstream project), not a file outside the repository"


def test_relative_markdown_links_resolve_inside_the_repository():
    broken = []
    for path in tracked_text_files():
        if path.suffix != ".md":
            continue
        for target in re.findall(r"\]\(([^)#\s]+)", path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            resolved = (path.parent / target).resolve()
            if REPO not in resolved.parents and resolved != REPO or not resolved.exists():
                broken.append(f"{path.relative_to(REPO)} -> {target}")
    assert broken == []
