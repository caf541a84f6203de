"""With no OpenTelemetry SDK configured a step starts no span and records no metric (one check per step,
`agentkv._stats._telemetry.sdk_configured`); a provider the application sets later turns them on from the next step.
The spans and metrics themselves: tests/test_telemetry.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry import metrics, trace
from opentelemetry.metrics import _internal as metrics_state
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider

from agentkv._stats import _telemetry
from agentkv._stats._telemetry import sdk_configured

_HERE = Path(__file__).parent


def test_no_sdk_no_span_work_and_a_provider_set_later_turns_it_on() -> None:
    """In a process of its own (a provider is set once per process): tests/telemetry_off.py."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_HERE), *sys.path])}
    for name in ("OTEL_PYTHON_TRACER_PROVIDER", "OTEL_PYTHON_METER_PROVIDER"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(_HERE / "telemetry_off.py")], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    phases = json.loads(done.stdout.strip().splitlines()[-1])
    none, meter, both = phases["none"], phases["meter"], phases["both"]
    assert none == {"configured": False, "steps": 2, "called": {}, "metrics": [], "spans": []}
    # A meter provider alone: the steps' metrics, and the spans' calls as before the check (no-op spans).
    assert meter["configured"] and meter["steps"] == 2
    assert meter["called"] == {"start_step": 2, "end_step": 2, "record": 2, "tool_span": 1, "start_span": 4}
    assert "gen_ai.server.time_to_first_token" in meter["metrics"] and meter["spans"] == []
    assert both["configured"] and both["called"] == meter["called"]
    assert both["spans"] == ["chat", "chat", "execute_tool", "invoke_agent"]


@pytest.mark.parametrize(
    ("tracers", "meters", "configured"),
    [
        (None, None, False),
        (trace.NoOpTracerProvider(), metrics.NoOpMeterProvider(), False),
        (TracerProvider(), None, True),
        (None, MeterProvider(), True),
    ],
)
def test_a_provider_set_counts_and_the_no_op_ones_do_not(
    monkeypatch: pytest.MonkeyPatch, tracers: object, meters: object, configured: bool
) -> None:
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", tracers)
    monkeypatch.setattr(metrics_state, "_METER_PROVIDER", meters)
    assert sdk_configured() is configured


def test_the_api_globals_it_reads_exist_in_the_installed_opentelemetry_api() -> None:
    """`sdk_configured` reads ``opentelemetry-api``'s private globals; an API without them would make every step
    count as observed (correct, at the spans' cost): this fails first."""
    assert _telemetry._READABLE
