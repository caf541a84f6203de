"""What ``agentkv serve`` reports at ``GET /metrics``, in the Prometheus text format (version 0.0.4)."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable

from .._stats._stats import StepStats

__all__ = ["ServeMetrics"]

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self, name: str) -> list[str]:
        lines, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += count
            label = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{le="{label}"}} {running}')
        return [*lines, f"{name}_sum {self.total}", f"{name}_count {running}"]


class ServeMetrics:
    """Counters of the front door, fed by each step's stats and each failed request (thread-safe)."""

    def __init__(self, *, gauges: Callable[[], dict[str, int]]) -> None:
        self._lock = threading.Lock()
        self._ttft = _Histogram(_LATENCY_BUCKETS_S)
        self._itl = _Histogram(_LATENCY_BUCKETS_S)
        self._tokens: Counter[str] = Counter()
        self._requests: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._kv_bytes = 0
        self._gauges = gauges
        """Read at each scrape: sessions held, pins held."""

    def step(self, stats: StepStats) -> None:
        """A request that ran a model step."""
        with self._lock:
            self._requests["ok"] += 1
            self._ttft.observe(stats.ttft_s)
            if stats.decode_s is not None and stats.output_tokens > 1:
                self._itl.observe(stats.decode_s / (stats.output_tokens - 1))
            self._tokens["local"] += stats.local_hit_tokens
            self._tokens["pulled"] += stats.pulled_tokens
            self._tokens["computed"] += stats.computed_tokens
            self._tokens["output"] += stats.output_tokens
            self._kv_bytes += stats.kv_bytes or 0

    def error(self, kind: str) -> None:
        """A request that failed, by the error's kind (its class name, or ``unauthorized``, ...)."""
        with self._lock:
            self._requests["error"] += 1
            self._errors[kind] += 1

    def text(self) -> str:
        """The exposition, every metric with its help and type."""
        with self._lock:
            lines = [
                "# HELP agentkv_ttft_seconds Time to first token of each model step (client clock).",
                "# TYPE agentkv_ttft_seconds histogram",
                *self._ttft.lines("agentkv_ttft_seconds"),
                "# HELP agentkv_itl_seconds Mean inter-token latency of each model step (decode time / (tokens - 1)).",
                "# TYPE agentkv_itl_seconds histogram",
                *self._itl.lines("agentkv_itl_seconds"),
                "# HELP agentkv_prompt_tokens_total Prompt tokens by where their KV came from.",
                "# TYPE agentkv_prompt_tokens_total counter",
                *(
                    f'agentkv_prompt_tokens_total{{source="{s}"}} {self._tokens[s]}'
                    for s in ("local", "pulled", "computed")
                ),
                "# HELP agentkv_output_tokens_total Tokens generated.",
                "# TYPE agentkv_output_tokens_total counter",
                f"agentkv_output_tokens_total {self._tokens['output']}",
                "# HELP agentkv_kv_bytes_total NIXL bytes moved, both directions.",
                "# TYPE agentkv_kv_bytes_total counter",
                f"agentkv_kv_bytes_total {self._kv_bytes}",
                "# HELP agentkv_requests_total Chat-completion requests by outcome.",
                "# TYPE agentkv_requests_total counter",
                *(f'agentkv_requests_total{{outcome="{o}"}} {self._requests[o]}' for o in ("ok", "error")),
                "# HELP agentkv_errors_total Failed requests by kind.",
                "# TYPE agentkv_errors_total counter",
                *(f'agentkv_errors_total{{kind="{k}"}} {n}' for k, n in sorted(self._errors.items())),
            ]
        for name, value in self._gauges().items():
            lines += [f"# TYPE agentkv_{name} gauge", f"agentkv_{name} {value}"]
        return "\n".join(lines) + "\n"
