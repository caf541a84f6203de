"""openai-agents on agentkv: `AgentKVModel` run by the framework's own `Runner`.

Unit tests on `HonestPairEngine` (it checks every pushed-back KV handle); one test runs the real pair.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agents import (
    Agent,
    ModelSettings,
    RunConfig,
    Runner,
    WebSearchTool,
    function_tool,
    set_tracing_disabled,
)
from agents.exceptions import ModelBehaviorError
from agents.exceptions import UserError as AgentsUserError
from agents.models.chatcmpl_converter import Converter
from agents.stream_events import RawResponsesStreamEvent
from openai.types.responses import ResponseOutputText
from pydantic import BaseModel

from agentkv import EmbeddedPair, InvalidMessageError, Session
from agentkv.engines import StepRequest
from agentkv.integrations.openai_agents import AgentKVModel, AgentKVProvider
from agentkv.serve import SqliteResponseStore
from agentkv.testing import HonestPairEngine
from scripted import Script, answer, calls, close_leftover_event_loop, with_logprobs

set_tracing_disabled(True)  # no network here: the default trace exporter would try to reach OpenAI


ADDED: list[tuple[int, int]] = []


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    ADDED.append((a, b))
    return a + b


@pytest.fixture(autouse=True)
def _fresh_tool_log() -> None:
    ADDED.clear()


@pytest.fixture
def script() -> Script:
    return Script(calls((2, 3)), calls((5, 10)), answer("It is 15."))


@pytest.fixture
def engine(script: Script) -> Iterator[HonestPairEngine]:
    with HonestPairEngine(script) as engine:
        yield engine  # type: ignore[misc]
    assert engine.violations == []


def adder(model: AgentKVModel, **options: Any) -> Agent[Any]:
    return Agent(name="adder", instructions="Add with the tool.", tools=[add], model=model, **options)


def prompt_text(tokenizer: Any, request: StepRequest) -> str:
    return str(tokenizer.decode(list(request.prompt_token_ids)))


def test_a_tool_using_agent_runs_every_step_on_one_pinned_session(
    engine: HonestPairEngine, script: Script, tokenizer: Any
) -> None:
    with AgentKVModel(engine=engine) as model:
        result = Runner.run_sync(adder(model), "Add 2 and 3, then add 10 to that.")
        steps = model.stats
        assert len(model.pool.sessions) == 1
    assert result.final_output == "It is 15."
    assert ADDED == [(2, 3), (5, 10)]  # the runner ran the tool with the model's arguments
    prompts = [prompt_text(tokenizer, r) for r in script.requests]
    assert json.dumps({"name": "add", "result": "5"}) in prompts[1]  # each tool result reached the model
    assert json.dumps({"name": "add", "result": "15"}) in prompts[2]
    assert [(s.turn, s.step) for s in steps] == [(1, 1), (1, 2), (1, 3)]
    assert [(s.handle_forwarded, s.miss_reason) for s in steps[1:]] == [(True, None), (True, None)]
    assert all(s.pulled_tokens > 0 for s in steps[1:])
    usage = result.context_wrapper.usage
    assert usage.requests == 3
    assert usage.input_tokens == sum(s.prompt_tokens for s in steps)
    assert usage.output_tokens == sum(s.output_tokens for s in steps)
    assert usage.input_tokens_details.cached_tokens == sum(s.prompt_tokens - s.computed_tokens for s in steps) > 0
    assert [u.input_tokens_details.cached_tokens for u in usage.request_usage_entries][0] == 0


def test_streaming_gives_the_answer_as_text_deltas_and_the_same_usage(engine: HonestPairEngine) -> None:
    async def run(model: AgentKVModel) -> tuple[Any, list[str]]:
        result = Runner.run_streamed(adder(model), "Add 2 and 3, then add 10 to that.")
        deltas = [
            event.data.delta
            async for event in result.stream_events()
            if isinstance(event, RawResponsesStreamEvent) and event.data.type == "response.output_text.delta"
        ]
        return result, deltas

    with AgentKVModel(engine=engine) as model:
        result, deltas = asyncio.run(run(model))
        steps = model.stats
    assert result.final_output == "It is 15." == "".join(deltas) and len(deltas) >= 2
    assert ADDED == [(2, 3), (5, 10)]
    assert all(s.handle_forwarded and s.miss_reason is None for s in steps[1:])
    usage = result.context_wrapper.usage
    assert (usage.requests, usage.input_tokens) == (3, sum(s.prompt_tokens for s in steps))
    assert usage.input_tokens_details.cached_tokens == sum(s.prompt_tokens - s.computed_tokens for s in steps)


def test_a_named_conversation_is_kept_by_the_model_across_runs(
    engine: HonestPairEngine, script: Script, tokenizer: Any
) -> None:
    script.outputs = [calls((2, 3)), answer("It is 5."), answer("You are welcome.")]
    with AgentKVModel(engine=engine) as model:
        first = Runner.run_sync(adder(model), "Add 2 and 3.", conversation_id="c1")
        second = Runner.run_sync(adder(model), "Thanks!", conversation_id="c1")  # the framework sends only this
        session = model.pool.session_for("c1")
        assert session is not None and model.pool.sessions == [session]
        steps = model.stats
    assert (first.final_output, second.final_output) == ("It is 5.", "You are welcome.")
    last_prompt = prompt_text(tokenizer, script.requests[-1])
    assert "Add 2 and 3." in last_prompt and json.dumps({"name": "add", "result": "5"}) in last_prompt
    assert [(s.turn, s.step) for s in steps] == [(1, 1), (1, 2), (2, 1)]
    assert all(s.handle_forwarded and s.miss_reason is None for s in steps[1:])


def test_previous_response_ids_continue_the_conversation_they_name(engine: HonestPairEngine, script: Script) -> None:
    script.outputs = [calls((2, 3)), answer("It is 5."), answer("You are welcome.")]
    with AgentKVModel(engine=engine) as model:
        first = Runner.run_sync(adder(model), "Add 2 and 3.", auto_previous_response_id=True)
        assert first.last_response_id is not None
        second = Runner.run_sync(adder(model), "Thanks!", previous_response_id=first.last_response_id)
        steps = model.stats
        with pytest.raises(AgentsUserError, match="previous_response_id 'resp_elsewhere'"):
            Runner.run_sync(adder(model), "Hi", previous_response_id="resp_elsewhere")
    assert second.final_output == "You are welcome."
    assert [(s.turn, s.step) for s in steps] == [(1, 1), (1, 2), (2, 1)]
    assert all(s.handle_forwarded and s.miss_reason is None for s in steps[1:])


def test_responses_and_named_conversations_outlive_the_model_in_a_sqlite_store(
    engine: HonestPairEngine, script: Script, tokenizer: Any, tmp_path: Path
) -> None:
    """The adapter keeps what the front door keeps, in the door's `ResponseStore`: a model made again on the same
    file (a restarted process) continues a response id and a named conversation it never saw."""
    script.outputs = [answer("It is 5."), answer("It is 7."), answer("Noted."), answer("You are welcome.")]
    path = tmp_path / "responses.sqlite3"
    with SqliteResponseStore(path) as store, AgentKVModel(engine=engine, response_store=store) as model:
        first = Runner.run_sync(adder(model), "What is 2 + 3?", auto_previous_response_id=True)
        Runner.run_sync(adder(model), "And 3 + 4?", conversation_id="c1")
    with SqliteResponseStore(path) as store, AgentKVModel(engine=engine, response_store=store) as model:
        assert first.last_response_id is not None
        Runner.run_sync(adder(model), "Remember that.", previous_response_id=first.last_response_id)
        Runner.run_sync(adder(model), "Thanks!", conversation_id="c1")
    by_response, by_conversation = (prompt_text(tokenizer, r) for r in script.requests[2:])
    assert "What is 2 + 3?" in by_response and "It is 5." in by_response and "3 + 4" not in by_response
    assert "And 3 + 4?" in by_conversation and "It is 7." in by_conversation and "2 + 3" not in by_conversation


def test_a_handoff_is_a_function_tool_to_the_model() -> None:
    handoff = json.dumps({"tool_calls": [{"name": "transfer_to_helper", "arguments": {}}]})
    script = Script(handoff, "Hello.")  # the helper has no tools: its output is plain text
    with HonestPairEngine(script) as engine, AgentKVModel(engine=engine) as model:
        helper = Agent(name="helper", instructions="Greet.", model=model)
        triage = Agent(name="triage", instructions="Hand off.", handoffs=[helper], model=model)
        result = Runner.run_sync(triage, "Hi")
    assert (result.last_agent.name, result.final_output) == ("helper", "Hello.")
    assert engine.violations == []


class Sum(BaseModel):
    total: int


@pytest.mark.parametrize(
    ("options", "run_options", "names"),
    [
        ({"output_type": Sum}, {}, "structured output"),
        ({"tools": [WebSearchTool()]}, {}, "hosted tool 'web_search'"),
        ({"model_settings": ModelSettings(extra_args={"best_of": 2})}, {}, "model settings extra_args\\['best_of'\\]"),
        (
            {},
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "images",
        ),
    ],
)
def test_unsupported_features_raise_a_clear_framework_error(
    options: dict[str, Any], run_options: dict[str, Any], names: str
) -> None:
    with HonestPairEngine(Script()) as engine, AgentKVModel(engine=engine) as model:
        agent = Agent(name="a", model=model, **options)
        with pytest.raises(AgentsUserError, match=names) as info:
            Runner.run_sync(agent, run_options.get("input", "Hi"))
        assert engine.steps == []  # refused before any model call
    if "input" in run_options:
        assert isinstance(info.value.__cause__, InvalidMessageError)  # agentkv's error, kept as the cause


def test_a_stop_in_extra_args_ends_the_answer_before_it() -> None:
    script = Script("Five. That is all.")
    with HonestPairEngine(script) as engine, AgentKVModel(engine=engine) as model:
        agent = Agent(name="a", model=model, model_settings=ModelSettings(extra_args={"stop": ["."]}))
        assert Runner.run_sync(agent, "2 + 3?").final_output == "Five"
    assert script.requests[0].sampling.stop == (".",)


def test_sampling_settings_reach_the_engine_and_logprobs_come_back() -> None:
    engine = with_logprobs(HonestPairEngine)(Script("Five."))
    extra = {"top_k": 4, "seed": 3, "repetition_penalty": 1.1}
    settings = ModelSettings(top_p=0.5, presence_penalty=0.25, top_logprobs=2, extra_args=extra)
    with engine, AgentKVModel(engine=engine) as model:
        result = Runner.run_sync(Agent(name="a", model=model, model_settings=settings), "2 + 3?")
        with pytest.raises(AgentsUserError, match="sampling.top_p"):
            Runner.run_sync(Agent(name="a", model=model, model_settings=ModelSettings(top_p=2.0)), "Hi")

        async def streamed() -> None:
            run = Runner.run_streamed(Agent(name="a", model=model, model_settings=settings), "Hi")
            async for _ in run.stream_events():
                pass

        close_leftover_event_loop()  # run_sync's loop, before asyncio.run sets its own
        with pytest.raises(AgentsUserError, match="top_logprobs"):
            asyncio.run(streamed())
    asked = engine.asked[0].sampling
    assert (asked.options.top_p, asked.options.presence_penalty, asked.options.top_k) == (0.5, 0.25, 4)
    assert (asked.options.repetition_penalty, asked.options.logprobs, asked.seed) == (1.1, 2, 3)
    parts = [part for item in result.raw_responses[0].output if item.type == "message" for part in item.content]
    logprobs = parts[0].logprobs if isinstance(parts[0], ResponseOutputText) else None
    assert logprobs and all(len(entry.top_logprobs) == 2 for entry in logprobs)


def test_output_the_model_did_not_write_as_json_is_a_model_behavior_error() -> None:
    with HonestPairEngine(Script("not json")) as engine, AgentKVModel(engine=engine) as model:
        with pytest.raises(ModelBehaviorError, match="could not read the model's output"):
            Runner.run_sync(adder(model), "Add 2 and 3.")


def test_the_model_closes_only_what_it_started(script: Script) -> None:
    async def run_and_close(model: AgentKVModel) -> None:
        await Runner.run(adder(model), "Add 2 and 3, then 10.")
        await model.close()  # the framework's async close

    given_open = HonestPairEngine(script)
    with given_open:
        asyncio.run(run_and_close(AgentKVModel(engine=given_open)))
        assert given_open.is_open and given_open.live_pins == 0  # pins released; the engine is its owner's
    unopened = HonestPairEngine(Script("Hello."))
    with AgentKVModel(engine=unopened) as model:
        assert Runner.run_sync(Agent(name="a", model=model), "Hi").final_output == "Hello."
    assert unopened.stopped  # the model opened it, so the model closed it


def test_a_provider_serves_every_model_name_from_one_model(engine: HonestPairEngine) -> None:
    agent = Agent(name="adder", instructions="Add with the tool.", tools=[add], model="any-name")
    with AgentKVProvider(engine=engine) as provider:
        result = Runner.run_sync(agent, "Add 2 and 3, then 10.", run_config=RunConfig(model_provider=provider))
        assert provider.get_model(None) is provider.get_model("other") is provider.model
        assert len(provider.model.stats) == 3
    assert result.final_output == "It is 15."
    assert engine.is_open  # the runner did not close the provider, nor the provider the engine given open


def test_a_provider_closes_its_model_with_aclose(engine: HonestPairEngine) -> None:
    async def run(provider: AgentKVProvider) -> None:
        await Runner.run(Agent(name="a", tools=[add]), "Add.", run_config=RunConfig(model_provider=provider))
        await provider.aclose()

    provider = AgentKVProvider(engine=engine)
    asyncio.run(run(provider))
    assert engine.live_pins == 0  # the pool closed, releasing its sessions' pins
    assert engine.is_open


@pytest.mark.pair
def test_a_three_turn_tool_agent_on_the_real_pair_pulls_back_and_matches_a_replay(pair: EmbeddedPair) -> None:
    instructions = "Add numbers with the add tool."
    with AgentKVModel(engine=pair, temperature=0.0, max_tokens=128, cache_salt="openai-agents-adapter") as model:
        agent = Agent(
            name="adder",
            instructions=instructions,
            tools=[add],
            model=model,
            model_settings=ModelSettings(tool_choice="required"),  # schema-forced: a call that parses
            tool_use_behavior="stop_on_first_tool",  # each turn: one model call, then the tool
        )
        history: list[Any] = []
        for text in ("Add 2 and 3.", "Now add 10 and 20.", "And 7 and 8?"):
            result = Runner.run_sync(agent, [*history, {"role": "user", "content": text}])
            assert result.final_output == str(sum(ADDED[-1]))
            history = result.to_input_list()
        steps = model.stats
        held = model.pool.sessions[-1].messages  # the conversation as the model read it
    assert len(steps) == 3 and len(ADDED) >= 3  # one step per turn; the small model may call add more than once
    assert all(s.handle_forwarded and s.pulled_tokens > 0 for s in steps[1:]), steps
    tool_messages = [m.content for m in held if m.role == "tool"]
    assert len(tool_messages) >= 2  # turns 1 and 2's results reached the model (turn 3 stopped at its tool)
    assert [json.loads(c)["result"] for c in tool_messages] == [str(a + b) for a, b in ADDED][: len(tool_messages)]

    # The same messages, one call at a time, on a plain session: the same greedy outputs.
    chat: list[Any] = Converter.items_to_messages(history)
    tools = [Converter.tool_to_openai(add)]
    replayed, adapter_said = [], []
    with Session(engine=pair, temperature=0.0, max_tokens=128, cache_salt="openai-agents-replay") as session:
        messages: list[Any] = [{"role": "system", "content": instructions}]
        for message in chat:
            if message["role"] == "assistant":
                reply = session.step_sync(messages, tools=tools, tool_choice="required")
                replayed.append([(c.name, c.arguments) for c in reply.tool_calls])
                said = message.get("tool_calls", [])
                adapter_said.append([(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in said])
            messages.append(message)
    assert len(replayed) == 3 and replayed == adapter_said
