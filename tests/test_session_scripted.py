"""Session loop logic on the scripted engine (no model runs here; the real pair is in test_pair.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from agentkv import (
    ContextLengthError,
    EngineError,
    InvalidMessageError,
    LifecycleState,
    Session,
    SessionClosedError,
    TextDelta,
    TurnEnd,
    UserError,
)
from agentkv._engines._server_process import ServerProcess
from agentkv._engines._vllm import AsyncLLMRunner
from agentkv.engines import EngineInfo, StepRequest
from agentkv.testing import ScriptedEngine, UnconsumedScriptError


@pytest.fixture
def engine() -> Iterator[ScriptedEngine]:
    with ScriptedEngine(["Paris.", "Rome.", "Madrid.", "Berlin."]) as scripted:
        yield scripted  # type: ignore[misc]


def test_turns_extend_the_token_history(engine: ScriptedEngine) -> None:
    with Session(engine=engine, system="You are terse.") as session:
        first = session.run_sync("Capital of France?")
        second = session.run_sync("And Italy?")
    assert (first.text, second.text) == ("Paris.", "Rome.")
    prompt_1, prompt_2 = (list(r.prompt_token_ids) for r in engine.requests)
    assert prompt_2[: len(prompt_1) + len(first.steps[0].token_ids)] == prompt_1 + first.steps[0].token_ids
    assert [m.role for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert [t.turn for t in session.stats.turns] == [1, 2]


@pytest.mark.parametrize("bad", ["", "   ", None, 42, ["hi"]])
def test_bad_messages_are_refused_and_nothing_is_lost(engine: ScriptedEngine, bad: object) -> None:
    with Session(engine=engine) as session:
        session.run_sync("Capital of France?")
        before = session.token_ids
        with pytest.raises(InvalidMessageError):
            session.run_sync(bad)  # type: ignore[arg-type]
        assert session.token_ids == before
        assert session.run_sync("And Italy?").text == "Rome."


def test_a_prompt_over_the_context_is_refused_before_the_engine(tokenizer: object) -> None:
    with ScriptedEngine(["ok", "ok"], max_model_len=64) as small, Session(engine=small) as session:
        with pytest.raises(ContextLengthError) as info:
            session.run_sync("word " * 100)
        assert info.value.max_model_len == 64 and info.value.prompt_tokens > 64
        assert small.requests == [] and session.messages == []
        assert session.run_sync("short").text == "ok"


def test_an_engine_error_mid_turn_restores_the_conversation(engine: ScriptedEngine) -> None:
    def fail(request: StepRequest) -> str:
        raise EngineError("boom")

    with ScriptedEngine(["Paris.", fail, "Rome."]) as flaky, Session(engine=flaky) as session:
        session.run_sync("Capital of France?")
        before = session.token_ids
        with pytest.raises(EngineError):
            session.run_sync("And Italy?")
        assert session.token_ids == before
        assert session.run_sync("And Italy?").text == "Rome."


def test_use_after_close_is_a_clear_error(engine: ScriptedEngine) -> None:
    session = Session(engine=engine)
    with pytest.raises(SessionClosedError):
        session.run_sync("hi")
    with session:
        session.run_sync("hi")
    with pytest.raises(SessionClosedError):
        session.run_sync("hi")
    with pytest.raises(SessionClosedError), session:
        pass


def test_configuration_mistakes_raise_user_errors(engine: ScriptedEngine) -> None:
    with pytest.raises(UserError):
        Session(mode="fast")  # type: ignore[arg-type]
    with pytest.raises(UserError):
        Session(engine=engine, model="other")
    with pytest.raises(UserError):
        Session(max_tokens=0)
    with pytest.raises(UserError), Session(engine=engine, mode="bidirectional"):
        pass  # a scripted engine has no push-back


def test_rewind_and_fork(engine: ScriptedEngine) -> None:
    with Session(engine=engine) as session:
        session.run_sync("Capital of France?")
        after_first = session.token_ids
        session.run_sync("And Italy?")
        session.rewind()
        assert session.token_ids == after_first and len(session.stats.turns) == 1
        fork = session.fork()
        assert fork.run_sync("And Spain?").text == "Madrid."
        assert session.token_ids == after_first  # the fork's turn did not touch the original
        assert session.run_sync("And Germany?").text == "Berlin."
        fork.close()
    engine.assert_complete()


@pytest.mark.anyio
async def test_async_streaming_events_in_order() -> None:
    async with ScriptedEngine(["Paris."]) as engine, Session(engine=engine) as session:
        events = [event async for event in session.stream("Capital of France?")]
    assert isinstance(events[0], TextDelta) and events[0].text == "Paris."
    assert [e.kind for e in events] == ["text_delta", "step_end", "turn_end"]
    assert isinstance(events[-1], TurnEnd) and events[-1].result.text == "Paris."


@pytest.mark.anyio
async def test_run_sync_on_an_async_session_says_what_to_call() -> None:
    async with ScriptedEngine(["Paris."]) as engine, Session(engine=engine) as session:
        with pytest.raises(UserError, match="await"):
            session.run_sync("hi")


def test_the_script_must_be_consumed() -> None:
    with ScriptedEngine(["one", "two"]) as engine, Session(engine=engine) as session:
        session.run_sync("hi")
        with pytest.raises(UnconsumedScriptError):
            engine.assert_complete()


def test_an_unopened_engine_given_to_a_session_is_the_sessions_own() -> None:
    engine = ScriptedEngine(["Paris."])
    with Session(engine=engine) as session:
        assert engine.is_open
        assert session.run_sync("Capital of France?").text == "Paris."
    assert engine.state is LifecycleState.CLOSED


class _ColocatedDouble(ScriptedEngine):
    """A scripted engine that declares what a single engine serves: the colocated mode only."""

    @property
    def info(self) -> EngineInfo:
        return dataclasses.replace(super().info, disaggregated=False)


def test_a_session_runs_in_a_mode_its_engine_serves() -> None:
    with _ColocatedDouble(["Paris."]) as colocated:
        with Session(engine=colocated) as session:
            assert session.mode == "colocated" and session.run_sync("Capital of France?").text == "Paris."
        with pytest.raises(UserError, match="serves colocated"), Session(engine=colocated, mode="disaggregated"):
            pass
    with ScriptedEngine([]) as scripted, Session(engine=scripted) as session:
        assert session.mode == "disaggregated"  # a double without push-back; it serves colocated too


def test_unit_tests_cannot_start_a_real_engine() -> None:
    for start in (AsyncLLMRunner.start, ServerProcess.start):
        with pytest.raises(UserError, match="blocked"):
            start(None)  # type: ignore[arg-type]
