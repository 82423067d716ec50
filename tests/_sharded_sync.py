"""What the FSDP2 and ZeRO-3 tests check of a sharded policy's weight sync (tests/fsdp_worker.py's `sync_out`)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def assert_lora_sync_merges_the_adapters(sent: dict, single_trainer, base_model: str) -> None:
    """A sharded LoRA policy's weight sync sends W + the trained adapters' delta, as one process merges them
    (`single_trainer`: the same run in one process)."""
    from vlrft.models.weights import PolicyWeights

    assert sent["duplicates"] == []
    expected = {name: t for bucket in PolicyWeights(single_trainer.actor, torch.float32).buckets(1 << 30, "cpu")
                for name, t in bucket}
    base = load_file(Path(base_model) / "model.safetensors")
    assert sorted(sent["received"]) == sorted(expected)
    # else this check could not fail: the trained adapters move the merged weights of their layers well beyond the
    # tolerance (the base weights are frozen: only an adapted layer's weight can differ from the checkpoint)
    moved = {k for k in expected if (expected[k] - base[k]).abs().max() > 1e-3}
    assert moved and all(k.endswith(".weight") and "norm" not in k and "embed" not in k for k in moved), moved
    # 1e-4: the adapters themselves match one process to 1e-4 (see the callers)
    worst = max((sent["received"][k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-4, worst
