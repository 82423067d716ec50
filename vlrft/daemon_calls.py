"""User code (reward functions, tools) run in a daemon thread, its outcome handed to the running asyncio loop.

A daemon thread, not a ThreadPoolExecutor: a call that hangs past its timeout cannot be killed, and an executor's
worker would block the interpreter's exit. A call that finishes after its caller timed out and moved on (or after
the loop closed) is dropped.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


async def call_in_daemon_thread(fn: Callable[[], Any], name: str, started: list[threading.Thread] | None = None) -> Any:
    """`fn()`'s value (or its exception) computed in a daemon thread named `name` (appended to `started`)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def deliver(setter: Callable[[Any], None], value: Any) -> None:
        if not future.done():
            setter(value)

    def target() -> None:
        try:
            value = fn()
        except BaseException as exc:  # handed to the loop, which re-raises it in the caller
            callback = (deliver, future.set_exception, exc)
        else:
            callback = (deliver, future.set_result, value)
        try:
            loop.call_soon_threadsafe(*callback)
        except RuntimeError:  # the loop is gone: the call timed out and its caller moved on
            pass

    thread = threading.Thread(target=target, name=name, daemon=True)
    if started is not None:
        started.append(thread)
    thread.start()
    return await future
