"""What ``agentkv serve`` reports at ``GET /metrics``, in the Prometheus text format (version 0.0.4).

Written by ``prometheus_client``, into a registry of each door's own (not the process-wide one: a process may
hold several doors, and each counts its own requests). The metrics of each step are declared once, for this page and
for OpenTelemetry (`agentkv._stats._telemetry.STEP_METRICS`); the requests, errors and gauges are the door's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .._stats._stats import StepStats
from .._stats._telemetry import LATENCY_BUCKETS_S, STEP_METRICS, StepMetric

__all__ = ["ServeMetrics"]

_GAUGE_HELP = {
    "sessions": "Sessions the door holds.",
    "pins": "Sessions whose KV is pinned on an engine.",
    "steps_in_flight": "Model steps running now.",
    "engines": "Engines of the door's group.",
    "engines_live": "Engines of the door's group that are running.",
}


class _Gauges(Collector):
    """The gauges, read from the door at each scrape."""

    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, value in self._read().items():
            yield GaugeMetricFamily(f"agentkv_{name}", _GAUGE_HELP.get(name, name), value=value)


class ServeMetrics:
    """Counters of the front door, fed by each step's stats and each failed request (thread-safe)."""

    def __init__(self, *, gauges: Callable[[], dict[str, int]]) -> None:
        """``gauges``: read at each scrape (sessions held, pins held, ...)."""
        self.registry = CollectorRegistry()
        """This door's metrics alone."""
        at = self.registry
        self._steps: list[tuple[StepMetric, Histogram | Counter]] = [
            (metric, _instrument(metric, at)) for metric in STEP_METRICS
        ]
        self._requests = Counter(
            "agentkv_requests_total", "Chat-completion requests by outcome.", ["outcome"], registry=at
        )
        self._errors = Counter("agentkv_errors_total", "Failed requests by kind.", ["kind"], registry=at)
        for outcome in ("ok", "error"):
            self._requests.labels(outcome)
        at.register(_Gauges(gauges))

    def step(self, stats: StepStats) -> None:
        """A request that ran a model step."""
        self._requests.labels("ok").inc()
        for metric, instrument in self._steps:
            for value, source in metric.values(stats):
                target = instrument if source is None else instrument.labels(source)
                if isinstance(target, Histogram):
                    target.observe(value)
                else:
                    target.inc(value)

    def error(self, kind: str) -> None:
        """A request that failed, by the error's kind (its class name, or ``unauthorized``, ...)."""
        self._requests.labels("error").inc()
        self._errors.labels(kind).inc()

    def text(self) -> str:
        """The exposition, every metric with its help and type."""
        return generate_latest(self.registry).decode()


def _instrument(metric: StepMetric, registry: CollectorRegistry) -> Histogram | Counter:
    """``metric``'s Prometheus instrument, its label's values listed at 0 from the start."""
    labels = [metric.label] if metric.label is not None else []
    if metric.kind == "histogram":
        made: Histogram | Counter = Histogram(
            metric.prometheus_name, metric.description, labels, buckets=LATENCY_BUCKETS_S, registry=registry
        )
    else:
        made = Counter(metric.prometheus_name, metric.description, labels, registry=registry)
    for value in metric.label_values:
        made.labels(value)
    return made
