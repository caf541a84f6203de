"""The OpenAI Responses shape: a ``POST /v1/responses`` request read into the chat messages
`SessionPool.step` takes, a `StepReply` written back as a ``response`` object or as stream events.

Input items become chat messages: messages (role user, system, developer or assistant; text
content), ``function_call`` items (the assistant's tool calls, grouped into one assistant
message) and ``function_call_output`` items (tool messages). ``instructions`` is the system
message; it is not carried over by ``previous_response_id`` (as with OpenAI).

A request lands on the pool conversation it names (src/agentkv/_surfaces/_conversation_keys.py: the
``x-session-id`` header, the body's ``session_id``, ``conversation_id`` or ``prompt_cache_key``); without one, on
the name of the response it continues (``previous_response_id``), if that had one; else on none: the
pool then finds its session by the conversation's history, as for chat completions. A response's id is the
door's own (``resp_<hex>``); a client's ``request_id`` is echoed (``x-request-id``), never an id of its. That works
for chains by ``previous_response_id`` (the stored conversation plus the new input extends the
session's history) and for clients that send the whole history as input alike.

What agentkv adds to the shape: ``usage.input_tokens_details.cached_tokens`` is the prompt
tokens whose KV was not computed, and an ``agentkv`` object carries the step's `StepStats`
(as in chat completions; documented in docs/serve.md).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ConfigDict, Field

from .._engines._sampling import SamplingOptions, format_outputs
from .._errors import UserError
from .._session._message_step import StepOptions
from .._session._results import StepReply
from ._openai_chat import SamplingFields, given_options, read_body, sampling_options
from ._request_fields import RESPONSES_FIELDS
from ._response_store import StoredResponse

__all__ = [
    "PreviousResponseNotFoundError",
    "ResponseNotFoundError",
    "ResponseTurn",
    "ResponsesRequest",
    "call_item",
    "deleted_response",
    "message_item",
    "new_id",
    "reasoning_item",
    "status_of",
    "text_part",
    "read_responses_request",
    "refuse_retrieve_options",
    "response_object",
    "response_usage",
]


class PreviousResponseNotFoundError(UserError):
    """``previous_response_id`` names no stored response of the caller's (a 404, as vLLM answers it)."""

    openai_code = "previous_response_not_found"
    openai_param = "previous_response_id"


class ResponseNotFoundError(UserError):
    """``GET`` or ``DELETE /v1/responses/{id}`` names no stored response (a 404)."""

    openai_code = "response_not_found"

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id {response_id!r} not found.")


def deleted_response(response_id: str) -> dict[str, Any]:
    """What ``DELETE /v1/responses/{id}`` answers (OpenAI's shape)."""
    return {"id": response_id, "object": "response", "deleted": True}


def refuse_retrieve_options(query: Mapping[str, str]) -> None:
    """``GET /v1/responses/{id}`` answers the stored response as JSON: the query options that ask for more are refused."""
    if query.get("stream", "false").lower() not in ("false", "0"):
        raise UserError("stream: a stored response is answered whole, not streamed again")
    if query.get("include"):
        raise UserError("include is not supported (there is nothing extra to include)")


class ResponsesRequest(SamplingFields):
    """A ``POST /v1/responses`` body: the fields agentkv honours, typed; every other field of vLLM's request is
    refused by name or accepted with no effect, as `RESPONSES_FIELDS` says (docs/serve.md lists each)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    previous_response_id: str | None = None
    store: bool | None = None
    """Whether the response is kept for ``previous_response_id`` (default: yes)."""
    text: dict[str, Any] | None = None
    truncation: str | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    session_id: str | None = None
    conversation_id: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra arguments of the model's chat template (src/agentkv/_conversation/_template_kwargs.py)."""

    @property
    def keeps(self) -> bool:
        """Whether the response is stored."""
        return self.store is not False

    def step_options(self) -> StepOptions:
        """The `Session.step` arguments of this request."""
        return {
            "tools": [_chat_tool(index, tool) for index, tool in enumerate(self.tools or [])] or None,
            "tool_choice": _chat_tool_choice(self.tool_choice),
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
            "stop": self.stop,
            "sampling": self.sampling_options(),
            "chat_template_kwargs": self.chat_template_kwargs,
        }

    def sampling_options(self) -> SamplingOptions | None:
        """The request's `SamplingOptions`, read as vLLM's ``ResponsesRequest.to_sampling_params`` reads them: only
        the fields it sets; ``text.format`` (json_schema, json_object) as structured outputs, never with
        ``structured_outputs`` too."""
        options = given_options(self)
        text_format = self.text_format()
        structured = self.structured_outputs or None
        if text_format is not None:
            if structured is not None:
                raise UserError("structured_outputs: cannot specify both structured_outputs and text.format")
            try:  # as vLLM's Responses server maps it
                structured = format_outputs(text_format.get("type"), text_format.get("schema"))
            except ValueError as exc:
                raise UserError(f"text.format: {exc}") from None
        if structured is not None:
            options["structured_outputs"] = structured
        return sampling_options(options, {}) if options else None

    def text_format(self) -> dict[str, Any] | None:
        """``text.format`` as given (None: not given)."""
        text_format = (self.text or {}).get("format")
        if text_format is not None and not isinstance(text_format, dict):
            raise UserError("text.format: must be an object (type text, json_schema or json_object)")
        return text_format

    def new_messages(self) -> list[dict[str, Any]]:
        """The input items as chat messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return _chat_messages(self.input)


def read_responses_request(body: bytes) -> ResponsesRequest:
    """The request, checked; anything agentkv cannot honour is a `UserError` naming it."""
    request = read_body(ResponsesRequest, body, RESPONSES_FIELDS)
    request.step_options()  # tools, tool_choice and the sampling options are checked now
    request.new_messages()  # and the input items
    return request


def _chat_tool(index: int, tool: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses function tool (``{"type": "function", "name", ...}``) in the chat shape."""
    if tool.get("type") != "function":
        raise UserError(f"tools[{index}]: only function tools are served, not {tool.get('type')!r}")
    function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | Mapping[str, Any]) -> str:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return str(choice["name"])
    raise UserError(
        f"tool_choice of type {choice.get('type')!r} is not supported "
        "(auto, required, none or {'type': 'function', 'name': ...})"
    )


def _chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages; an assistant's message and function calls in a row are one message."""
    messages: list[dict[str, Any]] = []

    def assistant() -> dict[str, Any]:
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": "", "tool_calls": []})
        return messages[-1]

    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            text = _text(index, item.get("content"))
            if role == "assistant":
                assistant()["content"] += text
            elif role in ("user", "system", "developer"):
                messages.append({"role": "user" if role == "user" else "system", "content": text})
            else:
                raise UserError(
                    f"input[{index}]: a message's role is user, system, developer or assistant, not {role!r}"
                )
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise UserError(f"input[{index}]: a function_call item needs a call_id and a name")
            arguments = item.get("arguments") or "{}"
            function = {"name": name, "arguments": arguments}
            assistant()["tool_calls"].append({"id": call_id, "type": "function", "function": function})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise UserError(f"input[{index}]: a function_call_output item needs a call_id")
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": _text(index, item.get("output"))}
            )
        else:
            raise UserError(
                f"input[{index}]: {kind!r} items are not supported (messages, function_call, function_call_output are)"
            )
    return [_without_empty_calls(message) for message in messages]


def _without_empty_calls(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("tool_calls") == []:
        return {key: value for key, value in message.items() if key != "tool_calls"}
    return message


_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(index: int, content: object) -> str:
    """Text content: a string or text parts (``input_text``, ``output_text``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in _TEXT_PARTS:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise UserError(f"input[{index}]: only text content is supported, not {kind!r}")
        return "".join(str(part.get("text", "")) for part in content)
    raise UserError(f"input[{index}]: content must be a string or a list of text parts")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ResponseTurn:
    """One Responses request made ready for the pool: its conversation, the pool conversation it lands on, its ids."""

    request: ResponsesRequest
    model: str
    conversation: tuple[dict[str, Any], ...]
    """The chat messages through the new input (the previous response's conversation first), no instructions."""
    conversation_id: str | None
    """The pool conversation: the ``x-session-id`` header, else the name the chain was given; None for an unnamed
    chain (the pool then matches the messages to the session whose history they extend, as for chat completions)."""
    response_id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def begin(
        cls, request: ResponsesRequest, previous: StoredResponse | None, *, conversation_id: str | None, model: str
    ) -> ResponseTurn:
        """The turn of ``request``, continuing ``previous``, on the conversation the request names (its key:
        `conversation_key`), else on ``previous``'s."""
        earlier = previous.messages if previous is not None else ()
        if conversation_id is None and previous is not None:
            conversation_id = previous.conversation_id
        return cls(request, model, (*earlier, *request.new_messages()), conversation_id)

    def messages(self) -> list[dict[str, Any]]:
        """What the pool steps on: the instructions as the system message, then the conversation."""
        instructions = self.request.instructions
        if instructions is None:
            return list(self.conversation)
        first = self.conversation[0] if self.conversation else None
        if first is not None and first.get("role") == "system":  # both: one system message, instructions first
            merged = {"role": "system", "content": f"{instructions}\n\n{first.get('content', '')}"}
            return [merged, *self.conversation[1:]]
        return [{"role": "system", "content": instructions}, *self.conversation]

    def stored(self, reply: StepReply, response: dict[str, Any]) -> StoredResponse:
        """The response as ``previous_response_id`` continues it (``response``: the object returned for it)."""
        messages = (*self.conversation, reply.message.chat_dict())
        return StoredResponse(self.response_id, self.conversation_id, messages, response)

    def response(self, reply: StepReply | None, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The ``response`` object: in progress (no reply yet), or completed with ``reply`` (``output``: its items)."""
        return response_object(
            self.request,
            response_id=self.response_id,
            created_at=self.created_at,
            model=self.model,
            reply=reply,
            output=output,
        )


def response_object(
    request: ResponsesRequest,
    *,
    response_id: str,
    created_at: int,
    model: str,
    reply: StepReply | None = None,
    output: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A ``response`` object (``Response``'s shape) answering ``request``: in progress (no reply yet), or completed
    with ``reply`` (``output``: its items; default: the reply's, new)."""
    status = status_of(reply)
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "model": model,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "output": output if output is not None else _output_items(reply) if reply is not None else [],
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "tool_choice": request.tool_choice,
        "tools": request.tools or [],
        "temperature": request.temperature,
        "top_p": request.top_p if request.top_p is not None else 1.0,
        "max_output_tokens": request.max_output_tokens,
        "previous_response_id": request.previous_response_id,
        "store": request.keeps,
        "text": {"format": request.text_format() or {"type": "text"}},
        "truncation": "disabled",
        "user": request.user,
        "metadata": request.metadata or {},
        "usage": None,
    }
    if reply is not None:
        body["usage"] = response_usage(reply)
        body["agentkv"] = {"stats": reply.stats.model_dump(mode="json"), "error": reply.error}
    return body


ItemStatus = Literal["in_progress", "completed", "incomplete"]


def status_of(reply: StepReply | None) -> ItemStatus:
    if reply is None:
        return "in_progress"
    return "incomplete" if reply.finish_reason == "length" else "completed"


def response_usage(reply: StepReply) -> dict[str, Any]:
    """A response's ``usage`` (``ResponseUsage``'s shape): cached tokens are the prompt tokens whose KV was not
    computed."""
    stats = reply.stats
    return {
        "input_tokens": stats.prompt_tokens,
        "input_tokens_details": {"cached_tokens": stats.prompt_tokens - stats.computed_tokens, "cache_write_tokens": 0},
        "output_tokens": stats.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": stats.prompt_tokens + stats.output_tokens,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, status: ItemStatus, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, status: ItemStatus, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def reasoning_item(item_id: str, status: ItemStatus, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": content}


def _output_items(reply: StepReply) -> list[dict[str, Any]]:
    """The reply as output items: its reasoning (with a reasoning parser), then its function calls, else one
    message."""
    items = [] if reply.reasoning is None else [reasoning_item(new_id("rs"), "completed", reply.reasoning)]
    if reply.tool_calls:
        return items + [
            call_item(new_id("fc"), "completed", call.id, call.name, call.arguments_json) for call in reply.tool_calls
        ]
    return [*items, message_item(new_id("msg"), status_of(reply), reply.text)]
