"""A lean decode step for Qwen-family text decoders: the same arithmetic as transformers' layers, fewer ops.

A decode step feeds one token per row through the text decoder. Through transformers' modules a
layer costs about 75 dispatched ops per token plus the Python of module calls, cache objects, mask
and rotary bookkeeping and output records; on a small model that fixed cost is most of the step
(CPU, hidden 64: 0.36 ms per layer per token). Here a step is the layers' arithmetic and nothing
else, about 45 ops per layer (44.7 with a per-row cache, `bench/bench_dispatch.py --decode`; 0.23 ms): the model's own weights read at each decode call (so no
weight sync is needed), residual adds folded into the output matmuls (not under autocast), a KV
cache preallocated for prompt + max_new_tokens positions and written in place, an additive mask
kept as one buffer, and the rotary cos/sin taken from a table the model's own rotary module
computed once (decoded tokens are text, whose M-RoPE positions are equal on all three axes, so the
table is indexed by one position per row).

On CPU in float32 (unless the step is compiled: `rollout.compile_decode`, `LeanDecoder(compiled=True)`)
the projections sharing an input (q/k/v, gate/up) are concatenated and reordered once per decode call into
oneDNN's blocked layout, which is what a matmul of a few rows needs: MKL
repacks a plain weight on every call, and the weights do not stay in cache from one step to the
next (bench/bench_decode.py: see docs/design.md). Elsewhere they are read in place.

Under autocast (the trainer's mixed precision on GPUs: float32 weights, bf16 matmuls) the step
computes what transformers' layers compute under the same autocast: the projections sharing an
input are concatenated and cast to the autocast dtype once per decode call (where the weights are
not in that dtype already: transformers' autocast casts them once per region too), residual adds
stay in float32, and attention is SDPA, as in transformers; the KV cache is kept in the autocast
dtype, which is what SDPA under autocast reads.

A LoRA-wrapped projection (PEFT's `lora.Linear`) decodes as its base weight plus the active adapters'
delta: where the weights are concatenated (packed or cast) the delta (`get_delta_weight`) is merged
into the copy once per decode call; where they are read in place it goes through the adapters' two
small matrices, as PEFT computes it (rounding differs from PEFT's forward by float32 / bf16 rounding).

q and k come out of the projections side by side and are normed (Qwen3) and rotated as one tensor;
under autocast the RMSNorm's scaling writes the next matmul's dtype itself. Kernels per layer matter
on a GPU, where a decode step is bound by them (`python bench/bench_dispatch.py --decode`).

Only architectures whose layers are known to be exactly this arithmetic are taken
(`unsupported_reason` says why another is not); anything else (DoRA and other LoRA variants,
sharded parameters, a sliding window) decodes through transformers (`decode_groups` falls back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlrft.models.precision import active_autocast_dtype

# Text decoders whose layer is: RMSNorm -> q/k/v (optional bias; Qwen3: RMSNorm on each head) -> rotary ->
# attention -> o_proj -> residual -> RMSNorm -> SiLU-gated MLP -> residual; final RMSNorm.
SUPPORTED_TEXT_MODELS = ("Qwen2VLTextModel", "Qwen2_5_VLTextModel", "Qwen3VLTextModel")

_compile_failed = False  # rollout.compile_decode failed once in this process: later decoders step eagerly


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
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
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


def _rms_norm(x: torch.Tensor, norm: nn.Module, weight: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """transformers' Qwen RMSNorm: normalised in float32, cast back, then scaled by the weight (`weight`: the
    norm's weight laid out for `x`, e.g. per head). `out_dtype`: the result written in that dtype by the scaling's
    own kernel (what the next matmul under autocast would cast it to; the same rounding, one kernel fewer)."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)
    return _written_in(out_dtype, torch.mul, norm.weight if weight is None else weight, normed)


def _written_in(dtype: torch.dtype | None, op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
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


class _Projections:
    """Linear projections of one input (a layer's q/k/v, its gate/up, or one projection alone).

    Packed (CPU, float32): the weights concatenated and reordered once into oneDNN's layout for
    matmuls of `rows` rows (the op inductor's CPU weight freezing uses), one matmul for all; a copy
    of the weights, rebuilt for every decode call since training changes them. Cast (`cast`, under
    autocast, weights in another dtype): concatenated and cast once, one matmul (a LoRA layer's delta
    merged into the copy). Else the model's own weights as transposed views, one matmul each, nothing
    copied (a LoRA layer's delta through its adapters' two small matrices). Under autocast a residual is
    added after the matmul, in float32, as transformers does; otherwise it is folded into the matmul.
    """

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


def _compile_fell_back(error: Exception) -> None:
    """Say once that compiling the step failed; later decoders step eagerly (each generate call builds one)."""
    import warnings

    global _compile_failed
    _compile_failed = True
    warnings.warn(f"rollout.compile_decode: torch.compile failed ({type(error).__name__}: {str(error)[:200]}); "
                  "decoding eagerly", RuntimeWarning, stacklevel=3)


def packing_applies(weight: torch.Tensor) -> bool:
    """Whether decode steps pack the projections (`_Projections`): float32 on a CPU with oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@dataclass(frozen=True)
class _LayerWeights:
    """One decoder layer's weights as the step uses them."""

    norm1: nn.Module
    qkv: _Projections  # -> (q and k side by side, v)
    # Qwen3: RMSNorm over each head before the rotary, q's and k's in one: (q_norm, the weights per head [q + k heads,
    # head_dim]: q_norm's for q's heads, k_norm's for k's; the norms share their eps)
    qk_norm: tuple[nn.Module, torch.Tensor] | None
    o: _Projections
    norm2: nn.Module
    gate_up: _Projections
    down: _Projections

    @classmethod
    def of(cls, layer: nn.Module, rows: int, pack: bool, cast: torch.dtype | None) -> "_LayerWeights":
        attn, mlp = layer.self_attn, layer.mlp

        def projections(*linears: nn.Linear, joined: int = 1) -> _Projections:
            return _Projections(list(linears), rows, pack, cast, joined)

        qk_norm = None
        if getattr(attn, "q_norm", None) is not None:
            heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
            per_head = torch.cat([attn.q_norm.weight.expand(heads, -1), attn.k_norm.weight.expand(kv_heads, -1)])
            qk_norm = (attn.q_norm, per_head)
        return cls(layer.input_layernorm, projections(attn.q_proj, attn.k_proj, attn.v_proj, joined=2), qk_norm,
                   projections(attn.o_proj), layer.post_attention_layernorm, projections(mlp.gate_proj, mlp.up_proj),
                   projections(mlp.down_proj))


@dataclass
class _SharedPrompt:
    """Each prompt's keys and values held once for its group of rows (`LeanDecoder(share_prompt=True)`).

    Copied per row, a long prompt's cache is repeated `group` times: 8 rows of a 16k-token video prompt of a 7B
    model hold 7.5 GB of copies of the same 0.94 GB, and every step reads them all. Here a row's query heads meet
    its prompt's keys in one batch per prompt and KV head (the `group` rows' query heads of that KV head are the
    batch's rows), and its own generated positions in one per row and KV head; one softmax over both score rows,
    so a row attends exactly as over the concatenated cache. Rows that stopped and were dropped (`keep`) leave
    their places in the prompt-by-prompt layout empty (zero queries, outputs dropped): `slots` maps each row there.
    """

    keys: list[torch.Tensor]  # per layer [prompts * kv_heads, prompt_len, head_dim]
    values: list[torch.Tensor]
    bias: torch.Tensor  # [prompts * kv_heads, 1, prompt_len]: 0 on a prompt's tokens, -inf on its left padding
    prompts: int
    group: int
    slots: torch.Tensor | None = None  # each row's place in the prompts x group layout (None: row i is place i)

    @classmethod
    def of(cls, prefill_cache, rows: torch.Tensor, prompt_mask: torch.Tensor,
           dtype: torch.dtype | None) -> "_SharedPrompt":
        """From the prefill's cache (one row per prompt); `rows` must be each prompt's rows together, as many for
        each (decode_groups' order); `prompt_mask` is per row."""
        first = prefill_cache.layers[0].keys
        prompts, kv_heads, prompt_len = first.shape[0], first.shape[1], prompt_mask.shape[1]
        group = len(rows) // prompts
        in_order = torch.arange(prompts, device=rows.device).repeat_interleave(group)
        if len(rows) != prompts * group or not torch.equal(rows, in_order):
            raise ValueError("share_prompt: `rows` must list each prompt's rows together, as many for every prompt "
                             "(the order decode_groups decodes in)")

        def flat(tensor: torch.Tensor) -> torch.Tensor:
            tensor = tensor[:, :, :prompt_len].to(dtype or tensor.dtype)
            return tensor.reshape(prompts * kv_heads, prompt_len, tensor.shape[-1])

        keys = [flat(layer.keys) for layer in prefill_cache.layers]
        values = [flat(layer.values) for layer in prefill_cache.layers]
        padding = ~prompt_mask[::group].bool()[:, None, None, :].expand(prompts, kv_heads, 1, prompt_len)
        bias = torch.zeros(padding.shape, dtype=keys[0].dtype, device=prompt_mask.device)
        bias.masked_fill_(padding, float("-inf"))
        return cls(keys, values, bias.view(prompts * kv_heads, 1, prompt_len), prompts, group)

    def keep(self, index: torch.Tensor) -> None:
        """Rows `index` of the current ones go on (the others stopped)."""
        self.slots = index if self.slots is None else self.slots.index_select(0, index)

    def _to_places(self, x: torch.Tensor) -> torch.Tensor:
        """Per-row `x` [rows, ...] in the prompts x group layout (empty places zero)."""
        if self.slots is None:
            return x
        return x.new_zeros(self.prompts * self.group, *x.shape[1:]).index_copy_(0, self.slots, x)

    def attend(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """One new query per row, `q` [rows, heads, dim], over its prompt and over its own generated positions
        (`keys`, `values` [rows * kv_heads, length, dim], `bias` [rows * kv_heads, 1, length]): [rows, heads * dim]."""
        rows, heads, dim = q.shape
        kv_heads, prompts, group = self.bias.shape[0] // self.prompts, self.prompts, self.group
        per_kv = heads // kv_heads
        prompt_keys, prompt_values = self.keys[layer], self.values[layer]
        prompt_len = prompt_keys.shape[1]

        def by_prompt(x: torch.Tensor) -> torch.Tensor:  # [places, kv, per_kv, n] -> [prompts * kv, group * per_kv, n]
            x = x.view(prompts, group, kv_heads, per_kv, x.shape[-1]).transpose(1, 2)
            return x.reshape(prompts * kv_heads, group * per_kv, x.shape[-1])

        def by_row(x: torch.Tensor) -> torch.Tensor:  # the inverse, then back to the current rows
            x = x.view(prompts, kv_heads, group, per_kv, x.shape[-1]).transpose(1, 2)
            x = x.reshape(prompts * group, kv_heads, per_kv, x.shape[-1])
            return x if self.slots is None else x.index_select(0, self.slots)

        # The products read the cache as it is (under autocast: bf16 operands and results, as transformers' eager
        # attention computes them); the softmax is float32, and the two halves of the output are added in float32
        # and rounded once (a bf16 add computes in float32). No float32 copy of any cache is made: the steps stay
        # bound by reading it once. The queries are laid out per row in the cache's dtype once, by one copy (the
        # cast the products' autocast would make twice).
        grouped = torch.empty((rows, kv_heads, per_kv, dim), dtype=keys.dtype, device=q.device)
        grouped.copy_(q.view(rows, kv_heads, per_kv, dim))
        prompt_scores = torch.baddbmm(self.bias, by_prompt(self._to_places(grouped)), prompt_keys.transpose(1, 2),
                                      alpha=scaling)
        own_scores = torch.baddbmm(bias, grouped.view(rows * kv_heads, per_kv, dim), keys.transpose(1, 2),
                                   alpha=scaling)
        scores = torch.cat([by_row(prompt_scores).reshape(rows * kv_heads, per_kv, prompt_len),
                            own_scores.to(prompt_scores.dtype)], dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(keys.dtype)
        prompt_probs, own_probs = probs.split([prompt_len, probs.shape[-1] - prompt_len], dim=-1)
        prompt_probs = self._to_places(prompt_probs.reshape(rows, kv_heads, per_kv, prompt_len))
        from_prompt = by_row(torch.bmm(by_prompt(prompt_probs), prompt_values))  # [rows, kv, per_kv, dim]
        own = torch.bmm(own_probs, values)
        return (from_prompt.reshape(rows * kv_heads, per_kv, dim) + own).view(rows, -1)


class LeanDecoder:
    """Decode steps for `rows` rows continuing prompts of `prompt_len` (left-padded) positions.

    Built from the prefill's KV cache, one row per prompt; `rows` picks each decoded row's prompt
    (repeated for the group), `prompt_mask` and `last_position` are per decoded row. `step` returns the
    final-norm hidden state of each row's new token, like the text model's last_hidden_state[:, -1].

    Each layer's cache is [rows, kv_heads, length, head_dim], used as [rows * kv_heads, ...] by
    batched matmuls in which a KV head's query heads are the rows (GQA without repeating the cache);
    the mask is additive (0 / -inf) in the same layout, so scores, mask and scaling are one `baddbmm`.
    Under autocast the same layout goes through SDPA, as transformers' layers do (`_sdpa`).
    """

    def __init__(self, text_model: nn.Module, prefill_cache, rows: torch.Tensor, prompt_mask: torch.Tensor,
                 last_position: torch.Tensor, max_new_tokens: int, fixed_shapes: bool = False,
                 share_prompt: bool = False, compiled: bool = False):
        self.model = text_model
        self.fixed_shapes = fixed_shapes
        # Under autocast: the dtype of its matmuls, in which the projections and the KV cache are kept.
        self.compute_dtype = active_autocast_dtype(text_model.embed_tokens.weight.device)
        # `compiled`: the step will be torch.compile'd, and inductor takes no oneDNN-packed weights as inputs
        pack = not compiled and self.compute_dtype is None and packing_applies(text_model.embed_tokens.weight)
        self.layers = [_LayerWeights.of(layer, len(rows), pack, self.compute_dtype) for layer in text_model.layers]
        first = text_model.layers[0].self_attn
        self.head_dim, self.scaling = first.head_dim, first.scaling
        self.prompt_len = prompt_mask.shape[1]
        device = prompt_mask.device
        self.shared: _SharedPrompt | None = None
        if share_prompt:
            self.shared = _SharedPrompt.of(prefill_cache, rows, prompt_mask, self.compute_dtype)
        # The per-row buffers: with a shared prompt the generated positions only, else the prompt's (copied) too.
        self.offset = 0 if self.shared else self.prompt_len  # where the generated positions start in them
        length = self.offset + max_new_tokens
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for index in range(len(self.layers)):
            keys, values = prefill_cache.layers[index].keys, prefill_cache.layers[index].values
            # With fixed shapes the attention reads positions not yet written: zeros there (masked, but 0 x NaN from
            # uninitialised memory would still be NaN); otherwise a step reads only what has been written.
            new = torch.zeros if fixed_shapes else torch.empty
            k_buffer = new(len(rows), keys.shape[1], length, keys.shape[3], dtype=self.compute_dtype or keys.dtype,
                           device=keys.device)
            v_buffer = new(len(rows), values.shape[1], length, values.shape[3],
                           dtype=self.compute_dtype or values.dtype, device=values.device)
            if not self.shared:
                k_buffer[:, :, :self.prompt_len] = keys[rows, :, :self.prompt_len]
                v_buffer[:, :, :self.prompt_len] = values[rows, :, :self.prompt_len]
            self.keys.append(k_buffer)
            self.values.append(v_buffer)
        self.kv_heads = self.keys[0].shape[1]
        dtype = self.keys[0].dtype
        bias = torch.full((len(rows), self.kv_heads, 1, length), float("-inf"), dtype=dtype, device=device)
        if not self.shared:
            bias[..., :self.prompt_len].masked_fill_(prompt_mask.bool()[:, None, None, :], 0.0)
        self.mask_bias = bias  # [rows, kv_heads, 1, length]: 0 where a row may attend, -inf elsewhere
        self.position = last_position.clone()  # [rows]: the last position each row has seen
        self.slot = torch.full((1,), self.offset - 1, dtype=torch.long, device=device)  # the last written
        table = torch.arange(int(last_position.max()) + max_new_tokens + 1, device=device)
        # in the hidden states' dtype, as transformers' layers take it (under autocast float32, not the cache's)
        probe = text_model.embed_tokens.weight.new_empty(1, 1, self.head_dim)
        cos, sin = text_model.rotary_emb(probe, table.view(1, 1, -1).expand(3, 1, -1))
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin[:half], sin[half:]]: the sign folded into the table
        self.cos, self.sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)  # [positions, head_dim]
        self.embed = text_model.embed_tokens.weight
        # `compiled` (rollout.compile_decode): inductor fuses the step's elementwise work (norms, rotary, SiLU gate,
        # casts, residual adds, a shared prompt's layout copies) into a few kernels around the matmuls. Compiled with
        # dynamic sizes (rows, prompt length, attended length) once, for every later call too (the compiled code is
        # kept per code object, not per decoder): static sizes would compile again for each training step's
        # prompts until the sizes that change were found. Eager if compiling fails.
        self._step = self._eager_step
        if compiled and not _compile_failed:
            try:
                self._step = torch.compile(self._eager_step, dynamic=True)
            except Exception as error:  # noqa: BLE001 - an unsupported platform or Python
                _compile_fell_back(error)

    def keep(self, index: torch.Tensor) -> None:
        """Drop every row not in `index` (rows that stopped)."""
        if self.fixed_shapes:
            raise RuntimeError("a fixed-shape LeanDecoder keeps every row; wrap it in vlrft.rollout.graph_decode."
                               "FixedRowsDecoder, whose keep() only stops reporting rows")
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.mask_bias = self.mask_bias.index_select(0, index)
        self.position = self.position.index_select(0, index)
        if self.shared:
            self.shared.keep(index)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """transformers' apply_rotary_pos_emb for one tensor [rows, heads, head_dim]. Under autocast the sum is
        written in the compute dtype by its own kernel: the cast the attention (and the cache) would make."""
        return _written_in(self.compute_dtype, torch.add, x * cos, torch.roll(x, self.head_dim // 2, dims=-1) * sin)

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Attention of one query per row as transformers' SDPA layers call it for one new token: a KV head's query
        heads folded into the query length ([rows, kv_heads, heads per kv head, dim]), so neither the KV cache is
        repeated nor `enable_gqa` taken (with a mask CUDA would fall back to the math kernel). [rows, heads * dim]."""
        rows, kv_heads, length = q.shape[0], keys.shape[1], keys.shape[2]
        mask = self.mask_bias[:, :1, :, :length]  # [rows, 1, 1, length], the same for every head
        grouped = q.view(rows, kv_heads, -1, q.shape[-1])
        return F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=self.scaling).view(rows, -1)

    def state(self) -> tuple[torch.Tensor, ...]:
        """Copies of what a step advances besides the KV cache (for `restore`)."""
        return self.slot.clone(), self.position.clone(), self.mask_bias.clone()

    def restore(self, state: tuple[torch.Tensor, ...]) -> None:
        """Undo steps since `state()`, in place. The KV entries they wrote stay, masked, until overwritten."""
        for tensor, saved in zip((self.slot, self.position, self.mask_bias), state):
            tensor.copy_(saved)

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """Feed `tokens` [rows] as generated token number `step` (0-based); the new hidden states [rows, hidden].

        The slot written, the positions and the mask advance as tensors, in place. With `fixed_shapes`
        every step attends over all preallocated positions (those not reached are masked) and `step`
        is not read: the same kernels on the same shapes each time, which a CUDA graph can replay.
        """
        if self._step == self._eager_step or (tokens.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self._step(tokens, step)  # (a CUDA graph records the step compiled in its warm-up: no fallback)
        state = self.state()
        try:
            return self._step(tokens, step)
        except torch.OutOfMemoryError:
            raise  # the eager step would need the memory too
        except Exception as error:  # noqa: BLE001 - no C++ compiler, an op inductor cannot lower, ...
            _compile_fell_back(error)
            self._step = self._eager_step
            self.restore(state)  # whatever the failed call advanced (its KV writes are masked again)
            return self._eager_step(tokens, step)

    def _eager_step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        rows, kv_heads, dim = tokens.shape[0], self.kv_heads, self.head_dim
        length = self.mask_bias.shape[-1] if self.fixed_shapes else self.offset + step + 1
        self.slot += 1
        self.position += 1
        self.mask_bias.index_fill_(-1, self.slot, 0.0)
        cos = self.cos.index_select(0, self.position).unsqueeze(1)  # [rows, 1, head_dim]
        sin = self.sin.index_select(0, self.position).unsqueeze(1)
        bias = self.mask_bias.view(rows * kv_heads, 1, -1)[..., :length]
        hidden = F.embedding(tokens, self.embed)  # [rows, hidden]
        for index, (weights, k_cache, v_cache) in enumerate(zip(self.layers, self.keys, self.values)):
            x = _rms_norm(hidden, weights.norm1, out_dtype=self.compute_dtype)
            qk, v = weights.qkv(x)
            qk, v = qk.view(rows, -1, dim), v.view(rows, kv_heads, dim)  # q's heads then k's: normed, rotated as one
            if weights.qk_norm is not None:
                qk = _rms_norm(qk, *weights.qk_norm)
            qk = self._rotate(qk, cos, sin)
            q, k = qk[:, :-kv_heads], qk[:, -kv_heads:]
            k_cache.index_copy_(2, self.slot, k.to(k_cache.dtype).unsqueeze(2))
            v_cache.index_copy_(2, self.slot, v.to(v_cache.dtype).unsqueeze(2))
            if self.shared:
                attended = self.shared.attend(index, q, k_cache.view(rows * kv_heads, -1, dim)[:, :length],
                                              v_cache.view(rows * kv_heads, -1, dim)[:, :length], bias, self.scaling)
            elif self.compute_dtype is not None:
                attended = self._sdpa(q, k_cache[:, :, :length], v_cache[:, :, :length])
            else:
                keys = k_cache.view(rows * kv_heads, -1, dim)[:, :length]
                values = v_cache.view(rows * kv_heads, -1, dim)[:, :length]
                grouped = q.reshape(rows * kv_heads, -1, dim)  # a KV head's query heads as rows
                scores = torch.baddbmm(bias, grouped, keys.transpose(1, 2), alpha=self.scaling)
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
                attended = torch.bmm(probs, values).view(rows, -1)
            [hidden] = weights.o(attended, residual=hidden)
            gate, up = weights.gate_up(_rms_norm(hidden, weights.norm2, out_dtype=self.compute_dtype))
            [hidden] = weights.down(F.silu(gate) * up, residual=hidden)
        return _rms_norm(hidden, self.model.norm)
