"""A session's configuration, validated once and frozen: what the constructor checks and `fork` copies."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .._conversation._conversation import check_unicode
from .._conversation._mcp import MCPServer
from .._conversation._parsers import check_parser
from .._conversation._tools import Tool, ToolChoice, ToolFormat, ToolSpec, check_tools, instructions
from .._engines._sampling import SamplingOptions
from .._errors import InvalidMessageError, UserError
from ._modes import Mode

__all__ = [
    "MAX_STOP_STRINGS",
    "SESSION_OPTIONS",
    "SessionConfig",
    "check_count",
    "check_message",
    "check_stop",
    "check_structured",
    "check_text",
]

MAX_STOP_STRINGS = 4
"""The most stop strings one step takes (as OpenAI's ``stop``)."""


class SessionConfig(BaseModel):
    """Everything a session is made with, except the engine (see `Session` for each field)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", arbitrary_types_allowed=True)

    model: str | None = None
    mode: Mode | None = None
    """The mode asked for; None: what the engine supports."""
    system: str | None = None
    """The system message as given (without tool instructions)."""
    tools: dict[str, Tool] = Field(default_factory=dict[str, Tool])
    """Every tool the model is told about: the functions given, and once the session opened, its MCP servers'."""
    tool_sources: tuple[MCPServer, ...] = ()
    """The MCP servers given among the tools (their tools join `tools` when the session opens: `with_source_tools`)."""
    tool_choice: str = "auto"
    tool_format: Literal["schema", "native"] = "schema"
    tool_call_parser: str | None = None
    """vLLM's tool parser of native-format calls (None: ``hermes``; see `agentkv._conversation._parsers`)."""
    reasoning_parser: str | None = None
    """vLLM's reasoning parser that splits the reasoning from the answer (None: no reasoning part)."""
    max_steps: int = Field(default=8, ge=1)
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings of the steps whose output is not forced JSON (see `Session.step`)."""
    sampling: SamplingOptions = Field(default_factory=SamplingOptions)
    """Every other sampling setting (vLLM's names; see `SamplingOptions`)."""
    expiry_margin_s: float = Field(default=10.0, ge=0.0, allow_inf_nan=False)
    renew_pins: bool = True
    """Renew the pin while the session is idle, and repin after a stop string (`agentkv._session._pin_upkeep`);
    only engines that pin renew."""
    renew_pins_for_s: float = Field(default=3600.0, gt=0.0, allow_inf_nan=False)
    """How long after its last turn an idle session stops renewing its pin."""
    early_transfer: bool = False
    """Move the pin's KV into P's prefix cache right after each turn (`agentkv._session._pin_upkeep`)."""
    cache_salt: str | None = None
    engine_options: dict[str, Any] = Field(default_factory=dict[str, Any])

    @classmethod
    def build(
        cls,
        *,
        tools: Sequence[Tool | MCPServer | Callable[..., Any]],
        engine_options: Mapping[str, Any] | None,
        **fields: Any,
    ) -> SessionConfig:
        """Validate the constructor's arguments; every mistake is a `UserError`."""
        if fields.get("system") is not None:
            check_text(fields["system"], "the system message")
        if isinstance(tools, str | bytes) or not isinstance(tools, Sequence):
            raise UserError(f"tools must be a list of tools, not {type(tools).__name__}")
        sources = tuple(item for item in tools if isinstance(item, MCPServer))
        if len(set(map(id, sources))) != len(sources):
            raise UserError("an MCP server is given twice among the tools")
        functions = [item for item in tools if not isinstance(item, MCPServer)]
        if fields.get("sampling") is None:
            fields.pop("sampling", None)
        for kind in ("tool_call", "reasoning"):  # vLLM is imported only for a parser that is named
            if fields.get(f"{kind}_parser") is not None:
                check_parser(kind, fields[f"{kind}_parser"])  # type: ignore[arg-type]
        try:
            config = cls(
                tools=check_tools(functions), tool_sources=sources, engine_options=dict(engine_options or {}), **fields
            )
        except ValidationError as exc:
            raise UserError(_describe(exc)) from None
        check_structured(config.has_tools, config.tool_format, config.sampling)
        return config

    @property
    def has_tools(self) -> bool:
        """Whether the model is offered tools (functions, or MCP servers whose tools are listed at open)."""
        return bool(self.tools or self.tool_sources)

    def with_source_tools(self, listed: Mapping[str, Tool]) -> SessionConfig:
        """This configuration with the tools its MCP servers list now (``listed``, by name) in place of those they
        listed before; a name a function has too, or a ``tool_choice`` that names no tool, is a `UserError`."""
        functions = {name: tool for name, tool in self.tools.items() if tool.source is None}
        for name in functions.keys() & listed.keys():
            raise UserError(f"a function and an MCP tool are both named {name!r}; give the server a prefix")
        tools = {**functions, **dict(listed)}
        choice = self.tool_choice
        if choice not in ("auto", "required", "none") and choice not in tools:
            raise UserError(f"tool_choice {choice!r} is neither auto, required, none nor one of the tools")
        if choice == "required" and not tools:
            raise UserError("tool_choice='required' needs tools; the MCP servers list none")
        return self.model_copy(update={"tools": tools})

    @classmethod
    def of_options(cls, options: Mapping[str, Any], *, owner: str) -> SessionConfig:
        """`build` from a `Session`'s keyword arguments as a mapping (a pool's or an adapter's ``session_options``):
        a name that is none of them is a `TypeError`, as for an unknown keyword argument of ``owner``'s call."""
        unknown = sorted(set(options) - SESSION_OPTIONS)
        if unknown:
            raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
        fields = dict(options)
        return cls.build(tools=fields.pop("tools", ()), engine_options=fields.pop("engine_options", None), **fields)

    def with_sampling(self, **values: Any) -> SessionConfig:
        """This configuration with other sampling settings (``max_tokens``, ``temperature``, ``seed``, ``stop``:
        see `check_stop`; ``sampling``: `SamplingOptions` or a mapping, put over the session's field by field),
        checked."""
        given = {name: value for name, value in values.items() if value is not None}
        if isinstance(given.get("sampling"), Mapping):
            given["sampling"] = _options(given["sampling"])
        if "sampling" in given:  # a step's options go over its session's, field by field
            if not isinstance(given["sampling"], SamplingOptions):
                raise UserError(
                    f"sampling must be SamplingOptions or a mapping, not {type(given['sampling']).__name__}"
                )
            given["sampling"] = self.sampling.with_updates(given["sampling"])
        if not given:
            return self
        try:
            return SessionConfig(**{**{name: getattr(self, name) for name in type(self).model_fields}, **given})
        except ValidationError as exc:
            raise UserError(_describe(exc)) from None

    @field_validator("sampling", mode="before")
    @classmethod
    def _sampling_from_mapping(cls, value: Any) -> Any:
        return _options(value) if isinstance(value, Mapping) else value

    @model_validator(mode="after")
    def _consistent(self) -> SessionConfig:
        choice = self.tool_choice
        listed_later = bool(self.tool_sources)  # MCP servers' tools are known once they open: checked then
        if choice not in ("auto", "required", "none") and choice not in self.tools and not listed_later:
            raise UserError(f"tool_choice {choice!r} is neither auto, required, none nor one of the tools")
        if choice == "required" and not self.has_tools:
            raise UserError("tool_choice='required' needs tools")
        if self.tool_call_parser is not None and self.tool_format != "native":
            raise UserError("tool_call_parser= reads the model's own tool calls: it needs tool_format='native'")
        if self.tool_format == "native" and choice != "auto":
            raise UserError(
                "with tool_format='native' the model decides (tool_choice='auto'); forced calls need tool_format='schema'"
            )
        return self

    @property
    def choice(self) -> ToolChoice:
        """`tool_choice`, typed."""
        return self.tool_choice  # type: ignore[return-value]

    @property
    def format(self) -> ToolFormat:
        """`tool_format`, typed."""
        return self.tool_format

    @property
    def tool_specs(self) -> dict[str, ToolSpec]:
        """What the model is told about each tool."""
        return {name: tool.spec for name, tool in self.tools.items()}

    @property
    def tool_instructions(self) -> str:
        """What schema-format tools append to the system message ("" otherwise)."""
        return instructions(self.tool_specs) if self.tools and self.tool_format == "schema" else ""

    def system_text(self, system: str | None) -> str | None:
        """The system message the model reads: ``system`` with the tool instructions appended once."""
        extra = self.tool_instructions
        if not extra or (system is not None and system.endswith(extra)):
            return system
        return (system or "") + extra


SESSION_OPTIONS = frozenset(SessionConfig.model_fields) - {"stop", "tool_sources"}
"""The keyword arguments of `Session` besides ``engine`` (a step's ``stop`` is no session option; MCP servers come
among the ``tools``)."""


def _describe(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "argument"
    return f"{where}: {first['msg']} (got {first.get('input')!r})"


def check_text(text: object, what: str) -> str:
    """``text`` if it is a string the tokenizer can take, else `InvalidMessageError`."""
    if not isinstance(text, str):
        raise InvalidMessageError(f"{what} must be a string, not {type(text).__name__}")
    check_unicode(text, what)
    return text


def check_message(message: object) -> str:
    """A user message or an edit: a non-empty string of valid Unicode text."""
    text = check_text(message, "a message")
    if not text.strip():
        raise InvalidMessageError("a message must not be empty")
    return text


def check_stop(stop: object) -> tuple[str, ...] | None:
    """Stop strings as OpenAI takes them (a string, or a list of at most `MAX_STOP_STRINGS`), as a tuple;
    None for None. Empty strings and anything else are a `UserError`."""
    if stop is None:
        return None
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, Sequence) or isinstance(strings, bytes):
        raise UserError(f"stop must be a string or a list of strings, not {type(stop).__name__}")
    if len(strings) > MAX_STOP_STRINGS:
        raise UserError(f"stop takes at most {MAX_STOP_STRINGS} strings, not {len(strings)}")
    for string in strings:
        if not isinstance(string, str):
            raise UserError(f"a stop string must be a string, not {type(string).__name__}")
        if not string:
            raise UserError("a stop string must not be empty")
        check_text(string, "a stop string")
    return tuple(strings)


def check_count(value: object, what: str) -> int:
    """A whole number given by the caller (not a bool, not a string), else `UserError`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{what} must be an int, not {type(value).__name__}")
    return value


def _options(values: Mapping[str, Any]) -> SamplingOptions:
    """``sampling=`` given as a mapping, checked: a mistake is a `UserError` naming ``sampling.<field>``."""
    try:
        return SamplingOptions.model_validate(dict(values))
    except ValidationError as exc:
        raise UserError(f"sampling.{_describe(exc)}") from None


def check_structured(tools: bool, tool_format: str, sampling: SamplingOptions) -> None:
    """Refuse a step whose output two constraints would force: schema-format tools (a JSON schema of the answer
    and the calls) and the caller's ``sampling.structured_outputs``. Native-format tools leave the output free."""
    if tools and tool_format == "schema" and sampling.structured_outputs is not None:
        raise UserError(
            "sampling.structured_outputs: tools in tool_format='schema' already force the output to a JSON schema "
            "(an answer or tool calls); both cannot apply. Use tool_format='native' or a step without tools"
        )
