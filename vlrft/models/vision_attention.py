"""The vision towers' attention in one SDPA call per segment length, instead of one call per window.

Outside flash-attention, the Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision attention of transformers splits a
layer's tokens into their segments (Qwen2.5-VL's 64-patch windows, each video frame, each image) and calls
SDPA once per segment: 16 calls per layer for one 448 px image, tens of thousands per forward for a long
video. Each call is a few kernels and many dispatches, so on a GPU the tower is bound by launches, not
arithmetic. With flash-attention the tower hands the segment bounds (`cu_seqlens`) to one variable-length
call instead; `segment_sdpa` takes that same call and computes it with SDPA: segments of equal length are
stacked as one batch, so a layer costs one SDPA call per distinct segment length (the full windows, the
edge windows, each image size) and every segment still attends only to itself.

transformers passes `cu_seqlens` only to an attention function whose name contains "flash"
(`transformers.utils.generic.is_flash_attention_requested`), hence the registered name. Only the vision
config is switched, and only from "sdpa": the text model, eager and flash-attention runs are left as they are.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NAME = "vlrft_sdpa_by_segment_length_flash_varlen_api"
# The towers whose attention calls SDPA per segment outside flash-attention, and hands the bounds to a "flash" one.
TOWERS = frozenset({"Qwen2VisionTransformerPretrainedModel", "Qwen2_5_VisionTransformerPretrainedModel",
                    "Qwen3VLVisionModel", "Qwen3VLMoeVisionModel"})
_CACHE_SIZE = 8  # segment plans kept: a forward has two bound tensors (windows, whole images), each used per layer


@dataclass(frozen=True)
class SegmentPlan:
    """How a layer's tokens regroup: `groups` are (segment length, segments) in stacking order; `order` (None when
    the tokens are already in that order) gathers them, `inverse` puts the outputs back."""

    groups: tuple[tuple[int, int], ...]
    order: torch.Tensor | None
    inverse: torch.Tensor | None


_plans: dict[int, tuple[torch.Tensor, SegmentPlan]] = {}  # id(bounds) -> (bounds, plan); the reference keeps the id
_plans_lock = threading.Lock()


def _plan(bounds: torch.Tensor) -> SegmentPlan:
    """The plan for cumulative segment bounds `bounds` ([segments + 1]), made once per bounds tensor (one host read:
    every layer of a forward, and its recomputation under checkpointing, passes the same tensor)."""
    cached = _plans.get(id(bounds))
    if cached is not None and cached[0] is bounds:
        return cached[1]
    edges = bounds.tolist()
    starts: dict[int, list[int]] = {}
    for start, end in zip(edges, edges[1:]):
        if end > start:
            starts.setdefault(end - start, []).append(start)
    groups = tuple((length, len(first)) for length, first in starts.items())
    order = inverse = None
    if len(groups) > 1:
        order = torch.cat([(torch.tensor(first)[:, None] + torch.arange(length)).flatten()
                           for length, first in starts.items()]).to(bounds.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), device=order.device)
    plan = SegmentPlan(groups, order, inverse)
    with _plans_lock:
        while len(_plans) >= _CACHE_SIZE:
            _plans.pop(next(iter(_plans)))
        _plans[id(bounds)] = (bounds, plan)
    return plan


def segment_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, scaling: float | None = None, dropout: float = 0.0,
                 cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                 is_causal: bool = False, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention-function API, varlen form: `query`/`key`/`value` are [1, heads, tokens, head_dim] and
    `cu_seq_lens_q` bounds the segments; returns ([1, tokens, heads, head_dim], None)."""
    if cu_seq_lens_q is None or attention_mask is not None or is_causal or \
            (cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q):
        raise ValueError(f"{NAME} serves the vision towers' bidirectional attention within segments (cu_seqlens, no "
                         f"mask); {type(module).__name__} called it otherwise: set its attention back to 'sdpa'")
    plan = _plan(cu_seq_lens_q)
    heads, dim = query.shape[1], query.shape[3]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, head_dim]
    if plan.order is not None:
        q, k, v = (t.index_select(0, plan.order) for t in (q, k, v))
    outputs, start = [], 0
    for length, count in plan.groups:
        size = length * count
        qs, ks, vs = (t[start:start + size].reshape(count, length, heads, dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout, scale=scaling)
        outputs.append(out.transpose(1, 2).reshape(size, heads, dim))
        start += size
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    if plan.inverse is not None:
        out = out.index_select(0, plan.inverse)
    return out.unsqueeze(0), None


def use_segment_attention(vision: nn.Module | None) -> bool:
    """Switch a Qwen-VL vision tower on SDPA to `segment_sdpa`; returns whether it was switched (or already was)."""
    if not any(cls.__name__ in TOWERS for cls in type(vision).__mro__):  # FSDP2 subclasses as FSDP<name>
        return False
    config = vision.config
    current = getattr(config, "_attn_implementation", None)
    if current == NAME:
        return True
    if current != "sdpa":
        return False
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, segment_sdpa)
    config._attn_implementation = NAME
    return True


def switched_copy(vision: nn.Module) -> nn.Module:
    """A deep copy of a vision tower with a config of its own, switched by `use_segment_attention`; the original
    keeps its attention (for comparing the two, as the tests and bench/bench_vision_attention.py do)."""
    import copy

    twin = copy.deepcopy(vision)
    twin.config = copy.deepcopy(vision.config)
    for module in twin.modules():
        if hasattr(module, "config"):
            module.config = twin.config
    use_segment_attention(twin)
    return twin
