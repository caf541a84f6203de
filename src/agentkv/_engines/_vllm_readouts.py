"""What vLLM has about each request but does not return with it: NIXL transfers and engine times.

NIXL's statistics come per engine step from a stat logger (`transfer_stat_logger`), summed
over the step's transfers; `Readouts` gives them to the requests in flight (a request's
`TransferLedger` holds them when it was alone), and the same logger keeps the scheduler's last
report (`SchedulerSnapshot`: what a stalled engine was doing). `PrefillStatsKeeper` holds each request's
prefix-cache split until the request's reader takes it. `engine_seconds` reads a finished request's
times. The in-process engines (`AsyncLLMRunner` in ``src/agentkv/_engines/_vllm.py``) and
agentkv's server (``src/agentkv/_engines/_server.py``) read them alike.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from vllm import RequestOutput

__all__ = [
    "PrefillStatsKeeper",
    "Readouts",
    "SchedulerSnapshot",
    "TransferLedger",
    "TransferStats",
    "engine_seconds",
    "no_prometheus_logger",
    "transfer_stat_logger",
]


@dataclass
class TransferLedger:
    """NIXL statistics of one request, when it was alone in flight on its engine."""

    bytes: int = 0
    seconds: float = 0.0
    expired: int = 0
    shared: bool = False
    """Another request was in flight at the same time: bytes and seconds are not this one's alone."""


class PrefillStatsKeeper(collections.OrderedDict[str, Any]):
    """vLLM's ``PrefillStats`` (the local/external prefix-cache split) of one engine's requests, by request id, as
    ``keep_prefill_stats`` (``src/_agentkv_vllm/_patches.py``) stores them; `take` hands one over, once.

    The oldest beyond `LIMIT` age out: stats nobody takes (the server's chat requests, which no completion reply
    reads; an in-process pin's release) are not kept for ever.
    """

    LIMIT = 4096

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        while len(self) > self.LIMIT:
            self.popitem(last=False)

    def take(self, request_id: str) -> Any:
        """The request's ``PrefillStats`` (None when none were stored), no longer kept."""
        return self.pop(request_id, None)


@dataclass
class Readouts:
    """One engine's read-outs: the prefill stats of finished requests, and the ledgers of those in flight."""

    prefill_stats: PrefillStatsKeeper = field(default_factory=PrefillStatsKeeper)
    in_flight: dict[str, TransferLedger] = field(default_factory=dict[str, TransferLedger])
    last_report: tuple[Any, float] | None = None
    """The scheduler's last ``SchedulerStats`` and when it came (``time.perf_counter()``); None before the first
    step. Kept as vLLM made it: it is read only when an error needs it (`scheduler`), not at every step."""

    def observe(self, stats: Any) -> None:
        self.last_report = (stats, time.perf_counter())

    @property
    def scheduler(self) -> SchedulerSnapshot | None:
        """The scheduler's last report (None before the first step)."""
        return SchedulerSnapshot.parse(*self.last_report) if self.last_report is not None else None

    def describe(self) -> str:
        """The scheduler's last report in words, for an error about a stalled engine."""
        snapshot = self.scheduler
        if snapshot is None:
            return "no scheduler report yet"
        return snapshot.describe(now=time.perf_counter())

    def attribute(self, moved: TransferStats) -> None:
        """An engine step's transfers: to the request in flight when it is alone, else marked shared."""
        ledgers = list(self.in_flight.values())
        for ledger in ledgers:
            ledger.expired += moved.expired
            if len(ledgers) == 1:
                ledger.bytes += moved.bytes
                ledger.seconds += moved.seconds
            elif moved.bytes:
                ledger.shared = True


@dataclass(frozen=True)
class TransferStats:
    """NIXL statistics of one engine step, summed over its transfers (vLLM ``kv_connector_stats``)."""

    bytes: int
    seconds: float
    expired: int
    """Reads P declined because D's blocks had expired (``num_kv_expired_reqs``)."""

    @classmethod
    def parse(cls, data: dict[str, Any]) -> TransferStats:
        return cls(
            bytes=int(sum(data.get("bytes_transferred", ()))),
            seconds=float(sum(data.get("transfer_duration", ()))),
            expired=len(data.get("num_kv_expired_reqs", ())),
        )


class SchedulerSnapshot(NamedTuple):
    """What an engine's scheduler reported after one step (vLLM ``SchedulerStats``), and when."""

    running: int
    """Requests the scheduler runs (prefilling or decoding)."""
    waiting: int
    """Requests not yet scheduled (waiting for blocks, or for KV from another engine)."""
    deferred: int
    """Waiting requests the scheduler skipped (blocked, e.g. on KV still arriving)."""
    fetching: dict[str, int]
    """Requests loading KV from another engine, by stage."""
    kv_cache_usage: float
    at: float
    """``time.perf_counter()`` when the report arrived."""

    @classmethod
    def parse(cls, stats: Any, at: float) -> SchedulerSnapshot:
        return cls(
            running=int(getattr(stats, "num_running_reqs", 0)),
            waiting=int(getattr(stats, "num_waiting_reqs", 0)),
            deferred=int(getattr(stats, "num_skipped_waiting_reqs", 0)),
            fetching={k: int(v) for k, v in (getattr(stats, "num_kv_fetch_reqs_by_stage", None) or {}).items() if v},
            kv_cache_usage=float(getattr(stats, "kv_cache_usage", 0.0)),
            at=at,
        )

    def describe(self, *, now: float) -> str:
        fetching = ", ".join(f"{n} {stage}" for stage, n in sorted(self.fetching.items()))
        return (
            f"{self.running} running, {self.waiting} waiting ({self.deferred} deferred)"
            + (f", fetching KV: {fetching}" if fetching else "")
            + f", KV cache {self.kv_cache_usage:.0%} used, reported {max(0.0, now - self.at):.1f} s ago"
        )


def transfer_stat_logger(
    on_stats: Callable[[TransferStats], None], on_scheduler: Callable[[Any], None] | None = None
) -> Callable[..., Any]:
    """A vLLM stat logger class that hands each step's NIXL statistics to ``on_stats``, and the scheduler's report
    (vLLM's ``SchedulerStats``, as it is) to ``on_scheduler``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class TransferStatLogger(StatLoggerBase):  # type: ignore[misc]  # vLLM is not type-checked here
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            if scheduler_stats is None:
                return
            if on_scheduler is not None:
                on_scheduler(scheduler_stats)
            data = getattr(scheduler_stats, "kv_connector_stats", None)
            if data:
                on_stats(TransferStats.parse(data))

        def log_engine_initialized(self) -> None:
            pass

    return TransferStatLogger


def no_prometheus_logger() -> Callable[..., Any]:
    """A vLLM stat logger class that stands in for vLLM's Prometheus logger in an engine inside agentkv's process.

    vLLM adds its `PrometheusStatLogger` to every ``AsyncLLM`` unless a logger given to it is one; that logger first
    unregisters every ``vllm:`` collector of the process's global registry, then registers its own. Two engines in
    one process (a pair) so drop each other's metrics, and when both get ready at once (their loggers are made
    after their engine cores answer, in two threads) one registers between the other's unregistering and
    registering: ``DuplicateTimeseries``, and the engine does not start (measured: every start of a pair in one
    test run, on this 2-core machine under load). agentkv reads what it needs through `transfer_stat_logger` and
    request metrics, and a library's engines have no business in its user's global registry; so in-process
    engines get this logger, which records nothing. Engines that agentkv starts as servers keep vLLM's metrics.
    """
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class NoPrometheusLogger(PrometheusStatLogger):  # type: ignore[misc]  # vLLM is not type-checked here
        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            pass

        def record(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record_admission_rejection(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

    return NoPrometheusLogger


def engine_seconds(output: RequestOutput) -> tuple[float | None, float, float | None]:
    """(prefill_s, wait_s, decode_s) from a finished request's ``RequestStateStats``."""
    metrics = output.metrics
    if metrics is None or not metrics.scheduled_ts:
        return None, 0.0, None
    prefill = metrics.first_token_ts - metrics.scheduled_ts if metrics.first_token_ts else None
    wait = max(0.0, metrics.scheduled_ts - metrics.queued_ts)
    decode = metrics.last_token_ts - metrics.first_token_ts if metrics.first_token_ts else None
    return prefill, wait, decode
