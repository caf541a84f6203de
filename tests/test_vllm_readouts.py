"""The stat loggers agentkv gives its in-process vLLM engines (``src/agentkv/_engines/_vllm_readouts.py``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY

from agentkv._engines._vllm_readouts import Readouts, TransferStats, no_prometheus_logger, transfer_stat_logger


def test_an_in_process_engine_registers_no_vllm_metric_and_still_hands_over_nixl_stats() -> None:
    """vLLM's own Prometheus logger is left out (it unregisters and registers every ``vllm:`` collector of the
    global registry, which two engines of one process race on), and the NIXL statistics still arrive."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager

    seen: list[TransferStats] = []
    before = dict(REGISTRY._names_to_collectors)
    manager = StatLoggerManager(
        vllm_config=SimpleNamespace(),  # neither logger reads it
        custom_stat_loggers=[transfer_stat_logger(seen.append), no_prometheus_logger()],
        enable_default_loggers=False,
    )
    prometheus = [type(x).__name__ for x in manager.stat_loggers if isinstance(x, PrometheusStatLogger)]
    assert prometheus == ["NoPrometheusLogger"]
    stats = SimpleNamespace(kv_connector_stats={"num_successful_transfers": 1, "bytes_transferred": [4096]})
    manager.record(stats, None)
    manager.record_sleep_state(1, 0)
    manager.log_engine_initialized()
    assert dict(REGISTRY._names_to_collectors) == before
    assert [moved.bytes for moved in seen] == [4096]


def test_the_scheduler_report_says_what_a_stalled_engine_was_doing() -> None:
    """Each step's ``SchedulerStats`` reach ``on_scheduler`` (vLLM's own class, through its logger manager), and
    `Readouts.describe` words the last one as a stall's error gives it."""
    from vllm.v1.metrics.loggers import StatLoggerManager
    from vllm.v1.metrics.stats import SchedulerStats

    readouts = Readouts()
    assert readouts.describe() == "no scheduler report yet"
    manager = StatLoggerManager(
        vllm_config=SimpleNamespace(),
        custom_stat_loggers=[transfer_stat_logger(readouts.attribute, readouts.observe), no_prometheus_logger()],
        enable_default_loggers=False,
    )
    stats = SchedulerStats(
        num_running_reqs=2,
        num_waiting_reqs=3,
        num_skipped_waiting_reqs=1,
        num_kv_fetch_reqs_by_stage={"waiting_for_remote_kvs": 1, "done": 0},
        kv_cache_usage=0.984,
    )
    manager.record(stats, None)
    assert readouts.scheduler is not None
    assert readouts.scheduler.fetching == {"waiting_for_remote_kvs": 1}
    said = readouts.scheduler.describe(now=readouts.scheduler.at + 2.0)
    assert said == (
        "2 running, 3 waiting (1 deferred), fetching KV: 1 waiting_for_remote_kvs, KV cache 98% used, "
        "reported 2.0 s ago"
    )
    manager.record(None, None)  # a step without a report changes nothing
    assert readouts.scheduler.running == 2


@pytest.mark.anyio
async def test_a_stream_that_makes_no_progress_says_what_the_engines_were_doing() -> None:
    """`DecodeStream`'s stall error carries its engine's last scheduler report and what the caller adds (the pair:
    P's report and D's pins), so that a stall can be told from a slow step (a stand-in engine that never answers)."""
    import anyio

    from agentkv import EngineError
    from agentkv._engines._vllm import DecodeStream, EngineRequest

    class SilentEngine:
        name = "decode"

        async def generate(self, request: object, **_: object) -> Any:
            await anyio.sleep_forever()
            yield None

        def describe_state(self) -> str:
            return "decode: 0 running, 1 waiting (0 deferred)"

    request = EngineRequest([1, 2], SimpleNamespace(logprobs=None), "r")  # type: ignore[arg-type]
    stream = DecodeStream(SilentEngine(), request, idle_timeout_s=0.05, describe_also=lambda: "pins: 3 pins")  # type: ignore[arg-type]
    with pytest.raises(EngineError) as stalled:
        async for _ in stream:
            pass
    assert str(stalled.value) == (
        "the decode engine made no progress for 0.05 s (decode: 0 running, 1 waiting (0 deferred); pins: 3 pins)"
    )
