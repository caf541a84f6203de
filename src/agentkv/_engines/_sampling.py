"""How one step samples: the engine contract's `Sampling`, the user's `SamplingOptions`, and `TokenLogprob`.

`SamplingOptions` carries every sampling setting of vLLM's OpenAI server beyond the four that a
`Session` takes by name (``max_tokens``, ``temperature``, ``seed``, ``stop``), under vLLM's names
and with vLLM's ranges, so that a request a stock ``vllm serve`` accepts means the same here.
An engine honours every field or refuses the step by name (`UserError`); it never drops one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "MAX_LOGPROBS",
    "Sampling",
    "SamplingOptions",
    "TokenLogprob",
    "format_outputs",
    "response_format_outputs",
]

MAX_LOGPROBS = 20
"""The most alternatives per token a step reports (vLLM's default ``--max-logprobs``, OpenAI's ``top_logprobs``)."""


class SamplingOptions(BaseModel):
    """Sampling settings beyond ``max_tokens``, ``temperature``, ``seed`` and ``stop`` (vLLM's names and meaning).

    The defaults change nothing: a step with ``SamplingOptions()`` samples as before.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches ``top_p``."""
    top_k: int = Field(default=0, ge=-1)
    """Sample from the ``top_k`` likeliest tokens (0 or -1: all)."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    """Drop tokens less likely than ``min_p`` times the likeliest."""
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    """Penalise tokens that already occur in the output (OpenAI's meaning)."""
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    """Penalise tokens by how often they occur in the output (OpenAI's meaning)."""
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    """Penalise tokens that occur in the prompt or the output (above 1: fewer repeats)."""
    logit_bias: dict[int, float] | None = None
    """Added to a token's logit before sampling (token id -> bias, clamped to [-100, 100] as vLLM does)."""
    min_tokens: int = Field(default=0, ge=0)
    """Generate at least this many tokens before EOS or a stop token id may end the output."""
    ignore_eos: bool = False
    """Go on after EOS (until ``max_tokens`` or a stop)."""
    stop_token_ids: tuple[int, ...] = ()
    """End the output at the first of these tokens (kept in the output, as vLLM does)."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the output in its text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output's text."""
    spaces_between_special_tokens: bool = True
    """Put spaces between special tokens in the output's text."""
    bad_words: tuple[str, ...] = ()
    """Words the output must not contain (vLLM ``bad_words``)."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Sample only among these tokens."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """Report each output token's log probability and this many likeliest alternatives (None: report none)."""
    structured_outputs: dict[str, Any] | None = None
    """Constrain the output (vLLM ``StructuredOutputsParams``: ``json``, ``json_object``, ``regex``, ``choice``,
    ``grammar``, ``structural_tag``); OpenAI's ``response_format`` becomes this (`response_format_outputs`)."""

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, value: Any) -> Any:
        if isinstance(value, dict):  # OpenAI sends token ids as JSON object keys (strings)
            return {int(k): v for k, v in value.items()}
        return value

    @field_validator("logit_bias")
    @classmethod
    def _clamp(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        return None if value is None else {k: min(100.0, max(-100.0, v)) for k, v in value.items()}

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        kinds = {"json", "json_object", "regex", "choice", "grammar", "structural_tag"}
        unknown = set(value) - kinds - {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields: {', '.join(sorted(unknown))}")
        given = [k for k in kinds if value.get(k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, json_object, regex, choice, grammar, structural_tag"
            )
        return value

    def with_updates(self, other: SamplingOptions | None) -> SamplingOptions:
        """These options with the fields ``other`` set explicitly put over them (a step's over its session's)."""
        if other is None:
            return self
        return self.model_copy(update={name: getattr(other, name) for name in other.model_fields_set})

    @property
    def history_dependent(self) -> bool:
        """Whether a token's distribution depends on the output tokens before it (not only on the prompt):
        presence and frequency penalties and multi-token bad words count the output's tokens, so the output
        cannot be continued by a second engine that sees its first tokens as prompt."""
        return bool(self.presence_penalty or self.frequency_penalty or self.bad_words)


def response_format_outputs(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as `SamplingOptions.structured_outputs`, as vLLM's server maps it
    (`format_outputs`); ``json_schema`` takes its ``json_schema.schema``, which must be an object."""
    if response_format is None:
        return None
    kind, spec = response_format.get("type"), response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if kind == "json_schema" and not isinstance(schema, dict):
        raise ValueError("response_format json_schema needs json_schema.schema (an object)")
    return format_outputs(kind, schema)


def format_outputs(kind: Any, schema: Any) -> dict[str, Any] | None:
    """An OpenAI response format (chat's ``response_format``, the Responses API's ``text.format``) as
    `SamplingOptions.structured_outputs`, as vLLM's servers map both: ``text`` (None), ``json_object`` (any JSON
    object), ``json_schema`` (``schema``; None: no schema, no constraint). Another type is a ValueError."""
    if kind not in ("text", "json_object", "json_schema"):
        raise ValueError(f"type {kind!r} is not one of text, json_object, json_schema")
    if kind == "json_object":
        return {"json_object": True}
    return {"json": schema} if kind == "json_schema" and schema is not None else None


@dataclass(frozen=True, kw_only=True)
class TokenLogprob:
    """One output token's log probability and the likeliest alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log probability) of the ``SamplingOptions.logprobs`` likeliest tokens, likeliest first."""


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How to sample one step's output."""

    max_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = None
    json_schema: dict[str, Any] | None = None
    """Force the output to match this JSON schema (vLLM structured outputs; a session's schema-forced tool calls)."""
    stop: tuple[str, ...] = ()
    """End the output at the first of these strings (vLLM ``stop``; finish reason ``"stop"``).

    The output's text ends before the stop string; its token ids are kept exactly as generated,
    up to and including the token that completed the stop string (they are what the engine
    computed, and what the next prompt must extend). vLLM ends such a request by aborting it
    (the stop string is found outside its scheduler), so a pair's D pins nothing for it: the
    step's `StepDone.pin` is None, and the next step recomputes rather than pulling back.
    """
    options: SamplingOptions = field(default_factory=SamplingOptions)

    @property
    def structured(self) -> dict[str, Any] | None:
        """The output's constraint as vLLM ``StructuredOutputsParams`` fields (the forced schema or the options')."""
        if self.json_schema is not None:
            return {"json": self.json_schema}
        return self.options.structured_outputs

    def continues_after_first_token(self) -> bool:
        """Whether an engine that gets the prompt plus this step's first token samples the rest as one engine would.

        Not when a token's distribution depends on earlier output (`SamplingOptions.history_dependent`), when the
        output is constrained (the grammar's state), nor when a seed fixes random draws (one engine draws every token
        from one generator, which a second engine cannot continue).
        """
        if self.options.history_dependent or self.structured is not None:
            return False
        return self.seed is None or self.temperature == 0.0
