"""Shared fixtures: tiny Qwen-VL model folders built locally once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# the media-check cache of a test session stays out of the user's ~/.cache
os.environ.setdefault("VLRFT_CACHE_DIR", __import__("tempfile").mkdtemp(prefix="vlrft-test-cache-"))


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """`tiny_vlm_dir(arch="qwen2_vl", **spec_fields)` -> folder with a tiny model + processor (cached per spec)."""
    from vlrft.models.tiny import TinySpec, build_tiny_vlm

    cache: dict[tuple, object] = {}

    def make(arch: str = "qwen2_vl", **fields):
        key = (arch, tuple(sorted(fields.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"tiny_{arch}")
            cache[key] = build_tiny_vlm(folder, TinySpec(arch=arch, **fields))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_processor(tiny_vlm_dir):
    """`tiny_processor(arch="qwen2_vl")` -> the processor loaded back from a tiny model folder."""
    from vlrft.models.loading import load_processor

    cache: dict[str, object] = {}

    def make(arch: str = "qwen2_vl"):
        if arch not in cache:
            cache[arch] = load_processor(tiny_vlm_dir(arch))
        return cache[arch]

    return make
