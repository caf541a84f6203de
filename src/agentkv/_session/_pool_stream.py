"""`SessionPool.stream`'s machinery: a step's callbacks turned into the items of an async generator, on the
consumer's event loop, whichever loop (maybe another thread's) runs the step."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import anyio

from ._message_step import StepOptions
from ._results import ReasoningDelta, StepReply, ToolCallDelta

__all__ = ["Item", "pumped", "streamed_step"]

Item = str | ToolCallDelta | ReasoningDelta | StepReply
Done = TypeVar("Done")


def streamed_step(
    step: Callable[[StepOptions], Awaitable[StepReply]], options: StepOptions, *, first_token: bool, deltas: bool
) -> AsyncGenerator[Item]:
    """The items of ``step(options)``, its callbacks set to queue them: the answer's text pieces (with
    ``first_token``, an empty string first, at the model's first token; with ``deltas``, the tool-call and reasoning
    pieces too), then the `StepReply`; its error raised. A consumer that stops early cancels the step, and waits
    for it to unwind."""

    def start(put: Callable[[Any], None]) -> Awaitable[StepReply]:
        streamed: StepOptions = {**options, "on_text": put}
        if first_token:
            streamed["on_first_token"] = functools.partial(put, "")
        if deltas:
            streamed["on_tool_call"] = streamed["on_reasoning"] = put
        return step(streamed)

    return pumped(start, StepReply)


async def pumped(start: Callable[[Callable[[Any], None]], Awaitable[Done]], done: type[Done]) -> AsyncGenerator[Any]:
    """What ``start(put)`` puts (from any thread, in call order), then what it returns (a ``done``); its error
    raised. A consumer that stops early cancels it, and waits for it to unwind."""
    # asyncio, not anyio: the pool's loop (maybe another thread's) feeds this loop's queue through
    # loop.call_soon_threadsafe (anyio has no call from another thread that does not block it), and the step's
    # task (asyncio.ensure_future) outlives each yield of this generator, which an anyio task group may not span
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(item: Any) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)  # from any thread, queued in call order

    async def run() -> None:  # the result or error queued after every piece before it, even on the pool's loop
        try:
            put(await start(put))
        except BaseException as exc:  # handed to the consumer, who raises it
            put(exc)

    task = asyncio.ensure_future(run())
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, done):
                return
    finally:
        task.cancel()
        with anyio.CancelScope(shield=True):  # the step is cancelled (and unwound) before the consumer goes on,
            await asyncio.gather(task, return_exceptions=True)  # even a consumer that was cancelled itself
