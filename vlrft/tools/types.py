"""Types that cross the tool API boundary: the parsed call, what a tool sees, what it returns, counters.

A tool is a plain (sync or async) callable `tool(call: ToolCall, context: ToolContext)` returning a
`ToolOutput`, a string, a PIL image, or a list of strings and images. Everything else is "garbage":
the trajectory gets a defined error observation and the failure is counted (`ToolStats`), like a
reward function that fails under `reward.on_error=none`.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field
from typing import Any

from vlrft.errors import UserError


class ToolConfigError(UserError):
    """A tool that cannot be loaded or described (bad name, bad schema); raised before training starts."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and its JSON arguments (a dict)."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ToolContext:
    """What a tool may read besides the call: the trajectory's images so far and the sample's columns.

    `images` are the images as the model saw them: the prompt's downscaled to `data.max_pixels` (the originals are
    `sample.images`, read with `vlrft.data.media.load_image`), then the tools' as processed. `trajectory_id` is the
    same on every call of one trajectory and differs between trajectories (within this process, across rollouts
    too): the key for state a tool keeps per trajectory.
    """

    images: list[Any]  # PIL images of the prompt, then those tools returned earlier in this trajectory
    sample: Any  # vlrft.data.Sample (id, answer, label, extra, ...)
    turn: int  # 1-based model turn that made the call
    kwargs: dict[str, Any] = field(default_factory=dict)  # the tool's fixed config kwargs
    trajectory_id: str = ""  # "<rollout>:<row>", e.g. "3:17": this process's 3rd rollout, its row 17


@dataclass
class ToolOutput:
    """A tool's answer: text and/or images, optional reward parts (summed into the trajectory's reward) and done."""

    text: str = ""
    images: list[Any] = field(default_factory=list)
    reward: float | None = None
    done: bool = False


@dataclass
class ToolStats:
    """Counts over a batch of trajectories (sums, so ranks can add them)."""

    calls: float = 0.0  # tool calls run (ok or not)
    errors: float = 0.0  # the tool raised
    timeouts: float = 0.0  # the tool ran past rollout.tool_timeout_s
    malformed_calls: float = 0.0  # the model wrote a call that does not parse or names no configured tool
    bad_outputs: float = 0.0  # the tool returned something that is not text/images/ToolOutput
    bad_rewards: float = 0.0  # a ToolOutput reward that is not a finite number (NaN, inf, "high"): left out
    parser_errors: float = 0.0  # rollout.tool_parser raised, or returned something not a ToolCall/MalformedCall/None
    unanswered_calls: float = 0.0  # the last turn allowed (rollout.max_turns) wrote a call: no tool answers it
    cut_calls: float = 0.0  # a turn cut at max_new_tokens (or the token budget) held a call: never run
    truncated_outputs: float = 0.0  # a tool's text cut to rollout.tool_max_output_tokens
    images_returned: float = 0.0  # tool images the processor accepted: shown to the model

    def __add__(self, other: "ToolStats") -> "ToolStats":
        return ToolStats(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def count(self, kind: str, output: "ToolOutput | None" = None) -> None:
        """Add one call that ended as `kind` ("ok" or a counter name). Its images count in `images_returned` once the
        processor accepted them (the caller adds them: `vlrft.rollout.multiturn`)."""
        self.calls += kind not in ("malformed_calls", "parser_errors")
        if kind != "ok":
            setattr(self, kind, getattr(self, kind) + 1)

    def as_dict(self) -> dict[str, float]:
        return {f"tools/{name}": float(value) for name, value in self.__dict__.items()}
