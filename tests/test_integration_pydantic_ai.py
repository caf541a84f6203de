"""`AgentKVModel`: pydantic-ai agents run by pydantic-ai's own loop on agentkv sessions.

Unit tests on `HonestPairEngine`, which checks every pushed-back handle; the last test runs the
real pair (marked ``pair``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, ImageUrl, ModelRetry, NativeOutput, PromptedOutput, RunContext, Tool
from pydantic_ai.capabilities import NativeTool
from pydantic_ai.exceptions import (
    ModelContextWindowExceededError,
    ModelServerError,
    UserError,
)
from pydantic_ai.messages import (
    BinaryContent,
    FilePart,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.native_tools import WebSearchTool
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import ToolDefinition

from agentkv import EmbeddedPair, Message, Session, SessionPool, StepReply
from agentkv.engines import StepRequest
from agentkv.integrations.pydantic_ai import AgentKVModel, _sampling
from agentkv.testing import HonestPairEngine


def call(tool: str, /, **arguments: Any) -> str:
    """The model's raw output for a tool call (schema format)."""
    return json.dumps({"tool_calls": [{"name": tool, "arguments": arguments}]})


def answer(text: str) -> str:
    return json.dumps({"answer": text})


class Script:
    """The model's raw outputs, one per call; keeps each call's request and prompt text."""

    def __init__(self, tokenizer: Any, *outputs: str) -> None:
        self._tokenizer = tokenizer
        self._outputs = list(outputs)
        self.requests: list[StepRequest] = []
        self.prompts: list[str] = []

    def __call__(self, request: StepRequest) -> str:
        self.requests.append(request)
        self.prompts.append(self._tokenizer.decode(request.prompt_token_ids))
        return self._outputs[len(self.requests) - 1]


@contextmanager
def honest(respond: Callable[[StepRequest], str], **options: Any) -> Iterator[HonestPairEngine]:
    with HonestPairEngine(respond, **options) as engine:
        yield engine  # type: ignore[misc]
    assert engine.violations == []


@contextmanager
def agentkv_model(engine: HonestPairEngine, **options: Any) -> Iterator[AgentKVModel]:
    model = AgentKVModel(engine=engine, **options)
    try:
        yield model
    finally:
        model.close()


added: list[tuple[int, int]] = []


def add(a: int, b: int) -> int:
    """Add two integers."""
    added.append((a, b))
    return a + b


@pytest.fixture(autouse=True)
def _no_calls_yet() -> None:
    added.clear()


def test_a_three_step_tool_run_extends_the_session_at_every_step(tokenizer: Any) -> None:
    script = Script(tokenizer, call("add", a=2, b=3), call("add", a=5, b=4), answer("The sum is 9."))
    with honest(script) as engine, agentkv_model(engine) as model:
        result = Agent(model, tools=[add], instructions="Use the tools.").run_sync("What is 2 + 3 + 4?")
        assert len(model.pool.sessions) == 1
        stats = model.stats
    assert result.output == "The sum is 9."
    assert added == [(2, 3), (5, 4)]
    assert "Use the tools." in script.prompts[0] and "add(a: integer, b: integer)" in script.prompts[0]
    assert '{"name": "add", "result": "5"}' in script.prompts[1]  # the tool's result reached the model
    assert '{"name": "add", "result": "9"}' in script.prompts[2]
    assert len(stats) == 3
    for step in stats[1:]:
        assert step.handle_forwarded and step.miss_reason is None and step.pulled_tokens > 0, step


def test_usage_carries_input_output_and_cached_tokens(tokenizer: Any) -> None:
    script = Script(tokenizer, call("add", a=1, b=1), answer("Two."))
    with honest(script) as engine, agentkv_model(engine) as model:
        result = Agent(model, tools=[add]).run_sync("1 + 1?")
        stats = model.stats
    responses = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    for response, step in zip(responses, stats, strict=True):
        assert response.usage.input_tokens == step.prompt_tokens
        assert response.usage.output_tokens == step.output_tokens
        assert response.usage.cache_read_tokens == step.prompt_tokens - step.computed_tokens
    assert result.usage.cache_read_tokens == stats[1].pulled_tokens > 0
    assert result.usage.input_tokens == sum(s.prompt_tokens for s in stats)
    assert responses[0].finish_reason == "tool_call" and responses[1].finish_reason == "stop"


def test_an_unreadable_output_is_the_answer_and_says_why(tokenizer: Any) -> None:
    script = Script(tokenizer, "no JSON here")
    with honest(script) as engine, agentkv_model(engine) as model:
        result = Agent(model, tools=[add]).run_sync("1 + 1?")
    response = result.all_messages()[-1]
    assert isinstance(response, ModelResponse) and result.output == "no JSON here"
    assert response.provider_details is not None and response.provider_details["output_error"]


def test_a_streamed_run_streams_the_answer_and_extends_the_session(tokenizer: Any) -> None:
    script = Script(tokenizer, call("add", a=20, b=22), answer("It is forty-two, as the tool says."))
    with honest(script) as engine, agentkv_model(engine) as model:
        agent = Agent(model, tools=[add])

        async def stream() -> tuple[list[str], str, int]:
            async with agent.run_stream("20 + 22?") as run:
                pieces = [piece async for piece in run.stream_text(delta=True, debounce_by=None)]
                return pieces, await run.get_output(), run.usage.cache_read_tokens

        pieces, output, cached = asyncio.run(stream())
        stats = model.stats
    assert added == [(20, 22)]
    assert output == "It is forty-two, as the tool says." == "".join(pieces) and len(pieces) >= 2
    assert stats[1].handle_forwarded and stats[1].miss_reason is None and cached == stats[1].pulled_tokens > 0


def test_stopping_a_stream_early_cancels_the_step_and_changes_nothing(tokenizer: Any) -> None:
    script = Script(tokenizer, "A long answer that nobody reads.", "Hello again.")
    with honest(script, stall_s=30.0) as engine, agentkv_model(engine) as model:
        agent = Agent(model)

        async def read_one_piece() -> None:
            async with agent.run_stream("Hi") as run:
                async for _ in run.stream_text(delta=True, debounce_by=None):
                    break

        engine.inject("stall")  # the step hangs after its first piece until it is cancelled
        asyncio.run(asyncio.wait_for(read_one_piece(), timeout=20))
        deadline = time.monotonic() + 5
        while engine.steps[0].outcome == "running" and time.monotonic() < deadline:
            time.sleep(0.01)  # the pool's own loop thread may finish cancelling a moment later
        assert engine.steps[0].outcome == "cancelled"
        assert agent.run_sync("Hi").output == "Hello again."
        assert len(model.stats) == 1  # the cancelled step left nothing in its session


def test_a_second_run_on_the_history_continues_the_same_session(tokenizer: Any) -> None:
    script = Script(tokenizer, call("add", a=1, b=2), answer("Three."), answer("Four."))
    with honest(script) as engine, agentkv_model(engine) as model:
        agent = Agent(model, tools=[add], system_prompt="You add numbers.")
        first = agent.run_sync("1 + 2?")
        second = agent.run_sync("And plus one?", message_history=first.all_messages())
        assert len(model.pool.sessions) == 1  # pinned by pydantic-ai's conversation_id
        last = model.stats[-1]
    assert second.output == "Four."
    assert last.turn == 2 and last.handle_forwarded and last.miss_reason is None
    assert script.prompts[2].count("You add numbers.") == 1


def test_a_tool_retry_goes_back_as_the_calls_tool_message(tokenizer: Any) -> None:
    def positive(n: int) -> int:
        """Check a number."""
        if n < 0:
            raise ModelRetry("n must be positive")
        return n

    script = Script(tokenizer, call("positive", n=-1), call("positive", n=1), answer("Done."))
    with honest(script) as engine, agentkv_model(engine) as model:
        result = Agent(model, tools=[positive]).run_sync("Check a number.")
        stats = model.stats
    assert result.output == "Done."
    assert "n must be positive" in script.prompts[1].split("<|im_start|>tool")[-1]
    assert all(step.handle_forwarded and step.miss_reason is None for step in stats[1:])


class City(BaseModel):
    name: str
    country: str


def test_a_structured_output_type_is_an_output_tool_the_model_must_call(tokenizer: Any) -> None:
    script = Script(
        tokenizer, call("final_result", name="Paris", country="France"), '{"name": "Rome", "country": "Italy"}'
    )
    with honest(script) as engine, agentkv_model(engine) as model:
        by_tool = Agent(model, output_type=City).run_sync("Where is Paris?")
        by_prompt = Agent(model, output_type=PromptedOutput(City)).run_sync("Where is Rome?")
    assert by_tool.output == City(name="Paris", country="France")
    assert script.requests[0].sampling.json_schema is not None
    assert script.requests[0].sampling.json_schema["required"] == ["tool_calls"]  # no plain answer allowed
    assert by_prompt.output == City(name="Rome", country="Italy") and "schema" in script.prompts[1]


def test_nested_argument_schemas_are_inlined_for_the_forced_output(tokenizer: Any) -> None:
    def visit(city: City, days: int) -> str:
        """Visit a city."""
        return f"Visited {city.name} for {days} days."

    script = Script(tokenizer, call("visit", city={"name": "Oslo", "country": "Norway"}, days=2), answer("Done."))
    with honest(script) as engine, agentkv_model(engine) as model:
        assert Agent(model, tools=[visit]).run_sync("Visit Oslo.").output == "Done."
    schema = json.dumps(script.requests[0].sampling.json_schema)
    assert '"country"' in schema and "$ref" not in schema  # nested in agentkv's schema, a $ref would dangle
    assert '"result": "Visited Oslo for 2 days."' in script.prompts[1]


def test_per_request_settings_reach_the_step(tokenizer: Any) -> None:
    script = Script(tokenizer, call("add", a=1, b=1), answer("Two."), "Hi there.")

    def settings(ctx: RunContext[None]) -> ModelSettings:  # the first step must call a tool, the next may not
        choice = "required" if ctx.run_step <= 1 else "none"
        return ModelSettings(max_tokens=40, temperature=0.5, seed=7, tool_choice=choice)

    with honest(script) as engine, agentkv_model(engine) as model:
        assert Agent(model, tools=[add], model_settings=settings).run_sync("1 + 1?").output == "Two."
        stopped = Agent(model).run_sync("Hi", model_settings={"stop_sequences": ["there"]})
    assert stopped.output == "Hi " and script.requests[2].sampling.stop == ("there",)
    first, second = (request.sampling for request in script.requests[:2])
    assert (first.max_tokens, first.temperature, first.seed) == (40, 0.5, 7)
    assert first.json_schema is not None and first.json_schema["required"] == ["tool_calls"]
    assert second.json_schema is not None and second.json_schema["required"] == ["answer"]


def test_sampling_settings_reach_the_step_under_vllms_names(tokenizer: Any) -> None:
    script = Script(tokenizer, "Hi.")
    settings: ModelSettings = {"top_p": 0.5, "top_k": 3, "presence_penalty": 0.25, "extra_body": {"min_p": 0.2}}
    with honest(script) as engine, agentkv_model(engine) as model:
        assert Agent(model).run_sync("Hi", model_settings=settings).output == "Hi."
        with pytest.raises(UserError, match="extra_body best_of"):
            Agent(model).run_sync("Hi", model_settings={"extra_body": {"best_of": 2}})
        with pytest.raises(UserError, match="extra_body logprobs"):
            Agent(model).run_sync("Hi", model_settings={"extra_body": {"logprobs": 2}})
    options = script.requests[0].sampling.options
    assert (options.top_p, options.top_k, options.presence_penalty, options.min_p) == (0.5, 3, 0.25, 0.2)
    biased = _sampling({"logit_bias": {"7": -5}, "frequency_penalty": 0.5, "seed": 1})
    assert biased == {"logit_bias": {"7": -5}, "frequency_penalty": 0.5}  # the seed is a step argument of its own


def test_unsupported_features_raise_a_clear_user_error(tokenizer: Any) -> None:
    script = Script(tokenizer)
    with honest(script) as engine, agentkv_model(engine) as model:
        with pytest.raises(UserError, match="ImageUrl"):
            Agent(model).run_sync(["Describe it.", ImageUrl(url="https://example.com/cat.png")])
        with pytest.raises(UserError, match="WebSearchTool"):
            Agent(model, capabilities=[NativeTool(WebSearchTool())]).run_sync("Search.")
        with pytest.raises(UserError, match="identifier"):
            Agent(model, tools=[Tool(add, name="add-numbers")]).run_sync("1 + 1?")
        with pytest.raises(UserError, match="Native structured output"):
            Agent(model, output_type=NativeOutput(City)).run_sync("Where is Paris?")
        history: list[ModelMessage] = [
            ModelRequest(parts=[UserPromptPart("Hi")]),
            ModelResponse(
                parts=[
                    FilePart(BinaryContent(b"x", media_type="image/png")),
                    ToolCallPart("add", {"a": 1, "b": 2}, tool_call_id="c1"),
                ]
            ),
            ModelRequest(parts=[ToolReturnPart("add", 3, tool_call_id="c1")]),
            ModelResponse(parts=[TextPart("3")]),
        ]
        with pytest.raises(UserError, match="FilePart"):
            Agent(model, tools=[add]).run_sync("Go on.", message_history=history)
    assert script.requests == []  # nothing reached the engine


def test_a_direct_request_renders_a_legacy_retry_prompt_as_the_calls_tool_message(tokenizer: Any) -> None:
    script = Script(tokenizer, answer("Fine."))
    with pytest.warns(match="RetryPromptPart"):
        retry = RetryPromptPart("b must be positive", tool_name="add", tool_call_id="call_1")
    messages: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart("Add 1 and -2.")]),
        ModelResponse(parts=[ToolCallPart("add", {"a": 1, "b": -2}, tool_call_id="call_1")]),
        ModelRequest(parts=[retry]),
    ]
    tool = ToolDefinition(name="add", parameters_json_schema={"type": "object", "properties": {}})
    with honest(script) as engine, agentkv_model(engine) as model:
        response = asyncio.run(model.request(messages, None, ModelRequestParameters(function_tools=[tool])))
    assert response.text == "Fine."
    assert "b must be positive" in script.prompts[0].split("<|im_start|>tool")[-1]


def test_engine_errors_become_pydantic_ai_errors(tokenizer: Any) -> None:
    with honest(Script(tokenizer, "unused"), max_model_len=64) as engine, agentkv_model(engine) as model:
        engine.inject("error")
        with pytest.raises(ModelServerError, match="injected"):
            Agent(model).run_sync("Hi")
        with pytest.raises(ModelContextWindowExceededError):
            Agent(model).run_sync("word " * 100)


def test_the_model_closes_only_what_it_started(tokenizer: Any) -> None:
    with honest(Script(tokenizer, "One.", "Two.")) as engine:
        model = AgentKVModel(engine=engine)
        assert Agent(model).run_sync("Hi").output == "One."
        model.close()
        assert engine.is_open  # given open: its owner closes it
        with pytest.raises(UserError, match="closed"):
            Agent(model).run_sync("Hi")
        with SessionPool(engine=engine) as pool:
            shared = AgentKVModel(pool=pool)
            assert Agent(shared).run_sync("Hi").output == "Two."
            shared.close()
            assert pool.is_open  # given a pool: its owner closes it
    unopened = HonestPairEngine(Script(tokenizer, "Three."))
    with AgentKVModel(engine=unopened) as model:
        assert Agent(model).run_sync("Hi").output == "Three."
    assert unopened.stopped and not unopened.is_open  # given unopened: the model opened it and closes it
    assert unopened.violations == []


def test_model_identity() -> None:
    model = AgentKVModel(engine=HonestPairEngine(), model_name="smol")
    assert (model.model_name, model.system, model.last_reply) == ("smol", "agentkv", None)
    assert model != AgentKVModel(engine=HonestPairEngine(), model_name="smol")  # each holds its own pool
    with pytest.raises(UserError):
        AgentKVModel(pool=SessionPool(), max_tokens=3)


# --------------------------------------------------------------------- the real pair


@pytest.mark.pair
def test_a_tool_agent_on_the_pair_pulls_back_every_step_and_equals_a_step_by_step_replay(
    pair: EmbeddedPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    def forced(ctx: RunContext[None]) -> ModelSettings:  # two tool calls, then an answer: three steps
        return ModelSettings(tool_choice="required" if ctx.run_step <= 2 else "none")

    model = AgentKVModel(engine=pair, max_tokens=128, cache_salt="pydantic-ai-run")
    calls: list[tuple[list[Message], dict[str, Any]]] = []
    replies: list[StepReply] = []
    step = model._pooled.call

    async def recording(messages: list[Message], **options: Any) -> StepReply:
        calls.append((list(messages), options))
        replies.append(await step(messages, **options))
        return replies[-1]

    monkeypatch.setattr(model._pooled, "call", recording)
    try:
        result = Agent(model, tools=[add], model_settings=forced).run_sync("What is 1234 + 4321?")
        stats = model.stats
    finally:
        model.close()
    assert len(replies) == 3 and len(added) >= 2 and result.output
    tool_results = [m.content for m in calls[-1][0] if m.role == "tool"]
    assert tool_results == [str(a + b) for a, b in added]  # every result reached the model
    for later_step in stats[1:]:
        assert later_step.handle_forwarded and later_step.pulled_tokens > 0, later_step

    # The same calls, one at a time, on a session of its own (whose tool call ids are its own).
    with Session(engine=pair, max_tokens=128, cache_salt="pydantic-ai-replay") as session:
        history = list(calls[0][0])
        mine: StepReply | None = None
        for index, (messages, options) in enumerate(calls):
            if mine is not None:  # its answer, then the tool results, renamed to its call ids
                theirs = replies[index - 1]
                ids = {old.id: new.id for old, new in zip(theirs.tool_calls, mine.tool_calls, strict=True)}
                results = messages[len(calls[index - 1][0]) + 1 :]
                renamed = [m.model_copy(update={"tool_call_id": ids[m.tool_call_id]}) for m in results]
                history += [mine.message, *renamed]
            mine = session.step_sync(history, **{k: v for k, v in options.items() if k != "conversation_id"})
            assert mine.step.text == replies[index].step.text, index
