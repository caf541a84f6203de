"""Run by tests/test_telemetry_off.py in a process of its own (the API's providers are set once per process): a tool
turn with no SDK configured, then with a meter provider set after agentkv was imported, then with a tracer provider
too. Prints, per phase, how often the span and metric functions ran and what the SDK received, as JSON."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agentkv._session._tool_calls as tool_calls
import agentkv._session._tracing as tracing
import agentkv._session._turn as turn
from agentkv import Session, tool
from agentkv._stats._telemetry import StepMetricsRecorder, sdk_configured
from agentkv.testing import HonestPairEngine
from scripted import Script, answer, calls

CALLED: Counter[str] = Counter()


def _counted(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def counting(*args: Any, **kwargs: Any) -> Any:
        CALLED[name] += 1
        return function(*args, **kwargs)

    return counting


class _CountedTracer:
    """agentkv's tracer, counting the spans it is asked to start."""

    def __init__(self, tracer: Any) -> None:
        self._tracer = tracer

    def start_span(self, *args: Any, **kwargs: Any) -> Any:
        CALLED["start_span"] += 1
        return self._tracer.start_span(*args, **kwargs)

    @contextmanager
    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        CALLED["start_span"] += 1
        with self._tracer.start_as_current_span(*args, **kwargs) as span:
            yield span


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _phase(reader: InMemoryMetricReader | None, exporter: InMemorySpanExporter | None) -> dict[str, Any]:
    CALLED.clear()
    configured = sdk_configured()
    with HonestPairEngine(Script(calls((1, 2)), answer("3."))) as engine:
        with Session(engine=engine, tools=[add], max_tokens=64) as session:
            result = session.run_sync("1 + 2?")
    data = reader.get_metrics_data() if reader is not None else None
    metric_names = sorted(
        {m.name for r in data.resource_metrics for s in r.scope_metrics for m in s.metrics} if data is not None else []
    )
    spans = sorted(s.name.split()[0] for s in exporter.get_finished_spans()) if exporter is not None else []
    return {
        "configured": configured,
        "steps": len(result.steps),
        "called": dict(CALLED),
        "metrics": metric_names,
        "spans": spans,
    }


def main() -> None:
    turn.start_step = _counted("start_step", turn.start_step)
    turn.end_step = _counted("end_step", turn.end_step)
    tool_calls.tool_span = _counted("tool_span", tool_calls.tool_span)
    StepMetricsRecorder.record = _counted("record", StepMetricsRecorder.record)  # type: ignore[method-assign]
    tracing._tracer = _CountedTracer(tracing._tracer)  # type: ignore[assignment]
    phases = {"none": _phase(None, None)}
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    phases["meter"] = _phase(reader, None)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    phases["both"] = _phase(reader, exporter)
    print(json.dumps(phases))


if __name__ == "__main__":
    main()
