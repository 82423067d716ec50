"""The configured tools of a run: loading, their JSON-schema descriptions, and running calls concurrently.

Calls of one turn (across the whole batch of trajectories) run at once: async tools on an event
loop, sync tools on a thread pool, each under `rollout.tool_timeout_s`. A tool that raises, times
out or returns something unusable, and a call the model wrote badly, all become a defined error
observation ("Error: ...") that the model reads on its next turn, and are counted in `ToolStats`;
the run goes on. A sync tool that hangs keeps its worker thread (Python cannot kill threads), but
never the rollout: the pool has spare workers and is replaced when it runs out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import logging
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from vlrft.registry import TOOLS
from vlrft.tools.parsing import MalformedCall
from vlrft.tools.types import ToolCall, ToolConfigError, ToolContext, ToolOutput, ToolStats

ERROR_PREFIX = "Error: "
logger = logging.getLogger("vlrft.tools")


@dataclass
class Tool:
    """One loaded tool: what the model calls it, its callable and its description (OpenAI/Qwen function format)."""

    name: str
    fn: Callable[..., Any]
    description: str
    parameters: dict[str, Any]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def schema(self) -> dict[str, Any]:
        """The `{"type": "function", "function": {...}}` entry chat templates render under `tools=`."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def tool(name: str | None = None, *, description: str | None = None, parameters: dict | None = None,
         override: bool = False):
    """Register a tool under `name` (default: the function's name) with its JSON-schema description.

        @tool("count", description="Count the objects of a colour", parameters={"type": "object", ...})
        def count(call, context): ...
    """

    def register(fn):
        fn.tool_schema = {"name": name or fn.__name__, "description": description, "parameters": parameters}
        return TOOLS.register(name or fn.__name__, override=override)(fn)

    return register


def load_tool(spec, index: int) -> Tool:
    """A `Tool` from one `rollout.tools` entry (vlrft.config.ToolConfig)."""
    fn = TOOLS.resolve(spec.name)
    declared = getattr(fn, "tool_schema", {}) or {}
    name = spec.alias or declared.get("name") or spec.name.rsplit(":", 1)[-1]
    description = spec.description or declared.get("description") or (inspect.getdoc(fn) or "").split("\n")[0]
    parameters = spec.parameters or declared.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ToolConfigError(f"config: rollout.tools[{index}].parameters must be a JSON schema object "
                              f'{{"type": "object", "properties": {{...}}}}; got {parameters!r}')
    if not description:
        raise ToolConfigError(f"config: rollout.tools[{index}] ({spec.name}): the tool has no description; set "
                              "rollout.tools[*].description or give the function a docstring")
    return Tool(name, fn, description, parameters, dict(spec.kwargs))


def as_output(value: Any) -> ToolOutput | None:
    """A tool's return value as a ToolOutput; None when it is not text, images or a ToolOutput."""
    output, _ = read_output(value)
    return output


def read_output(value: Any) -> tuple[ToolOutput | None, str]:
    """(the tool's return value as a ToolOutput, "") or (None, what is wrong with it)."""
    if isinstance(value, ToolOutput):
        if not isinstance(value.text, str):
            return None, f"returned ToolOutput(text=...) holding a {type(value.text).__name__}; the text must be a str"
        if not isinstance(value.images, (list, tuple)):
            return None, (f"returned ToolOutput(images=...) holding a {type(value.images).__name__}; the images must be "
                          "a list of PIL images")
        for k, im in enumerate(value.images):
            if not _is_image(im):
                return None, f"returned ToolOutput(images=...) whose item {k} is a {type(im).__name__}, not a PIL image"
        return value, ""
    if isinstance(value, str):
        return ToolOutput(text=value), ""
    if _is_image(value):
        return ToolOutput(images=[value]), ""
    if isinstance(value, (list, tuple)) and value:
        for k, v in enumerate(value):
            if not (isinstance(v, str) or _is_image(v)):
                return None, (f"returned a list whose item {k} is a {type(v).__name__}; a list may hold only str and "
                              "PIL images")
        return ToolOutput(text="\n".join(v for v in value if isinstance(v, str)),
                          images=[v for v in value if _is_image(v)]), ""
    return None, f"returned {type(value).__name__}, not text or images"


def read_reward(value: Any) -> tuple[float | None, str]:
    """(a ToolOutput's reward as a float or None, "") or (None, what is wrong with it): a finite real number only."""
    if value is None:
        return None, ""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a numpy scalar or a 0-d tensor
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None, f"returned reward={value!r} (a {type(value).__name__}); a reward must be a float or None"
    try:
        reward = float(value)
    except OverflowError:
        reward = math.inf
    if not math.isfinite(reward):
        return None, f"returned reward={reward}; a reward must be a finite float or None"
    return reward, ""


def _is_image(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow is a core dependency
        return False
    return isinstance(value, Image.Image)


class ToolSet:
    """The run's tools by the name the model uses; `run` answers one turn's calls of a whole batch."""

    def __init__(self, tools: Sequence[Tool], timeout_s: float = 30.0, max_concurrency: int = 16):
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            raise ToolConfigError("config: rollout.tools: two tools have the same name; give one an alias")
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency * 2, thread_name_prefix="vlrft-tool")
        self._hung = 0  # threads lost to sync tools that never returned
        self._reported: set[tuple] = set()  # failures already logged: one line per kind, tool and cause

    @classmethod
    def from_config(cls, rollout_cfg) -> "ToolSet":
        return cls([load_tool(spec, i) for i, spec in enumerate(rollout_cfg.tools)], rollout_cfg.tool_timeout_s,
                   rollout_cfg.tool_max_concurrency)

    def report(self, key: tuple, message: str, counter: str) -> None:
        """Log a failure once per `key` (its kind, tool and cause); later ones are only counted in `counter`."""
        if key in self._reported:
            return
        self._reported.add(key)
        logger.warning("%s; the run goes on (counted in %s, later ones of this kind are not logged)", message, counter)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def run(self, calls: Sequence[ToolCall | MalformedCall], contexts: Sequence[ToolContext]
            ) -> tuple[list[ToolOutput], list[str]]:
        """One observation per call, in order, and what happened to each ("ok" or a `ToolStats` counter name)."""
        if self._hung >= self.max_concurrency:  # too many workers stuck in hung tools: start a fresh pool
            self._pool.shutdown(wait=False)
            self._pool = concurrent.futures.ThreadPoolExecutor(self.max_concurrency * 2, thread_name_prefix="vlrft-tool")
            self._hung = 0
        results = asyncio.run(self._run_all(list(calls), list(contexts)))
        kinds = [kind for _, kind in results]
        self._hung += kinds.count("timeouts")
        return [output for output, _ in results], kinds

    async def _run_all(self, calls, contexts):
        semaphore = asyncio.Semaphore(self.max_concurrency)

        async def one(call, context):
            async with semaphore:
                return await self._run_one(call, context)

        return await asyncio.gather(*(one(c, x) for c, x in zip(calls, contexts)))

    async def _run_one(self, call: ToolCall | MalformedCall, context: ToolContext) -> tuple[ToolOutput, str]:
        if isinstance(call, MalformedCall):
            return ToolOutput(text=ERROR_PREFIX + call.reason), call.kind
        tool_ = self.tools.get(call.name)
        if tool_ is None:
            known = ", ".join(sorted(self.tools))
            return ToolOutput(text=f"{ERROR_PREFIX}unknown tool {call.name!r}; the tools are: {known}"), \
                "malformed_calls"
        context.kwargs = tool_.kwargs
        try:
            if inspect.iscoroutinefunction(tool_.fn) or inspect.iscoroutinefunction(getattr(tool_.fn, "__call__", None)):
                value = await asyncio.wait_for(tool_.fn(call, context), self.timeout_s)
            else:
                loop = asyncio.get_running_loop()
                future = loop.run_in_executor(self._pool, tool_.fn, call, context)
                value = await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            return ToolOutput(text=f"{ERROR_PREFIX}the tool {call.name!r} timed out after {self.timeout_s:g} s"), \
                "timeouts"
        except Exception as exc:  # a tool bug or bad arguments: the model reads it, the run goes on
            self.report(("errors", call.name, type(exc).__name__),
                        f"tool {call.name!r} raised {type(exc).__name__}: {_short(exc)} (sample {_sample_id(context)}, "
                        f"turn {context.turn}); the model reads it as an Error: observation", "tools/errors")
            return ToolOutput(text=f"{ERROR_PREFIX}{type(exc).__name__}: {exc}"), "errors"
        output, problem = read_output(value)
        if output is None:
            self.report(("bad_outputs", call.name, type(value).__name__),
                        f"tool {call.name!r} {problem} (sample {_sample_id(context)}, turn {context.turn}); the model "
                        "reads it as an Error: observation", "tools/bad_outputs")
            return ToolOutput(text=f"{ERROR_PREFIX}the tool {call.name!r} {problem}"), "bad_outputs"
        reward, problem = read_reward(output.reward)
        if problem:  # the text and images still reach the model; the reward part is left out
            self.report(("bad_rewards", call.name), f"tool {call.name!r} {problem} (sample {_sample_id(context)}, turn "
                        f"{context.turn}); the reward part is left out of the trajectory's reward", "tools/bad_rewards")
            return dataclasses.replace(output, reward=None), "bad_rewards"
        if reward != output.reward:
            output = dataclasses.replace(output, reward=reward)
        return output, "ok"

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def _sample_id(context: ToolContext) -> str:
    return repr(getattr(context.sample, "id", None))
