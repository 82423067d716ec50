"""KV caches for the trainer's shared-prompt forward that stay correct under gradient checkpointing.

The shared-prompt forward runs each distinct prompt once, then the completion rows attend to the
prompt's keys/values through a KV cache. transformers' `DynamicCache` appends on every `update`,
and gradient checkpointing replays each decoder layer's forward during backward: the replay would
append a second time (so transformers simply drops the cache under checkpointing, which would make
completions blind to their prompt). These two cache layers are pure with respect to a replay:

- `RecordingLayer` (prompt pass) keeps the first keys/values it is given and hands back exactly its
  input, so a replay computes the same attention and stores nothing new;
- `PrefixLayer` (completion pass) returns `cat(prompt_kv[rows], new_kv)` and stores nothing, so a
  replay again sees the same prefix. The rows' copies of the prompt's keys/values are made inside
  each layer's call, not for every layer up front: alive one layer at a time (under checkpointing
  the replay makes them again), instead of all layers' copies, and their gradients, for the whole
  pass. For 8 rows of a 16k-token prompt of a 7B model that is about 10 GiB of copies and as much
  of their gradients.

Gradients reach the prompt pass through the recorded tensors, which are ordinary autograd outputs (with the backward
in stages, through their hand-off: `vlrft.models.staged_backward`, `recorded_cache`).
`cache_through_checkpointing` tells transformers' checkpointed layers to keep passing the cache
(the `_can_checkpoint_with_cache` switch transformers provides for layers that only read a cache).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer


class RecordingLayer(DynamicLayer):
    """Prompt pass: records the layer's keys/values once; attention sees only the prompt itself."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class PrefixLayer(DynamicLayer):
    """Completion pass: a fixed prefix (the prompts' keys/values, row i's being `rows[i]`) in front of each call's
    new ones; the per-row copy is made in the call."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.rows = keys, values, rows  # keys/values: one per distinct prompt

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return (torch.cat([self.keys[self.rows], key_states], dim=-2),
                torch.cat([self.values[self.rows], value_states], dim=-2))


def recording_cache() -> Cache:
    return Cache(layer_class_to_replicate=RecordingLayer)


def recorded_cache(keys_values: list[tuple[torch.Tensor, torch.Tensor]]) -> Cache:
    """A recording cache holding these (keys, values) per layer, as if a prompt pass had recorded them."""
    layers = []
    for keys, values in keys_values:
        layer = RecordingLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        layers.append(layer)
    return Cache(layers=layers)


def prefix_cache(recorded: Cache, rows: torch.Tensor) -> Cache:
    """The recorded prompt keys/values in front of each completion row's (`rows[i]` = row i's prompt)."""
    return Cache(layers=[PrefixLayer(layer.keys, layer.values, rows) for layer in recorded.layers])


@contextlib.contextmanager
def cache_through_checkpointing(model: nn.Module):
    """Let checkpointed transformers layers keep `past_key_values` (safe: the caches above ignore replays)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache  # back to the class default


def cache_argument(module: nn.Module, cache: Cache | None) -> dict:
    """The keyword a model's forward takes its KV cache by: `cache` where it has one (transformers 5.2x renamed
    `past_key_values`, which then warns on every call), else `past_key_values` (earlier releases)."""
    return {_cache_keyword(type(module)): cache}


@functools.cache
def _cache_keyword(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
