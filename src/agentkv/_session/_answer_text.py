"""The answer's text while the model writes it, for `Session.step(on_text=...)`.

The raw output is not what the caller shows: with schema-format tools it is JSON
(``{"answer": "..."}`` or tool calls), with native tools an answer may turn into
``<tool_call>`` blocks. `AnswerText` gives only the answer's characters, as soon as they are
certain, so that everything it gave, joined, equals the final `StepReply.text`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .._conversation._call_stream import SchemaCallStream, parse_output
from .._conversation._parsers import (
    CallPiece,
    NativeToolParser,
    NativeToolStream,
    ReasoningSplitter,
    ReasoningStream,
)
from .._conversation._tools import ToolCall
from ._results import ReasoningDelta, ToolCallDelta

__all__ = [
    "AnswerText",
    "OutputReader",
    "OutputShape",
    "ReadOutput",
    "StepStream",
    "StreamPieces",
    "stream_events",
    "tool_call_delta",
]

OutputShape = Literal["plain", "json", "native"]
"""How a step's output is written: plain text (no tools), schema-format JSON, or text with ``<tool_call>`` blocks."""

_ANSWER_OPENING = re.compile(r'\s*\{\s*"answer"\s*:\s*"')
_CALL_OPENING = "<tool_call>"
_ESCAPE_LENGTH = {"u": 6}
"""Length of a JSON escape, its backslash included: ``\\uXXXX`` is six characters, every other escape two."""


class AnswerText:
    """Feed it the raw output's deltas; each call returns the answer text that became certain."""

    def __init__(self, shape: OutputShape) -> None:
        self._shape = shape
        self._raw = ""
        self._given = 0
        """Characters of the answer returned so far."""

    def feed(self, delta: str) -> str:
        self._raw += delta
        certain = self._json_answer() if self._shape == "json" else self._plain_answer()
        new = certain[self._given :]
        self._given = max(self._given, len(certain))
        return new

    def _plain_answer(self) -> str:
        """Plain or native-format output as written (vLLM's server strips nothing); nothing once a tool call starts."""
        text = self._raw
        if self._shape == "native":
            if _CALL_OPENING in text:
                return ""  # a tool-calling step: its text is not an answer
            text = _without_partial_opening(text)
        return text

    def _json_answer(self) -> str:
        """The decoded part of the ``"answer"`` string written so far (never half an escape)."""
        opening = _ANSWER_OPENING.match(self._raw)
        if opening is None:
            return ""
        body = self._raw[opening.end() :]
        decoded: list[str] = []
        index = 0
        while index < len(body):
            char = body[index]
            if char == '"':
                break
            if char != "\\":
                decoded.append(char)
                index += 1
                continue
            if index + 1 >= len(body):
                break
            end = index + _ESCAPE_LENGTH.get(body[index + 1], 2)
            if end > len(body):
                break
            piece = json.loads(f'"{body[index:end]}"')
            if "\ud800" <= piece <= "\udbff":  # a high surrogate: wait for its pair
                if end + 6 > len(body):
                    break
                piece = json.loads(f'"{body[index : end + 6]}"')
                end += 6
            decoded.append(piece)
            index = end
        return "".join(decoded)


def _without_partial_opening(text: str) -> str:
    """``text`` less a trailing start of ``<tool_call>`` (it may yet become a call)."""
    for length in range(min(len(_CALL_OPENING) - 1, len(text)), 0, -1):
        if text.endswith(_CALL_OPENING[:length]):
            return text[:-length]
    return text


@dataclass(frozen=True)
class ReadOutput:
    """A finished output read: its reasoning apart, then tool calls, or an answer, or why it is neither."""

    reasoning: str | None
    calls: list[ToolCall]
    answer: str | None
    error: str | None
    content: str
    """The output less its reasoning (what the calls or the answer were read from)."""


@dataclass(frozen=True)
class StreamPieces:
    """What one delta of the raw output made certain."""

    answer: str = ""
    reasoning: str = ""
    calls: tuple[CallPiece, ...] = ()


@dataclass(frozen=True)
class OutputReader:
    """How one step's output is read, finished (`read`) or while it is written (`stream`).

    With a reasoning parser, the reasoning is split off first (not from schema-format JSON: a grammar forces
    all of it, so it has no reasoning part); the rest is an answer (plain), the schema format's JSON, or text
    with the model's own tool calls, read by ``tools`` (a vLLM tool parser).
    """

    shape: OutputShape
    call_prefix: str
    """Call ids are this, a dash and the call's index (the same while streaming and when finished)."""
    tools: NativeToolParser | None = None
    reasoning: ReasoningSplitter | None = None
    forced: str | None = None
    """A native-format step whose calls are forced as vLLM's server forces them (`NativeToolParser.forced_outputs`):
    ``"required"`` or the tool's name; its output is calls only (read whole, streamed at the end)."""

    def _reasoning(self) -> ReasoningSplitter | None:
        return self.reasoning if self.shape != "json" else None

    def read(self, text: str) -> ReadOutput:
        reasoning: str | None = None
        splitter = self._reasoning()
        if splitter is not None:
            reasoning, text = splitter.split(text)
        if self.shape == "plain":
            return ReadOutput(reasoning, [], text, None, text)
        if self.forced is not None:
            assert self.tools is not None
            calls, error = self.tools.read_forced(text, self.forced, call_prefix=self.call_prefix)
            return ReadOutput(reasoning, calls, None, error, text)
        if self.shape == "json":
            calls, answer, error = parse_output(text, call_prefix=self.call_prefix)
        else:
            assert self.tools is not None
            calls, answer, error = self.tools.read(text, call_prefix=self.call_prefix)
        return ReadOutput(reasoning, calls, answer, error, text)

    def stream(self) -> StepStream:
        return StepStream(self)


class StepStream:
    """Feed it the raw output's deltas; each returns the answer text, reasoning and call pieces that became certain.

    The answer pieces, joined, are the finished answer (`AnswerText`); each call's argument pieces, joined, are
    its arguments' JSON text as written."""

    def __init__(self, reader: OutputReader) -> None:
        splitter = reader._reasoning()
        self._reasoning: ReasoningStream | None = splitter.stream() if splitter is not None else None
        self._answer = AnswerText("json" if reader.shape == "json" else "plain")
        self._schema = SchemaCallStream(reader.call_prefix) if reader.shape == "json" else None
        self._native: NativeToolStream | None = None
        self._forced = reader.forced is not None
        if reader.shape == "native" and reader.tools is not None and not self._forced:
            self._native = reader.tools.stream(reader.call_prefix)

    def feed(self, delta: str, token_ids: Sequence[int] = ()) -> StreamPieces:
        reasoning = ""
        if self._reasoning is not None:
            reasoning, delta = self._reasoning.feed(delta, token_ids)
        calls: list[CallPiece] = []
        if self._schema is not None:
            calls = self._schema.feed(delta)
        elif self._native is not None and delta:
            delta, calls = self._native.feed(delta, token_ids)
        if self._forced:  # calls only, read when the output is whole
            return StreamPieces("", reasoning, ())
        answer = self._answer.feed(delta) if delta else ""
        return StreamPieces(answer, reasoning, tuple(calls))


def tool_call_delta(turn: int, step: int, piece: CallPiece) -> ToolCallDelta:
    """The event of a call piece of step ``step`` of turn ``turn``."""
    return ToolCallDelta(
        turn=turn, step=step, index=piece.index, id=piece.id, name=piece.name, arguments=piece.arguments
    )


def stream_events(turn: int, step: int, pieces: StreamPieces) -> list[ReasoningDelta | ToolCallDelta]:
    """The reasoning and tool-call events of what one delta made certain (`Session.stream` yields them)."""
    events: list[ReasoningDelta | ToolCallDelta] = []
    if pieces.reasoning:
        events.append(ReasoningDelta(turn=turn, step=step, text=pieces.reasoning))
    events += [tool_call_delta(turn, step, piece) for piece in pieces.calls]
    return events
