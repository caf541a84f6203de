"""OpenTelemetry on the real pair: examples/observability.py's 2-turn tool-calling conversation has its turn, step
and tool spans with the GenAI conventions' attributes (turn 2's step reading cached tokens pulled back from D, with
its TTFT), and a door request's spans hang under its client's ``traceparent``. The logic on doubles:
tests/test_telemetry.py."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry import propagate, trace

from agentkv import EmbeddedPair, SessionPool
from agentkv._engines._system import free_port
from agentkv.serve import FrontDoor
from example_module import load_example
from spans import parent_of, recording

pytestmark = pytest.mark.pair

_app = trace.get_tracer("the-application")


def test_a_two_turn_tool_conversation_on_the_pair_is_traced(pair: EmbeddedPair) -> None:
    example = load_example("observability")
    with recording() as recorded:
        first, second = example.main(engine=pair)  # two turns under the example's own span
    drawn = example.draw(recorded.spans)
    print(drawn)  # docs/observability.md draws one such trace
    (root,) = recorded.named("my-agent-request")
    turns = recorded.named("invoke_agent")
    chats = recorded.named("chat ")
    tools = recorded.named("execute_tool")
    steps = [*first.steps, *second.steps]
    assert [parent_of(t) for t in turns] == [root.context.span_id] * 2
    assert len(chats) == len(steps) and len(tools) == sum(len(s.tool_calls) for s in steps) > 0
    in_turn = {t.context.span_id: n for n, t in enumerate(turns)}
    assert [in_turn[parent_of(c)] for c in chats] == [0] * len(first.steps) + [1] * len(second.steps)  # type: ignore[index]
    assert {parent_of(t) for t in tools} <= set(in_turn)
    assert [dict(t.attributes or {})["gen_ai.tool.name"] for t in tools] == [
        c.name for s in steps for c in s.tool_calls
    ]
    for chat, step in zip(chats, steps, strict=True):
        a = dict(chat.attributes or {})
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "vllm"
        assert a["gen_ai.request.model"] and a["gen_ai.response.id"].startswith("agentkv-")
        assert a["gen_ai.usage.input_tokens"] == step.stats.prompt_tokens
        assert a["gen_ai.response.time_to_first_chunk"] == step.stats.ttft_s > 0
        assert a["agentkv.placement"] == "P"
        assert (
            a["agentkv.tokens.local"] + a["agentkv.tokens.pulled"] + a["agentkv.tokens.computed"]
            == (a["gen_ai.usage.input_tokens"])
        )
    turn_two = dict(chats[len(first.steps)].attributes or {})
    assert turn_two["gen_ai.usage.cache_read.input_tokens"] > 0 and turn_two["agentkv.tokens.pulled"] > 0
    assert "agentkv.miss_reason" not in turn_two and turn_two["agentkv.pin.forwarded_tokens"] > 0
    assert turn_two["gen_ai.response.time_to_first_chunk"] > 0
    lines = drawn.splitlines()
    assert lines[0].startswith("my-agent-request")
    assert sum(line.strip().startswith("execute_tool add") for line in lines) == len(tools)
    assert all("ttft" in line and "cached" in line for line in lines if line.strip().startswith("chat "))


def test_a_door_request_on_the_pair_hangs_under_its_clients_trace(pair: EmbeddedPair) -> None:
    headers: dict[str, str] = {}
    with _app.start_as_current_span("client") as client:
        propagate.inject(headers)
    body = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
    with recording() as recorded:
        with SessionPool(engine=pair, max_tokens=8) as pool, FrontDoor(pool, port=free_port()) as door:
            response = httpx.post(door.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200
    (server,) = recorded.named("POST /v1/chat/completions")
    (chat,) = recorded.named("chat ")
    assert server.context.trace_id == chat.context.trace_id == client.get_span_context().trace_id
    assert parent_of(server) == client.get_span_context().span_id
    assert parent_of(chat) == server.context.span_id
    assert dict(chat.attributes or {})["gen_ai.response.time_to_first_chunk"] > 0
