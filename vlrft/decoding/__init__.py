"""Decoding for the hf engine: prefill each prompt once, then decode its group of completions.

One interface (`table.Decoder`): a decoder is built from the prefill's KV cache, which it holds; `step` feeds one
token per row, `keep` drops rows that stopped. `decode_groups` is the entry point the hf engine calls; the decoder
it uses is chosen in one place, `table.choose`, from the variants in `table.VARIANTS`:

| variant | default on | figure that keeps it |
|---|---|---|
| cuda_graph | CUDA, lean families | H100, 0.5B shape, text group 8: 7.37x generate, eager lean 1.95x |
| lean | CPU, lean families | CPU, text group 4: 1.61x generate, transformers' layers 1.28x |
| transformers_static | CUDA, other models | CPU, 112 px group 8: 1.52x generate, dynamic cache 1.34x |
| transformers_dynamic | CPU, other models; Gemma 3; autocast | CPU, text group 4: 1.28x generate, static cache 1.23x |
| fixed_rows | nowhere (cuda_graph_decode=true off CUDA) | the cuda_graph step without the capture (CPU tests) |

Lean families (`vlrft.sampling.LEAN_DECODE_FAMILIES`): Qwen2/2.5/3-VL (M-RoPE positions), InternVL 3,
LLaVA-OneVision, SmolVLM (1-D positions). Figures: `bench/bench_decode.py` (docs/results.md, docs/gpu_results.md).
The notes behind each choice (op and kernel counts, rounding under autocast, prefill budgets, shared prompts, 1-D
positions): docs/decoding.md. Imports only `vlrft.models` and lower layers.
"""

from __future__ import annotations

from vlrft.decoding.groups import DecodedRows, decode_groups
from vlrft.decoding.processors import sample_tokens, sampling_processors, sampling_warpers, step_processors
from vlrft.decoding.table import VARIANTS, Decoder, DecodeInputs, choose

__all__ = ["DecodeInputs", "DecodedRows", "Decoder", "VARIANTS", "choose", "decode_groups", "sample_tokens",
           "sampling_processors", "sampling_warpers", "step_processors"]
