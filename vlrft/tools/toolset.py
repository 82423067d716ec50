"""The configured tools of a run: loading, their JSON-schema descriptions, and running calls concurrently.

Calls of one turn (across the whole batch of trajectories) run at once, each in a daemon thread of
its own (an async tool on an event loop of that thread), under `rollout.tool_timeout_s`: an async
tool that blocks its loop (time.sleep, a synchronous HTTP client) is timed out like any other, and
the calls of the batch still run side by side. A tool that raises, times out or returns something
unusable, and a call the model wrote badly, all become a defined error observation ("Error: ...")
that the model reads on its next turn, and are counted in `ToolStats`; the run goes on. A tool that
hangs keeps its thread (Python cannot kill threads), but never the rollout, nor the process's exit
(daemon threads are not joined); once `max_concurrency` of one tool's calls hang, its further
calls time out at once without starting another thread, until one of them returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
import numbers
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from vlrft.daemon_calls import call_in_daemon_thread
from vlrft.registry import TOOLS
from vlrft.tools.parsing import MalformedCall
from vlrft.tools.types import ToolCall, ToolConfigError, ToolContext, ToolOutput

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
         override: bool = False, typed: bool = False):
    """Register a tool under `name` (default: the function's name) with its JSON-schema description.

        @tool("count", description="Count the objects of a colour", parameters={"type": "object", ...})
        def count(call, context): ...

    `typed=True`: the function takes the call's arguments as its parameters (and the ToolContext as `context` if it
    names one); its schema and description default to those of its signature and docstring
    (`vlrft.tools.signature`). The function itself is returned unchanged, so it can still be called directly.
    """

    def register(fn):
        if typed:
            from vlrft.tools.signature import typed_parameters

            typed_parameters(fn)  # *args / **kwargs: fail at import, where the tool is written
        fn.tool_schema = {"name": name or fn.__name__, "description": description, "parameters": parameters,
                          "typed": typed}
        return TOOLS.register(name or fn.__name__, override=override)(fn)

    return register


def load_tool(spec, index: int, described: bool = True) -> Tool:
    """A `Tool` from one `rollout.tools` entry (vlrft.config.ToolConfig). `described`: its schema goes into every
    prompt (`rollout.describe_tools`), so it must say what it does; otherwise the description may be empty."""
    fn = TOOLS.resolve(spec.name)
    declared = getattr(fn, "tool_schema", {}) or {}
    name = spec.alias or declared.get("name") or spec.name.rsplit(":", 1)[-1]
    own_description, own_parameters = (inspect.getdoc(fn) or "").split("\n")[0], None
    if declared.get("typed"):  # the call's arguments are the function's parameters: its signature is the schema
        from vlrft.tools.signature import schema_from_signature, typed_call

        own_description, own_parameters = schema_from_signature(fn)
        fn = typed_call(fn)
    description = spec.description or declared.get("description") or own_description
    parameters = spec.parameters or declared.get("parameters") or own_parameters or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ToolConfigError(f"config: rollout.tools[{index}].parameters must be a JSON schema object "
                              f'{{"type": "object", "properties": {{...}}}}; got {parameters!r}')
    if not description and described:
        raise ToolConfigError(f"config: rollout.tools[{index}] ({spec.name}): the tool has no description; set "
                              "rollout.tools[*].description or give the function a docstring (or set "
                              "rollout.describe_tools=false when your prompts say how to call it)")
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
        self._hung: dict[str, list[threading.Thread]] = {}  # per tool: threads of calls that ran past the timeout
        self._reported: set[tuple] = set()  # failures already logged: one line per kind, tool and cause

    @classmethod
    def from_config(cls, rollout_cfg) -> "ToolSet":
        described = getattr(rollout_cfg, "describe_tools", True)
        return cls([load_tool(spec, i, described) for i, spec in enumerate(rollout_cfg.tools)],
                   rollout_cfg.tool_timeout_s, rollout_cfg.tool_max_concurrency)

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
        for name, threads in self._hung.items():
            self._hung[name] = [t for t in threads if t.is_alive()]
        results = asyncio.run(self._run_all(list(calls), list(contexts)))
        return [output for output, _ in results], [kind for _, kind in results]

    async def _run_all(self, calls, contexts):
        semaphore = asyncio.Semaphore(self.max_concurrency)

        async def one(call, context):
            async with semaphore:
                return await self._run_one(call, context)

        return await asyncio.gather(*(one(c, x) for c, x in zip(calls, contexts)))

    async def _run_one(self, call: ToolCall | MalformedCall, context: ToolContext) -> tuple[ToolOutput, str]:
        if isinstance(call, MalformedCall):
            return ToolOutput(text=ERROR_PREFIX + call.reason), call.kind
        if not isinstance(call.name, str) or not isinstance(call.arguments, dict):
            return ToolOutput(text=f'{ERROR_PREFIX}the tool call must name a tool and give its arguments as a JSON '
                                   'object {"name": ..., "arguments": {...}}'), "malformed_calls"
        tool_ = self.tools.get(call.name)
        if tool_ is None:
            known = ", ".join(sorted(self.tools))
            return ToolOutput(text=f"{ERROR_PREFIX}unknown tool {call.name!r}; the tools are: {known}"), \
                "malformed_calls"
        context.kwargs = tool_.kwargs
        hung = self._hung.setdefault(call.name, [])
        if len(hung) >= self.max_concurrency:  # not started: its earlier calls still hang
            return ToolOutput(text=f"{ERROR_PREFIX}the tool {call.name!r} is not answering ({len(hung)} earlier calls "
                                   f"are still running past {self.timeout_s:g} s)"), "timeouts"
        thread: list[threading.Thread] = []
        try:
            value = await asyncio.wait_for(_in_thread(tool_, call, context, thread), self.timeout_s)
        except asyncio.TimeoutError:
            hung += thread
            self.report(("timeouts", call.name), f"tool {call.name!r} ran past rollout.tool_timeout_s="
                        f"{self.timeout_s:g} s (sample {_sample_id(context)}, turn {context.turn}); its thread is "
                        "left running", "tools/timeouts")
            return ToolOutput(text=f"{ERROR_PREFIX}the tool {call.name!r} timed out after {self.timeout_s:g} s"), \
                "timeouts"
        except _ToolRaised as raised:
            exc = raised.exc
            # a tool bug or bad arguments: the model reads it, the run goes on. SystemExit and KeyboardInterrupt too:
            # raised in the tool's own thread, they are its code's (sys.exit in a script), not a signal to the run
            # (Ctrl-C and SIGTERM reach the main thread only)
            self.report(("errors", call.name, type(exc).__name__),
                        f"tool {call.name!r} raised {type(exc).__name__}: {_short(exc)} (sample {_sample_id(context)}, "
                        f"turn {context.turn}); the model reads it as an Error: observation", "tools/errors")
            return ToolOutput(text=f"{ERROR_PREFIX}{type(exc).__name__}" + (f": {exc}" if str(exc) else "")), "errors"
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
        """Nothing to release: hung tools' daemon threads end with the process."""


class _ToolRaised(Exception):
    """What a tool raised, carried out of its thread (its own TimeoutError is not the call's timeout)."""

    def __init__(self, exc: BaseException):
        super().__init__(exc)
        self.exc = exc


async def _in_thread(tool_: Tool, call: ToolCall, context: ToolContext, started: list[threading.Thread]) -> Any:
    """The tool's value, computed in a daemon thread (appended to `started`); an async tool (or a sync one returning
    an awaitable) is awaited on an event loop of that thread. A daemon thread, not a ThreadPoolExecutor: a call that
    hangs past the timeout cannot be killed (`vlrft.daemon_calls`)."""

    def run() -> Any:
        try:
            value = tool_.fn(call, context)
            return asyncio.run(_awaited(value)) if inspect.isawaitable(value) else value
        except BaseException as exc:  # handed to the rollout's loop, which decides
            raise _ToolRaised(exc) from None

    return await call_in_daemon_thread(run, f"vlrft-tool-{tool_.name}", started)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def _sample_id(context: ToolContext) -> str:
    return repr(getattr(context.sample, "id", None))
