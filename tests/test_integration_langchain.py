"""`ChatAgentKV`: agentkv as a LangChain chat model, in LangChain's own tool loop.

Unit tests on `HonestPairEngine` (it checks every pushed-back KV handle); the last test runs
the real pair.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.exceptions import ContextOverflowError, ModelInvalidRequestError
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.runnables import RunnableConfig, RunnableLambda
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel

from agentkv import ContextLengthError, EmbeddedPair, InvalidMessageError, Session, SessionPool
from agentkv.integrations.langchain import ChatAgentKV
from agentkv.testing import HonestPairEngine
from scripted import Script, answer, calls


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
def script() -> Script:
    return Script(calls((2, 3)), calls((5, 4)), answer("It is 9."), then=answer("Done."))


@pytest.fixture
def engine(script: Script) -> Iterator[HonestPairEngine]:
    with HonestPairEngine(script) as engine:
        yield engine  # type: ignore[misc]
    assert engine.violations == []


@pytest.fixture
def model(engine: HonestPairEngine) -> Iterator[ChatAgentKV]:
    model = ChatAgentKV(engine=engine, max_tokens=64)
    yield model
    model.close()


def run_tools(messages: list[BaseMessage], reply: AIMessage) -> None:
    """What a LangChain agent does with a reply: keep it, run its tool calls, keep their results."""
    messages.append(reply)
    messages.extend(add.invoke(call) for call in reply.tool_calls)


def merged(chunks: list[AIMessageChunk]) -> AIMessageChunk:
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    return total


@pytest.mark.parametrize("output_version", ["v0", "v1"])
def test_a_tool_loop_runs_on_one_pinned_session(
    engine: HonestPairEngine, script: Script, tokenizer: Any, output_version: str
) -> None:
    model = ChatAgentKV(engine=engine, max_tokens=64, output_version=output_version)
    agent = model.bind_tools([add])
    messages: list[BaseMessage] = [SystemMessage("Use the tools."), HumanMessage("What is 2 + 3 + 4?")]
    replies: list[AIMessage] = []
    try:
        while len(replies) < 3:
            reply = agent.invoke(messages)
            replies.append(reply)
            run_tools(messages, reply)
            if not reply.tool_calls:
                break
        sessions = model.pool.sessions
    finally:
        model.close()
    assert [[(c["name"], c["args"]) for c in r.tool_calls] for r in replies] == [
        [("add", {"a": 2, "b": 3})],
        [("add", {"a": 5, "b": 4})],
        [],
    ]
    assert replies[-1].text == "It is 9."
    results = [m for m in messages if isinstance(m, ToolMessage)]
    assert [(m.content, m.tool_call_id) for m in results] == [
        ("5", replies[0].tool_calls[0]["id"]),
        ("9", replies[1].tool_calls[0]["id"]),
    ]
    for request, result in zip(script.requests[1:], ("5", "9"), strict=True):  # each result reached the model
        assert json.dumps({"name": "add", "result": result}) in tokenizer.decode(request.prompt_token_ids)
    assert len(sessions) == 1  # every call found the session of the one before
    assert [r.forwarded for r in engine.steps] == [False, True, True]
    stats = [r.response_metadata["agentkv"] for r in replies]
    assert [(s["turn"], s["step"], s["miss_reason"]) for s in stats] == [
        (1, 1, "no_handle"),
        (1, 2, None),
        (1, 3, None),
    ]
    for reply, step in zip(replies, stats, strict=True):
        usage = reply.usage_metadata
        assert usage is not None and usage["input_tokens"] == step["prompt_tokens"]
        assert usage["output_tokens"] == step["output_tokens"] > 0
        assert usage["input_token_details"]["cache_read"] == step["prompt_tokens"] - step["computed_tokens"]
    assert all(s["pulled_tokens"] > 0 for s in stats[1:])  # D's KV of the step before came back
    assert [r.response_metadata["finish_reason"] for r in replies] == ["tool_calls", "tool_calls", "stop"]


def test_the_model_exposes_each_calls_stats(model: ChatAgentKV) -> None:
    reply = model.bind_tools([add]).invoke([HumanMessage("What is 2 + 3?")])
    assert model.last_reply is not None and model.last_reply.tool_calls[0].id == reply.tool_calls[0]["id"]
    assert model.stats == [model.last_reply.stats]
    assert model.stats[0].model_dump() == reply.response_metadata["agentkv"]


def test_stream_carries_the_calls_as_written_and_ends_with_usage_and_merges_to_the_reply(
    model: ChatAgentKV, engine: HonestPairEngine
) -> None:
    agent = model.bind_tools([add])
    messages: list[BaseMessage] = [HumanMessage("What is 2 + 3 + 4?")]
    for expected in ((2, 3), (5, 4)):
        chunks = list(agent.stream(messages))
        last = chunks[-1]
        assert last.chunk_position == "last" and last.usage_metadata is not None
        pieces = [piece for chunk in chunks[:-1] for piece in chunk.tool_call_chunks]  # the call as it was written
        assert (
            pieces[0]["name"] == "add"
            and pieces[0]["id"]
            and [p["name"] for p in pieces[1:]] == [None] * (len(pieces) - 1)
        )
        call = merged(chunks)
        assert [(c["name"], c["args"]) for c in call.tool_calls] == [("add", dict(zip("ab", expected, strict=True)))]
        run_tools(messages, call)  # the merged chunks, sent back as they are: the session still matches
    assert last.response_metadata["agentkv"]["handle_forwarded"] is True
    assert [r.forwarded for r in engine.steps] == [False, True]


def test_streamed_text_joins_to_the_answer(engine: HonestPairEngine, script: Script) -> None:
    script.outputs = [answer("Five, since two and three make five.")]
    model = ChatAgentKV(engine=engine)
    try:
        chunks = list(model.bind_tools([add]).stream([HumanMessage("What is 2 + 3?")]))
    finally:
        model.close()
    texts = [c.content for c in chunks[:-1]]
    assert len(texts) > 1 and all(texts)  # pieces as they are generated
    message = merged(chunks)
    assert message.content == "Five, since two and three make five." and not message.tool_calls
    assert message.usage_metadata is not None and message.usage_metadata["output_tokens"] > 0


def test_the_async_loop_and_astream(model: ChatAgentKV, engine: HonestPairEngine) -> None:
    agent = model.bind_tools([add])
    messages: list[BaseMessage] = [HumanMessage("What is 2 + 3 + 4?")]

    async def loop() -> list[AIMessage]:
        first = await agent.ainvoke(messages)
        run_tools(messages, first)
        second = merged([chunk async for chunk in agent.astream(messages)])
        run_tools(messages, second)
        return [first, second, await agent.ainvoke(messages)]

    replies = asyncio.run(loop())
    assert [(c["name"], c["args"]) for c in replies[1].tool_calls] == [("add", {"a": 5, "b": 4})]
    assert replies[2].text == "It is 9."
    assert [r.forwarded for r in engine.steps] == [False, True, True]


def test_a_stream_stopped_early_leaves_the_model_usable(
    model: ChatAgentKV, engine: HonestPairEngine, script: Script
) -> None:
    script.outputs = ["A long answer, word after word after word.", "Again."]  # no tools: plain text
    messages = [HumanMessage("Talk.")]
    for _ in model.stream(messages):
        break
    assert model.invoke(messages).content == "Again."


def thread_config(thread_id: str, namespace: str | None = None) -> RunnableConfig:
    """The metadata a LangGraph node runs with (LangGraph copies ``thread_id`` there)."""
    metadata: dict[str, Any] = {"thread_id": thread_id}
    if namespace is not None:
        metadata["langgraph_checkpoint_ns"] = namespace
    return {"metadata": metadata}


def test_a_langgraph_thread_pins_its_conversation(model: ChatAgentKV, engine: HonestPairEngine) -> None:
    agent = model.bind_tools([add])
    messages: list[BaseMessage] = [HumanMessage("What is 2 + 3 + 4?")]
    node = RunnableLambda(lambda history: agent.invoke(history))  # a graph node calling the model
    streaming_node = RunnableLambda(lambda history: merged(list(agent.stream(history))))
    run_tools(messages, node.invoke(messages, thread_config("t1", "agent:1f0c2a")))
    pinned = model.pool.session_for("t1|agent")  # the thread and the node, without the task id
    assert pinned is not None
    run_tools(messages, streaming_node.invoke(messages, thread_config("t1", "agent:7d1e9b")))
    node.invoke(messages, thread_config("t1", "agent:02ab44"))
    assert model.pool.sessions == [pinned]
    assert [r.forwarded for r in engine.steps] == [False, True, True]
    model.invoke([HumanMessage("Hi")], {"metadata": {"thread_id": "t2"}})  # outside a graph: the thread alone
    assert model.pool.session_for("t2") is not None


def test_parallel_calls_on_one_thread_fall_back_to_matching(model: ChatAgentKV) -> None:
    config = thread_config("t1", "joke:1")

    async def both() -> list[AIMessage]:
        return list(
            await asyncio.gather(
                model.ainvoke([HumanMessage("A joke about cats.")], config),
                model.ainvoke([HumanMessage("A joke about dogs.")], config),
            )
        )

    assert len(asyncio.run(both())) == 2
    assert len(model.pool.sessions) == 2 and model.pool.session_for("t1|joke") is not None


class Sum(BaseModel):
    a: int
    b: int


def test_structured_output_by_tool_calling(engine: HonestPairEngine, script: Script) -> None:
    script.outputs = [json.dumps({"tool_calls": [{"name": "Sum", "arguments": {"a": 1, "b": 2}}]})]
    model = ChatAgentKV(engine=engine)
    try:
        assert model.with_structured_output(Sum).invoke("One plus two, as a sum.") == Sum(a=1, b=2)
        assert script.requests[0].sampling.json_schema is not None  # the call was forced
        with pytest.raises(NotImplementedError, match="tool calling only"):
            model.with_structured_output(Sum, method="json_schema")
    finally:
        model.close()


def test_stop_sequences_end_the_answer_before_the_first(script: Script, model: ChatAgentKV) -> None:
    script.outputs = ["First line.\nSecond line."] * 2
    reply = model.invoke("Two lines, please.", stop=["\n", "Second"])
    assert (reply.content, reply.response_metadata["finish_reason"]) == ("First line.", "stop")
    streamed = "".join(str(chunk.content) for chunk in model.stream("Two lines, please.", stop=["\n"]))
    assert streamed == "First line."
    assert [r.sampling.stop for r in script.requests] == [("\n", "Second"), ("\n",)]


def test_bound_sampling_options_under_vllms_names_reach_the_step(script: Script, model: ChatAgentKV) -> None:
    script.outputs[:] = ["One.", "Two."]
    model.bind(top_p=0.5, top_k=8).invoke("Hi")
    model.bind(sampling={"min_p": 0.1, "top_k": 2}, presence_penalty=0.5).invoke("Hi", top_k=4)
    first, second = (request.sampling.options for request in script.requests)
    assert (first.top_p, first.top_k) == (0.5, 8)
    assert (second.min_p, second.top_k, second.presence_penalty, second.top_p) == (0.1, 4, 0.5, 1.0)
    with pytest.raises(ModelInvalidRequestError, match="sampling.top_p"):
        model.invoke("Hi", top_p=0)


@pytest.mark.parametrize(
    ("messages", "options", "feature"),
    [
        ([HumanMessage([{"type": "image_url", "image_url": {"url": "https://x/y.png"}}])], {}, "'image_url' content"),
        ([HumanMessage("Hi")], {"parallel_tool_calls": False}, "call options parallel_tool_calls"),
        ([HumanMessage("Hi")], {"logprobs": True}, "call options logprobs"),
        ([ChatMessage(role="critic", content="Hi")], {}, "not ChatMessage"),
    ],
)
def test_unsupported_features_raise_a_clear_error(
    model: ChatAgentKV, messages: list[BaseMessage], options: dict[str, Any], feature: str
) -> None:
    with pytest.raises(NotImplementedError, match=feature):
        model.invoke(messages, **options)
    with pytest.raises(NotImplementedError, match=feature):
        list(model.stream(messages, **options))


def test_agentkv_errors_become_langchain_model_errors() -> None:
    with HonestPairEngine(max_model_len=64) as engine:
        model = ChatAgentKV(engine=engine)
        try:
            with pytest.raises(ContextOverflowError) as too_long:
                model.invoke([HumanMessage("word " * 200)])
            assert isinstance(too_long.value.__cause__, ContextLengthError)
            orphan = [HumanMessage("Hi"), AIMessage("Hello."), ToolMessage("5", tool_call_id="nobody")]
            with pytest.raises(ModelInvalidRequestError) as invalid:
                model.invoke(orphan)
            assert isinstance(invalid.value.__cause__, InvalidMessageError)
        finally:
            model.close()


def test_who_closes_what(script: Script) -> None:
    with HonestPairEngine(script) as given_open:
        model = ChatAgentKV(engine=given_open)
        model.invoke([HumanMessage("Hi")])
        model.close()
        assert given_open.is_open  # its owner closes it
        with SessionPool(engine=given_open) as pool:
            shared = ChatAgentKV(pool=pool)
            shared.invoke([HumanMessage("Hi")])
            shared.close()
            assert pool.is_open
    given_unopened = HonestPairEngine(script)
    model = ChatAgentKV(engine=given_unopened)
    model.invoke([HumanMessage("Hi")])
    model.close()
    assert given_unopened.stopped and given_unopened.violations == []


@pytest.mark.pair
def test_on_the_real_pair_the_loop_pulls_back_and_equals_session_steps(pair: EmbeddedPair) -> None:
    """A 3-step LangChain tool loop on the real pair: steps 2+ pull D's KV; greedy outputs equal `Session.step`'s."""
    question = "What is 1234 + 4321? Use the add tool."
    choices = ("required", "required", "none")  # two tool calls, then the answer
    model = ChatAgentKV(engine=pair, max_tokens=128, temperature=0.0, cache_salt="langchain-adapter")
    messages: list[BaseMessage] = [HumanMessage(question)]
    replies: list[AIMessage] = []
    try:
        for choice in choices:
            reply = model.bind_tools([add], tool_choice=choice).invoke(messages)
            replies.append(reply)
            run_tools(messages, reply)
        held = model.pool.sessions[0].messages
    finally:
        model.close()
    assert replies[0].tool_calls and replies[0].tool_calls[0]["name"] == "add"
    results = [m.content for m in messages if isinstance(m, ToolMessage)]
    assert results and all(any(r in m.content for m in held if m.role == "tool") for r in results)
    for reply in replies[1:]:
        stats = reply.response_metadata["agentkv"]
        assert stats["handle_forwarded"] and stats["pulled_tokens"] > 0, stats

    history: list[Any] = [{"role": "user", "content": question}]
    replayed = []
    with Session(engine=pair, max_tokens=128, temperature=0.0, cache_salt="langchain-replay") as session:
        for choice in choices:
            step = session.step_sync(history, tools=[convert_to_openai_tool(add)], tool_choice=choice)
            replayed.append(step)
            history.append(step.message)
            for call in step.tool_calls:
                history.append({"role": "tool", "tool_call_id": call.id, "content": str(add.invoke(call.arguments))})
    assert [(r.text, [(c["name"], c["args"]) for c in r.tool_calls]) for r in replies] == [
        (s.text, [(c.name, c.arguments) for c in s.tool_calls]) for s in replayed
    ]


def test_langchains_own_agent_runner_keeps_a_thread_on_one_session() -> None:
    """`langchain.agents.create_agent` (a LangGraph graph) with a checkpointer: two turns of one thread."""
    from langchain.agents import create_agent
    from langgraph.checkpoint.memory import InMemorySaver

    script = Script(calls((2, 3)), answer("It is 5."), calls((5, 4)), answer("It is 9."))
    with HonestPairEngine(script) as engine:
        model = ChatAgentKV(engine=engine, max_tokens=64)
        agent = create_agent(model, [add], checkpointer=InMemorySaver())
        thread = {"configurable": {"thread_id": "t1"}}
        agent.invoke({"messages": [HumanMessage("Add 2 and 3.")]}, thread)
        state = agent.invoke({"messages": [HumanMessage("Now 5 and 4.")]}, thread)
        steps = model.stats
        assert len(model.pool.sessions) == 1  # the thread stayed on its session
        model.close()
    assert engine.violations == []
    assert [type(m).__name__ for m in state["messages"]] == [
        "HumanMessage",
        "AIMessage",
        "ToolMessage",
        "AIMessage",
    ] * 2
    assert state["messages"][-1].content == "It is 9."
    assert [(s.turn, s.step) for s in steps] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert [s.handle_forwarded for s in steps] == [False, True, True, True]


@pytest.mark.pair
def test_a_langgraph_agent_on_the_real_pair_pulls_back_every_step(pair: EmbeddedPair) -> None:
    """A LangGraph graph (model node, `ToolNode`, checkpointer) runs 3 turns of one thread on the real pair."""
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    model = ChatAgentKV(engine=pair, max_tokens=128, temperature=0.0, cache_salt="langgraph-agent")

    def call_model(state: MessagesState) -> dict[str, list[BaseMessage]]:
        answering = isinstance(state["messages"][-1], ToolMessage)  # a call, then the answer: steady on 135M
        bound = model.bind_tools([add], tool_choice="none" if answering else "any")
        return {"messages": [bound.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([add]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    agent = graph.compile(checkpointer=InMemorySaver())
    thread = {"configurable": {"thread_id": "real-pair"}}
    try:
        for question in ("What is 12 + 30?", "And 5 + 6?", "And 100 + 1?"):
            state = agent.invoke({"messages": [HumanMessage(question)]}, thread)
        steps = model.stats
        held = model.pool.sessions[0].messages
        assert len(model.pool.sessions) == 1  # the thread stayed on its session
    finally:
        model.close()
    results = [m.content for m in state["messages"] if isinstance(m, ToolMessage)]
    assert len(results) >= 3 and all(any(r in m.content for m in held if m.role == "tool") for r in results)
    assert len(steps) == 6 and all(s.handle_forwarded for s in steps[1:])
    missed = [(s.turn, s.step, s.miss_reason) for s in steps[1:] if not s.pulled_tokens]
    assert all(reason == "below_threshold" for *_, reason in missed) and len(missed) <= 2, missed
