"""Keep idle engines idle: two vLLM/NIXL busy loops, made to sleep until there is work.

Measured on a 2-core machine with vLLM 0.32 and nixl 1.5, an embedded pair with nothing to
do kept about 1.8 cores busy, so a second pair, or the model itself, starved:

* **NIXL's UCX progress thread.** nixl's Python agent always asks for ``pthrDelay = 0``,
  and the UCX backend's shared progress thread then calls ``poll()`` with a zero timeout in
  a loop. Given a delay, the same thread blocks in ``poll()`` on the UCX workers' event
  descriptors: it wakes when traffic arrives, or after the delay at the latest (NIXL keeps
  that timeout as a fallback for events that do not wake ``poll``).
* **The engine core loop while KV is parked.** A request whose blocks wait to be read by
  the peer (D's pinned conversation KV under bidirectional transfer, P's prefill until D
  pulls it) keeps the engine core stepping every millisecond, each step a round trip to
  the worker process, for as long as the pin lives (minutes). When nothing but parked KV
  is left, the patched loop instead waits on its input queue for up to the poll interval:
  a new request wakes it at once, so no request waits; the parked blocks' bookkeeping
  (a finished read, an expired pin) is seen within one interval.
* **The worker's wait for the next step.** A vLLM worker spins (``sched_yield``) for a
  second after every step before it sleeps on its shared-memory queue, so even one poll a
  second kept it spinning. Its spin is cut to :data:`WORKER_SPIN_S`: longer than the gap
  between back-to-back steps, far shorter than the poll interval. A sleeping worker is
  woken by vLLM's own notification socket.

agentkv sets the variables of :func:`idle_env` in the environment of the engines it
starts. This module is registered as a vLLM general plugin (``pyproject.toml``), so vLLM
calls :func:`install` in every process it starts; without the variables it does nothing.
"""

from __future__ import annotations

import logging
import os
import queue
from typing import Any

__all__ = ["install", "idle_env"]

NIXL_DELAY_ENV = "AGENTKV_NIXL_PROGRESS_DELAY_US"
PARKED_POLL_ENV = "AGENTKV_PARKED_KV_POLL_MS"

WORKER_SPIN_S = 0.002

logger = logging.getLogger("agentkv")


def idle_env(poll_ms: int | None) -> dict[str, str]:
    """The environment that makes an engine poll every ``poll_ms`` when idle (none: busy loops)."""
    if poll_ms is None:
        return {}
    return {NIXL_DELAY_ENV: str(poll_ms * 1000), PARKED_POLL_ENV: str(poll_ms)}


def install() -> None:
    """Apply what the environment asks for, in this process (vLLM calls it in each one)."""
    if delay_us := os.environ.get(NIXL_DELAY_ENV):
        _give_nixl_agents_a_delay(int(delay_us))
    if poll_ms := os.environ.get(PARKED_POLL_ENV):
        _wait_for_input_while_only_parked(int(poll_ms) / 1000)
        _shorten_worker_spin(WORKER_SPIN_S)


# ------------------------------------------------------------------------- NIXL


class _BindingsWithDelay:
    """nixl's binding module, except that agents are created with a progress-thread delay."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        self.delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 (nixl's name)
        config.pthrDelay = self.delay_us
        return self._bindings.nixlAgent(name, config)


def _give_nixl_agents_a_delay(delay_us: int) -> None:
    # vLLM sets this before its own first nixl import; importing nixl here comes first.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        import nixl._api as nixl_api  # pyright: ignore[reportMissingImports]
    except ImportError:
        return
    bindings = nixl_api.nixlBind
    if isinstance(bindings, _BindingsWithDelay):
        bindings.delay_us = delay_us
    else:
        nixl_api.nixlBind = _BindingsWithDelay(bindings, delay_us)


# ------------------------------------------------------------------ engine core

_PATCHED_MARK = "_agentkv_parked_poll_s"


def _wait_for_input_while_only_parked(poll_s: float) -> None:
    from vllm.v1.engine.core import EngineCoreProc

    if getattr(EngineCoreProc, _PATCHED_MARK, None) is not None:
        setattr(EngineCoreProc, _PATCHED_MARK, poll_s)
        return
    step = EngineCoreProc._process_engine_step

    def step_then_wait_if_only_parked(self: Any) -> bool:
        model_executed: bool = step(self)
        if not model_executed and _only_parked_kv(self):
            try:
                request = self.input_queue.get(timeout=getattr(EngineCoreProc, _PATCHED_MARK))
            except queue.Empty:
                pass
            else:
                self._handle_client_request(*request)
        return model_executed

    EngineCoreProc._process_engine_step = step_then_wait_if_only_parked  # type: ignore[method-assign]
    setattr(EngineCoreProc, _PATCHED_MARK, poll_s)


def _only_parked_kv(core: Any) -> bool:
    """Nothing to run or receive: the scheduler only holds finished requests' blocks."""
    scheduler = core.scheduler
    return not (
        core.engines_running or core.batch_queue or scheduler.has_unfinished_requests() or scheduler.finished_req_ids
    )


# ----------------------------------------------------------------------- worker


def _shorten_worker_spin(spin_s: float) -> None:
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    if getattr(SpinCondition, _PATCHED_MARK, None) is not None:
        return
    init = SpinCondition.__init__

    def init_with_short_spin(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = min(self.busy_loop_s, spin_s)

    SpinCondition.__init__ = init_with_short_spin  # type: ignore[method-assign]
    setattr(SpinCondition, _PATCHED_MARK, spin_s)
