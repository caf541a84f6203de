"""One turn, as named steps: model step, tool round, finish (the session prepares and commits it).

A `Turn` works on its own copy of the conversation and of the pin; nothing here touches the
session. `model_step` is one engine call on a turn's conversation and runs no tools, so a
step over caller-made messages (client-run tools) can use it as it is.
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from opentelemetry.context import Context
from opentelemetry.trace import Span

from .._conversation._conversation import Conversation, Message
from .._conversation._parsers import OutputParsers
from .._conversation._tools import (
    ToolCall,
    ToolResult,
    native_result,
    output_schema,
    result_message,
)
from .._engines import Engine, Placement, Sampling, StepDone, StepRequest, TokenDelta
from .._engines._base import Pin
from .._engines._pinning import HeldPin, choose_pin, cut_to_prompt, miss_after_step
from .._errors import ContextLengthError
from .._stats._stats import MissReason, StepStats, TurnStats
from .._stats._telemetry import sdk_configured
from ._answer_text import OutputReader, OutputShape, stream_events
from ._results import Event, Step, StepEnd, TextDelta, ToolCallEvent, ToolResultEvent, TurnEnd, TurnResult
from ._session_config import SessionConfig
from ._tool_calls import ToolRunner
from ._tracing import TraceInfo, end_step, start_step

__all__ = ["Turn", "ended_at_stop_string", "model_step", "turn_events", "upkeep_counts"]

T = TypeVar("T")


@dataclass(eq=False)
class Turn:
    """A turn in progress: its own copy of the conversation and of the pin, committed at the end."""

    number: int
    conversation: Conversation
    pin: HeldPin | None
    """The pin this turn's next step may forward (taken from the session; single use)."""
    taken_pin: HeldPin | None
    """The pin the turn took from the session (given back if the turn ends without using it)."""
    consumer: weakref.ref[Any] | None = None
    """For `Session.stream`: the caller's iterator; once it is gone, the turn is abandoned."""
    started: float = field(default_factory=time.perf_counter)
    steps: list[Step] = field(default_factory=list[Step])
    result: TurnResult | None = None
    ended: bool = False
    pin_renewals: int = 0
    """Renewals of the session's pin since the turn before (`TurnStats.pin_renewals`)."""
    repins: int = 0
    """Repins of the conversation since the turn before (`TurnStats.repins`)."""
    early_transfers: int = 0
    """Prefetches of the pin's KV into P since the turn before (`TurnStats.early_transfers`)."""
    repinnable: bool = False
    """The turn's last step ended at a stop string, so D pinned nothing although its cache holds the blocks: the
    session repins once it keeps the turn (`agentkv._session._pin_upkeep`)."""
    trace_context: Context | None = None
    """The context of the turn's ``invoke_agent`` span (`Session.run`), which its steps and tools hang under; None:
    they hang under the caller's current span (`Session.step`, or no SDK configured when the turn began)."""
    upkeep_traced: bool = False
    """Whether a step span already carries the upkeep counts (on the first step after them)."""

    def abandoned(self) -> bool:
        return self.consumer is not None and self.consumer() is None


@dataclass(frozen=True)
class StepContext:
    """What a model step needs besides the turn: the engine, the configuration, the pin rule."""

    engine: Engine
    config: SessionConfig
    push_back: bool
    discard_pin: Callable[[HeldPin], None]
    """Called with a pin that is not forwarded (it is of use to no one any more)."""
    placement: Placement = "prefill"
    """Where a pair prefills each step (``"auto"`` in the session mode of the same name)."""
    resumed: bool = False
    """The session was restored from a snapshot and has not stepped since: its first step's missing pin is the reason
    ``resumed`` (a later step of the same turn without a pin says ``no_handle``, as anywhere else)."""
    parsers: OutputParsers = field(default_factory=OutputParsers)
    """The vLLM parsers the model's output is read with (native tool calls, reasoning)."""
    trace: TraceInfo | None = None
    """What the session's spans name (its conversation and model)."""
    cut_pins: bool = False
    """A prompt that shares only a prefix with the pin gets the pin cut to the whole blocks they share
    (`cut_to_prompt`; raw-token prompts, src/agentkv/_session/_completion_api.py), rather than no pin."""


async def turn_events(turn: Turn, context: StepContext) -> AsyncGenerator[Event]:
    """The steps of a turn, as events, ending with the `TurnEnd` (nothing is committed here).

    Model step, then either the answer or a tool round and the next model step. Without
    tools every step is the last: the first one answers.
    """
    config = context.config
    choice = config.choice
    forces_json = bool(config.tools) and config.format == "schema"
    for number in range(1, config.max_steps + 1):
        last = number == config.max_steps or not config.tools
        schema = output_schema(config.tool_specs, "none" if last else choice) if forces_json else None
        step: Step | None = None
        reader = step_reader(config, context.parsers, f"t{turn.number}s{number}")
        stream = reader.stream()
        runner = ToolRunner(config.tools, parent=turn.trace_context, early=not last and choice != "none")
        try:
            async with aclosing(model_step(turn, number, context, json_schema=schema)) as step_events:
                async for step_event in step_events:
                    if isinstance(step_event, Step):
                        step = step_event
                    else:
                        yield step_event
                        pieces = stream.feed(step_event.text, step_event.token_ids)
                        runner.feed(pieces.calls)
                        for piece_event in stream_events(turn.number, number, pieces):
                            yield piece_event
            assert step is not None
            calls, answer, error = read_step(config, reader, step.text, last=last)
            if answer is not None:
                await runner.close()
                turn.steps.append(step)
                yield StepEnd(step=step)
                yield TurnEnd(result=finish(turn, config, answer))
                return
            async with aclosing(tool_round(turn, number, config, step, calls, error, runner)) as round_events:
                async for event in round_events:
                    yield event
        finally:
            await runner.close()  # calls started early that the turn never took (it failed or was abandoned)
        choice = "auto" if choice != "none" else choice  # a forced call is forced once per turn


async def model_step(
    turn: Turn, number: int, context: StepContext, *, json_schema: dict[str, Any] | None
) -> AsyncGenerator[TextDelta | Step]:
    """One engine call on the turn's conversation: text deltas, then the `Step`.

    The prompt is the turn's conversation; the output is appended to it, and the turn's pin
    is replaced by the engine's new one.
    """
    conversation, engine, config = turn.conversation, context.engine, context.config
    prompt = list(conversation.tokens)
    max_model_len = engine.info.max_model_len
    if len(prompt) >= max_model_len:
        raise ContextLengthError(
            f"the prompt has {len(prompt)} tokens; the model's context is {max_model_len}",
            prompt_tokens=len(prompt),
            max_model_len=max_model_len,
        )
    sampling = Sampling(
        max_tokens=min(config.max_tokens, max_model_len - len(prompt)),
        temperature=config.temperature,
        seed=config.seed,
        json_schema=json_schema,
        stop=config.stop if json_schema is None else (),  # a stop string would cut the forced JSON
        options=config.sampling,
    )
    held = turn.pin
    if context.cut_pins and context.push_back and held is not None and not _extends(held, prompt):
        held = cut_to_prompt(held, prompt, engine.cut_pin) or held  # the cut replaces the pin (same D request)
    pin, reason = choose_pin(held, prompt, push_back=context.push_back, expiry_margin_s=config.expiry_margin_s)
    if reason == "no_handle" and context.resumed and not turn.steps:  # the first engine call since the restore only
        reason = "resumed"
    if held is not None and pin is None:
        context.discard_pin(held)
    turn.pin = None  # a pin is single-use
    request = StepRequest(
        request_id=f"agentkv-{uuid.uuid4().hex}",
        prompt_token_ids=prompt,
        sampling=sampling,
        pin=pin,
        cache_salt=config.cache_salt,
        placement=context.placement,
    )
    span: Span | None = None
    upkeep: dict[str, int] | None = None
    if sdk_configured():  # else no span, no metrics: nothing would record them
        span = start_step(context.trace, request, turn=turn.number, step=number, parent=turn.trace_context)
        upkeep = None if turn.upkeep_traced else upkeep_counts(turn)
        turn.upkeep_traced = True
    started = time.perf_counter()
    done: StepDone | None = None
    try:
        async with _closing(engine.step(request)) as events:
            async for event in events:
                if isinstance(event, TokenDelta):
                    yield TextDelta(
                        turn=turn.number,
                        step=number,
                        text=event.text,
                        token_ids=list(event.token_ids),
                        logprobs=None if event.logprobs is None else list(event.logprobs),
                    )
                else:
                    done = event
        assert done is not None
        stats = _step_stats(turn.number, number, prompt, pin, reason, done, time.perf_counter() - started)
    except BaseException as exc:
        if span is not None:
            end_step(span, context.trace, stats=None, done=done, upkeep=None, error=exc)
        raise
    if span is not None:
        end_step(span, context.trace, stats=stats, done=done, upkeep=upkeep, error=None)
    conversation.add_output(done.token_ids, done.text)
    if done.pin is not None:
        turn.pin = HeldPin(done.pin, prompt + list(done.token_ids))
    turn.repinnable = ended_at_stop_string(done, sampling)
    yield Step(
        text=done.text,
        token_ids=list(done.token_ids),
        finish_reason=done.finish_reason,
        logprobs=None if done.logprobs is None else list(done.logprobs),
        stats=stats,
    )


def _extends(held: HeldPin, prompt: list[int]) -> bool:
    kept = held.pin.tokens
    return kept <= len(held.token_ids) and len(prompt) > kept and prompt[:kept] == held.token_ids[:kept]


async def tool_round(
    turn: Turn,
    number: int,
    config: SessionConfig,
    step: Step,
    calls: list[ToolCall],
    error: str | None,
    runner: ToolRunner,
) -> AsyncGenerator[Event]:
    """Run a step's tool calls (those started while the step streamed give their results; see `ToolRunner`), or
    report its malformed output, then append the results."""
    for call in calls:
        yield ToolCallEvent(turn=turn.number, step=number, call=call)
    started = time.perf_counter()
    if error is None:
        results = await runner.results(calls)
    else:
        await runner.close()
        call_id = f"t{turn.number}s{number}"
        results = [ToolResult(call_id=call_id, name="agentkv", content=f"error: {error}", error="malformed_output")]
    for result in results:
        yield ToolResultEvent(turn=turn.number, step=number, result=result)
    tool_s = time.perf_counter() - min(started, runner.first_start or started)
    done = step.model_copy(
        update={"tool_calls": calls, "tool_results": results, "stats": step.stats.model_copy(update={"tool_s": tool_s})}
    )
    turn.steps.append(done)
    yield StepEnd(step=done)
    turn.conversation.add_messages(
        [Message(role="tool", name=r.name, content=_tool_message(config, r)) for r in results]
    )


def finish(turn: Turn, config: SessionConfig, answer: str) -> TurnResult:
    """The turn's result (kept on the turn until the session commits it)."""
    wall_s = time.perf_counter() - turn.started
    stats = TurnStats(turn=turn.number, steps=[s.stats for s in turn.steps], wall_s=wall_s, **upkeep_counts(turn))
    bounded = bool(config.tools) and config.max_steps > 1 and len(turn.steps) == config.max_steps
    stop_reason: Literal["answer", "max_steps"] = "max_steps" if bounded else "answer"
    turn.result = TurnResult(text=answer, steps=list(turn.steps), stats=stats, stop_reason=stop_reason)
    return turn.result


def upkeep_counts(turn: Turn) -> dict[str, int]:
    """The `TurnStats` counts of what the session did to its pin before ``turn`` (`agentkv._session._pin_upkeep`)."""
    return {"pin_renewals": turn.pin_renewals, "repins": turn.repins, "early_transfers": turn.early_transfers}


def ended_at_stop_string(done: StepDone, sampling: Sampling) -> bool:
    """Whether a step ended at one of its stop strings with no pin, its blocks still in D's prefix cache: vLLM's
    front end aborts such a request, and D pins nothing (a step that had a pin evicted or a malformed one is not)."""
    return (
        done.stopped_by_string
        and bool(sampling.stop)
        and done.finish_reason == "stop"
        and done.pin is None
        and done.pin_error is None
        and not done.timings.pin_evicted
    )


def step_reader(config: SessionConfig, parsers: OutputParsers, call_prefix: str) -> OutputReader:
    """How a step of `Session.run` is read: in the session's tool format, its reasoning apart."""
    shape: OutputShape = "plain" if not config.tools else "json" if config.format == "schema" else "native"
    tools = parsers.tools(config.tool_specs) if shape == "native" else None
    return OutputReader(shape, call_prefix, tools=tools, reasoning=parsers.reasoning())


def read_step(
    config: SessionConfig, reader: OutputReader, text: str, *, last: bool
) -> tuple[list[ToolCall], str | None, str | None]:
    """(tool calls, answer, error) from a step's output, in the session's tool format (its reasoning left out)."""
    read = reader.read(text)
    if not config.tools:
        return [], read.content if reader.reasoning is not None else text, None
    if last and read.answer is None:  # the step bound: whatever the last step said is the answer; no calls run
        return [], read.content.strip(), None
    return read.calls, read.answer, read.error


def _tool_message(config: SessionConfig, result: ToolResult) -> str:
    """A tool result as the model reads it: raw content for native templates (a lone surrogate escaped, as
    JSON escapes it), JSON for schema mode. A tool's output is not the caller's text: it is never refused."""
    return native_result(result) if config.format == "native" else result_message(result)


@asynccontextmanager
async def _closing(events: AsyncIterator[T]) -> AsyncGenerator[AsyncIterator[T]]:
    """`aclosing` for any async iterator: an engine's step is stopped as soon as the turn stops."""
    try:
        yield events
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def _step_stats(
    turn: int,
    number: int,
    prompt: list[int],
    pin: Pin | None,
    reason: MissReason | None,
    done: StepDone,
    duration_s: float,
) -> StepStats:
    timings = done.timings
    return StepStats(
        turn=turn,
        step=number,
        prompt_tokens=len(prompt),
        output_tokens=len(done.token_ids),
        handle_forwarded=pin is not None,
        miss_reason=miss_after_step(
            pin,
            reason,
            prompt_tokens=len(prompt),
            local_hit_tokens=timings.local_hit_tokens,
            pulled_tokens=timings.pulled_tokens,
            declined=timings.pin_declined,
            placed_on_decode=timings.prefill_engine == "decode",
            evicted=timings.pin_evicted,
        ),
        duration_s=duration_s,
        **timings.stats_fields(),
    )
