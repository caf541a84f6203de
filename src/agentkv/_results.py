"""What a turn returns and what streaming yields (pydantic models)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ._stats import StepStats, TurnStats

__all__ = ["Event", "Step", "StepEnd", "TextDelta", "TurnEnd", "TurnResult"]


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


class TurnResult(BaseModel):
    """The outcome of `Session.run`: the final answer and every step that led to it."""

    model_config = ConfigDict(frozen=True)

    text: str
    """The final answer."""
    steps: list[Step]
    stats: TurnStats


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


class TurnEnd(BaseModel):
    """The turn finished; `result` is what `Session.run` returns."""

    kind: Literal["turn_end"] = "turn_end"
    result: TurnResult


Event = Annotated[TextDelta | StepEnd | TurnEnd, Field(discriminator="kind")]
"""What `Session.stream` yields, in order: deltas and step ends, then one turn end."""
