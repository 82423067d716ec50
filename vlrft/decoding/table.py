"""The one place a decoder is chosen: every variant, where it is the default, and the bench figure that keeps it.

Every decoder has one small interface (`Decoder`): it is built from the prefill's KV cache (`DecodeInputs`), which
it holds from then on; `step(tokens, step)` feeds one token per row and returns the rows' new hidden states;
`keep(index)` drops every row not in `index`. docs/decoding.md has the variants' notes and figures in full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn

from vlrft.decoding import graph
from vlrft.decoding.lean import LeanDecoder
from vlrft.decoding.lean_weights import unsupported_reason
from vlrft.decoding.rows import HalvingRowsDecoder
from vlrft.decoding.transformers_layers import TransformersDecoder, text_model_of
from vlrft.models.precision import active_autocast_dtype


class Decoder(Protocol):
    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """Feed `tokens` [rows] as generated token number `step` (0-based): the new hidden states [rows, hidden]."""

    def keep(self, index: torch.Tensor) -> None:
        """Go on with rows `index` of the current ones only (the others stopped)."""


@dataclass(frozen=True)
class DecodeInputs:
    """What a decoder is built from; it takes over `cache`, the prefill's KV cache (one row per prompt)."""

    backbone: nn.Module
    cache: Any
    rows: torch.Tensor  # [rows]: each decoded row's prompt, a prompt's rows together
    row_mask: torch.Tensor  # [rows, prompt_len]: each row's prompt padding mask (left-padded)
    position: torch.Tensor  # [axes, rows]: each row's last prompt position (3 axes: M-RoPE; 1: 1-D positions)
    max_new_tokens: int
    mm_dtype: torch.dtype
    share_prompt: bool  # the lean decoder holds a prompt's KV once for its group (vlrft.sampling.shares_prompt)


@dataclass(frozen=True)
class Variant:
    build: Callable[[DecodeInputs], Decoder]
    static_cache: bool  # the prefill fills a transformers StaticCache for it (else a dynamic cache)
    default: str  # where it is the default
    figure: str  # the measured figure that keeps it


def _lean(inputs: DecodeInputs, fixed_shapes: bool = False) -> LeanDecoder:
    if active_autocast_dtype(inputs.row_mask.device) is not None:
        torch.clear_autocast_cache()  # the prefill's cached weight casts: one bf16 copy while decoding, not two
    return LeanDecoder(text_model_of(inputs.backbone), inputs.cache, inputs.rows, inputs.row_mask, inputs.position[0],
                       inputs.max_new_tokens, fixed_shapes=fixed_shapes, share_prompt=inputs.share_prompt,
                       mrope=inputs.position.shape[0] == 3)


def _transformers(inputs: DecodeInputs, static_cache: bool) -> Decoder:
    decoder = TransformersDecoder(inputs.backbone, inputs.cache, inputs.rows, inputs.row_mask, inputs.position,
                                  inputs.max_new_tokens, inputs.mm_dtype, static_cache)
    return HalvingRowsDecoder(decoder, len(inputs.rows))


VARIANTS: dict[str, Variant] = {
    "cuda_graph": Variant(
        lambda inputs: graph.CudaGraphDecoder(_lean(inputs, fixed_shapes=True)), False,
        "CUDA, Qwen2/2.5/3-VL, InternVL 3, LLaVA-OneVision, SmolVLM (rollout.cuda_graph_decode unset)",
        "H100, bench_decode.py, 0.5B shape, text group 8: 8,834 tokens/s, 7.37x generate; eager lean 1.95x"),
    "fixed_rows": Variant(
        lambda inputs: graph.FixedRowsDecoder(_lean(inputs, fixed_shapes=True)), False,
        "nowhere: rollout.cuda_graph_decode=true off CUDA, the graph's steps run eagerly (the CPU tests' path)",
        "none of its own: it is the cuda_graph variant's step, without the capture"),
    "lean": Variant(
        lambda inputs: HalvingRowsDecoder(_lean(inputs), len(inputs.rows)), False,
        "CPU, Qwen2/2.5/3-VL, InternVL 3, LLaVA-OneVision, SmolVLM; CUDA with rollout.cuda_graph_decode=false",
        "CPU, bench_decode.py, text group 4: 1.61x generate against 1.28x through transformers' layers"),
    "transformers_static": Variant(
        lambda inputs: _transformers(inputs, static_cache=True), True,
        "CUDA, models the lean step does not take (not Gemma 3: sliding-window layers), no autocast",
        "CPU, bench_decode.py, 112 px group 8: 1.52x generate against 1.34x with the dynamic cache"),
    "transformers_dynamic": Variant(
        lambda inputs: _transformers(inputs, static_cache=False), False,
        "CPU, models the lean step does not take; Gemma 3; under autocast; prompts prefilled in groups",
        "CPU, bench_decode.py, text group 4: 1.28x generate against 1.23x with the static cache"),
}


def lean_applies(backbone: nn.Module, position: torch.Tensor) -> bool:
    """Whether the lean step can decode: a supported text decoder, and text positions (equal on all axes)."""
    text_model = text_model_of(backbone)
    if text_model is None or unsupported_reason(text_model) is not None:
        return False
    return bool((position == position[0]).all())


def choose(*, lean: bool, device: torch.device, max_new_tokens: int, cuda_graph: bool | None,
           static_cache: bool | None, autocast_on: bool, one_prefill: bool, sliding_window: bool = False) -> str:
    """The name of the variant in VARIANTS that decodes a call. `cuda_graph`, `static_cache`: None picks by device.
    `sliding_window`: the model has sliding-window layers (Gemma 3), which the lean step refuses (`lean` is then
    False) and which decode over transformers' dynamic cache, whose sliding layers keep their window only."""
    if lean:
        fixed = (device.type == "cuda" if cuda_graph is None else cuda_graph)
        if fixed and max_new_tokens > graph.WARMUP_STEPS:  # a call too short for the capture's warm-up: no graph
            return "cuda_graph" if device.type == "cuda" else "fixed_rows"
        return "lean"
    static = device.type == "cuda" if static_cache is None else static_cache
    # a StaticCache cannot hold autocast's float32 keys beside bf16 values; a grouped prefill merges a dynamic cache
    return ("transformers_static" if static and not autocast_on and one_prefill and not sliding_window
            else "transformers_dynamic")
