"""The OpenAI chat-completions shape: a request read into `SessionPool.step` arguments, a
`StepReply` written back as a completion or as stream chunks.

What agentkv adds to the shape: ``usage.prompt_tokens_details.cached_tokens`` (the prompt
tokens whose KV was not computed: P's cache plus what was pulled back from D) and an
``agentkv`` object with the step's `StepStats` (documented in docs/serve.md).

The reply shapes are built here once, as plain dicts: the door writes them as JSON, and the
openai-agents adapter (src/agentkv/integrations/openai_agents.py) validates the same dicts into
``openai.types`` at its own boundary (tests/test_reply_shapes.py checks that every shape does).
Dicts, not ``ChatCompletionChunk(...)`` dumped with ``model_dump(exclude_unset=True)``: one text
chunk takes 1.4-1.6 µs as a dict and 15-23 µs as the model plus its dump (timeit, 10,000 reps,
best of 5, on the 2-core dev machine under load), and the door writes a chunk per token; the dump
would also reorder the keys (the model's field order), which the differential tests against
``vllm serve`` compare.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .._conversation._tools import ToolCall
from .._engines._sampling import SamplingOptions, response_format_outputs
from .._errors import UserError
from .._session._message_step import StepOptions
from .._session._results import StepReply, ToolCallDelta
from ._bounds import check_request, parse_json
from ._request_fields import CHAT_FIELDS, FieldRule, check_fields

__all__ = [
    "ChatRequest",
    "CompletionIds",
    "StreamedCalls",
    "chat_message",
    "chunk",
    "completion",
    "read_body",
    "read_request",
]

Body = TypeVar("Body", bound=BaseModel)


class StreamOptions(BaseModel):
    """``stream_options`` of a chat or completions body."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(BaseModel):
    """The `SamplingOptions` fields that the request bodies (chat, completions, Responses) take under their own names."""

    structured_outputs: dict[str, Any] | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None


class KeyFields(BaseModel):
    """The fields of a chat or completions body that say whose conversation it is and how it is named."""

    user: str | None = None
    """OpenAI's end-user id: metadata, never a conversation's key."""
    session_id: str | None = None
    """The conversation's id (src/agentkv/_surfaces/_conversation_keys.py reads it, with the two below)."""
    conversation_id: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = None
    """The request's own prefix-cache salt, over its tenant's (src/agentkv/_session/_tenancy.py)."""
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None


class ChatRequest(SamplingFields, KeyFields):
    """A ``POST /v1/chat/completions`` body: the fields agentkv honours, typed; every other field of vLLM's request
    is refused by name or accepted with no effect, as `CHAT_FIELDS` says (docs/serve.md lists each)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    """Up to 4 stop strings: the answer ends before the first (`Session.step`'s ``stop``)."""
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    response_format: dict[str, Any] | None = None
    min_tokens: int | None = None
    spaces_between_special_tokens: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra arguments of the model's chat template (src/agentkv/_conversation/_template_kwargs.py)."""

    def choice_reply(self, reply: StepReply) -> StepReply:
        """``reply`` as this request's choice reports it, as vLLM's server does: a call forced by name ends with
        ``stop`` (``tool_calls`` is for calls the model chose to make); with ``parallel_tool_calls: false``, only
        the first call is given (the session's history keeps what the model wrote)."""
        if self.parallel_tool_calls is False and len(reply.tool_calls) > 1:
            message = reply.message.model_copy(update={"tool_calls": reply.message.tool_calls[:1]})
            reply = reply.model_copy(update={"message": message})
        if isinstance(self.tool_choice, dict) and reply.tool_calls:
            return reply.model_copy(update={"finish_reason": "stop"})
        return reply

    def step_options(self) -> StepOptions:
        """The `Session.step` arguments of this request."""
        return {
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "max_tokens": self.max_completion_tokens or self.max_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
            "stop": self.stop,
            "sampling": self.sampling_options(),
            "chat_template_kwargs": self.chat_template_kwargs,
        }

    def top(self) -> int | None:
        """How many alternatives per output token the reply's logprobs list (None: the request asks for none)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_options(self) -> SamplingOptions | None:
        """The request's `SamplingOptions`, read as vLLM's ``ChatCompletionRequest.to_sampling_params`` reads them:
        only the fields it sets (the others stay the pool's); ``logprobs: true`` with ``top_logprobs``; the
        ``response_format`` over ``structured_outputs``."""
        if self.top_logprobs and not self.logprobs:
            raise UserError("top_logprobs: when using top_logprobs, logprobs must be set to true")
        options = given_options(self)
        if self.logprobs:
            options["logprobs"] = self.top_logprobs or 0
        structured = structured_outputs(self.structured_outputs, self.response_format)
        if structured is not None:
            options["structured_outputs"] = structured
        return sampling_options(options, {"logprobs": "top_logprobs"}) if options else None


_OPTION_FIELDS = frozenset(SamplingOptions.model_fields) - {"logprobs", "structured_outputs"}
"""The request fields that are `SamplingOptions` fields of the same name."""


def given_options(request: BaseModel) -> dict[str, Any]:
    """The `SamplingOptions` fields of the same name that ``request`` sets (not null)."""
    given = {name: getattr(request, name) for name in _OPTION_FIELDS & request.model_fields_set}
    return {name: value for name, value in given.items() if value is not None}


def structured_outputs(given: dict[str, Any] | None, response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """``structured_outputs`` with ``response_format``'s constraint put over it, as vLLM's server does."""
    if response_format is not None and response_format.get("type") == "structural_tag":
        raise UserError("response_format: type structural_tag is not supported; use structured_outputs.structural_tag")
    try:
        formatted = response_format_outputs(response_format)
    except ValueError as exc:
        raise UserError(f"response_format: {exc}") from None
    merged = {**(given or {}), **(formatted or {})}
    return merged or None


def sampling_options(options: dict[str, Any], names: Mapping[str, str]) -> SamplingOptions:
    """`SamplingOptions` of a request's fields; a bad value is a `UserError` naming the request's field."""
    try:
        return SamplingOptions.model_validate(options)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "sampling"
        raise UserError(f"{names.get(field, field)}: {first['msg']}") from None


def read_body(model: type[Body], body: bytes, table: Mapping[str, FieldRule]) -> Body:
    """A request body of ``model``, checked: a field the table refuses, or one past its bound
    (src/agentkv/_surfaces/_bounds.py), is a `UserError` saying why. The body is parsed once, bounded in depth, and
    its fields' bounds checked before pydantic reads it (a refusal costs one parse)."""
    raw = parse_json(body)
    if isinstance(raw, dict):
        check_fields(raw, table)
        check_request(raw)
    return validated(model, raw)


def validated(model: type[Body], raw: Any) -> Body:
    """``raw`` read as ``model``; a bad field is a `UserError` naming where it is (``messages.0.role: ...``)."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise UserError(f"{where}: {first['msg']}") from None


def check_stream_options(options: StreamOptions | None, stream: bool | None) -> None:
    """vLLM's rules for ``stream_options``, and the one agentkv cannot honour refused by name."""
    if options is not None and not stream:
        raise UserError("stream_options: stream options can only be defined when stream is true")
    if options is not None and options.continuous_usage_stats:
        raise UserError("stream_options.continuous_usage_stats is not supported: usage comes once, at the end")


def read_request(body: bytes) -> ChatRequest:
    """The request, checked; anything agentkv cannot honour is a `UserError` naming it."""
    request = read_body(ChatRequest, body, CHAT_FIELDS)
    check_stream_options(request.stream_options, request.stream)
    request.sampling_options()  # checked now: a bad option is a 400 before the step
    return request


def _usage(reply: StepReply) -> dict[str, Any]:
    stats = reply.stats
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.output_tokens,
        "total_tokens": stats.prompt_tokens + stats.output_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.prompt_tokens - stats.computed_tokens},
    }


def _tool_calls(reply: StepReply) -> list[dict[str, Any]]:
    return [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
        for call in reply.tool_calls
    ]


def _extension(reply: StepReply) -> dict[str, Any]:
    return {"stats": reply.stats.model_dump(mode="json"), "error": reply.error}


@dataclass(frozen=True)
class CompletionIds:
    """What every object of one completion repeats: its id, creation time and model."""

    request_id: str
    created: int
    model: str

    @classmethod
    def new(cls, model: str, request_id: str | None = None) -> CompletionIds:
        """New ids; ``request_id``: the request's own (the completion is ``chatcmpl-<request_id>``, as vLLM's; an
        id of at most 256 characters, src/agentkv/_surfaces/_bounds.py, for every chunk repeats it)."""
        return cls(f"chatcmpl-{request_id or uuid.uuid4().hex}", int(time.time()), model)

    def head(self, kind: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}


def chat_message(reply: StepReply) -> dict[str, Any]:
    """The completion's assistant message (``ChatCompletionMessage``'s shape): the answer, or null content and the
    tool calls; with a reasoning parser, ``reasoning_content`` is the reasoning."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text if not reply.tool_calls else None}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = _tool_calls(reply)
    return message


def completion(reply: StepReply, ids: CompletionIds, *, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A ``chat.completion`` object (its message: `chat_message`; ``logprobs``: the choice's ``logprobs.content``,
    when the request asked for them)."""
    return ids.head("chat.completion") | {
        "choices": [
            {
                "index": 0,
                "message": chat_message(reply),
                "finish_reason": reply.finish_reason,
                "logprobs": _logprobs(logprobs),
            }
        ],
        "usage": _usage(reply),
        "agentkv": _extension(reply),
    }


class StreamedCalls:
    """What a stream sent of each tool call while the model wrote it: the call's id and name, its arguments' text."""

    def __init__(self) -> None:
        self.announced: dict[int, ToolCallDelta] = {}
        """Each call's first delta (its id and name), by index."""
        self.arguments: dict[int, str] = {}
        """Each call's arguments' text streamed so far, by index."""

    def add(self, delta: ToolCallDelta) -> None:
        self.announced.setdefault(delta.index, delta)
        self.arguments[delta.index] = self.arguments.get(delta.index, "") + delta.arguments

    def rest(self, index: int, call: ToolCall) -> str:
        """The arguments' text left to send for the finished ``call`` (all of it if none was streamed), so that the
        pieces sent, joined, are JSON for ``call.arguments``."""
        full = call.arguments_json
        streamed = self.arguments.get(index, "")
        if not streamed:
            return full
        try:
            if json.loads(streamed) == call.arguments:
                return ""
        except json.JSONDecodeError:
            pass
        return full[len(streamed) :] if full.startswith(streamed) else ""


ChunkKind = Literal["role", "text", "reasoning", "tool_call", "end", "usage"]


def chunk(
    kind: ChunkKind,
    ids: CompletionIds,
    *,
    text: str = "",
    reply: StepReply | None = None,
    call: ToolCallDelta | None = None,
    streamed: StreamedCalls | None = None,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion.chunk``: the role, a piece of text, of reasoning (``reasoning_content``) or of a tool call
    (``call``: its index, id and name first, then its arguments piece by piece, as OpenAI streams them), the end
    (the tool calls' parts not ``streamed`` yet, and the finish reason), or usage. ``logprobs``: the
    ``logprobs.content`` of the chunk's tokens, when the request asked for them."""
    choice: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": None, "logprobs": _logprobs(logprobs)}
    body = ids.head("chat.completion.chunk")
    if kind == "role":
        choice["delta"] = {"role": "assistant", "content": ""}
    elif kind == "text":
        choice["delta"] = {"content": text}
    elif kind == "reasoning":
        choice["delta"] = {"reasoning_content": text}
    elif kind == "tool_call":
        assert call is not None
        choice["delta"] = {"tool_calls": [_call_delta(call)]}
    elif kind == "end":
        assert reply is not None
        calls = _rest_of_calls(reply, streamed or StreamedCalls())
        if calls:
            choice["delta"] = {"tool_calls": calls}
        choice["finish_reason"] = reply.finish_reason
    else:
        assert reply is not None
        body |= {"choices": [], "usage": _usage(reply), "agentkv": _extension(reply)}
        return body
    return body | {"choices": [choice]}


def _logprobs(content: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    return None if content is None else {"content": content}


def _call_delta(call: ToolCallDelta) -> dict[str, Any]:
    if call.name is not None:
        function = {"name": call.name, "arguments": call.arguments}
        return {"index": call.index, "id": call.id, "type": "function", "function": function}
    return {"index": call.index, "function": {"arguments": call.arguments}}


def _rest_of_calls(reply: StepReply, streamed: StreamedCalls) -> list[dict[str, Any]]:
    """The end chunk's tool calls: whole for a call not streamed, the arguments' rest (if any) for one that was."""
    calls: list[dict[str, Any]] = []
    for index, call in enumerate(reply.tool_calls):
        rest = streamed.rest(index, call)
        if index not in streamed.announced:
            function = {"name": call.name, "arguments": rest}
            calls.append({"index": index, "id": call.id, "type": "function", "function": function})
        elif rest:
            calls.append({"index": index, "function": {"arguments": rest}})
    return calls
