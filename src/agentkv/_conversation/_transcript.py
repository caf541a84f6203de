"""Conversations as callers send them: chat messages whose tool calls the caller runs.

Frameworks and HTTP clients send the whole conversation with every call, in the OpenAI chat
shape: assistant messages carry ``tool_calls``, tool messages a ``tool_call_id``. A
`Transcript` is what the session last answered in that shape; a request that starts with it
extends the conversation, and only its new messages are rendered (the model's earlier
outputs keep the token ids it generated). Anything else is rebuilt from the messages by
`rebuild`, each assistant message re-tokenized from the text the model would have written.

What the model reads differs from what the caller sees in two places, both decided by the
tool format: a tool result (schema format: the JSON ``{"name": ..., "result": ...}`` that
`Session.run` also gives the model) and an assistant message with tool calls (the JSON or
``<tool_call>`` text the model writes when it calls tools).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from .._errors import InvalidMessageError
from ._conversation import ChatRenderer, Conversation, Message, check_unicode
from ._tools import ToolCall, ToolFormat, ToolResult, ToolSpec, result_message, unwrapped_arguments

__all__ = ["Transcript", "TranscriptKey", "append", "assistant_text", "model_messages", "read_messages", "rebuild"]

MessageLike = Message | Mapping[str, Any]


def read_messages(messages: Sequence[MessageLike]) -> list[Message]:
    """`Message` objects from messages or OpenAI chat dicts, checked: a tool message answers a call of
    the assistant message before it (and takes that call's name); the last message is not the model's."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise InvalidMessageError("messages must be a non-empty list of messages")
    read = [_read_one(index, item) for index, item in enumerate(messages)]
    for index, message in enumerate(read):
        _check_unicode(index, message)
    calls: dict[str, ToolCall] = {}
    checked: list[Message] = []
    for index, message in enumerate(read):  # any order of roles: the chat template decides what it renders
        if message.role == "assistant":
            calls = {call.id: call for call in message.tool_calls}
        elif message.role == "tool":
            call = calls.get(message.tool_call_id or "")
            if call is None:
                raise InvalidMessageError(
                    f"message {index}: a tool message must answer a tool call of the assistant message before it "
                    f"(tool_call_id {message.tool_call_id!r} matches none)"
                )
            message = message.model_copy(update={"name": call.name})
        else:
            calls = {}
        checked.append(message)
    if checked[-1].role == "assistant":
        raise InvalidMessageError("the last message is the model's: send the user's message or the tool results")
    if all(m.role == "system" for m in checked):
        raise InvalidMessageError("messages hold no user message")
    return checked


def _read_one(index: int, item: MessageLike) -> Message:
    if isinstance(item, Message):
        return item
    if not isinstance(item, Mapping):
        raise InvalidMessageError(f"message {index}: a message or a dict, not {type(item).__name__}")
    role = "system" if item.get("role") == "developer" else item.get("role")
    try:
        return Message(
            role=role,  # type: ignore[arg-type]
            content=_text(index, item.get("content")),
            name=item.get("name") if role == "tool" else None,
            tool_calls=tuple(_read_call(index, call) for call in item.get("tool_calls") or ()),
            tool_call_id=item.get("tool_call_id"),
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise InvalidMessageError(f"message {index}: {where + ': ' if where else ''}{first['msg']}") from None


def _check_unicode(index: int, message: Message) -> None:
    """`InvalidMessageError` naming the message and the part of it that is not valid Unicode (a lone surrogate)."""
    parts = [("content", message.content), ("name", message.name or ""), ("tool_call_id", message.tool_call_id or "")]
    for call in message.tool_calls:
        arguments = json.dumps(call.arguments, ensure_ascii=False, default=str)
        parts += [
            ("tool call id", call.id),
            ("tool call name", call.name),
            (f"tool call {call.id!r}'s arguments", arguments),
        ]
    for what, text in parts:
        check_unicode(text, f"message {index}: its {what}")


def _text(index: int, content: object) -> str:
    """Content as text: a string, None (an assistant message with only tool calls) or text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise InvalidMessageError(f"message {index}: content must be text (images and other parts are not supported)")


def _read_call(index: int, call: object) -> ToolCall:
    if isinstance(call, ToolCall):
        return call
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping) or not call.get("id"):
        raise InvalidMessageError(f"message {index}: a tool call needs an id and a function")
    function = call["function"]
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = unwrapped_arguments(json.loads(arguments))  # a call handed out with an object as a string
        except json.JSONDecodeError:
            raise InvalidMessageError(
                f"message {index}: tool call {call['id']!r} has arguments that are not JSON"
            ) from None
    if not isinstance(arguments, dict):
        raise InvalidMessageError(f"message {index}: tool call {call['id']!r} has arguments that are not an object")
    return ToolCall(id=str(call["id"]), name=str(function.get("name")), arguments=arguments)


@dataclass(frozen=True)
class TranscriptKey:
    """What the rendering of a conversation depends on besides its messages."""

    system: str | None
    """The system message the model reads (schema-format tool instructions included)."""
    tools: tuple[ToolSpec, ...]
    format: ToolFormat
    template_kwargs: str | None = None
    """The chat template's extra arguments (a request's ``chat_template_kwargs``) as canonical JSON
    (`template_kwargs_key`); None: none."""


@dataclass(frozen=True)
class Transcript:
    """The conversation a session last answered, as the caller sees it, and how it was rendered."""

    key: TranscriptKey
    messages: tuple[Message, ...]

    def new_messages(self, key: TranscriptKey, messages: Sequence[Message]) -> list[Message] | None:
        """The messages after this transcript when ``messages`` extend it exactly, else None."""
        held = len(self.messages)
        if key != self.key or len(messages) <= held or tuple(messages[:held]) != self.messages:
            return None
        return list(messages[held:])


def model_messages(messages: Sequence[Message], format: ToolFormat) -> list[Message]:
    """User and tool messages as the model reads them (a tool result in schema format is JSON)."""
    read: list[Message] = []
    for message in messages:
        if message.role == "tool" and format == "schema":
            result = ToolResult(call_id=message.tool_call_id or "", name=message.name or "", content=message.content)
            message = Message(role="tool", name=message.name, content=result_message(result))
        elif message.role == "tool":
            message = Message(role="tool", name=message.name, content=message.content)
        read.append(message)
    return read


def assistant_text(message: Message, format: ToolFormat, *, tools: bool) -> str:
    """What the model would have written for an assistant message (with tools in schema format: JSON)."""
    calls = [{"name": call.name, "arguments": call.arguments} for call in message.tool_calls]
    if format == "native":
        blocks = "".join(f"\n<tool_call>\n{json.dumps(call)}\n</tool_call>" for call in calls)
        return (message.content + blocks).strip()
    if calls:
        return json.dumps({"tool_calls": calls})
    return json.dumps({"answer": message.content}) if tools else message.content


def rebuild(renderer: ChatRenderer, key: TranscriptKey, messages: Sequence[Message]) -> Conversation:
    """The conversation of ``messages`` (a first system message is the key's), re-tokenized."""
    system = Message(role="system", content=key.system) if key.system is not None else None
    conversation = Conversation(renderer, system=system)
    append(conversation, messages[1:] if messages and messages[0].role == "system" else messages, key)
    return conversation


def append(conversation: Conversation, messages: Sequence[Message], key: TranscriptKey) -> None:
    """Append the caller's messages in their order, as the chat template renders them: each run of user, tool and
    system messages through the template (with the next generation prompt), each assistant message as the text the
    model would have written for it (two in a row, or one first, opened as the template opens it). The model's own
    earlier outputs already in ``conversation`` keep their token ids."""
    pending: list[Message] = []
    for message in messages:
        if message.role != "assistant":
            pending.append(message)
            continue
        if pending:
            conversation.add_messages(model_messages(pending, key.format))
            pending = []
        text = assistant_text(message, key.format, tools=bool(key.tools))
        conversation.add_output(conversation.renderer.encode_text(text), text)
    if pending:
        conversation.add_messages(model_messages(pending, key.format))
