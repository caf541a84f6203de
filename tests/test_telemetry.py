"""OpenTelemetry on doubles: the spans of turns, steps and tools, their attributes and parents, the door continuing
its caller's trace, and the step metrics that OpenTelemetry and the door's Prometheus page read from one table.
The same spans on the real pair: tests/test_pair_observability.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry import propagate, trace

from agentkv import EngineError, Session, SessionPool, tool
from agentkv._engines._system import free_port
from agentkv._stats._telemetry import STEP_METRICS, step_attributes
from agentkv.engines import StepRequest
from agentkv.serve import FrontDoor
from agentkv.testing import HonestPairEngine
from scripted import Script, answer, calls
from spans import Recorded, parent_of, recording

_app = trace.get_tracer("the-application")


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def broken(a: int, b: int) -> int:
    """Always fails."""
    raise RuntimeError(f"no {a} + {b}")


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    with recording() as spans:
        yield spans


def test_a_tool_turn_is_a_turn_span_over_its_step_and_tool_spans(recorded: Recorded) -> None:
    script = Script(calls((1, 2)), answer("3."), answer("Bye."))
    with HonestPairEngine(script) as engine, _app.start_as_current_span("app") as app:
        with Session(engine=engine, tools=[add], max_tokens=64) as session:  # a loop of its own: another thread
            first = session.run_sync("1 + 2?")
            second = session.run_sync("Thanks.")
    turns = recorded.named("invoke_agent")
    chats = recorded.named("chat ")
    (tool_span,) = recorded.named("execute_tool")
    assert [parent_of(t) for t in turns] == [app.get_span_context().span_id] * 2  # carried across the loop's thread
    assert {t.context.trace_id for t in recorded.spans} == {app.get_span_context().trace_id}
    turn_ids = [t.context.span_id for t in turns]
    assert [parent_of(c) for c in chats] == [turn_ids[0], turn_ids[0], turn_ids[1]]
    assert parent_of(tool_span) == turn_ids[0]
    steps = [*first.steps, *second.steps]
    tool_attributes = dict(tool_span.attributes or {})
    assert isinstance(tool_attributes.pop("agentkv.tool.started_early"), bool)  # tests/test_early_tool_calls.py
    assert tool_attributes == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "add",
        "gen_ai.tool.call.id": steps[0].tool_calls[0].id,
        "gen_ai.tool.type": "function",
    }
    for chat, step in zip(chats, steps, strict=True):
        attributes = dict(chat.attributes or {})
        stats = step.stats
        assert chat.name == f"chat {attributes['gen_ai.request.model']}"
        assert chat.kind is trace.SpanKind.CLIENT
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.provider.name"] == "vllm"
        assert attributes["gen_ai.response.finish_reasons"] == (step.finish_reason,)
        assert attributes["gen_ai.usage.input_tokens"] == stats.prompt_tokens
        assert attributes["gen_ai.usage.output_tokens"] == stats.output_tokens
        assert attributes["gen_ai.usage.cache_read.input_tokens"] == stats.local_hit_tokens + stats.pulled_tokens
        assert attributes["gen_ai.response.time_to_first_chunk"] == stats.ttft_s
        assert attributes["agentkv.tokens.pulled"] == stats.pulled_tokens
        assert attributes["agentkv.tokens.computed"] == stats.computed_tokens
        assert attributes.get("agentkv.miss_reason") == stats.miss_reason
        assert attributes["gen_ai.conversation.id"] == dict(turns[0].attributes or {})["gen_ai.conversation.id"]
        assert attributes["agentkv.pin.tokens"] > 0 and attributes["agentkv.pin.expires_in_s"] > 0
        assert stats.duration_s is not None and stats.duration_s >= stats.ttft_s
    assert dict(chats[0].attributes or {})["agentkv.miss_reason"] == "no_handle"
    assert dict(chats[2].attributes or {})["gen_ai.usage.cache_read.input_tokens"] > 0  # turn 2 pulled D's KV
    assert dict(turns[1].attributes or {})["gen_ai.usage.cache_read.input_tokens"] == sum(
        s.stats.local_hit_tokens + s.stats.pulled_tokens for s in second.steps
    )
    assert dict(turns[0].attributes or {})["agentkv.steps"] == 2


def test_step_spans_carry_what_step_attributes_reads() -> None:
    """Every agentkv figure of a step's stats is on its span, under the names the docs list."""
    from agentkv import StepStats

    stats = StepStats(
        turn=1, step=1, ttft_s=0.5, prompt_tokens=10, output_tokens=3, local_hit_tokens=2, pulled_tokens=5,
        computed_tokens=3, kv_bytes=100, kv_transfer_s=0.01, prefill_engine="decode", miss_reason=None,
    )  # fmt: skip
    attributes = step_attributes(stats)
    assert attributes["agentkv.placement"] == "D" and attributes["gen_ai.usage.cache_read.input_tokens"] == 7
    assert attributes["agentkv.kv.bytes"] == 100 and attributes["agentkv.kv.transfer_s"] == 0.01
    assert "agentkv.miss_reason" not in attributes


def test_steps_the_caller_runs_hang_under_its_span_with_the_pools_conversation_id(recorded: Recorded) -> None:
    script = Script(calls((1, 2)), answer("3."))
    history: list[Any] = [{"role": "user", "content": "1 + 2?"}]
    with HonestPairEngine(script) as engine, SessionPool(engine=engine, max_tokens=64) as pool:
        with _app.start_as_current_span("agent") as agent:
            reply = pool.step_sync(history, conversation_id="conv-7", tools=[add])
            call = reply.tool_calls[0]
            history += [reply.message.chat_dict(), {"role": "tool", "tool_call_id": call.id, "content": "3"}]
            pool.step_sync(history, conversation_id="conv-7", tools=[add])
    chats = recorded.named("chat ")
    assert len(chats) == 2 and not recorded.named("invoke_agent") and not recorded.named("execute_tool")
    assert {parent_of(c) for c in chats} == {agent.get_span_context().span_id}
    assert {dict(c.attributes or {})["gen_ai.conversation.id"] for c in chats} == {"conv-7"}
    assert [dict(c.attributes or {})["agentkv.step"] for c in chats] == [1, 2]


def test_a_failed_step_and_a_failed_tool_say_why(recorded: Recorded) -> None:
    script = Script(calls((1, 2), tool="broken"), answer("It failed."))
    with HonestPairEngine(script) as engine, Session(engine=engine, tools=[broken], max_tokens=64) as session:
        session.run_sync("Try it.")
        engine.inject("error")
        with pytest.raises(EngineError):
            session.run_sync("Again.")
    (failed_tool,) = recorded.named("execute_tool")
    assert dict(failed_tool.attributes or {})["error.type"] == "raised"
    assert failed_tool.status.status_code is trace.StatusCode.ERROR
    failed_step = recorded.named("chat ")[-1]
    assert dict(failed_step.attributes or {})["error.type"] == "EngineError"
    assert failed_step.status.status_code is trace.StatusCode.ERROR
    failed_turn = recorded.named("invoke_agent")[-1]
    assert dict(failed_turn.attributes or {})["error.type"] == "EngineError"


def respond(request: StepRequest) -> str:
    return "A plain answer." if request.sampling.json_schema is None else answer("A forced answer.")


@pytest.fixture(scope="module")
def door() -> Iterator[tuple[str, SessionPool]]:
    with HonestPairEngine(respond) as engine, SessionPool(engine=engine, max_tokens=32) as pool:
        with FrontDoor(pool, model_name="smol", port=free_port()) as opened:
            yield opened.url, pool


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_the_door_continues_the_callers_trace(recorded: Recorded, door: tuple[str, SessionPool], stream: bool) -> None:
    headers: dict[str, str] = {}
    with _app.start_as_current_span("client") as client:
        propagate.inject(headers)  # traceparent (and tracestate), as an instrumented client sends them
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hello"}], "stream": stream}
    response = httpx.post(door[0] + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 200
    (server,) = recorded.named("POST")
    assert server.name == "POST /v1/chat/completions" and server.kind is trace.SpanKind.SERVER
    assert server.context.trace_id == client.get_span_context().trace_id
    assert parent_of(server) == client.get_span_context().span_id
    assert dict(server.attributes or {})["http.response.status_code"] == 200
    (chat,) = recorded.named("chat ")
    assert parent_of(chat) == server.context.span_id  # the pool's loop runs in another thread


def test_a_request_without_traceparent_starts_a_trace_and_a_bad_one_is_ignored(
    recorded: Recorded, door: tuple[str, SessionPool]
) -> None:
    for headers in ({}, {"traceparent": "00-not-a-trace-01"}):
        response = httpx.get(door[0] + "/v1/models", headers=headers, timeout=30)
        assert response.status_code == 200
    assert [(s.name, s.parent) for s in recorded.named("GET")] == [("GET /v1/models", None)] * 2


def _prometheus(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_the_door_and_opentelemetry_count_the_same_steps(recorded: Recorded, door: tuple[str, SessionPool]) -> None:
    """One table, two readers: what the door's /metrics adds over some requests is what OpenTelemetry adds."""

    def both() -> dict[str, tuple[float, float]]:
        text = httpx.get(door[0] + "/metrics", timeout=30).text
        found = {}
        for metric in STEP_METRICS:
            if metric.kind == "histogram":
                otel = sum(p.count for p in recorded.points(metric.otel_name))
                found[metric.otel_name] = (otel, _prometheus(text, metric.prometheus_name + "_count"))
            else:
                otel = sum(p.value for p in recorded.points(metric.otel_name))
                found[metric.otel_name] = (otel, _prometheus(text, metric.prometheus_name))
        return found

    before = both()
    for n in range(3):
        body = {"model": "smol", "messages": [{"role": "user", "content": f"Hello {n}"}]}
        assert httpx.post(door[0] + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    after = both()
    for name, (otel, prometheus) in after.items():
        added = (otel - before[name][0], prometheus - before[name][1])
        assert added[0] == added[1], (name, added)
    assert after["gen_ai.server.time_to_first_token"][0] - before["gen_ai.server.time_to_first_token"][0] == 3
    assert after["agentkv.prompt.tokens"][0] > before["agentkv.prompt.tokens"][0]
    ttft = recorded.points("gen_ai.server.time_to_first_token")
    assert {p.attributes["gen_ai.operation.name"] for p in ttft} == {"chat"}
    assert all("gen_ai.conversation.id" not in p.attributes for p in ttft)  # no label per conversation


def test_the_genai_names_are_the_conventions(recorded: Recorded) -> None:
    """Every ``gen_ai.*`` attribute and metric agentkv writes is a name of the conventions (as the semantic
    conventions package of the environment lists them)."""
    names = pytest.importorskip("opentelemetry.semconv._incubating.attributes.gen_ai_attributes")
    metric_names = pytest.importorskip("opentelemetry.semconv._incubating.metrics.gen_ai_metrics")
    known = {value for value in vars(names).values() if isinstance(value, str) and value.startswith("gen_ai.")}
    known_metrics = {v for v in vars(metric_names).values() if isinstance(v, str) and v.startswith("gen_ai.")}
    script = Script(calls((1, 2)), answer("3."))
    with HonestPairEngine(script) as engine, Session(engine=engine, tools=[add], max_tokens=64) as session:
        session.run_sync("1 + 2?")
    written = {key for span in recorded.spans for key in (span.attributes or {}) if key.startswith("gen_ai.")}
    assert written and written <= known, written - known
    ours = {m.otel_name for m in STEP_METRICS if m.otel_name.startswith("gen_ai.")}
    assert ours and ours <= known_metrics
    assert json.dumps(sorted(written))  # listed in docs/observability.md


@pytest.mark.anyio
async def test_a_streamed_turn_ends_its_span_once_and_an_abandoned_one_says_cancelled(recorded: Recorded) -> None:
    from contextlib import aclosing

    from agentkv import TurnEnd

    async with HonestPairEngine(Script(answer("One."), answer("Two."))) as engine, Session(engine=engine) as session:
        async with aclosing(session.stream("First?")) as events:
            async for event in events:
                if isinstance(event, TurnEnd):
                    break  # the consumer stops at the turn's end: the turn is kept, its span ended already
        async with aclosing(session.stream("Second?")) as events:
            async for _ in events:
                break  # abandoned at its first event
    kept, abandoned = recorded.named("invoke_agent")
    assert "error.type" not in dict(kept.attributes or {}) and dict(kept.attributes or {})["agentkv.steps"] == 1
    assert dict(abandoned.attributes or {})["error.type"] == "cancelled"
    assert len(session.stats.turns) == 1
