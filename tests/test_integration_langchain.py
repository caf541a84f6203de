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
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.exceptions import ContextOverflowError, ModelConnectionError, ModelInvalidRequestError
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
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
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
    finally:
        model.close()


@pytest.mark.parametrize("method", ["json_schema", "json_mode"])
def test_structured_output_by_forcing_the_output_itself(engine: HonestPairEngine, script: Script, method: str) -> None:
    """``json_schema`` forces the output to the schema, ``json_mode`` to a JSON object (vLLM's structured outputs);
    with ``include_raw`` an output that does not parse is the parsing error, not an exception."""
    script.outputs = [json.dumps({"a": 1, "b": 2}), "not JSON"]
    model = ChatAgentKV(engine=engine)
    try:
        if method == "json_schema":
            assert model.with_structured_output(Sum, method="json_schema").invoke("One plus two.") == Sum(a=1, b=2)
        else:
            assert model.with_structured_output(None, method="json_mode").invoke("1 + 2 as JSON.") == {"a": 1, "b": 2}
        forced = script.requests[0].sampling.options.structured_outputs
        assert forced == ({"json": convert_to_json_schema(Sum)} if method == "json_schema" else {"json_object": True})
        assert script.requests[0].sampling.json_schema is None  # no tools: the output itself is forced
        raw = model.with_structured_output(Sum, method=method, include_raw=True).invoke("Again.")  # type: ignore[arg-type]
        assert raw["parsed"] is None and raw["parsing_error"] is not None and raw["raw"].content == "not JSON"
    finally:
        model.close()


def test_the_model_name_is_the_model_the_pool_serves(script: Script, model: ChatAgentKV) -> None:
    """LangChain's usage callback and LangSmith key usage by it: in every reply, streamed or not, and in the trace's
    standard parameters (a call's own ``model`` there, which the call itself then refuses: one engine, one model)."""
    from langchain_core.callbacks import get_usage_metadata_callback

    script.outputs[:] = ["One.", "Two."]
    with get_usage_metadata_callback() as usage:
        reply = model.invoke("Hi")
        streamed = merged(list(model.stream("Hi")))
    name = "test_model"  # the doubles' model folder
    assert reply.response_metadata["model_name"] == streamed.response_metadata["model_name"] == name
    assert model._get_ls_params()["ls_model_name"] == name and model._get_ls_params(model="x")["ls_model_name"] == "x"
    assert list(usage.usage_metadata) == [name] and usage.usage_metadata[name]["input_tokens"] > 0
    with pytest.raises(NotImplementedError, match="serves one model"):
        model.invoke("Hi", model="another-model")


def test_langchains_standard_init_parameters_are_honoured(engine: HonestPairEngine, script: Script) -> None:
    """``stop``, ``streaming``, ``timeout``, ``max_retries`` mean what they mean; ``api_key`` is accepted, unused.
    An unknown option is a TypeError naming ChatAgentKV (never the SessionPool its user did not make)."""
    script.outputs[:] = ["First line.\nSecond line.", "Streamed."]
    model = ChatAgentKV(engine=engine, stop=["\n"], streaming=False, timeout=30, max_retries=2, api_key="unused")
    try:
        assert model.invoke("Two lines.").content == "First line."
        assert script.requests[0].sampling.stop == ("\n",)
        assert model._get_ls_params()["ls_stop"] == ["\n"]
    finally:
        model.close()
    streaming = ChatAgentKV(engine=engine, streaming=True)
    try:
        seen: list[str] = []

        class Tokens(BaseCallbackHandler):
            def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
                seen.append(token)

        assert streaming.invoke("Hi", config={"callbacks": [Tokens()]}).content == "Streamed."
        assert "".join(seen) == "Streamed."  # invoke streamed from the engine
    finally:
        streaming.close()
    with pytest.raises(TypeError, match=r"ChatAgentKV\(\) got an unexpected keyword argument 'tempreature'"):
        ChatAgentKV(engine=engine, tempreature=0.5)


def test_a_timeout_cancels_the_call_and_leaves_the_session_as_it_was() -> None:
    with HonestPairEngine(lambda request: "late") as engine:
        engine.inject("stall")
        model = ChatAgentKV(engine=engine, timeout=0.2)
        try:
            with pytest.raises(TimeoutError, match="timeout"):
                model.invoke("Hi")
            assert engine.steps[-1].outcome == "cancelled" and model.stats == []
            assert model.invoke("Hi").content == "late"  # the next call runs as if nothing happened
        finally:
            model.close()


def test_max_retries_makes_a_call_again_only_when_its_server_could_not_be_reached() -> None:
    from agentkv import EngineUnavailableError

    failures = [EngineUnavailableError("the decode server could not be reached")]

    def respond(request: Any) -> str:
        if failures:
            raise failures.pop()
        return "Reached."

    with HonestPairEngine(respond) as engine:
        model = ChatAgentKV(engine=engine, max_retries=1)
        try:
            assert model.invoke("Hi").content == "Reached."
            failures.append(EngineUnavailableError("again"))
            failures.append(EngineUnavailableError("and again"))
            with pytest.raises(ModelConnectionError):  # two failures, one retry
                model.invoke("Hi")
        finally:
            model.close()


def test_content_blocks_of_the_common_providers_are_read(script: Script, model: ChatAgentKV) -> None:
    """A history another provider wrote continues here: Anthropic's ``tool_use`` blocks (repeating ``tool_calls``),
    ``thinking`` blocks and ``tool_result`` blocks in a human message; LangChain v1's ``reasoning`` and ``tool_call``
    blocks. The reasoning is not part of the message the model reads back, as chat templates drop it."""
    script.outputs[:] = ["Noted."] * 3
    anthropic = [
        HumanMessage("Pick a colour."),
        AIMessage(
            [
                {"type": "thinking", "thinking": "Green.", "signature": "x"},
                {"type": "text", "text": "Let me pick."},
                {"type": "tool_use", "id": "foo", "name": "add", "input": {"a": 1, "b": 2}},
            ],
            tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "foo", "type": "tool_call"}],
        ),
        HumanMessage(
            [
                {"type": "tool_result", "tool_use_id": "foo", "content": [{"type": "text", "text": "3"}]},
                {"type": "text", "text": "And now?"},
            ]
        ),
    ]
    assert model.bind_tools([add]).invoke(anthropic).content == "Noted."
    v1 = [
        HumanMessage("Hi"),
        AIMessage([{"type": "reasoning", "reasoning": "A greeting."}, {"type": "text", "text": "Hello."}]),
        HumanMessage("Again"),
    ]
    assert model.invoke(v1).content == "Noted."
    prompt = script.requests[1].prompt_token_ids
    with pytest.raises(NotImplementedError, match="'image'"):
        model.invoke([HumanMessage([{"type": "image", "url": "https://example.com/x.png"}])])
    assert prompt  # the v1 history was rendered


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
