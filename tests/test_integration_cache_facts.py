"""Each adapter gives its framework the conversation's identity and cache facts: openai-agents' ``prompt_cache_key``
routes a run's calls to its conversation's session, and its trace spans carry the cached tokens and the miss reason;
pydantic-ai learns the cache retention (the pin's TTL after its renewals) and gets the miss reason per response.
Unit tests on `HonestPairEngine`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import anyio
from agents import Agent, RunConfig, Runner, set_trace_processors, set_tracing_disabled
from agents.tracing import GenerationSpanData, TracingProcessor
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.messages import ModelResponse

from agentkv.integrations.openai_agents import AgentKVModel as AgentsModel
from agentkv.integrations.pydantic_ai import AgentKVModel as PydanticModel
from agentkv.testing import HonestPairEngine
from scripted import close_leftover_event_loop


class Spans(TracingProcessor):
    """Keeps the usage of every generation span that ends."""

    def __init__(self) -> None:
        self.usage: list[dict[str, Any]] = []

    def on_trace_start(self, trace: Any) -> None: ...
    def on_trace_end(self, trace: Any) -> None: ...
    def on_span_start(self, span: Any) -> None: ...
    def on_span_end(self, span: Any) -> None:
        if isinstance(span.span_data, GenerationSpanData) and span.span_data.usage is not None:
            self.usage.append(span.span_data.usage)

    def shutdown(self) -> None: ...
    def force_flush(self) -> None: ...


def test_openai_agents_prompt_cache_key_names_the_conversation_and_spans_carry_the_cache_facts() -> None:
    spans = Spans()
    set_trace_processors([spans])
    set_tracing_disabled(False)
    try:
        with HonestPairEngine(lambda request: "Noted.") as engine, AgentsModel(engine=engine) as model:
            agent = Agent(name="a", model=model)
            grouped = RunConfig(group_id="thread-7")  # the runner's prompt_cache_key of this group, run after run

            async def runs() -> None:
                first = await Runner.run(agent, "Remember 7.", run_config=grouped)
                await Runner.run(agent, "Something else entirely.")  # no group: matched by its messages
                await Runner.run(
                    agent, [*first.to_input_list(), {"role": "user", "content": "And?"}], run_config=grouped
                )

            anyio.run(runs)
            named = [c for c in model.pool.conversations if c.startswith("prompt_cache_key:agents-sdk:group:")]
            stats = model.stats
    finally:
        set_tracing_disabled(True)
        set_trace_processors([])
        close_leftover_event_loop()
    assert len(named) == 1
    third = [s for s in stats if s.turn == 2]
    assert third and third[0].handle_forwarded and third[0].miss_reason is None  # the group's session, pushed back
    assert [u["details"]["agentkv_miss_reason"] for u in spans.usage] == ["no_handle", "no_handle", None]
    last = spans.usage[-1]
    assert last["cached_tokens"] == last["details"]["agentkv_pulled_tokens"] > 0
    engine.assert_honest()


def test_pydantic_ai_learns_the_cache_retention_and_each_responses_miss_reason() -> None:
    with HonestPairEngine(lambda request: "Noted.") as engine:
        renewing = PydanticModel(engine=engine)
        not_renewing = PydanticModel(engine=engine, renew_pins=False)
        assert renewing.profile["default_cache_retention"] == timedelta(seconds=480 + 3600)
        assert not_renewing.profile["default_cache_retention"] == timedelta(seconds=480)
        try:
            agent = PydanticAgent(renewing)
            first = agent.run_sync("Remember 7.")
            second = agent.run_sync("And?", message_history=first.all_messages())
        finally:
            renewing.close()
            not_renewing.close()
            close_leftover_event_loop()
    responses = [m for m in second.all_messages() if isinstance(m, ModelResponse)]
    assert [r.provider_details and r.provider_details["agentkv_miss_reason"] for r in responses] == ["no_handle", None]
    assert responses[1].usage.details["agentkv_pulled_tokens"] == responses[1].usage.cache_read_tokens > 0
    engine.assert_honest()
