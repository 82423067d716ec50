"""What sampling is, below every engine: `SamplingParams`, finish reasons, and the group decoder's sizes.

The sizes and rules here are the hf engine's decoder's (`vlrft.decoding`, docs/decoding.md) that the memory plan
counts (`vlrft.plan.engine`): both import them from this module, so the plan cannot drift from the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlrft.families import FAMILIES

if TYPE_CHECKING:
    from vlrft.config import RolloutConfig

FINISH_STOP = "stop"  # an EOS / stop token or stop string ended the completion
FINISH_LENGTH = "length"  # max_new_tokens reached: the completion is truncated

# A decode call prefills its prompts this many padded tokens at a time at most (a prefill holds a layer's activations
# of every token it runs; docs/decoding.md, "Prefill"). A longer prompt runs alone.
PREFILL_TOKENS = 1 << 15
# Prompts of different lengths whose padded prefill mask would reach this many elements prefill one length at a time.
PREFILL_MASK_ELEMENTS = 1 << 26
# From this many padded prompt tokens the lean decoder holds a prompt's KV once per group, not once per row.
SHARED_PROMPT_TOKENS = 128
# The attention implementations whose layers the lean decode step reproduces (it computes with SDPA or baddbmm).
LEAN_ATTENTION = ("sdpa", "eager")

# How the hf engine samples each family (config.json `model_type`), from the family table (`vlrft.families`, its
# `hf_decoder`); the engine (vlrft.rollout.hf, vlrft.decoding) and the memory plan (vlrft.plan.engine) both read these,
# so the plan counts the decoder that runs.
# The group decoder (vlrft.decoding): each prompt prefilled once, then its n completions. It places tokens after a
# cached prompt by the model's M-RoPE rule (`get_rope_index`), or at 1-D positions (the prompt's last + 1, + 2, ...)
# for the families without one (ONE_D_POSITION_FAMILIES).
ONE_D_POSITION_FAMILIES = ("gemma3", "internvl", "llava_onevision", "smolvlm")
GROUP_DECODE_FAMILIES = tuple(f.model_type for f in FAMILIES if f.hf_decoder != "generate")
# Of those, the ones whose text decoder the lean decode step takes (its class name; vlrft.decoding.lean_weights);
# the others decode through transformers' layers, every row holding its own copy of its prompt's KV (Gemma 3: its
# sliding-window layers; GLM-4.1V, Qwen3-VL-MoE: other layer layouts). InternVL 3 and LLaVA-OneVision as released
# have a Qwen2 language model, SmolVLM a Llama one (a checkpoint with another decodes through transformers' layers).
LEAN_DECODE_FAMILIES = {f.model_type: f.lean_text_model for f in FAMILIES if f.hf_decoder == "lean"}
# A family the table gives `generate` samples through transformers' `generate` (as every family does with
# HFEngine(share_prompts=False)): the prompts repeated n times before the prefill, every row a KV cache of its prompt
# and completion.


def hf_decoder(model_type: str, lean_decode: bool = True, attn_implementation: str = "sdpa") -> str:
    """How the hf engine samples a `model_type` (one of vlrft.families.HF_DECODERS): the lean group decoder, the group
    decoder through transformers' layers, or transformers' `generate`. `lean_decode`: rollout.lean_decode;
    `attn_implementation`: model.attn_implementation."""
    if model_type not in GROUP_DECODE_FAMILIES:
        return "generate"
    if lean_decode and model_type in LEAN_DECODE_FAMILIES and attn_implementation in LEAN_ATTENTION:
        return "lean"
    return "transformers_layers"


def shares_prompt(n: int, prompt_tokens: int) -> bool:
    """Whether the lean decoder holds each prompt's KV cache once for its group of `n` rows."""
    return n > 1 and prompt_tokens >= SHARED_PROMPT_TOKENS


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; every field maps one-to-one onto each engine's own sampling options."""

    n: int = 1
    max_new_tokens: int = 64
    min_new_tokens: int = 0  # stop tokens cannot be sampled before this many tokens
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @classmethod
    def from_config(cls, cfg: "RolloutConfig", **overrides) -> "SamplingParams":
        params = dict(n=cfg.n, max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.min_new_tokens,
                      temperature=cfg.temperature, top_p=cfg.top_p,
                      top_k=cfg.top_k, min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty,
                      stop=tuple(cfg.stop), stop_token_ids=tuple(cfg.stop_token_ids))
        params.update(overrides)
        return cls(**params)


def request_seed(engine_seed: int, call: int, prompt: int) -> int:
    """The sampling seed of prompt `prompt` in an engine's `call`-th generate call. A function of these three only:
    the same completions in the colocated engine and on any rollout server, and after a resume that restored the
    call count.

    A hash, not a sum: vLLM seeds a group's k-th completion with seed + k, so seeds of neighbouring prompts that
    differ by less than the group size would share random streams (prompt p's completion 1 and prompt p + 1's
    completion 0 drawing the same noise), correlating samples across groups."""
    import hashlib

    digest = hashlib.blake2b(f"{engine_seed}:{call}:{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 2**16)  # room for seed + k
