"""The adapters on an engine opened any way: the README's second pattern (``async with`` the engine, then the
framework's async runner), ``with`` and ``.start()``, from async code and from sync code in another thread.

Unit tests on `HonestPairEngine` (it checks every pushed-back handle); the real pair opened with ``async with``
runs the same adapters in the real-engine tier's adapter tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import pytest
from agents import Agent, Runner, function_tool, set_tracing_disabled
from agents.stream_events import RawResponsesStreamEvent
from langchain_core.messages import HumanMessage
from pydantic_ai import Agent as PydanticAgent

from agentkv import UserError
from agentkv.engines import StepRequest
from agentkv.integrations.langchain import ChatAgentKV
from agentkv.integrations.openai_agents import AgentKVModel as AgentsModel
from agentkv.integrations.pydantic_ai import AgentKVModel as PydanticModel
from agentkv.testing import HonestPairEngine
from scripted import close_leftover_event_loop

pytestmark = pytest.mark.anyio
set_tracing_disabled(True)


def calls_then_answer(text: str) -> Callable[[StepRequest], str]:
    """A model that calls ``add(2, 3)`` on a conversation's first step and answers ``text`` after."""
    seen: list[int] = []

    def respond(request: StepRequest) -> str:
        seen.append(1)
        if len(seen) % 2 == 1:
            return json.dumps({"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]})
        return json.dumps({"answer": text})

    return respond


@function_tool(name_override="add")
def agents_add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def pydantic_add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def assert_pushed_back(stats: list[Any]) -> None:
    assert len(stats) == 2
    assert stats[1].handle_forwarded and stats[1].miss_reason is None and stats[1].pulled_tokens > 0


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_openai_agents_runs_on_an_engine_opened_with_async_with(streamed: bool) -> None:
    async with HonestPairEngine(calls_then_answer("It is 5.")) as engine:
        async with AgentsModel(engine=engine) as model:
            agent = Agent(name="adder", instructions="Add.", tools=[agents_add], model=model)
            if streamed:
                result: Any = Runner.run_streamed(agent, "2 + 3?")
                deltas = [
                    event.data.delta
                    async for event in result.stream_events()
                    if isinstance(event, RawResponsesStreamEvent) and event.data.type == "response.output_text.delta"
                ]
                assert "".join(deltas) == "It is 5."
            else:
                result = await Runner.run(agent, "2 + 3?")
            assert result.final_output == "It is 5."
            assert_pushed_back(model.stats)
        engine.assert_honest()
        assert engine.live_pins == 0  # the model's close released its session's pin; the engine is still open
        assert engine.is_open


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_stream"])
async def test_pydantic_ai_runs_on_an_engine_opened_with_async_with(streamed: bool) -> None:
    async with HonestPairEngine(calls_then_answer("It is 5.")) as engine:
        model = PydanticModel(engine=engine)
        agent = PydanticAgent(model, tools=[pydantic_add], instructions="Add.")
        if streamed:
            async with agent.run_stream("2 + 3?") as stream:
                pieces = [piece async for piece in stream.stream_text(delta=True)]
            assert "".join(pieces) == "It is 5."
        else:
            result = await agent.run("2 + 3?")
            assert result.output == "It is 5."
        assert_pushed_back(model.stats)
        await model.aclose()
        engine.assert_honest()
        assert engine.live_pins == 0 and engine.is_open


async def test_langchain_runs_on_an_engine_opened_with_async_with() -> None:
    async with HonestPairEngine(lambda request: "Hello.") as engine:
        model = ChatAgentKV(engine=engine)
        messages: list[Any] = [HumanMessage("Hi")]
        messages.append(await model.ainvoke(messages))
        messages.append(HumanMessage("Again?"))
        chunks = [chunk async for chunk in model.astream(messages)]
        assert "".join(str(c.content) for c in chunks) == "Hello."
        assert_pushed_back(model.stats)
        await model._pooled.aclose()
        engine.assert_honest()


async def test_a_blocking_call_from_another_thread_reaches_an_engine_opened_with_async_with() -> None:
    async with HonestPairEngine(lambda request: "Hello.") as engine:
        model = ChatAgentKV(engine=engine)
        first = await anyio.to_thread.run_sync(model.invoke, [HumanMessage("Hi")])
        chunks = await anyio.to_thread.run_sync(
            lambda: list(model.stream([HumanMessage("Hi"), first, HumanMessage("And?")]))
        )
        assert "".join(str(c.content) for c in chunks) == "Hello."
        assert_pushed_back(model.stats)
        await anyio.to_thread.run_sync(model.close)  # a blocking close, from a thread: on the engine's loop
        engine.assert_honest()
        assert engine.live_pins == 0


async def test_a_blocking_call_on_the_loop_an_async_with_engine_runs_on_is_refused_by_name() -> None:
    async with HonestPairEngine(lambda request: "Hello.") as engine:
        model = ChatAgentKV(engine=engine)
        with pytest.raises(UserError, match="await"):
            model._pooled.call_sync([{"role": "user", "content": "Hi"}])
        assert (await model.ainvoke([HumanMessage("Hi")])).content == "Hello."  # and the model is still usable
        await model._pooled.aclose()


def test_the_adapters_run_on_an_engine_opened_with_start_and_closed_after() -> None:
    engine = HonestPairEngine(calls_then_answer("It is 5.")).start()
    try:
        with AgentsModel(engine=engine) as model:
            result = Runner.run_sync(Agent(name="adder", tools=[agents_add], model=model), "2 + 3?")
            assert result.final_output == "It is 5."
            assert_pushed_back(model.stats)
        close_leftover_event_loop()
        with PydanticModel(engine=engine) as pydantic_model:
            assert PydanticAgent(pydantic_model, tools=[pydantic_add]).run_sync("2 + 3?").output == "It is 5."
            assert_pushed_back(pydantic_model.stats)
        engine.assert_honest()
    finally:
        close_leftover_event_loop()
        engine.close()
