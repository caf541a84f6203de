"""Tools: `@tool` turns a typed Python function into something the model can call.

The JSON schema of a tool's arguments comes from its signature (pydantic) and its
docstring (the first paragraph describes the tool; an ``Args:`` section, Google style,
describes the parameters). Arguments are validated before the call. A mistake in the
definition (a parameter without a type, ``*args``) raises `UserError` at declaration.
"""

from __future__ import annotations

import inspect
import json
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import anyio
import anyio.to_thread
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator
from pydantic_core import to_jsonable_python

from .._errors import UserError

__all__ = [
    "Tool",
    "ToolCall",
    "ToolChoice",
    "ToolFormat",
    "ToolOutput",
    "ToolResult",
    "ToolSpec",
    "check_tool_specs",
    "check_tools",
    "run_tool_call",
    "tool",
    "unwrapped_arguments",
]

ToolChoice = Literal["auto", "required", "none"] | str
"""``"auto"`` (the model decides), ``"required"`` (the first step must call a tool),
``"none"`` (no tools this turn) or a tool's name (the first step must call that tool)."""

ToolFormat = Literal["schema", "native"]
"""How tool calls are made: ``"schema"`` (default: the output is forced to JSON by vLLM
structured outputs, so any model makes calls that parse) or ``"native"`` (the model's own
chat-template tool support; calls are read by a vLLM tool parser, ``hermes`` unless the session
names another: `agentkv._conversation._parsers`)."""

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class ToolCall(BaseModel):
    """A call the model asked for."""

    model_config = ConfigDict(frozen=True)

    id: str
    name: str
    arguments: dict[str, Any]
    raw_arguments: str | None = Field(default=None, repr=False)
    """The arguments' JSON text as it was read from the model's output: the model's own text in the schema format,
    the text of vLLM's tool parser for native calls, as ``vllm serve`` returns it (a model not trained for tools
    may write no JSON object where vLLM's grammar lets it: `arguments` is then ``{}``). What OpenAI's
    ``function.arguments`` carries, streamed or not; None for a call made from a dict (`arguments_json`)."""

    def __eq__(self, other: object) -> bool:
        """Equal by id, name and the arguments' value: the same call written with other spacing is the same call
        (a client may send the arguments back re-serialized, and vLLM's server reads them as a value too)."""
        if not isinstance(other, ToolCall):
            return NotImplemented
        return (self.id, self.name, self._value()) == (other.id, other.name, other._value())

    def __hash__(self) -> int:
        return hash((self.id, self.name))

    def _value(self) -> object:
        if self.raw_arguments is None:
            return self.arguments
        try:
            return unwrapped_arguments(json.loads(self.raw_arguments))
        except json.JSONDecodeError:
            return self.raw_arguments

    @property
    def arguments_json(self) -> str:
        """The arguments as OpenAI's ``function.arguments`` carries them (JSON text)."""
        return self.raw_arguments if self.raw_arguments is not None else json.dumps(self.arguments)


def unwrapped_arguments(value: object) -> object:
    """A call's arguments as a value: an object the model wrote as a JSON *string* (``"{\\"a\\": 1}"``, which vLLM's
    parsers hand out as the string's text) is that object, as agentkv reads the call (`ToolCall.arguments`)."""
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except json.JSONDecodeError:
            return value
        if isinstance(inner, dict):
            return inner
    return value


class ToolResult(BaseModel):
    """What a tool call returned, or why it failed (the model sees either)."""

    model_config = ConfigDict(frozen=True)

    call_id: str
    name: str
    content: str
    """The result as the model sees it: JSON, or the error message."""
    error: str | None = None
    """``invalid_arguments``, ``unknown_tool``, ``raised``, ``timeout``, ``unserializable``, or ``error_result`` (the
    tool said its call failed: an MCP tool's result with ``isError``)."""
    duration_s: float = 0.0


class ToolSpec(BaseModel):
    """What the model is told about a tool: its name, description and JSON schema of arguments.

    A `Tool` has one (``tool.spec``). On its own it describes a tool that the caller runs
    (`Session.step`): the model may call it, and the call comes back to the caller.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    @field_validator("name")
    @classmethod
    def _identifier(cls, name: str) -> str:
        if not _NAME.match(name):
            raise ValueError(f"tool name {name!r} must be a Python-style identifier")
        return name

    @classmethod
    def from_openai(cls, data: dict[str, Any]) -> ToolSpec:
        """From an OpenAI tool (``{"type": "function", "function": {...}}``) or its ``function`` part."""
        function = data.get("function", data) if data.get("type", "function") == "function" else None
        if not isinstance(function, dict):
            raise UserError(f"only function tools are supported, not {data.get('type')!r}")
        try:
            return cls.model_validate({k: v for k, v in function.items() if k in ("name", "description", "parameters")})
        except ValidationError as exc:
            raise UserError(f"tool {function.get('name')!r}: {exc.errors()[0]['msg']}") from None

    def signature_line(self) -> str:
        """``name(arg: type, ...): description``, for the model's instructions."""
        properties = self.parameters.get("properties", {})
        arguments = ", ".join(f"{key}: {value.get('type', 'any')}" for key, value in properties.items())
        return f"{self.name}({arguments}): {self.description}"


@dataclass(frozen=True)
class ToolOutput:
    """What a tool made from a schema returns (`Tool.of_schema`): the text the model reads, and whether it says
    that the call failed."""

    content: str
    error: bool = False


class Tool:
    """A function the model can call, with its name, description and argument schema.

    Made from a typed Python function (``@tool``), or from a schema and a call another program serves
    (`of_schema`: an MCP server's tools).
    """

    source: object | None = None
    """Where a tool made from a schema comes from (an `agentkv.mcp.MCPServer`); None for a Python function."""
    _remote: Callable[[dict[str, Any]], Awaitable[ToolOutput]] | None = None

    def __init__(
        self,
        function: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.function = function
        self.name = name or function.__name__
        if not _NAME.match(self.name):
            raise UserError(f"tool name {self.name!r} must be a Python-style identifier")
        summary, argument_docs = _parse_docstring(inspect.getdoc(function) or "")
        self.description = description or summary
        if not self.description:
            raise UserError(f"tool {self.name!r} needs a description: a docstring or description=")
        self.timeout_s = timeout_s
        self.is_async = inspect.iscoroutinefunction(function)
        self._arguments: type[BaseModel] | None = _arguments_model(function, self.name, argument_docs)
        self.parameters: dict[str, Any] = self._arguments.model_json_schema()
        """JSON schema of the arguments."""
        self.spec = ToolSpec(name=self.name, description=self.description, parameters=self.parameters)
        """What the model is told about this tool."""

    @classmethod
    def of_schema(
        cls,
        spec: ToolSpec,
        call: Callable[[dict[str, Any]], Awaitable[ToolOutput]],
        *,
        timeout_s: float,
        source: object,
    ) -> Tool:
        """A tool whose arguments ``spec`` describes and ``call`` takes as they come (the program that serves it
        checks them); its results are what ``call`` returns."""
        made = cls.__new__(cls)

        async def function(**arguments: Any) -> ToolOutput:
            return await call(arguments)

        made.function = function
        made.name, made.description, made.timeout_s, made.is_async = spec.name, spec.description, timeout_s, True
        made._arguments = None
        made.parameters = spec.parameters
        made.spec = spec
        made.source = source
        made._remote = call
        return made

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Validated keyword arguments; raises pydantic's ValidationError (a tool made from a schema: as given)."""
        if self._arguments is None:
            return dict(arguments)
        return dict(self._arguments.model_validate(arguments))

    async def invoke(self, arguments: dict[str, Any]) -> Any:
        """Call the tool (a sync one in a worker thread, so the event loop keeps serving)."""
        if self._remote is not None:
            return await self._remote(arguments)
        if self.is_async:
            return await self.function(**arguments)
        return await anyio.to_thread.run_sync(lambda: self.function(**arguments), abandon_on_cancel=True)


@overload
def tool(function: Callable[..., Any], /) -> Tool: ...
@overload
def tool(
    *, name: str | None = None, description: str | None = None, timeout_s: float = 60.0
) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(
    function: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float = 60.0,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a function (sync or async) a tool: ``@tool`` or ``@tool(name=..., description=..., timeout_s=...)``."""
    if function is not None:
        return Tool(function)

    def decorate(inner: Callable[..., Any]) -> Tool:
        return Tool(inner, name=name, description=description, timeout_s=timeout_s)

    return decorate


def check_tools(tools: Sequence[Tool | Callable[..., Any]]) -> dict[str, Tool]:
    """Tools by name; plain functions are wrapped; duplicate names raise `UserError`."""
    by_name: dict[str, Tool] = {}
    for item in tools:
        wrapped = item if isinstance(item, Tool) else Tool(item)
        if wrapped.name in by_name:
            raise UserError(f"two tools are named {wrapped.name!r}")
        _check_spec_text(wrapped.spec)
        by_name[wrapped.name] = wrapped
    return by_name


def check_tool_specs(tools: Sequence[ToolSpec | Tool | dict[str, Any]]) -> dict[str, ToolSpec]:
    """Specs by name from specs, tools or OpenAI tool dicts; duplicate names raise `UserError`."""
    by_name: dict[str, ToolSpec] = {}
    for item in tools:
        if isinstance(item, Tool):
            spec = item.spec
        elif isinstance(item, ToolSpec):
            spec = item
        elif isinstance(item, dict):
            spec = ToolSpec.from_openai(item)
        else:
            raise UserError(f"a tool must be a ToolSpec, a Tool or an OpenAI tool dict, not {type(item).__name__}")
        if spec.name in by_name:
            raise UserError(f"two tools are named {spec.name!r}")
        by_name[spec.name] = _check_spec_text(spec)
    return by_name


def _check_spec_text(spec: ToolSpec) -> ToolSpec:
    """``spec``, if its text can reach the model: a lone surrogate (no tokenizer takes it) is a `UserError`."""
    try:
        json.dumps(spec.model_dump(), ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(
            f"tool {spec.name!r}: its description or parameters are not valid Unicode text ({exc.reason})"
        ) from None
    return spec


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The first paragraph, and ``name: description`` lines of an ``Args:`` section."""
    summary = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    described: dict[str, str] = {}
    match = re.search(r"^\s*(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
    if match:
        for line in match.group(1).splitlines():
            found = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.+)", line)
            if found:
                described[found.group(1)] = found.group(2).strip()
    return summary, described


def _arguments_model(function: Callable[..., Any], name: str, described: dict[str, str]) -> type[BaseModel]:
    try:
        hints = inspect.get_annotations(function, eval_str=True)
    except Exception as exc:
        raise UserError(f"tool {name!r}: its type hints cannot be resolved: {exc}") from exc
    fields: dict[str, Any] = {}
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise UserError(f"tool {name!r}: *args and **kwargs cannot be described to a model")
        if parameter.name not in hints:
            raise UserError(f"tool {name!r}: parameter {parameter.name!r} needs a type hint")
        default = ... if parameter.default is parameter.empty else parameter.default
        fields[parameter.name] = (hints[parameter.name], Field(default, description=described.get(parameter.name)))
    return create_model(f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)


# ----------------------------------------------------------------- the call protocol


def instructions(tools: Mapping[str, ToolSpec]) -> str:
    """The text that tells the model its tools and how to call them (appended to the system message)."""
    lines = "\n".join(f"- {t.signature_line()}" for t in tools.values())
    return (
        "\n\nYou can call tools:\n" + lines + '\nTo call tools reply with JSON {"tool_calls": [{"name": ..., '
        '"arguments": {...}}]}. Tool results come back as tool messages. To answer the user reply with JSON '
        '{"answer": "..."}.'
    )


def template_tools(tools: Mapping[str, ToolSpec]) -> list[dict[str, Any]]:
    """The tools as chat templates take them (``apply_chat_template(..., tools=...)``)."""
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in tools.values()
    ]


def output_schema(tools: Mapping[str, ToolSpec], choice: ToolChoice) -> dict[str, Any]:
    """The JSON schema the model's output is forced to (vLLM structured outputs) for this step."""
    answer = {
        "type": "object",
        "properties": {"answer": {"type": "string"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    if choice == "none" or not tools:
        return answer
    chosen = [tools[choice]] if choice in tools else list(tools.values())
    definitions: dict[str, Any] = {}
    """Each tool's ``$defs`` (nested argument types), hoisted to the root its ``#/$defs/...`` refs now point at."""
    for t in chosen:
        for name, schema in t.parameters.get("$defs", {}).items():
            if definitions.setdefault(name, schema) != schema:
                raise UserError(f"two tools define the argument type {name!r} differently; rename one of them")
    call_variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.name},
                "arguments": {key: value for key, value in t.parameters.items() if key != "$defs"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    calls = {
        "type": "object",
        "properties": {
            "tool_calls": {"type": "array", "minItems": 1, "maxItems": 8, "items": {"anyOf": call_variants}}
        },
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    schema = {"anyOf": [calls, answer]} if choice == "auto" else calls
    return {**schema, "$defs": definitions} if definitions else schema


async def run_tool_call(call: ToolCall, tools: Mapping[str, Tool]) -> ToolResult:
    """Run one call under its tool's timeout; every failure becomes a result (the model reads it)."""
    started = time.perf_counter()

    def result(content: str, error: str | None = None) -> ToolResult:
        return ToolResult(
            call_id=call.id, name=call.name, content=content, error=error, duration_s=time.perf_counter() - started
        )

    found = tools.get(call.name)
    if found is None:
        return result(f"error: unknown tool {call.name!r}; the tools are {', '.join(tools)}", "unknown_tool")
    try:
        arguments = found.validate(call.arguments)
    except ValidationError as exc:
        details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return result(f"error: invalid arguments for {call.name}: {details}", "invalid_arguments")
    try:
        with anyio.fail_after(found.timeout_s):
            value = await found.invoke(arguments)
    except TimeoutError:
        return result(f"error: {call.name} timed out after {found.timeout_s} s", "timeout")
    except Exception as exc:  # a failing tool is the model's problem to handle, not the turn's
        return result(f"error: {call.name} raised {type(exc).__name__}: {exc}", "raised")
    if isinstance(value, ToolOutput):
        return result(value.content, "error_result" if value.error else None)
    try:
        content = value if isinstance(value, str) else json.dumps(to_jsonable_python(value))
    except Exception as exc:
        return result(
            f"error: {call.name} returned a {type(value).__name__}, which cannot be serialized: {exc}", "unserializable"
        )
    return result(content)


def native_result(result: ToolResult) -> str:
    """The tool message content the model reads in the native format: the tool's text as it is, but a lone
    surrogate (which no tokenizer takes) written as `result_message`'s JSON writes it (``\\ud800``)."""
    return result.content.encode("utf-8", "backslashreplace").decode("utf-8")


def result_message(result: ToolResult) -> str:
    """The tool message content the model reads (schema format: JSON, so any text is escaped)."""
    return (
        json.dumps({"name": result.name, "result": result.content})
        if result.error is None
        else json.dumps({"name": result.name, "error": result.content})
    )
