"""The answer's text while the model writes it, for `Session.step(on_text=...)`.

The raw output is not what the caller shows: with schema-format tools it is JSON
(``{"answer": "..."}`` or tool calls), with native tools an answer may turn into
``<tool_call>`` blocks. `AnswerText` gives only the answer's characters, as soon as they are
certain, so that everything it gave, joined, equals the final `StepReply.text`.
"""

from __future__ import annotations

import json
import re
from typing import Literal

__all__ = ["AnswerText", "OutputShape"]

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
        """Plain or native-format output, stripped as the answer is; nothing once a tool call starts."""
        text = self._raw
        if self._shape == "native":
            if _CALL_OPENING in text:
                return ""  # a tool-calling step: its text is not an answer
            text = _without_partial_opening(text)
        return text.strip()

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
