"""The policy's weights as a colocated engine loads them: checkpoint names, LoRA merged, in bounded buckets.

Engines load weights by the names of the checkpoint they were started from (vLLM maps both the
pre- and post-transformers-4.52 Qwen-VL layouts through `hf_to_vllm_mapper`; SGLang's loaders read
the layout the Hub checkpoints use). transformers 5 keeps weights under other names in memory
(`model.language_model.*`, `model.visual.*`) and reverts them when saving; we ask transformers for
that same reversion (`revert_weight_conversion`, what `save_pretrained` calls), so the names we send
are exactly those `save_pretrained` writes. A PEFT policy is sent merged (W + the adapters' delta,
computed per layer without touching the trained model); tied weights are sent once, found by name
(transformers' tied-weights map), never by storage address: a sharded parameter (`DTensor`) has
`data_ptr() == 0`, so addresses would make every same-shape parameter look tied.

A sharded policy (FSDP2 `DTensor`s, ZeRO-3 partitions) is gathered one tensor at a time on every
rank in lock-step (`full_tensor()` is a collective; `gather` is the strategy's context for the
parameters one tensor is made of: the weight, and a LoRA layer's adapters), so every rank must
iterate `buckets()` to the end even if only one sends. A rank holds the bucket it builds and one
gathered tensor, never a bucket's worth of gathered parameters besides.

Tensors are produced lazily, one bucket of at most `bucket_bytes` at a time, so syncing a 7B model
never materialises a second full copy of it on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ContextManager

import torch
from torch import nn

from vlrft.errors import UserError

_LORA_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


def policy_module(model: nn.Module) -> nn.Module:
    """The transformers model inside what the trainer passes (ActorVL, DDP wrapper, PEFT wrapper)."""
    for _ in range(4):
        if hasattr(model, "module") and isinstance(model.module, nn.Module):  # DDP / FSDP wrappers
            model = model.module
        elif hasattr(model, "get_base_model"):  # PEFT: LoRA layers are injected in place in the base model
            model = model.get_base_model()
        elif hasattr(model, "model") and hasattr(model, "logprobs"):  # ActorVL
            model = model.model
        else:
            break
    return model


def _clean_name(name: str) -> str | None:
    """The plain parameter name of a (possibly PEFT-injected) state-dict key; None for adapter-only entries."""
    if any(part in name for part in _LORA_PARTS) or ".original_module." in name:
        return None
    if ".modules_to_save." in name:  # the trained copy of a fully trained module; drop the adapter segment
        head, _, tail = name.partition(".modules_to_save.")
        name = f"{head}.{tail.partition('.')[2]}"
    return name.replace(".base_layer.", ".")


def _lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """PEFT LoRA layers by module path (those with a base layer and a `get_delta_weight`)."""
    return {name: module for name, module in model.named_modules()
            if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")}


def _merged(weight: torch.Tensor, module: nn.Module) -> Callable[[], torch.Tensor]:
    """W + the active adapters' delta (PEFT's own `get_delta_weight`, scaling included), computed on demand."""
    adapters = {*getattr(module, "lora_A", {}), *getattr(module, "lora_embedding_A", {})}
    if any(getattr(module, "use_dora", {}).get(name, False) for name in adapters):
        raise UserError("DoRA adapters rescale the merged weight; vLLM/SGLang weight sync merges plain LoRA only "
                        "(turn DoRA off or use rollout.engine=hf)")

    def produce() -> torch.Tensor:
        if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
            return weight.detach()  # already inside the weight, or switched off
        deltas = [module.get_delta_weight(name) for name in module.active_adapters if name in adapters]
        return weight.detach() + sum(deltas) if deltas else weight.detach()

    return produce


def _adapter_weights(module: nn.Module) -> tuple[torch.Tensor, ...]:
    """A LoRA layer's own parameters (A, B, magnitudes), not its base layer's."""
    return tuple(p for name, p in module.named_parameters() if not name.startswith("base_layer."))


def tied_weight_names(model: nn.Module) -> set[str]:
    """State-dict names of weights tied to another weight (e.g. lm_head.weight when embeddings are tied).

    transformers 5 records the active ties, expanded to full names, in `all_tied_weights_keys` (empty
    when the config does not tie); older versions list candidates in `_tied_weights_keys`, active
    when the config's `tie_word_embeddings` is set.
    """
    expanded = getattr(model, "all_tied_weights_keys", None)
    if isinstance(expanded, dict):
        return set(expanded)
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    ties = getattr(config, "tie_word_embeddings", None)
    if ties is None:
        ties = getattr(text, "tie_word_embeddings", False)
    keys = getattr(model, "_tied_weights_keys", None) or ()
    return set(keys) if ties else set()


def checkpoint_names(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Memory name -> checkpoint name, as transformers' `save_pretrained` renames them.

    Tracks tensors by identity through `revert_weight_conversion`: a pure renaming returns the same
    tensor objects. A conversion that builds new tensors (fused MoE experts split on save) cannot
    be streamed name by name and is refused.
    """
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5 keeps checkpoint names in memory
        return {name: name for name in tensors}
    reverted = revert_weight_conversion(model, dict(tensors))
    by_identity = {id(t): name for name, t in tensors.items()}
    mapping: dict[str, str] = {}
    for saved_name, tensor in reverted.items():
        source = by_identity.get(id(tensor))
        if source is None:
            raise UserError(f"{type(model).__name__}: transformers converts '{saved_name}' from several in-memory "
                            "weights when saving; vLLM/SGLang weight sync streams weights one by one and does not "
                            "support such models yet (use rollout.engine=hf)")
        mapping[source] = saved_name
    return mapping


def _checkpoint_converters(model: nn.Module) -> list | None:
    """transformers' converters from memory back to the published checkpoint (what loading applied, reversed); None
    before transformers 5, which keeps checkpoint layouts in memory."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return None
    conversions = getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(model, add_legacy=False)
    reverse = [c.reverse_transform() for c in (conversions or [])[::-1]]
    return [c for c in reverse if isinstance(c, WeightConverter)]


def _converter_of(name: str, converters: list):
    return next((c for c in converters if c.rename_source_key(name)[1] is not None), None)


def checkpoint_transposes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """In-memory name -> the two dimensions to swap for the published layout, of the weights transformers loads with
    one `Transpose` and nothing else: Qwen3-VL-MoE's fused experts, `gate_up_proj` [experts, 2 x intermediate, hidden]
    and `down_proj` [experts, hidden, intermediate] in memory, the release's [experts, hidden, 2 x intermediate] and
    [experts, intermediate, hidden], which vLLM's fused-expert loader takes (`is_fused_checkpoint_transposed`).

    Swapped always, not by comparing shapes as transformers' own `Transpose(check_dims=True)` does: the in-memory
    layout is fixed by the model class, and a square [2 x intermediate, hidden] would make the comparison guess."""
    from transformers.core_model_loading import Transpose

    converters = _checkpoint_converters(model) or []
    swaps: dict[str, tuple[int, int]] = {}
    for name, _ in model.named_parameters():
        converter = _converter_of(name, converters)
        operations = getattr(converter, "operations", None) or []
        if len(operations) == 1 and isinstance(operations[0], Transpose):
            swaps[name] = (operations[0].dim0, operations[0].dim1)
    return swaps


def unsyncable_weights(model: nn.Module) -> list[str]:
    """In-memory names of the weights vLLM's and SGLang's loaders would read wrongly if sent: those transformers
    converts between a published checkpoint and memory otherwise than by renaming or one transpose
    (`checkpoint_transposes`, which the sync undoes). Before transformers 5 (no conversion map), fused MoE experts
    (3-D weights under `.experts.`); other 3-D parameters (InternViT's cls_token [1, 1, C] and position_embeddings
    [1, N, C]) are as published."""
    converters = _checkpoint_converters(model)
    if converters is None:
        return [name for name, p in model.named_parameters() if p.dim() == 3 and ".experts." in name]
    swapped = checkpoint_transposes(model)
    return sorted(name for name, _ in model.named_parameters()
                  if name not in swapped and _converter_of(name, converters) is not None)


def _numel(tensor: torch.Tensor) -> int:
    """Elements of the whole tensor: a ZeRO-3 partition keeps its full size in `ds_numel` (it holds none)."""
    return int(getattr(tensor, "ds_numel", tensor.numel()))


def on_mesh_device(shard: torch.Tensor) -> torch.Tensor:
    """A DTensor shard moved to its device mesh's device type, where it is elsewhere.

    FSDP2's `cpu_offload` keeps the shards in host memory under a CUDA mesh; gathered as they are,
    the all-gather would run on the CPU tensors, over the process group's gloo backend (slow across
    nodes). FSDP2's own unshard copies a shard to the GPU first, and so does this: the gather then
    runs over NCCL, one tensor at a time. `"cuda"` is the current device, which each rank has set.
    """
    device_type = shard.device_mesh.device_type
    return shard if shard.device.type == device_type else shard.to(device_type)


def fusion_group(name: str) -> str:
    """The module whose projections an engine may fuse into one layer: `...layers.3.self_attn` for
    `...layers.3.self_attn.q_proj.weight` (q/k/v -> vLLM's `qkv_proj`), `...layers.3.mlp` for its
    `gate_proj`/`up_proj` (-> `gate_up_proj`)."""
    return name.rsplit(".", 2)[0]


def plan_buckets(entries: list, bucket_bytes: int) -> list[list]:
    """`entries` (with `.name`, `.nbytes`) in order, cut into buckets of at most `bucket_bytes` between fusion groups.

    vLLM (re)loads a fused layer (qkv, gate_up) from the weights it receives in one load call and runs
    its post-load processing (CPU weight packing, quantization) once it has them all: a bucket ending
    between q_proj and k_proj leaves the layer half loaded. So a group is never split; one larger than
    `bucket_bytes` goes in a bucket of its own.
    """
    groups: list[list] = []
    for entry in entries:
        if groups and fusion_group(groups[-1][-1].name) == fusion_group(entry.name):
            groups[-1].append(entry)
        else:
            groups.append([entry])
    planned: list[list] = [[]]
    size = 0
    for group in groups:
        group_bytes = sum(e.nbytes for e in group)
        if planned[-1] and size + group_bytes > bucket_bytes:
            planned.append([])
            size = 0
        planned[-1].extend(group)
        size += group_bytes
    return [bucket for bucket in planned if bucket]


@dataclass(frozen=True)
class _Entry:
    name: str  # checkpoint name
    produce: Callable[[], torch.Tensor]
    gathered: tuple[torch.Tensor, ...]  # what `produce` reads: the parameter (or buffer), and a LoRA layer's adapters
    nbytes: int  # at the engine dtype
    swap: tuple[int, int] | None = None  # dimensions swapped for the published layout (`checkpoint_transposes`)


class PolicyWeights:
    """Iterates the policy's current weights in checkpoint names, LoRA merged, tied weights once.

    The name map is computed once; `buckets()` re-reads the live parameters every call. `dtype`: what
    floating-point tensors are cast to (the engine's); None keeps each tensor's own (a checkpoint).
    `engine_layout`: weights transformers keeps transposed against the release are sent in the released layout,
    which the engines load (`checkpoint_transposes`); False keeps them as `save_pretrained` writes them (an export,
    which transformers reloads by comparing shapes, so a square expert tensor must stay as it is in memory).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype | None,
                 gather: Callable[[list[torch.Tensor]], ContextManager] | None = None,
                 engine_layout: bool = True):
        self.model = policy_module(model)
        self.dtype = dtype
        self._gather = gather or (lambda params: contextlib.nullcontext())
        lora = _lora_modules(self.model)
        tied = tied_weight_names(self.model)
        plain: dict[str, torch.Tensor] = {}
        producers: dict[str, Callable[[], torch.Tensor]] = {}
        reads: dict[str, tuple[torch.Tensor, ...]] = {}
        for key, tensor in self.model.state_dict(keep_vars=True).items():
            name = _clean_name(key)
            if name is None or name in tied:  # a tied weight (lm_head = embed_tokens): engines tie it themselves
                continue
            plain[name] = tensor
            module = lora.get(key.rsplit(".base_layer.", 1)[0]) if ".base_layer." in key else None
            merged = module is not None and key.endswith(".weight")
            producers[name] = _merged(tensor, module) if merged else (lambda t=tensor: t.detach())
            # ZeRO-3 partitions the adapters too: merging gathers them with the weight
            reads[name] = (tensor, *_adapter_weights(module)) if merged else (tensor,)
        names = checkpoint_names(self.model, plain)
        swaps = checkpoint_transposes(self.model) if engine_layout and _checkpoint_converters(self.model) else {}
        # Sharded tensors are gathered collectively: every rank must walk the buckets in lock-step.
        self.sharded = any(hasattr(t, "full_tensor") or hasattr(t, "ds_id") for t in plain.values())
        self._entries = [
            _Entry(names[name], producers[name], reads[name],
                   _numel(plain[name]) * (torch.finfo(dtype).bits // 8 if dtype is not None and
                                          plain[name].is_floating_point() else plain[name].element_size()),
                   swaps.get(name))
            for name in plain
        ]

    @property
    def names(self) -> list[str]:
        return [e.name for e in self._entries]

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def _materialise(self, entry: _Entry, device: torch.device | str | None) -> torch.Tensor:
        with torch.no_grad(), self._gather(list(entry.gathered)):  # released before the next tensor is gathered
            tensor = entry.produce()
            dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else tensor.dtype
            if hasattr(tensor, "full_tensor"):  # a DTensor shard (FSDP2): the engine needs the whole tensor
                # cast the shard, then gather: a bfloat16 engine's sync moves and holds half of float32's bytes
                tensor = on_mesh_device(tensor.to(dtype)).full_tensor()
            if entry.swap is not None:
                tensor = tensor.transpose(*entry.swap)
            return tensor.to(device=device, dtype=dtype).contiguous()

    def buckets(self, bucket_bytes: int, device: torch.device | str | None
                ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Lists of (checkpoint name, tensor) of about `bucket_bytes` each, on `device` (None: where each gathered
        tensor is). A module's weights go in one bucket (`plan_buckets`), even past `bucket_bytes`.

        This generator keeps no reference to a bucket it has handed out. A `for` loop's variable does, while the
        next bucket is gathered: end the loop body with `del bucket` so that only one bucket is alive at a time.
        """
        for entries in plan_buckets(self._entries, bucket_bytes):
            # Not `@torch.no_grad()` on this method: its generator wrapper keeps the last bucket it passed on.
            handed = [[(e.name, self._materialise(e, device)) for e in entries]]
            yield handed.pop()  # not kept in this frame while the caller uses it and asks for the next
