"""The policy in Hugging Face format from sharded weights (FSDP2, ZeRO-3), written one shard file at a time.

`save_pretrained` wants the whole state dict in one process: for a sharded 72B policy that is 288 GB of
float32 in rank 0's host memory at every checkpoint. Here every rank walks `PolicyWeights.buckets` in
lock-step (each tensor gathered collectively) and rank 0 writes each bucket as one safetensors file as it
arrives, then the index, the config and the processor: rank 0 holds one bucket (`SHARD_BYTES`) at a time.
Names are those `save_pretrained` writes (`PolicyWeights`: transformers' reversion of its in-memory names,
tied weights once), dtypes the weights' own or the one asked for (`train.hf_model_dtype`), so `from_pretrained`
reads the folder as it reads one `save_pretrained` wrote. A LoRA policy gathers only its adapter and saves it
with PEFT's `save_pretrained`.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ContextManager

import torch
from torch import nn

SHARD_BYTES = 2 << 30  # the largest shard file (a bigger tensor goes alone), as save_pretrained's max_shard_size
INDEX = "model.safetensors.index.json"


def save_policy_streamed(hf_model: nn.Module, processor, folder: Path, *, is_main: bool,
                         gather: Callable[[Sequence[torch.Tensor]], ContextManager],
                         shard_bytes: int = SHARD_BYTES, dtype: torch.dtype | None = None) -> None:
    """Write `hf_model` (sharded or not) into `folder` as `save_pretrained` would, its floating-point tensors in
    `dtype` (None: their own); every rank calls this together."""
    from safetensors.torch import save_file

    from vlrft.models.weights import PolicyWeights

    folder = Path(folder)
    if is_main:
        folder.mkdir(parents=True, exist_ok=True)
    parts: list[tuple[Path, list[str]]] = []
    total, written = 0, None  # written: the dtype of the floating-point weights, for config.json
    # Only rank 0 writes. The other ranks take part in each gather (one tensor at a time) and drop each gathered
    # tensor at once ("meta" keeps the shape, not the data): they hold one tensor at a time, never a bucket.
    # Not `enumerate`: its cached result tuple would hold the previous bucket while the next one is gathered.
    weights = PolicyWeights(hf_model, dtype, gather, engine_layout=False)  # as save_pretrained writes them
    for bucket in weights.buckets(shard_bytes, "cpu" if is_main else "meta"):
        if is_main:  # the other ranks only take part in the gathers
            part = folder / f"part-{len(parts):05d}.safetensors"
            save_file(dict(bucket), str(part), metadata={"format": "pt"})
            parts.append((part, [name for name, _ in bucket]))
            total += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
            written = written or next((t.dtype for _, t in bucket if t.is_floating_point()), None)
        del bucket  # freed before the next bucket is gathered: rank 0 holds one bucket, not two
    if not is_main:
        return
    weight_map = {}
    for i, (part, names) in enumerate(parts):
        final = "model.safetensors" if len(parts) == 1 else f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        os.replace(part, folder / final)
        weight_map.update(dict.fromkeys(names, final))
    if len(parts) > 1:
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                               indent=2, sort_keys=True))
    config = copy.deepcopy(hf_model.config)  # what is written, not the training model's own config
    config.architectures = [type(hf_model).__name__.removeprefix("FSDP")]  # fully_shard renames a root's class
    if written is not None:
        config.dtype = written  # as save_pretrained records the weights' dtype
    config.save_pretrained(folder)
    if getattr(hf_model, "generation_config", None) is not None and hf_model.can_generate():
        hf_model.generation_config.save_pretrained(folder)
    processor.save_pretrained(folder)


def save_gathered(hf_model: nn.Module, processor, folder: Path, *, is_main: bool,
                  gather: Callable[[Sequence[torch.Tensor]], ContextManager], dtype: torch.dtype | None = None) -> None:
    """A sharded policy's `model/` folder: only a LoRA policy's adapter (as trained), else the policy one shard file
    at a time, in `dtype` (`train.hf_model_dtype`); rank 0 never holds the whole model. Every rank calls this
    together."""
    if hasattr(hf_model, "peft_config"):
        save_adapter_gathered(hf_model, processor, folder, is_main=is_main, gather=gather)
    else:
        save_policy_streamed(hf_model, processor, folder, is_main=is_main, gather=gather, dtype=dtype)


def save_adapter_gathered(hf_model: nn.Module, processor, folder: Path, *, is_main: bool,
                          gather: Callable[[Sequence[torch.Tensor]], ContextManager]) -> None:
    """A LoRA policy: only what PEFT's `save_pretrained` keeps (`lora_*` tensors, `modules_to_save` copies) is
    gathered, on every rank together; rank 0 hands it to PEFT. The frozen base weights are never gathered."""
    from vlrft.models.weights import on_mesh_device

    kept = {name: tensor for name, tensor in hf_model.state_dict(keep_vars=True).items()
            if "lora_" in name or ".modules_to_save." in name}
    with gather(list(kept.values())):  # full_tensor() is a collective: every rank, only rank 0 keeps a copy
        whole = {name: (on_mesh_device(t).full_tensor() if hasattr(t, "full_tensor") else t).detach()
                 for name, t in kept.items()}
        whole = {name: t.to("cpu").clone() for name, t in whole.items()} if is_main else {}
    if is_main:
        hf_model.save_pretrained(folder, state_dict=whole, safe_serialization=True)
        processor.save_pretrained(folder)
