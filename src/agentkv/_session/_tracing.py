"""OpenTelemetry spans of a session's work: a turn (``invoke_agent``), a model step (``chat``), a tool call
(``execute_tool``), named and attributed as the GenAI semantic conventions name them, agentkv's own figures under
``agentkv.`` (src/agentkv/_stats/_telemetry.py).

Through ``opentelemetry-api`` only: agentkv configures no SDK and chooses no exporter. Without an SDK (no tracer
provider and no meter provider set: `agentkv._stats._telemetry.sdk_configured`, asked once per step, per turn and
per tool call) no span is started and no metric recorded: the callers skip `start_step`, `end_step`, the turn's
span and `tool_span`. With one, a span that does not record (a meter provider but no tracer provider, or a sampled
out trace) costs its creation, and its attributes are not even computed (`Span.is_recording`).
Spans are started with an explicit parent and ended explicitly, never made current inside an async generator (a
turn's and a step's code yields): a step's parent is its turn, or the caller's current span (a framework's agent
span, the door's request span); a tool's parent is its turn.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from .._conversation._tools import ToolCall, ToolResult
from .._engines import StepDone, StepRequest
from .._stats._stats import StepStats
from .._stats._telemetry import PROVIDER, StepMetricsRecorder, sdk_configured, step_attributes
from ._results import TurnResult

__all__ = ["TraceInfo", "TurnSpan", "end_step", "start_step", "tool_result", "tool_span"]

_tracer = trace.get_tracer("agentkv")
_metrics: StepMetricsRecorder | None = None


class TraceInfo:
    """What every span of a session names: its conversation and model (set when the session opens)."""

    __slots__ = ("attributes", "conversation_id", "model")

    def __init__(self, *, conversation_id: str, model: str) -> None:
        self.conversation_id = conversation_id
        self.model = model
        self.attributes: Mapping[str, str] = {
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": model,
            "gen_ai.conversation.id": conversation_id,
        }

    def of_conversation(self, conversation_id: str) -> TraceInfo:
        """The same model's spans for another conversation (a fork)."""
        return TraceInfo(conversation_id=conversation_id, model=self.model)


def _named(info: TraceInfo | None) -> Mapping[str, str]:
    return info.attributes if info is not None else {"gen_ai.provider.name": PROVIDER}


def _metrics_recorder() -> StepMetricsRecorder:
    global _metrics
    if _metrics is None:
        _metrics = StepMetricsRecorder()
    return _metrics


def _fail(span: Span, error: BaseException) -> None:
    if not span.is_recording():
        return
    if isinstance(error, Exception):
        span.record_exception(error)
        span.set_attribute("error.type", type(error).__qualname__)
        span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
    else:  # cancelled, abandoned, interrupted
        span.set_attribute("error.type", "cancelled")


# ----------------------------------------------------------------- turns


class TurnSpan:
    """The ``invoke_agent`` span of a turn of `Session.run` (a child of the caller's current span), and the context
    its steps and tools hang under. Ended once: with the turn's result, or with the error that ended it.

    None while the application configured no SDK (`sdk_configured`): no span, and the turn's steps and tools, should
    a provider be set during the turn, hang under the caller's current span."""

    __slots__ = ("context", "ended", "span")

    def __init__(self, span: Span | None) -> None:
        self.span = span
        self.context: otel_context.Context | None = trace.set_span_in_context(span) if span is not None else None
        self.ended = span is None

    @classmethod
    def start(cls, info: TraceInfo | None, *, turn: int, mode: str) -> TurnSpan:
        if not sdk_configured():
            return cls(None)
        span = _tracer.start_span("invoke_agent", kind=SpanKind.INTERNAL)
        if span.is_recording():
            span.set_attributes({"gen_ai.operation.name": "invoke_agent", **_named(info)})
            span.set_attributes({"agentkv.turn": turn, "agentkv.mode": mode})
        return cls(span)

    def end(self, result: TurnResult | None = None, *, error: BaseException | None = None) -> None:
        """End it: its usage summed over the turn's steps, what the session did to its pin before the turn. Once: a
        stream's consumer may stop at the turn's end, already ended."""
        if self.ended or self.span is None:
            return
        self.ended = True
        span = self.span
        if not span.is_recording():
            span.end()
            return
        if result is not None:
            stats, steps = result.stats, result.stats.steps
            span.set_attributes(
                {
                    "gen_ai.usage.input_tokens": sum(s.prompt_tokens for s in steps),
                    "gen_ai.usage.output_tokens": sum(s.output_tokens for s in steps),
                    "gen_ai.usage.cache_read.input_tokens": sum(s.local_hit_tokens + s.pulled_tokens for s in steps),
                    "agentkv.steps": len(steps),
                    "agentkv.stop_reason": result.stop_reason,
                    "agentkv.pin.renewals": stats.pin_renewals,
                    "agentkv.pin.repins": stats.repins,
                    "agentkv.pin.early_transfers": stats.early_transfers,
                }
            )
        if error is not None:
            _fail(span, error)
        span.end()


# ----------------------------------------------------------------- model steps


def start_step(
    info: TraceInfo | None, request: StepRequest, *, turn: int, step: int, parent: otel_context.Context | None
) -> Span:
    """The ``chat`` span of one model call (``parent``: its turn's context; None: the caller's current span)."""
    model = info.model if info is not None else "unknown"
    span = _tracer.start_span(f"chat {model}", context=parent, kind=SpanKind.CLIENT)
    if span.is_recording():
        sampling = request.sampling
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            **_named(info),
            "gen_ai.response.id": request.request_id,
            "gen_ai.request.max_tokens": sampling.max_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.output.type": "json" if sampling.json_schema is not None else "text",
            "agentkv.turn": turn,
            "agentkv.step": step,
            "agentkv.pin.forwarded_tokens": request.pin.tokens if request.pin is not None else 0,
        }
        if sampling.seed is not None:
            attributes["gen_ai.request.seed"] = sampling.seed
        span.set_attributes(attributes)
    return span


def end_step(
    span: Span,
    info: TraceInfo | None,
    *,
    stats: StepStats | None,
    done: StepDone | None,
    upkeep: Mapping[str, int] | None,
    error: BaseException | None,
) -> None:
    """End a step's span with its stats (and record the step's metrics); ``upkeep``: the pin's renewals, repins
    and early transfers before the step, on the first step after them."""
    if stats is not None:
        attributes = {"gen_ai.operation.name": "chat", **_named(info)}
        attributes.pop("gen_ai.conversation.id", None)  # a label of every conversation would not aggregate
        _metrics_recorder().record(stats, attributes)
    if span.is_recording() and stats is not None and done is not None:
        span.set_attributes(step_attributes(stats))
        span.set_attribute("gen_ai.response.finish_reasons", [done.finish_reason])
        if info is not None:
            span.set_attribute("gen_ai.response.model", info.model)
        if done.pin is not None:
            span.set_attribute("agentkv.pin.tokens", done.pin.tokens)
            span.set_attribute("agentkv.pin.expires_in_s", round(done.pin.expires_at - time.perf_counter(), 3))
        if upkeep:
            span.set_attributes({f"agentkv.pin.{name}": value for name, value in upkeep.items()})
    if error is not None:
        _fail(span, error)
    span.end()


# ----------------------------------------------------------------- tools


@contextmanager
def tool_span(call: ToolCall, *, kind: str, parent: otel_context.Context | None, early: bool) -> Iterator[Span]:
    """The ``execute_tool`` span of a tool call, current while the tool runs (its own spans hang under it); set its
    result with `tool_result`."""
    with _tracer.start_as_current_span(
        f"execute_tool {call.name}", context=parent, kind=SpanKind.INTERNAL, record_exception=False
    ) as span:
        if span.is_recording():
            span.set_attributes(
                {
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": call.name,
                    "gen_ai.tool.call.id": call.id,
                    "gen_ai.tool.type": kind,
                    "agentkv.tool.started_early": early,
                }
            )
        yield span


def tool_result(span: Span, result: ToolResult) -> None:
    """A tool call's outcome on its span: an error result is the span's error."""
    if result.error is not None and span.is_recording():
        span.set_attribute("error.type", result.error)
        span.set_status(Status(StatusCode.ERROR, result.content[:200]))
