"""The parts of `Session.step` that are not the session's bookkeeping: the request, checked once,
and the model's output read back as a message (an answer or tool calls for the caller to run)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from .._conversation._conversation import Message
from .._conversation._parsers import OutputParsers
from .._conversation._template_kwargs import template_kwargs_key
from .._conversation._tools import (
    Tool,
    ToolChoice,
    ToolSpec,
    check_tool_specs,
    instructions,
    output_schema,
)
from .._conversation._transcript import MessageLike, TranscriptKey, read_messages
from .._engines._sampling import SamplingOptions
from .._errors import UserError
from ._answer_text import OutputReader, OutputShape
from ._results import ReasoningDelta, Step, StepReply, ToolCallDelta
from ._session_config import SessionConfig, check_stop, check_structured

__all__ = ["MessageRequest", "StepOptions", "ToolsArgument", "read_reply"]

ToolsArgument = Sequence[ToolSpec | Tool | Mapping[str, Any]] | None


class StepOptions(TypedDict, total=False):
    """The keyword arguments of `Session.step` (see there)."""

    tools: ToolsArgument
    tool_choice: ToolChoice | Mapping[str, Any]
    max_tokens: int | None
    temperature: float | None
    seed: int | None
    stop: str | Sequence[str] | None
    sampling: SamplingOptions | Mapping[str, Any] | None
    chat_template_kwargs: Mapping[str, Any] | None
    on_text: Callable[[str], None] | None
    on_first_token: Callable[[], None] | None
    on_tool_call: Callable[[ToolCallDelta], None] | None
    on_reasoning: Callable[[ReasoningDelta], None] | None


@dataclass(frozen=True)
class MessageRequest:
    """One `Session.step` call, checked: the caller's messages, the tools it runs, the step's settings."""

    messages: list[Message]
    key: TranscriptKey
    tools: dict[str, ToolSpec]
    choice: ToolChoice
    config: SessionConfig
    """The session's configuration with this call's sampling settings."""
    call_prefix: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:16]}")
    """This step's tool calls are ``<call_prefix>-<index>`` (known while they stream, kept in the reply)."""

    @classmethod
    def build(cls, config: SessionConfig, messages: Sequence[MessageLike], options: StepOptions) -> MessageRequest:
        """Read `Session.step`'s messages and keyword arguments (its callbacks are not part of the request)."""
        read = read_messages(messages)
        tools = options.get("tools")
        if tools is None:
            specs = config.tool_specs
        elif isinstance(tools, str | bytes) or not isinstance(tools, Sequence):
            raise UserError(f"tools must be a list, not {type(tools).__name__}")
        else:
            specs = check_tool_specs([dict(t) if isinstance(t, Mapping) else t for t in tools])
        choice = _choice(options.get("tool_choice", "auto"), specs, config)
        system = read[0].content if read[0].role == "system" else config.system
        if specs and config.format == "schema":
            system = (system or "") + instructions(specs)
        key = TranscriptKey(
            system=system,
            tools=tuple(specs.values()),
            format=config.format,
            template_kwargs=template_kwargs_key(options.get("chat_template_kwargs")),
        )
        step_config = config.with_sampling(
            max_tokens=options.get("max_tokens"),
            temperature=options.get("temperature"),
            seed=options.get("seed"),
            stop=check_stop(options.get("stop")),
            sampling=options.get("sampling"),
        )
        check_structured(bool(specs), config.format, step_config.sampling)
        return cls(read, key, specs, choice, step_config)

    @property
    def shape(self) -> OutputShape:
        """How the model writes this step's output."""
        if not self.tools:
            return "plain"
        return "json" if self.key.format == "schema" else "native"

    def reader(self, parsers: OutputParsers) -> OutputReader:
        """How this step's output is read (``parsers``: the session's, bound to its tokenizer)."""
        shape = self.shape
        tools = parsers.tools(self.tools) if shape == "native" else None
        forced = self.choice if shape == "native" and self.choice not in ("auto", "none") else None
        return OutputReader(shape, self.call_prefix, tools=tools, reasoning=parsers.reasoning(), forced=forced)

    def step_config(self, parsers: OutputParsers) -> SessionConfig:
        """The step's configuration; a native-format step whose calls are forced (``required`` or a tool's name)
        gets what vLLM's server constrains such a step to as its structured outputs (over any of the caller's, as
        vLLM puts it over them)."""
        if self.shape != "native" or self.choice in ("auto", "none"):
            return self.config
        forced = parsers.tools(self.tools).forced_outputs(self.choice)
        sampling = self.config.sampling.model_copy(update={"structured_outputs": forced})
        return self.config.model_copy(update={"sampling": sampling})

    def json_schema(self) -> dict[str, Any] | None:
        """What the output is forced to: in schema format with tools, an answer or calls of these tools (a native
        step's forced calls are constrained as vLLM constrains them: `step_config`)."""
        if not self.tools:
            return None
        if self.key.format == "schema":
            return output_schema(self.tools, self.choice)
        return None


def _choice(choice: ToolChoice | Mapping[str, Any], tools: dict[str, ToolSpec], config: SessionConfig) -> ToolChoice:
    if isinstance(choice, Mapping):  # OpenAI's {"type": "function", "function": {"name": ...}}
        choice = str((choice.get("function") or {}).get("name", ""))
    if choice not in ("auto", "required", "none") and choice not in tools:
        raise UserError(f"tool_choice {choice!r} is neither auto, required, none nor one of the tools")
    if choice == "required" and not tools:
        raise UserError("tool_choice='required' needs tools")
    return choice


def read_reply(request: MessageRequest, step: Step, reader: OutputReader) -> StepReply:
    """The model's output as the caller's next message (calls get ids unique to this step: ``request.call_prefix``).

    With a reasoning parser the reasoning is the reply's `StepReply.reasoning`, not part of the message."""
    read = reader.read(step.text)
    if read.error is not None:
        message = Message(role="assistant", content=read.content)
        return StepReply(
            message=message, finish_reason=_finish(step), step=step, error=read.error, reasoning=read.reasoning
        )
    if read.answer is not None:
        return _answer(step, read.answer, read.reasoning)
    message = Message(role="assistant", content="", tool_calls=tuple(read.calls))
    return StepReply(message=message, finish_reason="tool_calls", step=step, reasoning=read.reasoning)


def _answer(step: Step, text: str, reasoning: str | None) -> StepReply:
    message = Message(role="assistant", content=text)
    return StepReply(message=message, finish_reason=_finish(step), step=step, reasoning=reasoning)


def _finish(step: Step) -> Any:
    return "length" if step.finish_reason == "length" else "stop"
