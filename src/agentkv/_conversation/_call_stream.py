"""Tool calls of the schema format while the model writes them: the forced JSON read character by character.

The schema format forces the output to ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` or
``{"answer": ...}`` (`agentkv._conversation._tools.output_schema`). `SchemaCallStream` follows the JSON as it
grows, without parsing it again, and gives each call's name once it is complete, then the text of its
``arguments`` value as it is written: the pieces, joined, are that value's JSON text exactly as generated.
`parse_output` reads a finished output; each call keeps that same text (`ToolCall.raw_arguments`), so a client
joining the streamed pieces gets what a client of the whole reply gets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ._parsers import CallPiece, call_id
from ._tools import ToolCall

__all__ = ["SchemaCallStream", "parse_output"]

_WHITESPACE = " \t\r\n"


@dataclass
class _Frame:
    kind: str
    """``{`` or ``[``."""
    key: str | None = None
    """An object's current key."""
    count: int = 0
    """An array's elements so far (the index of the current one)."""
    expects_key: bool = True


@dataclass
class _Call:
    name: str | None = None
    start: int | None = None
    """Where its arguments' text starts in the output."""
    end: int | None = None
    """Where it ends (None: still being written)."""
    sent: int = 0
    """Characters of the arguments given so far."""
    announced: bool = False


@dataclass
class SchemaCallStream:
    """Feed it the forced JSON's deltas; each call returns the call pieces that became certain."""

    call_prefix: str
    _text: str = ""
    _length: int = 0
    """Characters read so far (the text's length once a delta is read)."""
    _stack: list[_Frame] = field(default_factory=list[_Frame])
    _string: list[str] | None = None
    """The string being read (its quotes included), or None outside strings."""
    _string_is_key: bool = False
    _escape: bool = False
    _in_scalar: bool = False
    _calls: dict[int, _Call] = field(default_factory=dict[int, _Call])

    def feed(self, delta: str) -> list[CallPiece]:
        for char in delta:
            self._char(char)
            self._length += 1
        self._text += delta
        return self._pieces()

    # ----------------------------------------------------------------- the JSON, one character at a time

    def _char(self, char: str) -> None:
        if self._string is not None:
            self._string.append(char)
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._end_string()
            return
        if self._in_scalar and (char in _WHITESPACE or char in ",]}"):
            self._in_scalar = False
            self._value_ended(self._length)
        if char in _WHITESPACE:
            return
        top = self._stack[-1] if self._stack else None
        if char == '"':
            self._string_is_key = top is not None and top.kind == "{" and top.expects_key
            if not self._string_is_key:
                self._value_started()
            self._string = [char]
        elif char in "{[":
            self._value_started()
            self._stack.append(_Frame(char))
        elif char in "}]":
            if self._stack:
                self._stack.pop()
            self._value_ended(self._length + 1)
        elif char == ":" and top is not None:
            top.expects_key = False
        elif char == "," and top is not None:
            top.expects_key = True
            top.count += 1
        elif not self._in_scalar:  # a number, true, false or null
            self._in_scalar = True
            self._value_started()

    def _end_string(self) -> None:
        text, self._string = "".join(self._string or ()), None
        top = self._stack[-1] if self._stack else None
        if self._string_is_key:
            if top is not None:
                top.key = json.loads(text)
            return
        index = self._call_field("name")
        if index is not None:
            name = json.loads(text)
            self._call(index).name = name if isinstance(name, str) else str(name)
        self._value_ended(self._length + 1)

    def _call_field(self, key: str) -> int | None:
        """The call whose ``key`` the current value is, if it is one (depth: root object, list, call object)."""
        stack = self._stack
        if len(stack) != 3 or stack[0].key != "tool_calls" or stack[1].kind != "[" or stack[2].kind != "{":
            return None
        return stack[1].count if stack[2].key == key else None

    def _call(self, index: int) -> _Call:
        return self._calls.setdefault(index, _Call())

    def _value_started(self) -> None:
        index = self._call_field("arguments")
        if index is not None and self._call(index).start is None:
            self._call(index).start = self._length

    def _value_ended(self, end: int) -> None:
        index = self._call_field("arguments")
        if index is not None:
            call = self._call(index)
            if call.start is not None and call.end is None:
                call.end = end

    # ----------------------------------------------------------------- what became certain

    def _pieces(self) -> list[CallPiece]:
        pieces: list[CallPiece] = []
        for index in sorted(self._calls):
            call = self._calls[index]
            if call.name is None:
                break  # calls are given in order, each once its name is known
            if not call.announced:
                call.announced = True
                pieces.append(CallPiece(index, call_id(self.call_prefix, index), name=call.name))
            if call.start is None:
                continue
            text = self._text[call.start : call.end if call.end is not None else self._length]
            if len(text) > call.sent:
                pieces.append(CallPiece(index, call_id(self.call_prefix, index), arguments=text[call.sent :]))
                call.sent = len(text)
        return pieces


def parse_output(text: str, *, call_prefix: str) -> tuple[list[ToolCall], str | None, str | None]:
    """(tool calls, answer, error) from the model's finished JSON output; each call's arguments keep their text
    as the model wrote it (what `SchemaCallStream` streamed)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return [], None, f"the output is not valid JSON ({exc.msg} at character {exc.pos})"
    if isinstance(data, dict) and isinstance(data.get("answer"), str):
        return [], data["answer"], None
    found = data.get("tool_calls") if isinstance(data, dict) else None
    if not isinstance(found, list) or not found:
        return [], None, 'the output has neither "answer" nor a list of "tool_calls"'
    written = _arguments_as_written(text)
    calls: list[ToolCall] = []
    for index, call in enumerate(found):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return [], None, f"tool call {index} has no name"
        arguments = call.get("arguments", {})
        calls.append(
            ToolCall(
                id=call_id(call_prefix, index),
                name=call["name"],
                arguments=arguments if isinstance(arguments, dict) else {"value": arguments},
                raw_arguments=written.get(index) if isinstance(arguments, dict) else None,
            )
        )
    return calls, None, None


def _arguments_as_written(text: str) -> dict[int, str]:
    """Each call's ``arguments`` text in a complete output, by the call's index."""
    reader = SchemaCallStream("")
    reader.feed(text)
    return {
        index: text[call.start : call.end]
        for index, call in reader._calls.items()
        if call.start is not None and call.end is not None
    }
