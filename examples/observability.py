"""A traced agent: OpenTelemetry spans of every turn, model step and tool call, on the embedded pair.

agentkv writes its spans through ``opentelemetry-api``; the application configures the SDK and the exporter. Here
`setup` sends them to the console (the SDK's console exporter), or with ``--otlp URL`` to an OpenTelemetry
collector, Jaeger or Tempo (OTLP over HTTP, e.g. ``http://localhost:4318/v1/traces``). At the end it draws the
trace of each turn (`draw`): the turn, its model steps with their TTFT and cached tokens, its tool calls.

Run: .venv/bin/python examples/observability.py [--otlp URL]
     (needs the ``observability`` extra: pip install "agentkv-vllm[observability]")
"""

import argparse
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentkv import Session, TurnResult, tool
from agentkv.engines import Engine


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def setup(otlp: str | None) -> InMemorySpanExporter:
    """Configure the SDK: spans to the console, or to an OTLP collector; a copy kept in memory to draw them."""
    provider = TracerProvider(resource=Resource.create({"service.name": "agentkv-example"}))
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    kept = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(kept))
    trace.set_tracer_provider(provider)
    return kept


def main(engine: Engine | None = None) -> list[TurnResult]:
    """Two turns of a tool-calling agent; with ``engine=`` on an open engine (the tests pass theirs)."""
    with trace.get_tracer("example").start_as_current_span("my-agent-request"):  # agentkv's spans hang under it
        with Session(engine=engine, tools=[add], tool_choice="required", max_steps=2, max_tokens=48) as session:
            return [session.run_sync("What is 1234 + 4321?"), session.run_sync("Thanks. And 1 + 1?")]


def draw(spans: Sequence[ReadableSpan]) -> str:
    """The spans as a tree: each turn, its steps (TTFT, cached / input tokens, why KV was not pulled) and tools."""
    children: dict[int | None, list[ReadableSpan]] = {}
    for span in sorted(spans, key=lambda s: s.start_time or 0):
        children.setdefault(span.parent.span_id if span.parent else None, []).append(span)
    known = {span.context.span_id for span in spans}
    lines: list[str] = []

    def visit(span: ReadableSpan, depth: int) -> None:
        a = dict(span.attributes or {})
        took = ((span.end_time or 0) - (span.start_time or 0)) / 1e9
        line = f"{'  ' * depth}{span.name}  {took:.3f} s"
        if a.get("gen_ai.operation.name") == "chat":
            line += (
                f"  ttft {a['gen_ai.response.time_to_first_chunk']:.3f} s  cached {a['gen_ai.usage.cache_read.input_tokens']}"
                f"/{a['gen_ai.usage.input_tokens']} (pulled {a['agentkv.tokens.pulled']})"
                f"  {a.get('agentkv.miss_reason', '')}"
            )
        lines.append(line.rstrip())
        for child in children.get(span.context.span_id, []):
            visit(child, depth + 1)

    for root in [s for s in spans if s.parent is None or s.parent.span_id not in known]:
        visit(root, 0)
    return "\n".join(lines)


if __name__ == "__main__":  # vLLM spawns processes that re-import this module
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--otlp", metavar="URL", help="an OTLP/HTTP traces endpoint (default: the console)")
    kept = setup(parser.parse_args().otlp)
    main()
    print(draw(kept.get_finished_spans()))
    trace.get_tracer_provider().shutdown()  # type: ignore[attr-defined]  # flush the batch to the collector
