"""The policy's weights as a colocated engine loads them: checkpoint names, LoRA merged, in bounded buckets.

Engines load weights by the names of the checkpoint they were started from (vLLM maps both the
pre- and post-transformers-4.52 Qwen-VL layouts through `hf_to_vllm_mapper`; SGLang's loaders read
the layout the Hub checkpoints use). transformers 5 keeps weights under other names in memory
(`model.language_model.*`, `model.visual.*`) and reverts them when saving; we ask transformers for
that same reversion (`revert_weight_conversion`, what `save_pretrained` calls), so the names we send
are exactly those `save_pretrained` writes. A PEFT policy is sent merged (W + the adapters' delta,
computed per layer without touching the trained model); tied weights are sent once.

Tensors are produced lazily, one bucket of at most `bucket_bytes` at a time, so syncing a 7B model
never materialises a second full copy of it on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

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


@dataclass(frozen=True)
class _Entry:
    name: str  # checkpoint name
    produce: Callable[[], torch.Tensor]
    nbytes: int  # at the engine dtype


class PolicyWeights:
    """Iterates the policy's current weights in checkpoint names, LoRA merged, tied weights once.

    The name map is computed once; `buckets()` re-reads the live parameters every call.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.model = policy_module(model)
        self.dtype = dtype
        lora = _lora_modules(self.model)
        seen: set[tuple[int, int, tuple[int, ...]]] = set()
        plain: dict[str, torch.Tensor] = {}
        producers: dict[str, Callable[[], torch.Tensor]] = {}
        for key, tensor in self.model.state_dict(keep_vars=True).items():
            name = _clean_name(key)
            if name is None:
                continue
            identity = (tensor.data_ptr(), tensor.numel(), tuple(tensor.shape))
            if identity in seen and tensor.numel():  # a tied weight (lm_head = embed_tokens): engines tie it themselves
                continue
            seen.add(identity)
            plain[name] = tensor
            module = lora.get(key.rsplit(".base_layer.", 1)[0]) if ".base_layer." in key else None
            producers[name] = _merged(tensor, module) if module is not None and key.endswith(".weight") \
                else (lambda t=tensor: t.detach())
        names = checkpoint_names(self.model, plain)
        self._entries = [
            _Entry(names[name], producers[name],
                   plain[name].numel() * (torch.finfo(dtype).bits // 8 if plain[name].is_floating_point()
                                          else plain[name].element_size()))
            for name in plain
        ]

    @property
    def names(self) -> list[str]:
        return [e.name for e in self._entries]

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def _materialise(self, entry: _Entry, device: torch.device | str) -> torch.Tensor:
        tensor = entry.produce()
        if hasattr(tensor, "full_tensor"):  # a DTensor shard (FSDP2): the engine needs the whole tensor
            tensor = tensor.full_tensor()
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.to(device=device, dtype=dtype).contiguous()

    @torch.no_grad()
    def buckets(self, bucket_bytes: int, device: torch.device | str) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Lists of (checkpoint name, tensor) of about `bucket_bytes` each (a bigger tensor goes alone)."""
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for entry in self._entries:
            if bucket and size + entry.nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((entry.name, self._materialise(entry, device)))
            size += entry.nbytes
        if bucket:
            yield bucket
