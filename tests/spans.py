"""The OpenTelemetry SDK in a test: spans and metrics in memory, as an application that configures the SDK gets them.

agentkv uses the global tracer and meter providers (``opentelemetry-api``), which a process sets once. The first
test that asks sets an SDK provider of each (or joins the SDK tracer provider something else set, a docs snippet
say), with one processor that hands ended spans to the test listening now, and drops them otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


class _Listening(SpanProcessor):
    """Hands each ended span to the exporter of the test listening now (none: dropped)."""

    exporter: InMemorySpanExporter | None = None

    def on_end(self, span: ReadableSpan) -> None:
        if self.exporter is not None:
            self.exporter.export([span])


_LISTENING = _Listening()
_READER: InMemoryMetricReader | None = None


def _install() -> InMemoryMetricReader:
    global _READER
    if _READER is None:
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            provider = TracerProvider()
            trace.set_tracer_provider(provider)
        provider.add_span_processor(_LISTENING)
        _READER = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[_READER]))
    return _READER


@dataclass
class Recorded:
    """The spans ended while recording, and the metric points as they stand."""

    exporter: InMemorySpanExporter
    reader: InMemoryMetricReader

    @property
    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, prefix: str) -> list[ReadableSpan]:
        """The spans whose name starts with ``prefix``, in the order they ended."""
        return [span for span in self.spans if span.name.startswith(prefix)]

    def points(self, name: str) -> list[Any]:
        """The data points of the metric ``name`` now (cumulative since the meter provider was set)."""
        data = self.reader.get_metrics_data()
        found: list[Any] = []
        for resource in data.resource_metrics if data is not None else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found


@contextmanager
def recording() -> Iterator[Recorded]:
    """Spans ended within the block are kept (in the order they ended)."""
    reader = _install()
    exporter = InMemorySpanExporter()
    _LISTENING.exporter = exporter
    try:
        yield Recorded(exporter, reader)
    finally:
        _LISTENING.exporter = None


def parent_of(span: ReadableSpan) -> int | None:
    """The span id of ``span``'s parent (None: a root span)."""
    return span.parent.span_id if span.parent is not None else None
