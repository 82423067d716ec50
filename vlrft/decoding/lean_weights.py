"""The lean step's weights: which text decoders it takes, and their projections in one of three layouts.

Layouts (`Projections`; why each, with figures: docs/decoding.md, "Weight layouts"):
- packed: CPU float32, the projections sharing an input concatenated in oneDNN's blocked layout (MKL repacks a
  plain weight on every call);
- cast: under autocast over weights in another dtype, concatenated and cast once per decode call;
- in place: the model's own weights as views (a LoRA delta through its two small matrices), nothing copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlrft.sampling import LEAN_ATTENTION, LEAN_DECODE_FAMILIES

# Text decoders whose layer is: RMSNorm -> q/k/v (optional bias; Qwen3: RMSNorm on each head) -> rotary ->
# attention -> o_proj -> residual -> RMSNorm -> SiLU-gated MLP -> residual; final RMSNorm. Listed by family in
# vlrft.sampling, which the memory plan reads too.
SUPPORTED_TEXT_MODELS = tuple(dict.fromkeys(LEAN_DECODE_FAMILIES.values()))


def unsupported_reason(text_model: nn.Module) -> str | None:
    """Why `text_model` cannot use the lean step (None: it can)."""
    name = type(text_model).__name__
    if name not in SUPPORTED_TEXT_MODELS:
        return f"{name} is not one of {', '.join(SUPPORTED_TEXT_MODELS)}"
    config = text_model.config
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "the model has sliding-window layers"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act is {config.hidden_act}, not silu"
    if getattr(config, "_attn_implementation", "sdpa") not in LEAN_ATTENTION:
        return f"attention implementation {config._attn_implementation} (lean decoding uses SDPA)"
    for layer in text_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if q_norm is not None and q_norm.variance_epsilon != k_norm.variance_epsilon:
            return "the q and k head norms have different eps (the lean step norms q's and k's heads as one)"
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            reason = None if type(linear) is nn.Linear else _lora_reason(linear)
            if reason is not None:
                return reason
    for parameter in text_model.parameters():
        if type(parameter.data) is not torch.Tensor:  # DTensor (FSDP2 shard) or another tensor subclass
            return f"parameters are {type(parameter.data).__name__}, not whole tensors"
    return None


def _is_lora(linear: nn.Module) -> bool:
    return hasattr(linear, "base_layer") and hasattr(linear, "get_delta_weight") and hasattr(linear, "lora_A")


def _lora_reason(linear: nn.Module) -> str | None:
    """Why a non-Linear projection cannot be read as one weight (None: a plain LoRA adapter over a Linear)."""
    name = type(linear).__name__
    if not _is_lora(linear) or type(linear.base_layer) is not nn.Linear:
        return f"a projection is a {name}, neither a Linear nor a LoRA adapter over one"
    active = [a for a in linear.active_adapters if a in linear.lora_A]
    if linear.merged or linear.disable_adapters:
        return "a LoRA adapter is merged into its base weight or disabled"
    use_dora, lora_bias = getattr(linear, "use_dora", {}), getattr(linear, "lora_bias", {})
    if any(use_dora.get(a) or lora_bias.get(a) or a in getattr(linear, "lora_variant", {}) for a in active):
        return "a LoRA adapter is a variant (DoRA, LoRA bias, ...) whose delta is not one weight"
    return None


def _weight_and_bias(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's weight and bias as its forward applies them; a LoRA adapter's base weight plus the active
    adapters' delta (a new tensor), which is what `x @ W.T + scaling * B(A(x))` computes."""
    if not _is_lora(linear):
        return linear.weight, linear.bias
    base = linear.base_layer
    with torch.no_grad():
        weight = base.weight.detach().clone()
        for adapter in linear.active_adapters:
            if adapter in linear.lora_A:
                weight += linear.get_delta_weight(adapter).to(weight.dtype)
    return weight, base.bias


def _low_rank(linear: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """A LoRA adapter's active adapters as (A.T, B.T, scaling): its delta on `x` is `scaling * (x @ A.T) @ B.T`, as
    PEFT computes it (dropout is off in decoding). Empty for a plain Linear."""
    if not _is_lora(linear):
        return []
    return [(linear.lora_A[a].weight.t(), linear.lora_B[a].weight.t(), linear.scaling[a])
            for a in linear.active_adapters if a in linear.lora_A]


def rms_norm(x: torch.Tensor, norm: nn.Module, weight: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """transformers' Qwen RMSNorm: normalised in float32, cast back, then scaled by the weight (`weight`: the
    norm's weight laid out for `x`, e.g. per head). `out_dtype`: the result written in that dtype by the scaling's
    own kernel (what the next matmul under autocast would cast it to; the same rounding, one kernel fewer)."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)
    return written_in(out_dtype, torch.mul, norm.weight if weight is None else weight, normed)


def written_in(dtype: torch.dtype | None, op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`op(a, b)` (a broadcasting mul or add), its result written in `dtype` by the op's own kernel where both
    operands are in another dtype: the same rounding as casting the result, one kernel fewer. Else as it is (mixed
    operands: cast by whatever reads it)."""
    if dtype is None or dtype in (a.dtype, b.dtype):
        return op(a, b)
    return op(a, b, out=torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=dtype, device=b.device))


def _linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) (+ residual) in one dispatched op: what `F.linear` runs, minus its transpose dispatch."""
    if residual is not None:
        out = torch.addmm(residual, x, weight_t)
        return out if bias is None else out.add_(bias)
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


class Projections:
    """Linear projections of one input (a layer's q/k/v, its gate/up, or one projection alone), in one of the three
    layouts of the module docstring. Copies (packed, cast) are rebuilt each decode call: training changes the
    weights. A residual is folded into the matmul, except under autocast, where transformers adds it in float32."""

    def __init__(self, linears: list[nn.Module], rows: int, pack: bool, cast: torch.dtype | None = None,
                 joined: int = 1):
        self.fold_residual = cast is None  # under autocast transformers adds the residual after the matmul
        plain = [linear.base_layer if _is_lora(linear) else linear for linear in linears]
        if cast == plain[0].weight.dtype:
            cast = None  # already in the compute dtype: read in place
        self.packed, self.bias, self.views, self.low_rank = None, None, [], []
        self.sizes = [linear.weight.shape[0] for linear in plain]
        # the first `joined` projections come out side by side as one tensor (q and k, which rotate together)
        self.joined = joined
        if not pack and cast is None:
            # read in place, LoRA's delta applied through its two small matrices: no merged copy of the weight
            # (under FSDP2 the gathered weights are bf16 already, and a copy per layer would be 2 B per parameter)
            self.views = [(linear.weight.t(), linear.bias) for linear in plain]
            self.low_rank = [_low_rank(linear) for linear in linears]
            return
        weights, biases = zip(*(_weight_and_bias(linear) for linear in linears))
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        if any(bias is not None for bias in biases):
            self.bias = torch.cat([bias if bias is not None else weight.new_zeros(size)
                                   for bias, size in zip(biases, self.sizes)])
        if pack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
        else:
            self.views = [(weight.detach().to(cast).t(), None if self.bias is None else self.bias.to(cast))]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each projection of `x` [rows, in] (plus `residual`, for a single projection)."""
        if self.packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            outs = [out if residual is None else out.add_(residual)]
        elif residual is not None and not self.fold_residual:
            outs = [residual + self._delta(x, _linear(x, weight_t, bias), i) for i, (weight_t, bias) in
                    enumerate(self.views)]
        else:
            outs = [self._delta(x, _linear(x, weight_t, bias, residual), i) for i, (weight_t, bias) in
                    enumerate(self.views)]
        if len(outs) == len(self.sizes):  # one matmul each: the joined ones concatenated
            return [torch.cat(outs[:self.joined], dim=-1) if self.joined > 1 else outs[0], *outs[self.joined:]]
        return list(outs[0].split([sum(self.sizes[:self.joined]), *self.sizes[self.joined:]], dim=-1))

    def _delta(self, x: torch.Tensor, out: torch.Tensor, index: int) -> torch.Tensor:
        """`out` plus projection `index`'s LoRA deltas on `x` (in the views layout; none elsewhere)."""
        for a_t, b_t, scaling in self.low_rank[index] if self.low_rank else ():
            # in the adapter's dtype (PEFT keeps float32 adapters on a bf16 model), back in the output's
            out = out + (torch.mm(torch.mm(x.to(a_t.dtype), a_t), b_t) * scaling).to(out.dtype)
        return out


def packing_applies(weight: torch.Tensor) -> bool:
    """Whether decode steps pack the projections (`Projections`): float32 on a CPU with oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights as the step uses them."""

    norm1: nn.Module
    qkv: Projections  # -> (q and k side by side, v)
    # Qwen3: RMSNorm over each head before the rotary, q's and k's in one: (q_norm, the weights per head [q + k heads,
    # head_dim]: q_norm's for q's heads, k_norm's for k's; the norms share their eps)
    qk_norm: tuple[nn.Module, torch.Tensor] | None
    o: Projections
    norm2: nn.Module
    gate_up: Projections
    down: Projections

    @classmethod
    def of(cls, layer: nn.Module, rows: int, pack: bool, cast: torch.dtype | None) -> "LayerWeights":
        attn, mlp = layer.self_attn, layer.mlp

        def projections(*linears: nn.Linear, joined: int = 1) -> Projections:
            return Projections(list(linears), rows, pack, cast, joined)

        qk_norm = None
        if getattr(attn, "q_norm", None) is not None:
            heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
            per_head = torch.cat([attn.q_norm.weight.expand(heads, -1), attn.k_norm.weight.expand(kv_heads, -1)])
            qk_norm = (attn.q_norm, per_head)
        return cls(layer.input_layernorm, projections(attn.q_proj, attn.k_proj, attn.v_proj, joined=2), qk_norm,
                   projections(attn.o_proj), layer.post_attention_layernorm, projections(mlp.gate_proj, mlp.up_proj),
                   projections(mlp.down_proj))
