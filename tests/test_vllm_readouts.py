"""The stat loggers agentkv gives its in-process vLLM engines (``src/agentkv/_engines/_vllm_readouts.py``)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import REGISTRY

from agentkv._engines._vllm_readouts import TransferStats, no_prometheus_logger, transfer_stat_logger


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
