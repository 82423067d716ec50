"""The shared-prompt forward's backward, one backbone call at a time, so no parameter's gradient waits for another's.

`ActorVL._predicting_states_shared` calls the backbone once for the distinct prompts (the prompt pass) and once per
class of completions (the completion calls), all with the same parameters. In one autograd graph each parameter's
accumulator then has an input from every call, and autograd runs the newest calls' nodes first: each parameter's
gradient from the completion calls waits in the accumulator's input buffer until the prompt pass's backward sends
its own, a whole copy of the language model's gradients (or, under FSDP2, every gathered layer's unsharded gradient,
which its post-backward could not reduce).

`StagedBackward` cuts the graph between the calls: what a call hands on (the prompt pass's key/value records, its
last hidden states and router logits; a completion call's hidden states and router logits) is read through the
outputs of a node of its own (`_Tap`), which keeps the gradients they receive, and the forward's outputs go
through one more such node. Its backward runs the calls' backwards one after the other, the newest first (the
order one graph runs them in), each a `torch.autograd.backward` from where the call's outputs enter its graph, with
the gradients its hand-off kept. In each of those backwards every parameter has one input, so its accumulator adds
it to `.grad` (FSDP2: its post-backward reduces it) as soon as it is made. The stages hold no tensor of the forward
(only the edges into each call's graph), so nothing lives longer than in one graph: the float32 key records that
autocast's attention does not keep are freed after the forward as before.

The gradients are those of the one graph: the same contributions reach `.grad` in the same order (the first call's
added to `.grad` before the next one's, where one graph first sums them in the buffer). It takes a `.backward()`:
`torch.autograd.grad(..., inputs=parameters)` would not see the calls' parameter gradients (they go to `.grad`),
hence off by default (`ActorVL.backward_in_stages`, set by the strategies whose gradient hooks allow an
accumulator to fire more than once per backward: `vlrft.parallel.strategy.Strategy.stages_backward`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class Stage:
    """One backbone call: where each output it hands on enters its graph (None: no gradient), and the gradients the
    rest of the forward sent them, summed (`_Tap`)."""

    edges: list[GradientEdge | None]
    grads: list[torch.Tensor | None]

    def receive(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        self.grads = [mine if new is None else new if mine is None else mine + new
                      for mine, new in zip(self.grads, grads)]

    def backward(self) -> None:
        grads, self.grads = self.grads, [None] * len(self.grads)
        _backward(self.edges, grads)


@dataclass
class StagedBackward:
    """The stages of one training forward, in call order, and where its exits enter their graph (`close`)."""

    stages: list[Stage] = field(default_factory=list)
    exits: list[GradientEdge | None] = field(default_factory=list)
    anchor: torch.Tensor | None = None  # the nodes' one input: gives them a place in the graph
    ran: bool = False  # `run` happened: its stages are gone

    def cut(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors standing for a call's `outputs` (the same storage): what comes after reads these."""
        stage = Stage([_edge(t) for t in outputs], [None] * len(outputs))
        self.stages.append(stage)
        return list(_Tap.apply(self._anchor(outputs[0].device), stage.receive, list(outputs)))

    def close(self, exits: list[torch.Tensor]) -> list[torch.Tensor]:
        """The forward's outputs `exits`, through the node whose backward runs the stages' backwards."""
        self.exits = [_edge(t) for t in exits]
        return list(_Tap.apply(self._anchor(exits[0].device), self.run, list(exits)))

    def _anchor(self, device: torch.device) -> torch.Tensor:
        if self.anchor is None:
            self.anchor = torch.zeros((), device=device, requires_grad=True)
        return self.anchor

    def run(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        if self.ran:
            raise RuntimeError("a staged backward runs once (a second backward through the graph, retain_graph, is "
                               "not supported)")
        self.ran = True
        _backward(self.exits, grads)  # the cheap ops between the hand-offs and the exits (concatenation, indexing)
        for stage in reversed(self.stages):
            stage.backward()
        self.stages, self.exits = [], []


def _edge(t: torch.Tensor) -> GradientEdge | None:
    return get_gradient_edge(t) if t.requires_grad else None


def _backward(edges: list[GradientEdge | None], grads) -> None:
    pairs = [(e, g) for e, g in zip(edges, grads) if e is not None and g is not None]
    if pairs:
        torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])


class _Tap(torch.autograd.Function):
    """Identity on `outputs`, which it is given rather than takes as inputs (so the graph that made them is not part of
    its readers' backward); its backward hands the gradients it is sent to `receive`. A call's hand-off
    (`Stage.receive`) runs once in each backward that reaches it (the exits', then each later call's), each time
    adding what it is sent; the exits' (`StagedBackward.run`) runs the stages' backwards."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, receive: Callable[[tuple], None], outputs: list[torch.Tensor]):
        ctx.receive = receive
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.receive(grads)
        return None, None, None
