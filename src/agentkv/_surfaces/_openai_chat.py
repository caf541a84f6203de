"""The OpenAI chat-completions shape: a request read into `SessionPool.step` arguments, a
`StepReply` written back as a completion or as stream chunks.

What agentkv adds to the shape: ``usage.prompt_tokens_details.cached_tokens`` (the prompt
tokens whose KV was not computed: P's cache plus what was pulled back from D) and an
``agentkv`` object with the step's `StepStats` (documented in docs/serve.md).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .._errors import UserError
from .._session._message_step import StepOptions
from .._session._results import StepReply

__all__ = ["ChatRequest", "CompletionIds", "chunk", "completion", "read_body", "read_request"]

Body = TypeVar("Body", bound=BaseModel)


class _StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    """A ``POST /v1/chat/completions`` body: the fields agentkv serves (others are refused by name)."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    """Up to 4 stop strings: the answer ends before the first (`Session.step`'s ``stop``)."""
    stream: bool = False
    stream_options: _StreamOptions | None = None
    user: str | None = None
    session_id: str | None = None
    """agentkv's extension: the conversation's id (as the ``x-session-id`` header)."""
    n: int = 1
    top_p: float = 1.0
    parallel_tool_calls: bool | None = None

    def step_options(self) -> StepOptions:
        """The `Session.step` arguments of this request."""
        return {
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "max_tokens": self.max_completion_tokens or self.max_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
            "stop": self.stop,
        }


_REFUSED = {
    "response_format": "response_format is not supported (tool calls are schema-forced; answers are text)",
    "logprobs": "logprobs are not supported",
    "top_logprobs": "logprobs are not supported",
    "audio": "audio is not supported",
    "modalities": "only text is supported",
    "prediction": "predicted outputs are not supported",
}


def read_body(model: type[Body], body: bytes, refused: dict[str, str]) -> Body:
    """A request body of ``model``, checked: a field agentkv cannot honour is a `UserError` saying why."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise UserError(f"{where}: {first['msg']}") from None
    for name, why in refused.items():
        if (request.model_extra or {}).get(name) not in (None, False, [], {}):
            raise UserError(why)
    return request


def read_request(body: bytes) -> ChatRequest:
    """The request, checked; anything agentkv cannot honour is a `UserError` naming it."""
    request = read_body(ChatRequest, body, _REFUSED)
    if request.n != 1:
        raise UserError("n must be 1: one choice per request")
    if request.top_p != 1.0:
        raise UserError("top_p is not supported (sampling is by temperature)")
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
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
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
    def new(cls, model: str) -> CompletionIds:
        return cls(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model)

    def head(self, kind: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}


def completion(reply: StepReply, ids: CompletionIds) -> dict[str, Any]:
    """A ``chat.completion`` object."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text if not reply.tool_calls else None}
    if reply.tool_calls:
        message["tool_calls"] = _tool_calls(reply)
    return ids.head("chat.completion") | {
        "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}],
        "usage": _usage(reply),
        "agentkv": _extension(reply),
    }


ChunkKind = Literal["role", "text", "end", "usage"]


def chunk(kind: ChunkKind, ids: CompletionIds, *, text: str = "", reply: StepReply | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk``: the role, a piece of text, the end (tool calls and finish reason), or usage."""
    choice: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": None, "logprobs": None}
    body = ids.head("chat.completion.chunk")
    if kind == "role":
        choice["delta"] = {"role": "assistant", "content": ""}
    elif kind == "text":
        choice["delta"] = {"content": text}
    elif kind == "end":
        assert reply is not None
        if reply.tool_calls:
            choice["delta"] = {"tool_calls": [{"index": i, **call} for i, call in enumerate(_tool_calls(reply))]}
        choice["finish_reason"] = reply.finish_reason
    else:
        assert reply is not None
        body |= {"choices": [], "usage": _usage(reply), "agentkv": _extension(reply)}
        return body
    return body | {"choices": [choice]}
