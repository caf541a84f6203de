"""What ``agentkv serve`` reports at ``GET /metrics``, in the Prometheus text format (version 0.0.4).

Written by ``prometheus_client``, into a registry of each door's own (not the process-wide one: a process may
hold several doors, and each counts its own requests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .._stats._stats import StepStats

__all__ = ["ServeMetrics"]

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

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
        self._ttft = Histogram(
            "agentkv_ttft_seconds",
            "Time to first token of each model step (client clock).",
            buckets=_LATENCY_BUCKETS_S,
            registry=at,
        )
        self._itl = Histogram(
            "agentkv_itl_seconds",
            "Mean inter-token latency of each model step (decode time / (tokens - 1)).",
            buckets=_LATENCY_BUCKETS_S,
            registry=at,
        )
        self._prompt = Counter(
            "agentkv_prompt_tokens_total", "Prompt tokens by where their KV came from.", ["source"], registry=at
        )
        self._output = Counter("agentkv_output_tokens_total", "Tokens generated.", registry=at)
        self._kv_bytes = Counter("agentkv_kv_bytes_total", "NIXL bytes moved, both directions.", registry=at)
        self._requests = Counter(
            "agentkv_requests_total", "Chat-completion requests by outcome.", ["outcome"], registry=at
        )
        self._errors = Counter("agentkv_errors_total", "Failed requests by kind.", ["kind"], registry=at)
        for source in ("local", "pulled", "computed"):
            self._prompt.labels(source)  # listed at 0 from the start
        for outcome in ("ok", "error"):
            self._requests.labels(outcome)
        at.register(_Gauges(gauges))

    def step(self, stats: StepStats) -> None:
        """A request that ran a model step."""
        self._requests.labels("ok").inc()
        self._ttft.observe(stats.ttft_s)
        if stats.decode_s is not None and stats.output_tokens > 1:
            self._itl.observe(stats.decode_s / (stats.output_tokens - 1))
        self._prompt.labels("local").inc(stats.local_hit_tokens)
        self._prompt.labels("pulled").inc(stats.pulled_tokens)
        self._prompt.labels("computed").inc(stats.computed_tokens)
        self._output.inc(stats.output_tokens)
        self._kv_bytes.inc(stats.kv_bytes or 0)

    def error(self, kind: str) -> None:
        """A request that failed, by the error's kind (its class name, or ``unauthorized``, ...)."""
        self._requests.labels("error").inc()
        self._errors.labels(kind).inc()

    def text(self) -> str:
        """The exposition, every metric with its help and type."""
        return generate_latest(self.registry).decode()
