"""The shared-prompt forward's backward, one backbone call at a time, so no parameter's gradient waits for another's.

`ActorVL._predicting_states_shared` calls the backbone once for the distinct prompts (the prompt pass) and once per
class of completions (the completion calls), all with the same parameters. In one autograd graph each parameter's
accumulator then has an input from every call, and autograd runs the newest calls' nodes first: each parameter's
gradient from the completion calls waits in the accumulator's input buffer until the prompt pass's backward sends
its own, a whole copy of the language model's gradients (or, under FSDP2, every gathered layer's unsharded gradient,
which its post-backward could not reduce).

`StagedBackward` cuts the graph between the calls: what a call hands on (the prompt pass's key/value records, its
last hidden states and router logits; a completion call's hidden states and router logits) is read through leaf
tensors, and the forward's outputs go through one autograd node (`_Exits`). Its backward runs the calls' backwards
one after the other, the newest first (the order one graph runs them in), each a `torch.autograd.backward` of the
call's outputs with the gradients its leaves collected. In each of those backwards every parameter has one input, so
its accumulator adds it to `.grad` (FSDP2: its post-backward reduces it) as soon as it is made.

The gradients are those of the one graph: the same contributions reach `.grad` in the same order (the first call's
added to `.grad` before the next one's, where one graph first sums them in the buffer). It takes a `.backward()`:
`torch.autograd.grad(..., inputs=parameters)` would not see the calls' parameter gradients (they go to `.grad`),
hence off by default (`ActorVL.backward_in_stages`, set by the strategies whose gradient hooks allow an
accumulator to fire more than once per backward: `vlrft.parallel.strategy.Strategy.stages_backward`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Stage:
    """One backbone call: the tensors it hands on (`outputs`, with their graph) and the leaves the rest reads."""

    outputs: list[torch.Tensor]
    leaves: list[torch.Tensor]


@dataclass
class StagedBackward:
    """The stages of one training forward, in call order, and its `exits` (set by `close`)."""

    stages: list[Stage] = field(default_factory=list)
    exits: list[torch.Tensor] = field(default_factory=list)

    def cut(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Leaves standing for a call's `outputs` (the same storage): what comes after reads these."""
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in outputs]
        self.stages.append(Stage(list(outputs), leaves))
        return leaves

    def close(self, exits: list[torch.Tensor]) -> list[torch.Tensor]:
        """The forward's outputs `exits`, through the node whose backward runs the stages' backwards."""
        self.exits = list(exits)
        anchor = torch.zeros((), device=exits[0].device, requires_grad=True)  # gives the node a place in the graph
        return list(_Exits.apply(anchor, self))

    def run(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        _backward(self.exits, grads)  # the cheap ops between leaves and exits (concatenation, padding, indexing)
        for stage in reversed(self.stages):
            grads = tuple(leaf.grad for leaf in stage.leaves)
            for leaf in stage.leaves:
                leaf.grad = None
            _backward(stage.outputs, grads)
        self.stages, self.exits = [], []


def _backward(outputs: list[torch.Tensor], grads: tuple[torch.Tensor | None, ...]) -> None:
    pairs = [(t, g) for t, g in zip(outputs, grads) if g is not None and t.requires_grad]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


class _Exits(torch.autograd.Function):
    """Identity on the staged forward's outputs, which it holds rather than takes as inputs (so the graph of the
    stages is not part of the caller's backward); its backward runs them (`StagedBackward.run`)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, staged: StagedBackward):
        ctx.staged = staged
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in staged.exits)

    @staticmethod
    def backward(ctx, *grads):
        staged, ctx.staged = ctx.staged, None
        staged.run(grads)
        return None, None
