"""The MoE router's load-balancing loss (Switch Transformer), as transformers computes it for the family.

A training forward of `ActorVL` runs the backbone once per row, or once per distinct prompt and once per class of
completions (`ActorVL._predicting_states_shared`). Each call asks transformers for its router logits
(`output_router_logits=True`); `RouterLogits` keeps them with the attention mask of the tokens they score, a shared
prompt's logits repeated for every row continuing it. The loss is then the family's own `load_balancing_loss_func`
(e.g. transformers' `qwen3_vl_moe`) over all of them: the number transformers' forward of the same rows gives as
`aux_loss`, padding left out by the attention mask.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from vlrft.errors import UserError


def router_config(model: nn.Module):
    """The text config of a model with MoE routers transformers computes the loss for, else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    has_routers = getattr(config, "num_experts_per_tok", None) and hasattr(config, "router_aux_loss_coef")
    return config if has_routers and _loss_function(base) is not None else None


def _loss_function(base: nn.Module) -> Callable | None:
    """The model family's `load_balancing_loss_func`, from the module that defines its transformers class."""
    return getattr(sys.modules.get(type(base).__module__), "load_balancing_loss_func", None)


def check_router_loss(model: nn.Module, coef: float, lora: bool) -> None:
    """Refuse `algorithm.router_aux_loss_coef` > 0 where it cannot train what it is for."""
    if coef <= 0:
        return
    name = type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__
    if router_config(model) is None:
        raise UserError(f"algorithm.router_aux_loss_coef is {coef:g} but {name} has no MoE routers; set it to 0")
    if lora:
        raise UserError(f"algorithm.router_aux_loss_coef is {coef:g} with model.lora.rank > 0, but LoRA leaves "
                        f"{name}'s routers frozen; set it to 0 or fine-tune fully (model.lora.rank: 0)")


class RouterLogits:
    """Router logits of one training forward's backbone calls, each layer's with the mask of the tokens it scored."""

    def __init__(self, model: nn.Module):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.config = router_config(model)
        self.loss_function = _loss_function(base)
        self.layers: list[list[torch.Tensor]] = []
        self.masks: list[torch.Tensor] = []

    def add(self, output, mask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Keep a backbone call's `router_logits` ([N * L, E] per layer) for tokens under `mask` [R, L]; `rows`: the
        call ran N distinct prompts, and row r of `mask` continues prompt rows[r] (its logits count once per row)."""
        logits = output.router_logits
        if not self.layers:
            self.layers = [[] for _ in logits]
        width = mask.shape[1]
        for kept, layer in zip(self.layers, logits):
            layer = layer.reshape(-1, width, layer.shape[-1])
            kept.append((layer if rows is None else layer[rows]).reshape(-1, layer.shape[-1]))
        self.masks.append(mask.reshape(-1))

    def tensors(self) -> list[torch.Tensor]:
        """Every logits tensor kept, layer by layer (`replace` takes them back in this order)."""
        return [t for kept in self.layers for t in kept]

    def replace(self, tensors: list[torch.Tensor]) -> None:
        """Keep `tensors` instead of those `tensors()` gave (the same values, another autograd node's outputs)."""
        it = iter(tensors)
        self.layers = [[next(it) for _ in kept] for kept in self.layers]

    def loss(self) -> torch.Tensor:
        """The load-balancing loss over every token kept, as transformers' forward of the same rows computes it."""
        layers = tuple(torch.cat(kept) for kept in self.layers)
        return self.loss_function(layers, self.config.num_experts, self.config.num_experts_per_tok,
                                  torch.cat(self.masks))
