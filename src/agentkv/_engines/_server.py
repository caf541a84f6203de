"""agentkv's vLLM server: vLLM's own OpenAI API server, plus what a stateful client needs.

Run as ``python -m agentkv._engines._server <vllm serve arguments>`` (``LaunchedPair`` and
``agentkv engine`` build that command). It is vLLM's server unchanged, with one addition (made in ``src/_agentkv_vllm/_patches.py``):
every ``/v1/completions`` response carries an ``agentkv`` object, and a streamed response
ends with one more chunk (no choices) that carries it and the ``kv_transfer_params``. Requests are
vLLM's: every sampling field a client sends (``completion_body`` in ``_http_transport.py``) reaches
vLLM as sent, and its refusals are vLLM's 400s.

vLLM 0.32 returns the KV handle only in non-streamed responses, so a client that streams
tokens from D never sees it and cannot push it back (upstream PR #40186 adds it to the
last chunk). The ``agentkv`` object holds what the embedded engines read in-process::

    {"prefill": {"local": 2816, "external": 12, "computed": 40} | null,   # PrefillStats
     "seconds": {"prefill": 0.14, "wait": 0.01, "decode": 0.8},           # RequestStateStats
     "nixl": {"bytes": 123, "seconds": 0.01, "expired": 0},               # totals since start
     "clock": 22914.9,                                                    # the server's perf_counter()
     "features_off": {"auto placement": "..."},                           # what this server cannot do
     "versions": {"vllm": "0.32.0", "nixl": "1.5.1", "nixl_handshake": 14}}  # what P and D must agree on

``nixl`` holds the server's running NIXL totals (what the reading side recorded, as vLLM's
``kv_connector_stats``); a client that knows it was the server's only user between two
responses takes the difference. ``clock`` lets a client on another host turn D's
``remote_blocks_expiry_time`` (the server's ``time.perf_counter()``) into its own clock.
``features_off`` names the agentkv features a client may ask of this server that it cannot serve
(today one: ``auto placement``, a step on D alone that D pins), with why. ``versions`` says what the server
runs; a pair refuses a P and a D of different NIXL handshake versions at open (``_http_versions.py``).
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._handle import SERVER_EXTRAS_FIELD
from ._vllm_readouts import PrefillStatsKeeper

if TYPE_CHECKING:
    from ._vllm_readouts import TransferStats

__all__ = ["main"]


@dataclass
class _Totals:
    bytes: int = 0
    seconds: float = 0.0
    expired: int = 0

    def add(self, moved: TransferStats) -> None:
        with _LOCK:
            self.bytes += moved.bytes
            self.seconds += moved.seconds
            self.expired += moved.expired


_LOCK = threading.Lock()
_TOTALS = _Totals()
_PREFILL_STATS = PrefillStatsKeeper()


@functools.cache
def _versions() -> dict[str, Any]:
    """What this server runs: vLLM, NIXL, and the NIXL connector's handshake version (which P and D must share)."""
    from importlib import metadata

    from _agentkv_vllm._patches import installed_vllm

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NIXL_CONNECTOR_VERSION
    except Exception:  # moved or absent: the client falls back on the vLLM release
        handshake = None
    else:
        handshake = int(NIXL_CONNECTOR_VERSION)
    try:
        nixl: str | None = metadata.version("nixl")
    except metadata.PackageNotFoundError:
        nixl = None
    return {"vllm": installed_vllm(), "nixl": nixl, "nixl_handshake": handshake}


@functools.cache
def _features_off() -> dict[str, str]:
    """What a client may ask of this server and it cannot serve (probed once, on first reply)."""
    from _agentkv_vllm._patches import AUTO_PLACEMENT, engine_features, probe

    if AUTO_PLACEMENT not in engine_features():
        return {AUTO_PLACEMENT: "the server was not started as an agentkv engine (no AGENTKV_ENGINE)"}
    problem = probe(AUTO_PLACEMENT)
    return {} if problem is None else {AUTO_PLACEMENT: problem}


def _extras(output: Any) -> dict[str, Any]:
    """The ``agentkv`` object for one finished request (a vLLM ``RequestOutput``)."""
    from ._vllm_readouts import engine_seconds

    stats = _PREFILL_STATS.take(output.request_id)
    prefill_s, wait_s, decode_s = engine_seconds(output)
    with _LOCK:
        nixl = {"bytes": _TOTALS.bytes, "seconds": _TOTALS.seconds, "expired": _TOTALS.expired}
    return {
        "prefill": None
        if stats is None
        else {
            "local": stats.num_local_cached_tokens,
            "external": stats.num_external_cached_tokens,
            "computed": stats.num_computed_tokens,
        },
        "seconds": {"prefill": prefill_s, "wait": wait_s, "decode": decode_s},
        "nixl": nixl,
        "clock": time.perf_counter(),
        "features_off": _features_off(),
        "versions": _versions(),
    }


def main() -> None:
    """Run vLLM's OpenAI API server (arguments from ``sys.argv``) with agentkv's additions."""
    from _agentkv_vllm._patches import add_server_readouts

    from ._vllm import check_vllm_version
    from ._vllm_readouts import transfer_stat_logger

    check_vllm_version()
    add_server_readouts(
        extras_field=SERVER_EXTRAS_FIELD,
        extras=_extras,
        stat_logger=transfer_stat_logger(_TOTALS.add),
        prefill_stats=_PREFILL_STATS,
    )
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
