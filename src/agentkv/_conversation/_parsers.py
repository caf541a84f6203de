"""vLLM's own output parsers, chosen by name as ``vllm serve --tool-call-parser`` / ``--reasoning-parser`` choose them.

`NativeToolParser` reads a model's native tool calls (``tool_format="native"``) with a vLLM tool parser:
``extract_tool_calls`` on a finished output, ``extract_tool_calls_streaming`` on its deltas.
`ReasoningSplitter` separates a reasoning model's thinking from its answer with a vLLM reasoning parser.
vLLM is imported only when one of them is used (its import takes seconds).
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .._errors import UserError
from ._tools import ToolCall, ToolSpec, template_tools

__all__ = [
    "DEFAULT_TOOL_CALL_PARSER",
    "CallPiece",
    "NativeToolParser",
    "NativeToolStream",
    "OutputParsers",
    "ReasoningSplitter",
    "ReasoningStream",
    "check_parser",
    "parser_names",
]

logger = logging.getLogger("agentkv")

DEFAULT_TOOL_CALL_PARSER = "hermes"
"""The tool parser of ``tool_format="native"`` when none is named: Hermes ``<tool_call>{...}</tool_call>`` blocks
(Hermes, Qwen2.5/Qwen3 and most models tuned on their format; what agentkv parsed before parsers could be named)."""

ParserKind = Literal["tool_call", "reasoning"]


def _manager(kind: ParserKind) -> Any:
    if kind == "tool_call":
        from vllm.tool_parsers import ToolParserManager

        return ToolParserManager
    from vllm.reasoning import ReasoningParserManager

    return ReasoningParserManager


def parser_names(kind: ParserKind) -> list[str]:
    """The names vLLM registers for ``--tool-call-parser`` (``kind="tool_call"``) or ``--reasoning-parser``."""
    return list(_manager(kind).list_registered())


def check_parser(kind: ParserKind, name: object) -> str:
    """``name`` if vLLM has a parser of that name, else `UserError` listing the names it has."""
    what = "tool_call_parser" if kind == "tool_call" else "reasoning_parser"
    if not isinstance(name, str) or not name:
        raise UserError(f"{what} must be a parser's name, not {name!r}")
    names = parser_names(kind)
    if name not in names:
        raise UserError(f"{what} {name!r} is not one of vLLM's: {', '.join(names)}")
    return name


def _parser_class(kind: ParserKind, name: str) -> Any:
    manager = _manager(kind)
    getter = manager.get_tool_parser if kind == "tool_call" else manager.get_reasoning_parser
    try:
        return getter(name)
    except KeyError:
        check_parser(kind, name)  # raises, naming the parsers there are
        raise


def _fresh(pristine: Any) -> Any:
    """A parser in the state ``pristine`` was made in, with the same tokenizer and vocabulary (shared, not copied:
    a parser reads its tokenizer's vocabulary once, and that takes tens of milliseconds)."""
    shared = [pristine.model_tokenizer, pristine.__dict__.get("vocab")]
    return copy.deepcopy(pristine, {id(value): value for value in shared if value is not None})


def _chat_request(tools: Mapping[str, ToolSpec]) -> Any:
    """The request vLLM's parsers are handed (they read its tools, some its settings)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="agentkv", messages=[], tools=template_tools(tools) or None)


@dataclass(frozen=True)
class CallPiece:
    """A piece of a tool call as the model writes it: its id and name first (once), then its arguments' text."""

    index: int
    """The call's position among the step's calls."""
    id: str
    name: str | None = None
    """On the call's first piece only."""
    arguments: str = ""


def call_id(call_prefix: str, index: int) -> str:
    """The id of a step's call ``index`` (the same while it streams and in the finished reply)."""
    return f"{call_prefix}-{index}"


def _arguments(text: str | None) -> dict[str, Any] | None:
    """A call's arguments object from the JSON text a parser gives (a JSON string holding JSON is unwrapped)."""
    try:
        value = json.loads(text or "{}")
        if isinstance(value, str):  # some models send the arguments as a JSON string
            value = json.loads(value)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


class NativeToolParser:
    """A vLLM tool parser (by name) for one kind of output: the model's own tool-call format."""

    def __init__(self, name: str, tokenizer: Any, tools: Mapping[str, ToolSpec]) -> None:
        self.name = name
        self._class = _parser_class("tool_call", name)
        self._request = _chat_request(tools)
        self._tools = template_tools(tools)
        try:
            self._pristine = self._class(tokenizer, self._request.tools)
        except Exception as exc:  # e.g. a parser whose call markers are no tokens of this tokenizer
            raise UserError(f"tool_call_parser {self.name!r} does not fit this model's tokenizer: {exc}") from None

    def _parser(self) -> Any:
        return _fresh(self._pristine)

    def read(self, text: str, *, call_prefix: str) -> tuple[list[ToolCall], str | None, str | None]:
        """(tool calls, answer, error) of a finished output; output without calls is the answer.

        Output the parser finds no call in but that holds its call marker (e.g. an unclosed ``<tool_call>``) is an
        error, not an answer: the model meant to call a tool."""
        parser = self._parser()
        info = parser.extract_tool_calls(text, self._request)
        if not info.tools_called or not info.tool_calls:
            marker = getattr(parser, "tool_call_start_token", None)
            if isinstance(marker, str) and marker and marker in text:
                return [], None, f"the output has a tool call ({marker}) the {self.name} parser cannot read"
            return [], info.content if info.content is not None else text, None
        calls: list[ToolCall] = []
        for index, found in enumerate(info.tool_calls):
            arguments = _arguments(found.function.arguments)
            if not found.function.name or arguments is None:
                return [], None, f"tool call {index} needs a name and an arguments object"
            calls.append(
                ToolCall(
                    id=call_id(call_prefix, index),
                    name=found.function.name,
                    arguments=arguments,
                    raw_arguments=found.function.arguments,
                )
            )
        return calls, None, None

    def _forced(self, choice: str) -> tuple[Any, Any]:
        """vLLM's composed parser for a forced ``choice`` and the request it adjusted (as ``vllm serve`` does)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.parser import ParserManager

        tool_choice: Any = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
        request = ChatCompletionRequest(model="agentkv", messages=[], tools=self._tools, tool_choice=tool_choice)
        composed = ParserManager.get_parser(tool_parser_name=self.name, enable_auto_tools=True)
        assert composed is not None
        parser = composed(self._pristine.model_tokenizer, request.tools)
        return parser, parser.adjust_request(request)

    def forced_outputs(self, choice: str) -> dict[str, Any] | None:
        """What vLLM's server constrains a step to when ``tool_choice`` is ``"required"`` or a tool's name (its
        parser's ``adjust_request``: the call envelope as a structural tag, or the tools' JSON schema), as
        `SamplingOptions.structured_outputs` fields; None when vLLM constrains nothing."""
        constraint = self._forced(choice)[1].structured_outputs
        if constraint is None:
            return None
        kinds = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
        return {kind: value for kind in kinds if (value := getattr(constraint, kind)) not in (None, False)}

    def read_forced(self, text: str, choice: str, *, call_prefix: str) -> tuple[list[ToolCall], str | None]:
        """(calls, error) of a forced step's finished output, read as vLLM's server reads it (its parser's
        ``parse``); each call keeps the parser's arguments text (`ToolCall.raw_arguments`), an object or not."""
        parser, request = self._forced(choice)
        _, _, found = parser.parse(text, request, enable_auto_tools=True)
        calls: list[ToolCall] = []
        for index, function in enumerate(found or ()):
            try:
                value = json.loads(function.arguments or "{}")
            except json.JSONDecodeError:
                value = None
            arguments = value if isinstance(value, dict) else {}
            raw = function.arguments or ""
            calls.append(
                ToolCall(id=call_id(call_prefix, index), name=function.name, arguments=arguments, raw_arguments=raw)
            )
        return (calls, None) if calls else ([], "the forced tool call could not be read from the output")

    def stream(self, call_prefix: str) -> NativeToolStream:
        """A reader of one output's deltas (the parser's streaming state is its own)."""
        return NativeToolStream(self._parser(), self._request, call_prefix)


@dataclass
class NativeToolStream:
    """One output's deltas through a vLLM tool parser's ``extract_tool_calls_streaming``."""

    parser: Any
    request: Any
    call_prefix: str
    _text: str = ""
    _token_ids: list[int] = field(default_factory=list[int])
    _named: set[int] = field(default_factory=set[int])

    def feed(self, delta: str, token_ids: Sequence[int]) -> tuple[str, list[CallPiece]]:
        """(text that is not a tool call, pieces of calls) that this delta made certain."""
        previous_text, previous_ids = self._text, list(self._token_ids)
        self._text += delta
        self._token_ids += token_ids
        try:
            message = self.parser.extract_tool_calls_streaming(
                previous_text, self._text, delta, previous_ids, list(self._token_ids), list(token_ids), self.request
            )
        except Exception:  # a parser's bug must not end the step: its finished output is read again anyway
            logger.debug("agentkv: the tool parser failed on a delta", exc_info=True)
            return "", []
        if message is None:
            return "", []
        pieces: list[CallPiece] = []
        for delta_call in message.tool_calls or ():
            function = delta_call.function
            index = delta_call.index
            name = function.name if function is not None else None
            arguments = (function.arguments or "") if function is not None else ""
            if index not in self._named:
                if not name:
                    continue  # arguments before the name: the parser resends them once the name is known
                self._named.add(index)
                pieces.append(CallPiece(index, call_id(self.call_prefix, index), name=name))
            if arguments:
                pieces.append(CallPiece(index, call_id(self.call_prefix, index), arguments=arguments))
        return message.content or "", pieces


class ReasoningSplitter:
    """A vLLM reasoning parser (by name): the model's reasoning apart from its answer."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        self.name = name
        self._class = _parser_class("reasoning", name)
        self._request = _chat_request({})
        try:  # a parser that does not fit the tokenizer (its markers are no tokens of it) fails now
            self._pristine = self._class(tokenizer)
        except Exception as exc:
            raise UserError(f"reasoning_parser {self.name!r} does not fit this model's tokenizer: {exc}") from None

    def _parser(self) -> Any:
        return _fresh(self._pristine)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, the rest) of a finished output (reasoning None: there was none)."""
        reasoning, content = self._parser().extract_reasoning(text, self._request)
        return reasoning, content or ""

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self._parser())


@dataclass
class ReasoningStream:
    """One output's deltas through a vLLM reasoning parser's ``extract_reasoning_streaming``."""

    parser: Any
    _text: str = ""
    _token_ids: list[int] = field(default_factory=list[int])

    def feed(self, delta: str, token_ids: Sequence[int]) -> tuple[str, str]:
        """(reasoning, the rest) in this delta."""
        previous_text, previous_ids = self._text, list(self._token_ids)
        self._text += delta
        self._token_ids += token_ids
        message = self.parser.extract_reasoning_streaming(
            previous_text, self._text, delta, previous_ids, list(self._token_ids), list(token_ids)
        )
        if message is None:
            return "", ""
        return message.reasoning or "", message.content or ""


@dataclass(frozen=True)
class OutputParsers:
    """The parsers a session reads its model's output with, by name, bound to the model's tokenizer (each made
    once: a session's tools rarely change)."""

    tokenizer: Any = None
    tool_call_parser: str | None = None
    """For ``tool_format="native"`` (None: `DEFAULT_TOOL_CALL_PARSER`)."""
    reasoning_parser: str | None = None
    """None: the output has no reasoning part."""
    _made: dict[str, Any] = field(default_factory=dict[str, Any], compare=False, repr=False)

    def tools(self, specs: Mapping[str, ToolSpec]) -> NativeToolParser:
        key = json.dumps(template_tools(specs), sort_keys=True, default=str)
        parser = self._made.get(key)
        if not isinstance(parser, NativeToolParser):
            parser = NativeToolParser(self.tool_call_parser or DEFAULT_TOOL_CALL_PARSER, self.tokenizer, specs)
            if len(self._made) > 16:  # tool lists that came and went
                self._made.clear()
            self._made[key] = parser
        return parser

    def reasoning(self) -> ReasoningSplitter | None:
        if not self.reasoning_parser:
            return None
        splitter = self._made.get("")
        if not isinstance(splitter, ReasoningSplitter):
            splitter = self._made[""] = ReasoningSplitter(self.reasoning_parser, self.tokenizer)
        return splitter
