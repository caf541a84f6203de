"""The two halves of a pushed step (``transfer="push"``), run together and always ended in a safe order.

In push mode P and D get the step under one request id at the same time: D registers the blocks it
lacks with P and waits, P prefills and writes into them, D decodes. What vLLM 0.32 does when that
goes wrong (measured, docs/transfer.md) sets the rules here:

* D never gives up on a push by itself (``push_registration_timeout`` only logs), and a D aborted
  while it waits keeps its blocks until some P with that id writes into them. So D is closed
  only once its KV has arrived (its first output).
* An aborted P pushes nothing; a P that failed (a declined read, an error) pushed nothing either.
  So P is never aborted, and a P that failed is replaced by ``rescue``: a plain prefill under the
  same id, which completes D's push. P's write then never lands in blocks D has freed.

`EmbeddedPair` and the HTTP pairs run their pushed steps through `PushedStep`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

import anyio

__all__ = ["PushedStep"]

logger = logging.getLogger("agentkv")

T = TypeVar("T")
R = TypeVar("R")


class PushedStep(Generic[T, R]):
    """Iterate D's outputs while P runs beside it; afterwards `prefill_result` holds P's.

    Args:
        prefill: P's half (started at once, as D's first output is awaited).
        outputs: D's half, not started yet (a request is sent when it is first iterated).
        rescue: a plain prefill under the step's id, for a P that failed; True when it pushed.
        timeout_s: how long each wait of the cleanup may take.
    """

    def __init__(
        self,
        prefill: Awaitable[R],
        outputs: AsyncGenerator[T, None],
        rescue: Callable[[], Awaitable[bool]],
        *,
        timeout_s: float,
    ) -> None:
        self._prefill_half = prefill
        self._outputs = outputs
        self._rescue = rescue
        self._timeout_s = timeout_s
        self._prefill_result: R | None = None

    @property
    def prefill_result(self) -> R:
        """P's result, once the outputs have been iterated to their end."""
        if self._prefill_result is None:
            raise RuntimeError("the pushed step has not finished")
        return self._prefill_result

    async def __aiter__(self) -> AsyncIterator[T]:
        # asyncio futures, not an anyio task group: P's half runs on while this generator yields D's outputs, and a
        # task group may not span a generator's yields (its cancel scope would cancel the consumer's code, and a
        # generator closed by the loop's finalizer exits it from another task)
        prefill = asyncio.ensure_future(self._prefill_half)
        arrived = asyncio.ensure_future(anext(self._outputs, None))  # D's first output: its KV is there
        try:
            await asyncio.wait({prefill, arrived}, return_when=asyncio.FIRST_COMPLETED)
            if prefill.done() and prefill.exception() is not None:
                await prefill  # P failed: D still waits for a push (the cleanup completes it, then closes D)
            first = await asyncio.shield(arrived)  # a cancelled step must not abort D before its KV is in
            if first is not None:
                yield first
                async for output in self._outputs:
                    yield output
            self._prefill_result = await asyncio.shield(prefill)
        finally:
            await self._end(prefill, arrived)

    async def _end(self, prefill: asyncio.Future[R], arrived: asyncio.Future[T | None]) -> None:
        with anyio.CancelScope(shield=True):  # a cancelled step still ends both halves, in this order
            with contextlib.suppress(Exception, asyncio.CancelledError), anyio.move_on_after(self._timeout_s):
                await asyncio.shield(prefill)
            pushed = _succeeded(prefill)
            if not arrived.done() and not pushed:
                prefill.cancel()
                with contextlib.suppress(Exception), anyio.move_on_after(self._timeout_s):
                    pushed = await self._rescue()
                if not pushed:
                    logger.error("agentkv: no prefill could push a step's KV; D keeps its blocks for it until restart")
            if pushed:
                with contextlib.suppress(Exception, asyncio.CancelledError), anyio.move_on_after(self._timeout_s):
                    await asyncio.shield(arrived)
                if not _succeeded(arrived):
                    logger.error(
                        "agentkv: a step's KV was pushed but D gave no output; D may keep its blocks until restart"
                    )
            if not arrived.done():
                arrived.cancel()
            with contextlib.suppress(BaseException):
                await arrived
            await self._outputs.aclose()


def _succeeded(future: asyncio.Future[Any]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None
