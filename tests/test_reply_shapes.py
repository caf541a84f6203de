"""The door's reply shapes are OpenAI's: every builder's output (src/agentkv/_surfaces/_openai_chat.py,
_openai_responses.py, _response_events.py) validates as its ``openai.types`` class and dumps back to itself, so
the openai-agents adapter can validate the same dicts at its boundary and lose nothing."""

from __future__ import annotations

from typing import Any

import pytest
from agents.usage import Usage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.responses import Response, ResponseOutputItem, ResponseStreamEvent, ResponseUsage
from pydantic import BaseModel, TypeAdapter

from agentkv._conversation._conversation import Message
from agentkv._conversation._tools import ToolCall
from agentkv._session._results import ReasoningDelta, Step, StepReply, ToolCallDelta
from agentkv._stats._stats import StepStats
from agentkv._surfaces._openai_chat import CompletionIds, StreamedCalls, chat_message, chunk, completion
from agentkv._surfaces._openai_responses import (
    ResponsesRequest,
    ResponseTurn,
    call_item,
    message_item,
    reasoning_item,
    response_object,
    response_usage,
)
from agentkv._surfaces._response_events import ResponseEvents

CALLS = (
    ToolCall(id="call_1", name="add", arguments={"a": 1, "b": 2}, raw_arguments='{"a": 1, "b": 2}'),
    ToolCall(id="call_2", name="mul", arguments={"x": 3}),
)
LOGPROBS = [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": [{"token": "Hi", "logprob": -0.25}]}]
IDS = CompletionIds.new("model-x", "req")


def reply(
    content: str = "",
    finish: str = "stop",
    calls: tuple[ToolCall, ...] = (),
    reasoning: str | None = None,
    error: str | None = None,
) -> StepReply:
    stats = StepStats(
        ttft_s=0.25, turn=1, step=1, prompt_tokens=10, output_tokens=4, local_hit_tokens=3, pulled_tokens=2,
        computed_tokens=5,
    )  # fmt: skip
    step = Step(text=content, token_ids=[1, 2], finish_reason="stop" if calls else finish, stats=stats)
    message = Message(role="assistant", content=content, tool_calls=calls)
    return StepReply.model_validate(
        {"message": message, "finish_reason": finish, "step": step, "reasoning": reasoning, "error": error}
    )


REPLIES = {
    "answer": reply("Hi there", reasoning="First, greet."),
    "tool calls": reply("", "tool_calls", CALLS),
    "cut": reply("Hi th", "length"),
    "unreadable": reply('{"a": ', error="not JSON"),
    "empty": reply(""),
}


def same_after_validation(model: type[BaseModel] | TypeAdapter[Any], shape: dict[str, Any]) -> Any:
    """``shape`` validated as ``model``; asserts that it dumps back to ``shape``: no field dropped, none coerced."""
    adapter = model if isinstance(model, TypeAdapter) else TypeAdapter(model)
    validated = adapter.validate_python(shape)
    assert adapter.dump_python(validated, mode="json", exclude_unset=True) == shape
    return validated


def test_text_reasoning_and_role_chunks_are_chat_completion_chunks() -> None:
    role = same_after_validation(ChatCompletionChunk, chunk("role", IDS))
    text = same_after_validation(ChatCompletionChunk, chunk("text", IDS, text="Hi", logprobs=LOGPROBS))
    thought = same_after_validation(ChatCompletionChunk, chunk("reasoning", IDS, text="hmm"))
    assert (role.choices[0].delta.role, text.choices[0].delta.content) == ("assistant", "Hi")
    assert text.choices[0].logprobs.content[0].top_logprobs[0].logprob == -0.25
    assert thought.choices[0].delta.model_extra == {"reasoning_content": "hmm"}


def test_tool_call_delta_chunks_are_chat_completion_chunks() -> None:
    first = ToolCallDelta(turn=1, step=1, index=0, id="call_1", name="add")
    piece = ToolCallDelta(turn=1, step=1, index=0, id="call_1", arguments='{"a": 1')
    opened = same_after_validation(ChatCompletionChunk, chunk("tool_call", IDS, call=first))
    grown = same_after_validation(ChatCompletionChunk, chunk("tool_call", IDS, call=piece))
    call = opened.choices[0].delta.tool_calls[0]
    assert (call.index, call.id, call.type, call.function.name, call.function.arguments) == (
        0, "call_1", "function", "add", ""
    )  # fmt: skip
    assert grown.choices[0].delta.tool_calls[0].function.arguments == '{"a": 1'


@pytest.mark.parametrize("name", REPLIES)
def test_the_last_chunks_carry_the_calls_rest_the_finish_reason_and_usage(name: str) -> None:
    streamed = StreamedCalls()
    streamed.add(ToolCallDelta(turn=1, step=1, index=0, id="call_1", name="add"))
    streamed.add(ToolCallDelta(turn=1, step=1, index=0, id="call_1", arguments='{"a": 1'))
    end = same_after_validation(ChatCompletionChunk, chunk("end", IDS, reply=REPLIES[name], streamed=streamed))
    usage = same_after_validation(ChatCompletionChunk, chunk("usage", IDS, reply=REPLIES[name]))
    assert end.choices[0].finish_reason == REPLIES[name].finish_reason
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens, usage.usage.total_tokens) == (10, 4, 14)
    assert usage.usage.prompt_tokens_details is not None and usage.usage.prompt_tokens_details.cached_tokens == 5
    if name == "tool calls":  # the first call's arguments' rest, the second call whole
        rest = [(c.index, c.id, c.function.name, c.function.arguments) for c in end.choices[0].delta.tool_calls]
        assert rest == [(0, None, None, ', "b": 2}'), (1, "call_2", "mul", '{"x": 3}')]


@pytest.mark.parametrize("name", REPLIES)
def test_completions_and_their_messages_are_chat_completions(name: str) -> None:
    done = same_after_validation(ChatCompletion, completion(REPLIES[name], IDS, logprobs=LOGPROBS))
    message = same_after_validation(ChatCompletionMessage, chat_message(REPLIES[name]))
    assert done.choices[0].message == message
    if name == "tool calls":
        assert message.content is None and message.tool_calls is not None
        assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [  # type: ignore[union-attr]
            ("call_1", "add", '{"a": 1, "b": 2}'),
            ("call_2", "mul", '{"x": 3}'),
        ]


FULL_REQUEST = ResponsesRequest.model_validate(
    {
        "input": "hi",
        "instructions": "Be brief.",
        "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}, "strict": False}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "store": False,
        "text": {"format": {"type": "json_object"}},
        "user": "u",
        "metadata": {"k": "v"},
    }
)


@pytest.mark.parametrize("request_", [ResponsesRequest(input="hi"), FULL_REQUEST], ids=["defaults", "every echo"])
@pytest.mark.parametrize("name", REPLIES)
def test_response_objects_and_their_usage_are_responses(request_: ResponsesRequest, name: str) -> None:
    opened = same_after_validation(Response, response_object(request_, response_id="resp_1", created_at=1, model="m"))
    done = same_after_validation(
        Response, response_object(request_, response_id="resp_1", created_at=1, model="m", reply=REPLIES[name])
    )
    assert (opened.status, opened.output, done.status) == (
        "in_progress",
        [],
        "incomplete" if name == "cut" else "completed",
    )
    usage = same_after_validation(ResponseUsage, response_usage(REPLIES[name]))
    assert done.usage == usage and usage.input_tokens_details.cached_tokens == 5
    framework = Usage(requests=1, **response_usage(REPLIES[name]))  # what the adapter reports
    assert (framework.input_tokens, framework.input_tokens_details.cached_tokens, framework.total_tokens) == (10, 5, 14)


def test_output_items_are_response_output_items() -> None:
    items = [
        message_item("msg_1", "in_progress", None),
        message_item("msg_1", "completed", "Hi"),
        call_item("fc_1", "completed", "call_1", "add", '{"a": 1}'),
        reasoning_item("rs_1", "in_progress", None),
        reasoning_item("rs_1", "completed", "hmm"),
    ]
    types = [same_after_validation(TypeAdapter(ResponseOutputItem), item).type for item in items]
    assert types == ["message", "message", "function_call", "reasoning", "reasoning"]


@pytest.mark.parametrize("name", REPLIES)
def test_every_stream_event_is_a_response_stream_event(name: str) -> None:
    turn = ResponseTurn.begin(FULL_REQUEST, None, conversation_id=None, model="m")
    events = ResponseEvents(turn)
    written = events.opening()
    written += events.piece(ReasoningDelta(turn=1, step=1, text="First"))
    written += events.piece("Hi")
    written += events.piece(ToolCallDelta(turn=1, step=1, index=0, id="call_1", name="add"))
    written += events.piece(ToolCallDelta(turn=1, step=1, index=0, id="call_1", arguments='{"a": 1'))
    written += events.piece(ToolCallDelta(turn=1, step=1, index=2, id="call_9", name="gone"))  # not in the reply
    written += events.closing(REPLIES[name])
    written.append(events.error({"code": "x", "message": "it broke", "param": None}))
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    kinds = [same_after_validation(adapter, event).type for event in written]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "error"
    assert kinds[-2] == ("response.incomplete" if name == "cut" else "response.completed")
    assert [event["sequence_number"] for event in written] == list(range(len(written)))
