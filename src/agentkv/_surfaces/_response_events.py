"""The Responses stream: a `StepReply` written as ``response.*`` events while the model writes it.

`ResponseEvents` numbers the events of one response: its opening, then each output item as it is written
(reasoning text, the message's text, each function call's arguments, from `SessionPool.stream` with
``deltas=True``), then the items' ends and the full response (items in `agentkv._surfaces._openai_responses`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._conversation._tools import ToolCall
from .._session._results import ReasoningDelta, StepReply, ToolCallDelta
from ._openai_chat import StreamedCalls
from ._openai_responses import (
    ResponseTurn,
    call_item,
    message_item,
    new_id,
    reasoning_item,
    status_of,
    text_part,
)

__all__ = ["ResponseEvents"]


@dataclass
class _OpenItem:
    """An output item a stream opened: its id, its place in the output, the text streamed into it so far."""

    item_id: str
    output_index: int
    text: str = ""
    done: bool = False

    def at_content(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": self.output_index, "content_index": 0}


class ResponseEvents:
    """The stream events of one response, numbered in order: the opening, then its items as the model writes
    them (a reasoning item's text, the message's text, each function call's arguments), then the items' ends
    and ``response.completed`` (``response.incomplete`` when cut at ``max_output_tokens``)."""

    def __init__(self, turn: ResponseTurn) -> None:
        self._turn = turn
        self._sequence = 0
        self._items: dict[int, dict[str, Any]] = {}
        """Every item opened, by output index (finished ones in their final form)."""
        self._message: _OpenItem | None = None
        self._reasoning: _OpenItem | None = None
        self._calls: dict[int, _OpenItem] = {}
        """Function calls opened while streaming, by the call's index in the reply."""
        self._streamed = StreamedCalls()

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        in_progress = self._turn.response(None)
        return [
            self._event("response.created", response=in_progress),
            self._event("response.in_progress", response=in_progress),
        ]

    def piece(self, item: str | ToolCallDelta | ReasoningDelta) -> list[dict[str, Any]]:
        """The events of one piece `SessionPool.stream` gave (``deltas=True``); an empty text piece has none."""
        if isinstance(item, ToolCallDelta):
            return self.tool_call(item)
        if isinstance(item, ReasoningDelta):
            return self.reasoning(item.text)
        return self.text(item) if item else []

    def _open(self, item: dict[str, Any]) -> tuple[_OpenItem, list[dict[str, Any]]]:
        at = len(self._items)
        self._items[at] = item
        return _OpenItem(item["id"], at), [self._event("response.output_item.added", item=item, output_index=at)]

    def reasoning(self, piece: str) -> list[dict[str, Any]]:
        """A piece of the reasoning (its item opens with the first)."""
        events = self._end_reasoning_before("reasoning")
        if self._reasoning is None:
            self._reasoning, added = self._open(reasoning_item(new_id("rs"), "in_progress", None))
            events += added
        self._reasoning.text += piece
        at = self._reasoning.at_content()
        events.append(self._event("response.reasoning_text.delta", delta=piece, **at))
        return events

    def _end_reasoning_before(self, kind: str) -> list[dict[str, Any]]:
        """The reasoning item's end, once something else than reasoning comes."""
        if kind == "reasoning" or self._reasoning is None or self._reasoning.done:
            return []
        reasoning = self._reasoning
        reasoning.done = True
        item = reasoning_item(reasoning.item_id, "completed", reasoning.text)
        self._items[reasoning.output_index] = item
        return [
            self._event("response.reasoning_text.done", text=reasoning.text, **reasoning.at_content()),
            self._event("response.output_item.done", item=item, output_index=reasoning.output_index),
        ]

    def text(self, piece: str) -> list[dict[str, Any]]:
        """A piece of the answer (the message item opens with the first)."""
        events = self._end_reasoning_before("text")
        if self._message is None:
            self._message, added = self._open(message_item(new_id("msg"), "in_progress", None))
            events += added
            events.append(self._event("response.content_part.added", part=text_part(""), **self._message.at_content()))
        self._message.text += piece
        if piece:
            at = self._message.at_content()
            events.append(self._event("response.output_text.delta", delta=piece, logprobs=[], **at))
        return events

    def tool_call(self, delta: ToolCallDelta) -> list[dict[str, Any]]:
        """A piece of a function call: its item opens with the call's name, then its arguments stream."""
        events = self._end_reasoning_before("tool_call")
        self._streamed.add(delta)
        call = self._calls.get(delta.index)
        if call is None:
            item = call_item(new_id("fc"), "in_progress", delta.id, delta.name or "", "")
            call, added = self._open(item)
            self._calls[delta.index] = call
            events += added
        if delta.arguments:
            call.text += delta.arguments
            at = {"item_id": call.item_id, "output_index": call.output_index}
            events.append(self._event("response.function_call_arguments.delta", delta=delta.arguments, **at))
        return events

    def closing(self, reply: StepReply) -> list[dict[str, Any]]:
        """The rest of the answer, the items' ends (calls' arguments completed), then the full response."""
        events = self._end_reasoning_before("end")
        if reply.reasoning is not None and self._reasoning is None:  # reasoning that was not streamed
            events += self.reasoning(reply.reasoning)
            events += self._end_reasoning_before("end")
        if not reply.tool_calls:
            streamed = self._message.text if self._message is not None else ""
            rest = reply.text[len(streamed) :] if reply.text.startswith(streamed) else ""
            if rest or self._message is None:
                events += self.text(rest)  # what was not streamed (or an empty answer's message)
        if self._message is not None:
            message = self._message
            text = message.text if reply.tool_calls else reply.text
            item = message_item(message.item_id, status_of(reply), text)
            self._items[message.output_index] = item
            at = message.at_content()
            events += [
                self._event("response.output_text.done", text=text, logprobs=[], **at),
                self._event("response.content_part.done", part=text_part(text), **at),
                self._event("response.output_item.done", item=item, output_index=message.output_index),
            ]
        for index, call in enumerate(reply.tool_calls):
            events += self._close_call(index, call)
        for index, opened in self._calls.items():  # streamed, but not a call of the finished output (unreadable)
            if index >= len(reply.tool_calls):
                item = {**self._items[opened.output_index], "status": "incomplete", "arguments": opened.text}
                self._items[opened.output_index] = item
                events.append(self._event("response.output_item.done", item=item, output_index=opened.output_index))
        output = [self._items[at] for at in sorted(self._items)]
        response = self._turn.response(reply, output)
        events.append(self._event(f"response.{response['status']}", response=response))
        return events

    def _close_call(self, index: int, call: ToolCall) -> list[dict[str, Any]]:
        """A finished call's arguments' rest and end (its item opened now if it was not streamed)."""
        events: list[dict[str, Any]] = []
        opened = self._calls.get(index)
        if opened is None:
            opened, added = self._open(call_item(new_id("fc"), "in_progress", call.id, call.name, ""))
            events += added
        rest = self._streamed.rest(index, call) if index in self._calls else call.arguments_json
        at = {"item_id": opened.item_id, "output_index": opened.output_index}
        if rest:
            opened.text += rest
            events.append(self._event("response.function_call_arguments.delta", delta=rest, **at))
        arguments = opened.text
        done = call_item(opened.item_id, "completed", call.id, call.name, arguments)
        self._items[opened.output_index] = done
        events += [
            self._event("response.function_call_arguments.done", arguments=arguments, **at),
            self._event("response.output_item.done", item=done, output_index=opened.output_index),
        ]
        return events

    def error(self, error: Mapping[str, Any]) -> dict[str, Any]:
        """The ``error`` event of a failure after the stream began (``error``: OpenAI's error body's object)."""
        return self._event("error", code=error.get("code"), message=error.get("message", ""), param=error.get("param"))
