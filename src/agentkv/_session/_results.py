"""What a turn returns and what streaming yields (pydantic models)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from .._conversation._conversation import Message
from .._conversation._tools import ToolCall, ToolResult
from .._engines._sampling import TokenLogprob
from .._stats._stats import StepStats, TurnStats

__all__ = [
    "Event",
    "ReasoningDelta",
    "Step",
    "StepEnd",
    "StepReply",
    "TextDelta",
    "TextPiece",
    "ToolCallDelta",
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
    logprobs: list[TokenLogprob] | None = Field(default=None, repr=False)
    """One per output token when the step asked for them (`SamplingOptions.logprobs`), else None."""
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


class _StepEvent(BaseModel):
    """What every event of a step in progress says first: its kind, then the turn's and the step's numbers."""

    kind: str
    turn: int
    step: int


class TextDelta(_StepEvent):
    """New output text of the step in progress."""

    kind: Literal["text_delta"] = "text_delta"
    text: str
    token_ids: list[int] = Field(repr=False)
    logprobs: list[TokenLogprob] | None = Field(default=None, repr=False)
    """One per token of `token_ids` when the step asked for them (`SamplingOptions.logprobs`), else None."""


class TextPiece(str):
    """A piece of a step's answer as `Session.step(on_text=...)` and `SessionPool.stream` give it: a `str`, and
    when the step asked for log probabilities (`SamplingOptions.logprobs`), `logprobs` holds those of the output
    tokens generated since the previous piece (the rest are in `Step.logprobs` only)."""

    logprobs: tuple[TokenLogprob, ...]

    def __new__(cls, text: str, logprobs: Sequence[TokenLogprob] = ()) -> TextPiece:
        return super().__new__(cls, text)

    def __init__(self, text: str, logprobs: Sequence[TokenLogprob] = ()) -> None:
        super().__init__()
        self.logprobs = tuple(logprobs)


class ToolCallDelta(_StepEvent):
    """A piece of a tool call while the model writes it: the call's id and name first (once), then its arguments'
    JSON text as it grows. A call's ``arguments`` pieces, joined, are its arguments as written (the finished call's
    `ToolCall.arguments`, parsed)."""

    kind: Literal["tool_call_delta"] = "tool_call_delta"
    index: int
    """The call's position among the step's calls (as in OpenAI's streamed ``tool_calls[].index``)."""
    id: str
    """The call's id: the same as the finished `ToolCall.id`."""
    name: str | None = None
    """The tool's name, on the call's first delta only."""
    arguments: str = ""
    """The next piece of the arguments' text ("" on the first delta)."""


class ReasoningDelta(_StepEvent):
    """New reasoning text of the step in progress (with a ``reasoning_parser``; not part of the answer)."""

    kind: Literal["reasoning_delta"] = "reasoning_delta"
    text: str


class StepEnd(BaseModel):
    """A model call finished."""

    kind: Literal["step_end"] = "step_end"
    step: Step


class ToolCallEvent(_StepEvent):
    """The model asked for a tool call (sent before the tool runs)."""

    kind: Literal["tool_call"] = "tool_call"
    call: ToolCall


class ToolResultEvent(_StepEvent):
    """A tool call finished (or failed)."""

    kind: Literal["tool_result"] = "tool_result"
    result: ToolResult


class TurnEnd(BaseModel):
    """The turn finished; `result` is what `Session.run` returns."""

    kind: Literal["turn_end"] = "turn_end"
    result: TurnResult


Event = Annotated[
    TextDelta | ReasoningDelta | ToolCallDelta | ToolCallEvent | ToolResultEvent | StepEnd | TurnEnd,
    Field(discriminator="kind"),
]
"""What `Session.stream` yields, in order: per step its text deltas (each followed by the reasoning and tool-call
pieces it made certain), tool calls, tool results and step end; then one turn end."""


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
    reasoning: str | None = None
    """The model's reasoning, apart from its answer (with a ``reasoning_parser``; None: none was found)."""

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
