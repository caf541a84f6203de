"""What agentkv reports to OpenTelemetry and to the door's Prometheus page, defined once.

The names follow the OpenTelemetry GenAI semantic conventions (the ``semantic-conventions-genai`` registry, status
Development) where they name what agentkv measures; agentkv's own figures are under ``agentkv.``. Each metric of a
step is declared once (`STEP_METRICS`): its OpenTelemetry name, its Prometheus name, how its value is read off a
`StepStats`. `StepMetricsRecorder` records them through ``opentelemetry-api`` (a no-op until the application
configures an SDK), and the door's ``/metrics`` (src/agentkv/_surfaces/_metrics.py) builds its Prometheus
instruments from the same table: one source of truth for both.

`sdk_configured` tells whether the application configured any of it: the one check a model step makes before
its spans and metrics, which it skips entirely when nothing would record them.

A leaf like the rest of the stats layer: it imports only ``opentelemetry-api`` and `StepStats`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from opentelemetry import metrics, trace
from opentelemetry.environment_variables import OTEL_PYTHON_METER_PROVIDER, OTEL_PYTHON_TRACER_PROVIDER
from opentelemetry.metrics import _internal as _metrics_state

from ._stats import StepStats

__all__ = [
    "LATENCY_BUCKETS_S",
    "PROVIDER",
    "STEP_METRICS",
    "StepMetric",
    "StepMetricsRecorder",
    "sdk_configured",
    "step_attributes",
]

PROVIDER = "vllm"
"""``gen_ai.provider.name``: the engines that serve agentkv's model calls are vLLM's."""

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Bucket bounds of every latency histogram (Prometheus buckets, OpenTelemetry's advisory boundaries)."""

if OTEL_PYTHON_TRACER_PROVIDER in os.environ or OTEL_PYTHON_METER_PROVIDER in os.environ:
    # A provider named by the environment is loaded by the API's first get: now, so that `sdk_configured` sees it.
    trace.get_tracer_provider()
    metrics.get_meter_provider()

_READABLE = hasattr(trace, "_TRACER_PROVIDER") and hasattr(_metrics_state, "_METER_PROVIDER")


def sdk_configured() -> bool:
    """Whether the application set a tracer provider or a meter provider (other than the API's no-op ones), now.

    Asked once per model step, so a provider set after agentkv was imported is seen from the next step on. It reads
    the API's globals, which hold None until a provider is set (once per process): the public getters cost about a
    microsecond each while nothing is set (an environment lookup, a raised ``KeyError``), this a few attribute reads.
    The names are private to ``opentelemetry-api`` (1.12 and later; tests/test_telemetry_off.py checks them against
    the installed version): where a later version lacks them, every step counts as observed, at the spans' cost."""
    if not _READABLE:
        return True
    tracers = trace._TRACER_PROVIDER
    if tracers is not None and not isinstance(tracers, trace.NoOpTracerProvider):
        return True
    meters = _metrics_state._METER_PROVIDER
    return meters is not None and not isinstance(meters, metrics.NoOpMeterProvider)


Value = tuple[float, str | None]
"""A value to record and its ``source`` label (None: the metric has no label)."""


@dataclass(frozen=True)
class StepMetric:
    """One metric of every model step, as OpenTelemetry and Prometheus both report it."""

    otel_name: str
    prometheus_name: str
    kind: Literal["histogram", "counter"]
    unit: str
    description: str
    values: Callable[[StepStats], Iterable[Value]]
    """The values one step records (none: the step did not measure it)."""
    label: str | None = None
    """The label of the values' source: ``source`` in Prometheus, ``agentkv.kv.source`` in OpenTelemetry."""
    label_values: tuple[str, ...] = ()
    """Every value of the label (listed at 0 from the start on the Prometheus page)."""


def _seconds(value: float | None) -> list[Value]:
    return [] if value is None else [(value, None)]


def _time_per_output_token(stats: StepStats) -> list[Value]:
    """The decode time over the tokens after the first (the conventions' definition, and the door's ITL)."""
    if stats.decode_s is None or stats.output_tokens < 2:
        return []
    return [(stats.decode_s / (stats.output_tokens - 1), None)]


STEP_METRICS: tuple[StepMetric, ...] = (
    StepMetric(
        "gen_ai.server.time_to_first_token",
        "agentkv_ttft_seconds",
        "histogram",
        "s",
        "Time to first token of each model step (client clock).",
        lambda s: [(s.ttft_s, None)],
    ),
    StepMetric(
        "gen_ai.server.time_per_output_token",
        "agentkv_itl_seconds",
        "histogram",
        "s",
        "Mean inter-token latency of each model step (decode time / (tokens - 1)).",
        _time_per_output_token,
    ),
    StepMetric(
        "gen_ai.server.request.duration",
        "agentkv_request_duration_seconds",
        "histogram",
        "s",
        "Duration of each model step, submitted to its last token (client clock).",
        lambda s: _seconds(s.duration_s),
    ),
    StepMetric(
        "agentkv.prompt.tokens",
        "agentkv_prompt_tokens_total",
        "counter",
        "{token}",
        "Prompt tokens by where their KV came from (cached: local or pulled; or computed).",
        lambda s: [(s.local_hit_tokens, "local"), (s.pulled_tokens, "pulled"), (s.computed_tokens, "computed")],
        label="source",
        label_values=("local", "pulled", "computed"),
    ),
    StepMetric(
        "agentkv.output.tokens",
        "agentkv_output_tokens_total",
        "counter",
        "{token}",
        "Tokens generated.",
        lambda s: [(s.output_tokens, None)],
    ),
    StepMetric(
        "agentkv.kv.bytes",
        "agentkv_kv_bytes_total",
        "counter",
        "By",
        "NIXL bytes moved, both directions.",
        lambda s: [(s.kv_bytes or 0, None)],
    ),
)
"""Every metric of a step. The conventions' three server histograms; the conventions count no cached tokens, so the
prompt's tokens by source (``local`` + ``pulled`` = cached) are agentkv's own counter."""


class StepMetricsRecorder:
    """`STEP_METRICS` through the OpenTelemetry metrics API (the global meter provider's ``agentkv`` meter).

    Instruments are made once; without an SDK they are the API's no-op proxies, which start recording when the
    application sets a meter provider."""

    def __init__(self) -> None:
        meter = metrics.get_meter("agentkv")
        self._instruments: list[tuple[StepMetric, Any]] = []
        for metric in STEP_METRICS:
            if metric.kind == "histogram":
                instrument: Any = meter.create_histogram(
                    metric.otel_name,
                    unit=metric.unit,
                    description=metric.description,
                    explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
                )
            else:
                instrument = meter.create_counter(metric.otel_name, unit=metric.unit, description=metric.description)
            self._instruments.append((metric, instrument))

    def record(self, stats: StepStats, attributes: Mapping[str, str]) -> None:
        """One step's values; ``attributes`` name the operation, the provider and the model."""
        for metric, instrument in self._instruments:
            for value, source in metric.values(stats):
                tags = attributes if source is None else {**attributes, "agentkv.kv.source": source}
                if metric.kind == "histogram":
                    instrument.record(value, tags)
                else:
                    instrument.add(value, tags)


def step_attributes(stats: StepStats) -> dict[str, Any]:
    """A step span's attributes read off its stats: the conventions' usage and TTFT, agentkv's own figures."""
    attributes: dict[str, Any] = {
        "gen_ai.usage.input_tokens": stats.prompt_tokens,
        "gen_ai.usage.output_tokens": stats.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": stats.local_hit_tokens + stats.pulled_tokens,
        "gen_ai.response.time_to_first_chunk": stats.ttft_s,
        "agentkv.tokens.local": stats.local_hit_tokens,
        "agentkv.tokens.pulled": stats.pulled_tokens,
        "agentkv.tokens.computed": stats.computed_tokens,
        "agentkv.handle_forwarded": stats.handle_forwarded,
        "agentkv.kv_wait_s": stats.kv_wait_s,
    }
    if stats.miss_reason is not None:
        attributes["agentkv.miss_reason"] = stats.miss_reason
    if stats.prefill_engine is not None:
        attributes["agentkv.placement"] = "P" if stats.prefill_engine == "prefill" else "D"
    optional = {
        "agentkv.prefill_s": stats.prefill_s,
        "agentkv.decode_s": stats.decode_s,
        "agentkv.kv.transfer_s": stats.kv_transfer_s,
        "agentkv.kv.bytes": stats.kv_bytes,
        "agentkv.placement_reason": stats.placement_reason,
    }
    attributes.update({name: value for name, value in optional.items() if value is not None})
    return attributes
