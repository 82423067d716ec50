"""The vision towers' attention batched by segment length (vlrft.models.vision_attention) equals transformers' SDPA
per window / frame / image, in values and gradients, with one SDPA call per segment length instead of one per
segment."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vlrft.models.actor import vision_module
from vlrft.models.tiny import TinySpec, build_processor, build_tiny_model
from vlrft.models.vision_attention import NAME, segment_sdpa, switched_copy, use_segment_attention

ARCHS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def _tower(arch: str):
    spec = TinySpec(arch=arch, vision_depth=2, max_pixels=28 * 28 * 64)
    processor = build_processor(spec)
    torch.manual_seed(0)
    model = build_tiny_model(spec, processor.tokenizer).float()
    # Three images, two sizes: whole-image segments of two lengths and, for Qwen2.5-VL, full and edge windows.
    images = [Image.new("RGB", (224, 224), (200, 40, 40)), Image.new("RGB", (196, 140), (40, 200, 40)),
              Image.new("RGB", (224, 224), (40, 40, 200))]
    pixels = processor.image_processor(images=images, return_tensors="pt")
    return model, pixels["pixel_values"].float(), pixels["image_grid_thw"]


def _run(tower, pixel_values, grid):
    """(features, gradient of the pixels, gradients of the tower's weights) for a fixed random projection."""
    pixel_values = pixel_values.clone().requires_grad_(True)
    out = tower(pixel_values, grid_thw=grid)
    features = out.pooler_output if hasattr(out, "pooler_output") else out[0]
    features = torch.cat(list(features)) if isinstance(features, (list, tuple)) else features
    torch.manual_seed(1)
    (features * torch.randn_like(features)).sum().backward()
    return features.detach(), pixel_values.grad, {n: p.grad.clone() for n, p in tower.named_parameters()
                                                  if p.grad is not None}


def _count_sdpa(monkeypatch) -> list[tuple]:
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counted(q, *args, **kwargs):
        calls.append(tuple(q.shape))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    return calls


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.slow
def test_segments_batched_by_length_equal_sdpa_per_segment_in_values_and_gradients(arch, monkeypatch):
    model, pixel_values, grid = _tower(arch)
    stock = vision_module(model)
    grouped = switched_copy(stock)
    assert grouped.config._attn_implementation == NAME
    assert stock.config._attn_implementation == "sdpa"

    calls = _count_sdpa(monkeypatch)
    expected = _run(stock, pixel_values, grid)
    stock_calls = len(calls)
    calls.clear()
    got = _run(grouped, pixel_values, grid)
    assert torch.equal(got[0], expected[0])  # CPU float32: the same kernel on the same rows, bitwise
    assert torch.allclose(got[1], expected[1], atol=1e-5)
    assert got[2].keys() == expected[2].keys()
    assert all(torch.allclose(got[2][n], expected[2][n], atol=1e-5) for n in expected[2])
    # One call per distinct segment length and layer instead of one per segment. Whole images: 2 lengths, 3 images.
    # Qwen2.5-VL's window layer: 8 full 64-patch windows and 4 edge windows of 3 more lengths (48, 16, 12).
    assert (stock_calls, len(calls)) == {"qwen2_5_vl": (12 + 3, 4 + 2)}.get(arch, (2 * 3, 2 * 2))


def test_a_frame_per_segment_video_runs_in_one_call_per_layer(monkeypatch):
    """Qwen2-VL attends within each frame of a video: 8 frames of one size are one batched call per layer."""
    model, _, _ = _tower("qwen2_vl")
    tower = vision_module(model)
    grid = torch.tensor([[8, 4, 4]])
    pixel_values = torch.randn(8 * 16, tower.patch_embed.proj.weight[0].numel())
    stock = _run(tower, pixel_values, grid)
    use_segment_attention(tower)
    calls = _count_sdpa(monkeypatch)
    got = _run(tower, pixel_values, grid)
    assert torch.allclose(got[0], stock[0], atol=1e-5) and torch.allclose(got[1], stock[1], atol=1e-5)
    assert calls == [(8, tower.blocks[0].attn.num_heads, 16, tower.blocks[0].attn.head_dim)] * len(tower.blocks)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_policy_reference_and_critic_switch_their_tower(arch):
    from vlrft.models.actor import ActorVL, CriticVL

    model, _, _ = _tower(arch)
    ActorVL(model, image_token_id=-1, video_token_id=-1)
    assert vision_module(model).config._attn_implementation == NAME
    other, _, _ = _tower(arch)
    CriticVL(other, image_token_id=-1, video_token_id=-1)
    assert vision_module(other).config._attn_implementation == NAME


def test_a_tower_subclassed_by_fsdp2_is_still_recognised():
    model, _, _ = _tower("qwen2_5_vl")
    tower = vision_module(model)
    tower.__class__ = type(f"FSDP{type(tower).__name__}", (type(tower),), {})  # what fully_shard does to a module
    assert use_segment_attention(tower)


def test_only_a_qwen_tower_on_sdpa_is_switched_and_a_saved_config_does_not_carry_it(tmp_path):
    model, _, _ = _tower("qwen2_5_vl")
    tower = vision_module(model)
    tower.config._attn_implementation = "eager"
    assert not use_segment_attention(tower) and tower.config._attn_implementation == "eager"
    assert not use_segment_attention(torch.nn.Linear(2, 2))
    tower.config._attn_implementation = "sdpa"
    assert use_segment_attention(tower) and use_segment_attention(tower)  # twice: still switched
    assert model.config.get_text_config()._attn_implementation == "sdpa"  # the language model keeps SDPA
    model.save_pretrained(tmp_path)
    assert NAME not in (tmp_path / "config.json").read_text()


def test_a_call_it_cannot_serve_is_refused_by_name():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="set its attention back to 'sdpa'"):
        segment_sdpa(torch.nn.Identity(), q, q, q, attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool),
                     cu_seq_lens_q=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="bidirectional attention within segments"):
        segment_sdpa(torch.nn.Identity(), q, q, q)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and none is visible")
@pytest.mark.parametrize("arch", ARCHS)
def test_on_cuda_in_bf16_segments_batched_by_length_equal_sdpa_per_segment(arch):
    """On a GPU the batched calls take SDPA's CUDA kernels (flash / memory-efficient) in bf16: the same features and
    gradients as one call per segment, within bf16's rounding."""
    model, pixel_values, grid = _tower(arch)
    stock = vision_module(model).cuda().to(torch.bfloat16)
    grouped = switched_copy(stock)
    pixel_values, grid = pixel_values.cuda().to(torch.bfloat16), grid.cuda()
    expected, got = _run(stock, pixel_values, grid), _run(grouped, pixel_values, grid)
    assert torch.allclose(got[0].float(), expected[0].float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(got[1].float(), expected[1].float(), atol=2e-2, rtol=2e-2)
