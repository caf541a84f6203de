"""A turn that does not finish is gone at once: callbacks that raise, streams left early, other threads.

Each test would have failed before the turn was committed only at its end (issue 12, defects 1
and 12): the aborted turn stayed in `messages` until the garbage collector finalized it, and the
next turn failed with "a turn is already running".
"""

from __future__ import annotations

import gc
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from agentkv import Event, Session, TextDelta, TurnEnd, UserError, tool
from agentkv.engines import StepRequest
from agentkv.testing import ScriptedEngine


class Stop(Exception):
    pass


@pytest.fixture(autouse=True)
def _no_garbage_collector() -> Iterator[None]:
    """Rollback must not wait for the collector: run every test here with it off."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _raise_on(kind: str) -> Any:
    def on_event(event: Event) -> None:
        if event.kind == kind:
            raise Stop(kind)

    return on_event


@pytest.mark.parametrize("kind", ["text_delta", "step_end", "turn_end"])
def test_a_callback_that_raises_leaves_the_turn_out_of_history_and_stats(kind: str) -> None:
    with ScriptedEngine(["Paris.", "aborted", "Rome."]) as engine, Session(engine=engine) as session:
        session.run_sync("Capital of France?")
        before, turns = session.token_ids, session.stats.turns
        with pytest.raises(Stop):
            session.run_sync("And Italy?", on_event=_raise_on(kind))
        assert session.token_ids == before and session.stats.turns == turns
        assert [m.role for m in session.messages] == ["user", "assistant"]
        again = session.run_sync("And Italy?")  # at once: no turn is left running
        assert again.text == "Rome." and again.stats.turn == 2
        assert [t.turn for t in session.stats.turns] == [1, 2]


@pytest.mark.anyio
async def test_leaving_a_stream_early_drops_the_turn_at_once() -> None:
    async with ScriptedEngine(["Paris.", "left", "Rome."]) as engine, Session(engine=engine) as session:
        await session.run("Capital of France?")
        before = session.token_ids
        async for event in session.stream("And Italy?"):
            assert isinstance(event, TextDelta)
            break  # the consumer stops before the turn ends
        assert session.token_ids == before and len(session.stats.turns) == 1
        assert (await session.run("And Italy?")).text == "Rome."  # not "a turn is already running"
        assert [m.content for m in session.messages][-2:] == ["And Italy?", "Rome."]
        assert len(session.stats.turns) == 2
        engine.assert_complete()


@pytest.mark.anyio
async def test_an_abandoned_stream_does_not_block_edits() -> None:
    async with ScriptedEngine(["Paris.", "left"]) as engine, Session(engine=engine) as session:
        await session.run("Capital of France?")
        async for _ in session.stream("And Italy?"):
            break
        session.rewind()  # an edit right after: the abandoned turn is not "running"
        assert session.messages == [] and session.stats.turns == []


@pytest.mark.anyio
async def test_a_stream_kept_to_its_turn_end_is_kept_even_if_the_consumer_stops_there() -> None:
    async with ScriptedEngine(["Paris.", "Rome."]) as engine, Session(engine=engine) as session:
        async for event in session.stream("Capital of France?"):
            if isinstance(event, TurnEnd):
                break
        assert [m.content for m in session.messages] == ["Capital of France?", "Paris."]
        assert len(session.stats.turns) == 1
        assert (await session.run("And Italy?")).stats.turn == 2


@pytest.mark.anyio
async def test_a_consumer_that_raises_inside_a_stream_drops_the_turn() -> None:
    async with ScriptedEngine(["Paris.", "Rome."]) as engine, Session(engine=engine) as session:
        with pytest.raises(Stop):
            async for _ in session.stream("Capital of France?"):
                raise Stop
        assert session.messages == []
        assert (await session.run("Capital of France?")).text == "Rome."


GATE_TIMEOUT_S = 30.0


def test_edits_from_another_thread_while_a_turn_runs_are_refused() -> None:
    entered, release = threading.Event(), threading.Event()

    @tool
    def wait() -> str:
        """Block until the test lets go."""
        entered.set()
        assert release.wait(GATE_TIMEOUT_S)
        return "done"

    script = [json.dumps({"tool_calls": [{"name": "wait", "arguments": {}}]}), json.dumps({"answer": "ok"})]
    with (
        ScriptedEngine([json.dumps({"answer": "Paris."}), *script]) as engine,
        Session(engine=engine, tools=[wait], system="Be brief.") as session,
    ):
        session.run_sync("Capital of France?")
        before = session.token_ids
        outcome: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: outcome.update(result=session.run_sync("wait, please")))
        runner.start()
        try:
            assert entered.wait(GATE_TIMEOUT_S)
            for edit in (session.rewind, session.fork, lambda: session.replace_message(1, "changed")):
                with pytest.raises(UserError, match="while a turn runs"):
                    edit()
            with pytest.raises(UserError, match="already running"):
                session.run_sync("another")
            assert session.token_ids == before  # the running turn is not visible until it ends
        finally:
            release.set()
            runner.join(GATE_TIMEOUT_S)
        assert outcome["result"].text == "ok"
        assert len(session.stats.turns) == 2
        session.rewind()  # idle again: edits work
        assert session.token_ids == before


def test_an_engine_error_after_a_tool_round_keeps_nothing_of_the_turn() -> None:
    def fail(request: StepRequest) -> str:
        raise Stop("engine")

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    call = json.dumps({"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]})
    with (
        ScriptedEngine([call, fail, call, json.dumps({"answer": "3"})]) as engine,
        Session(engine=engine, tools=[add]) as session,
    ):
        with pytest.raises(Stop):
            session.run_sync("1 + 2?")
        assert session.messages[1:] == [] and session.stats.turns == []
        assert session.run_sync("1 + 2?").text == "3"
        assert [m.role for m in session.messages[1:]] == ["user", "assistant", "tool", "assistant"]
