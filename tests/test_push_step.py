"""`PushedStep`'s ordering rules on scripted halves (no engine): P is never aborted, a P that failed is
replaced by the rescue so D's push completes, D is closed only after its KV arrived, and a D whose
push never comes fails the step within its bound. The real-pair versions are in test_push_pair.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import anyio
import pytest

from agentkv import EngineError
from agentkv._engines._push import PushedStep

pytestmark = pytest.mark.anyio


class Halves:
    """A scripted P and D: D's first output comes once some prefill (P or the rescue) has pushed."""

    def __init__(
        self,
        *,
        p_fails: bool = False,
        p_seconds: float = 0.01,
        push_arrives: bool = True,
        d_seconds: float = 0.0,
        d_refuses: bool = False,
    ) -> None:
        self.p_fails, self.p_seconds, self.push_arrives, self.d_seconds = p_fails, p_seconds, push_arrives, d_seconds
        self.d_refuses = d_refuses
        self.pushed = asyncio.Event()
        self.events: list[str] = []

    async def prefill(self) -> str:
        try:
            await asyncio.sleep(self.p_seconds)
        except asyncio.CancelledError:
            self.events.append("p aborted")
            raise
        if self.p_fails:
            self.events.append("p failed")
            raise EngineError("the prefill engine failed the request")
        self.events.append("p pushed")
        if self.push_arrives:
            self.pushed.set()
        return "p-output"

    async def rescue(self) -> bool:
        self.events.append("rescue")
        self.pushed.set()
        return True

    async def outputs(self) -> AsyncGenerator[str, None]:
        try:
            if self.d_refuses:  # refused when added (a bad request): D waits for nothing
                raise EngineError("the decode engine refused the request")
            try:
                with anyio.fail_after(0.5):
                    await self.pushed.wait()
                    await asyncio.sleep(self.d_seconds)  # the write lands, D's first pass
            except TimeoutError as exc:
                raise EngineError("the decode engine made no progress for 0.5 s") from exc
            except asyncio.CancelledError:
                self.events.append("d aborted")
                raise
            self.events.append("d arrived")
            for token in ("a", "b"):
                yield token
        finally:
            self.events.append("d closed")

    def step(self) -> PushedStep[str, str]:
        return PushedStep(self.prefill(), self.outputs(), self.rescue, timeout_s=2.0)


async def test_a_good_step_streams_d_and_keeps_ps_result() -> None:
    halves = Halves()
    step = halves.step()
    assert [token async for token in step] == ["a", "b"]
    assert step.prefill_result == "p-output"
    assert halves.events == ["p pushed", "d arrived", "d closed"]


async def test_a_failed_prefill_is_rescued_before_d_is_closed() -> None:
    halves = Halves(p_fails=True)
    with pytest.raises(EngineError, match="prefill engine failed"):
        async for _ in halves.step():
            pass
    assert halves.events == ["p failed", "rescue", "d arrived", "d closed"]


async def test_a_push_that_never_comes_fails_the_step_within_its_bound(caplog: pytest.LogCaptureFixture) -> None:
    halves = Halves(push_arrives=False)
    with anyio.fail_after(5):
        with pytest.raises(EngineError, match="no progress"):
            async for _ in halves.step():
                pass
    assert halves.events == ["p pushed", "d closed"]
    assert "D gave no output" in caplog.text  # vLLM's D keeps blocks it waited in: said, not hidden


async def test_a_cancelled_step_lets_p_finish_and_closes_d_after_its_kv() -> None:
    halves = Halves(p_seconds=0.2)
    with anyio.move_on_after(0.05):  # the caller gives up while P prefills (Ctrl-C, a timeout)
        async for _ in halves.step():
            pass
    assert halves.events == ["p pushed", "d arrived", "d closed"]  # P not aborted; D closed last


async def test_a_step_cancelled_after_p_pushed_still_waits_for_ds_kv() -> None:
    halves = Halves(d_seconds=0.2)
    with anyio.move_on_after(0.1):  # P has pushed; D's KV is not in yet
        async for _ in halves.step():
            pass
    assert halves.events == ["p pushed", "d arrived", "d closed"]  # D not aborted while its KV was in flight


async def test_a_refused_d_fails_the_step_once_p_has_ended_unaborted(caplog: pytest.LogCaptureFixture) -> None:
    halves = Halves(p_seconds=0.1, d_refuses=True)
    with pytest.raises(EngineError, match="decode engine refused"):
        async for _ in halves.step():
            pass
    assert halves.events == ["d closed", "p pushed"]  # P ran to its end; D's error is the step's
    assert "D gave no output" in caplog.text


async def test_a_consumer_that_leaves_after_the_first_output_closes_d() -> None:
    halves = Halves()
    outputs = aiter(halves.step())
    assert await anext(outputs) == "a"
    await outputs.aclose()  # type: ignore[attr-defined]  # an async generator's
    assert halves.events == ["p pushed", "d arrived", "d closed"]
