"""The two halves of a pushed step (``transfer="push"``), run together and always ended in a safe order.

In push mode P and D get the step under one request id at the same time: D registers the blocks it
lacks with P and waits, P prefills and writes into them, D decodes. What vLLM 0.32 does when that
goes wrong (measured, docs/transfer.md) sets the rules here:

* D never gives up on a push by itself (``push_registration_timeout`` only logs), and a D aborted
  while it waits keeps its blocks until some P with that id writes into them. So D is closed
  only once its KV has arrived (its first output).
* An aborted P pushes nothing; a P that failed (a declined read, an error) pushed nothing either.
  So P is never aborted while D may still wait for it, and a P that failed is replaced by ``rescue``:
  a plain prefill under the same id, which completes D's push. P's write then never lands in blocks
  D has freed.

`EmbeddedPair` and the HTTP pairs run their pushed steps through `PushedStep`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

import anyio

__all__ = ["PushedStep"]

logger = logging.getLogger("agentkv")

T = TypeVar("T")
R = TypeVar("R")
V = TypeVar("V")


class PushedStep(Generic[T, R]):
    """Iterate D's outputs while P runs beside it; afterwards `prefill_result` holds P's.

    Both halves run in a task group until D's first output has arrived and P has ended (P's request ends once
    it has prefilled, as its write to D starts: D's first output comes after that anyway); D's outputs are
    then given, the first one included, with nothing left running beside them, so no task group or task spans
    this generator's yields.

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
        try:
            first, prefill_result = await self._halves()
            if first is not None:
                yield first
                async for output in self._outputs:
                    yield output
            self._prefill_result = prefill_result
        finally:
            with anyio.CancelScope(shield=True):
                await self._outputs.aclose()

    async def _halves(self) -> tuple[T | None, R]:
        """P's result and D's first output (None: D gave none), or the error of the half that failed first;
        both halves have ended (in the safe order) when this returns or raises, even when it is cancelled."""
        either = anyio.Event()
        p: _Half[R] = _Half(either)
        d: _Half[T | None] = _Half(either)
        failure: Exception | None = None
        async with anyio.create_task_group() as group:  # the halves end before it does: no task spans a yield
            group.start_soon(p.run, self._prefill_half)
            group.start_soon(d.run, anext(self._outputs, None))  # D's first output: its KV is there
            try:
                await either.wait()
                failure = p.error  # P failed: D still waits for a push (the cleanup completes it, then closes D)
                if failure is None:
                    await d.ended.wait()
                    failure = d.error
                if failure is None:
                    await p.ended.wait()
                    failure = p.error
            finally:
                await self._end(p, d)
        if failure is not None:
            raise failure
        return d.value, p.value  # type: ignore[return-value]  # both succeeded: their values are set

    async def _end(self, p: _Half[R], d: _Half[T | None]) -> None:
        with anyio.CancelScope(shield=True):  # a cancelled step still ends both halves, in this order
            with anyio.move_on_after(self._timeout_s):
                await p.ended.wait()
            pushed = p.succeeded
            if not d.ended.is_set() and not pushed:
                p.abort()
                with contextlib.suppress(Exception), anyio.move_on_after(self._timeout_s):
                    pushed = await self._rescue()
                if not pushed:
                    logger.error("agentkv: no prefill could push a step's KV; D keeps its blocks for it until restart")
            if pushed:
                with anyio.move_on_after(self._timeout_s):
                    await d.ended.wait()
                if not d.succeeded:
                    logger.error(
                        "agentkv: a step's KV was pushed but D gave no output; D may keep its blocks until restart"
                    )
            p.abort()  # D's KV is in, or will not come: nothing waits for P any more
            d.abort()


class _Half(Generic[V]):
    """One half of a pushed step, run in the step's task group but shielded from the step's cancellation: only
    `abort` ends it early. Its end sets ``either``."""

    def __init__(self, either: anyio.Event) -> None:
        self._either = either
        self._scope = anyio.CancelScope(shield=True)
        self.ended = anyio.Event()
        self.value: V | None = None
        self.error: Exception | None = None
        self.succeeded = False

    async def run(self, work: Awaitable[V]) -> None:
        try:
            with self._scope:
                self.value = await work
                self.succeeded = True
        except Exception as exc:
            self.error = exc
        finally:
            self.ended.set()
            self._either.set()

    def abort(self) -> None:
        """Cancel the half, if it runs still."""
        self._scope.cancel()
