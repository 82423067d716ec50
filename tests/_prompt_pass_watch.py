"""Which decoder-layer gradients exist when the shared-prompt forward's prompt pass starts its backward (tests of
`vlrft.models.staged_backward`, in one process and under torchrun)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def layer_gradients_when_the_prompt_pass_starts(model: nn.Module, forward_backward: Callable[[], None]
                                                ) -> dict[str, bool]:
    """Run `forward_backward` (one training forward and its backward) on `model` from zeroed gradients; whether each
    decoder-layer parameter had its `.grad` (sharded, under FSDP2) when the prompt pass's backward started: when the
    final norm's output of the first backbone call (the prompt pass, whose top node that is) got its gradient."""
    layers = {name: p for name, p in model.named_parameters() if ".layers." in name and "visual" not in name}
    norm = next(m for name, m in model.named_modules() if name.endswith("language_model.norm"))
    seen: dict[str, bool] = {}
    calls = []

    def look(grad):
        if not seen:
            seen.update({name: p.grad is not None for name, p in layers.items()})
        return grad

    def hooking(module, args, output):
        if not calls:
            output.register_hook(look)
        calls.append(1)

    handle = norm.register_forward_hook(hooking)
    model.zero_grad(set_to_none=True)
    try:
        forward_backward()
    finally:
        handle.remove()
    assert len(calls) > 1 and seen, "no prompt pass and completion calls"
    return seen
