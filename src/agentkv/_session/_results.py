"""What a turn returns and what streaming yields (pydantic models)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from .._conversation._conversation import Message
from .._conversation._tools import ToolCall, ToolResult
from .._stats._stats import StepStats, TurnStats

__all__ = [
    "Event",
    "Step",
    "StepEnd",
    "StepReply",
    "TextDelta",
    "ToolCallEvent",
    "ToolResultEvent",
    "TurnEnd",
    "TurnResult",
]


class Step(BaseModel):
    """One model call inside a turn."""

    model_config = ConfigDict(frozen=True)

    text: str
    """The model's output text (special tokens removed)."""
    token_ids: list[int] = Field(repr=False)
    """The output exactly as generated; the conversation keeps these ids."""
    finish_reason: str
    """``stop`` (end of answer) or ``length`` (``max_tokens`` reached)."""
    stats: StepStats
    tool_calls: list[ToolCall] = Field(default_factory=list[ToolCall])
    """Tools the model called in this step."""
    tool_results: list[ToolResult] = Field(default_factory=list[ToolResult])
    """What they returned (or why they failed), in call order."""


class TurnResult(BaseModel):
    """The outcome of `Session.run`: the final answer and every step that led to it."""

    model_config = ConfigDict(frozen=True)

    text: str
    """The final answer."""
    steps: list[Step]
    stats: TurnStats
    stop_reason: Literal["answer", "max_steps"] = "answer"
    """``max_steps``: the step bound was reached and the last step was made to answer."""


class TextDelta(BaseModel):
    """New output text of the step in progress."""

    kind: Literal["text_delta"] = "text_delta"
    turn: int
    step: int
    text: str
    token_ids: list[int] = Field(repr=False)


class StepEnd(BaseModel):
    """A model call finished."""

    kind: Literal["step_end"] = "step_end"
    step: Step


class ToolCallEvent(BaseModel):
    """The model asked for a tool call (sent before the tool runs)."""

    kind: Literal["tool_call"] = "tool_call"
    turn: int
    step: int
    call: ToolCall


class ToolResultEvent(BaseModel):
    """A tool call finished (or failed)."""

    kind: Literal["tool_result"] = "tool_result"
    turn: int
    step: int
    result: ToolResult


class TurnEnd(BaseModel):
    """The turn finished; `result` is what `Session.run` returns."""

    kind: Literal["turn_end"] = "turn_end"
    result: TurnResult


Event = Annotated[TextDelta | ToolCallEvent | ToolResultEvent | StepEnd | TurnEnd, Field(discriminator="kind")]
"""What `Session.stream` yields, in order: per step its text deltas, tool calls, tool results
and step end; then one turn end."""


class StepReply(BaseModel):
    """What `Session.step` returns: the model's next message for the caller's conversation.

    No tool has run: when the model called tools, `message` carries the calls (and `text` is
    empty); the caller runs them and sends their results back as tool messages.
    """

    model_config = ConfigDict(frozen=True)

    message: Message
    """The assistant message to append to the conversation the caller keeps."""
    finish_reason: Literal["stop", "length", "tool_calls"]
    """``tool_calls`` (the model called tools), ``stop`` (it answered) or ``length`` (``max_tokens`` reached)."""
    step: Step
    """The model call: its raw output, token ids and stats."""
    error: str | None = None
    """Why the output could not be read as an answer or as tool calls (it is then the message's text)."""

    @property
    def text(self) -> str:
        """The answer ("" when the model called tools)."""
        return self.message.content

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The tools the model called, for the caller to run."""
        return list(self.message.tool_calls)

    @property
    def stats(self) -> StepStats:
        """The model call's stats."""
        return self.step.stats
