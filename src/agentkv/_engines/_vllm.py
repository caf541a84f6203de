"""One in-process vLLM ``AsyncLLM`` engine, as the embedded pair and the colocated engine use it.

It owns what one engine needs from its host: its cores, its NIXL side-channel port, its
process tree (so close can prove nothing is left), and two read-outs vLLM has but does not
return per request: the local/external prefix-cache split (``EngineCoreOutput.prefill_stats``,
read in the output processor) and the NIXL transfer statistics (a stat logger: see
``src/agentkv/_engines/_vllm_readouts.py``). `DecodeStream` streams one request of it as a step's
`TokenDelta`s and ends the step (`DecodeStream.done`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from _agentkv_vllm._cores import CoreSlot
from _agentkv_vllm._patches import keep_prefill_stats, stop_output_handler

from .._errors import EngineDeadError, EngineError, EngineStartError, UserError
from ._base import Pin, StepDone, StepTimings, TokenDelta, TokenLogprob
from ._engine_launch import EngineLaunch
from ._spawn import SpawnTurn, ipc_folder, quiet_env, remove_ipc_folder, spawn_turn, stop_signals_blocked
from ._start_log import record_engine_start
from ._system import descendants, kill_and_reap, repin_threads
from ._vllm_features import check_vllm_version, warn_engine_features
from ._vllm_readouts import Readouts, TransferLedger, no_prometheus_logger, transfer_stat_logger
from ._vllm_sampling import could_stop, first_token_of_prefill, refused, vllm_logprobs, vllm_sampling
from ._watchdog import forget_pids, stop_watching, watch_pids

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = [
    "AsyncLLMRunner",
    "EngineRequest",
    "check_vllm_version",
    "could_stop",
    "first_token_of_prefill",
    "vllm_sampling",
]

logger = logging.getLogger("agentkv")

# How long an engine core may take to stop before vLLM kills it (vLLM's default: 5 s). Its
# workers alone took 2-3 s to exit on a loaded 2-core machine, and a core killed before it
# finishes leaves its shared memory and semaphores behind (docs/vllm-patches.md).
_SHUTDOWN_TIMEOUT_S = 30.0

# Engines still running at interpreter exit are stopped then, while the interpreter is whole
# (left to vLLM's __del__, shutdown fails and workers are force-killed). The one exit hook
# of agentkv: after it, the watchdog (which covers deaths that skip exit hooks) is let go.
_RUNNING: weakref.WeakSet[AsyncLLMRunner] = weakref.WeakSet()


def _at_exit() -> None:
    stopping = [threading.Thread(target=e.shutdown, name=f"agentkv-stop-{e.name}") for e in list(_RUNNING)]
    for thread in stopping:  # all at once: each engine takes seconds to exit
        thread.start()
    for thread in stopping:
        thread.join()
    stop_watching()


def _stop_first_at_exit() -> None:
    """Make `_at_exit` the first exit hook to run (hooks run last-registered first). vLLM's engine client
    registers its own clean-up (a ``weakref.finalize``) when it is built; had it run first, it would stop the
    engine core with vLLM's 5-s timeout, not `_SHUTDOWN_TIMEOUT_S`: a script that ended with its pair open
    had its engine cores and workers killed mid-exit, and their shared memory left behind."""
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


_stop_first_at_exit()


@dataclass(frozen=True)
class EngineRequest:
    """One request to a vLLM engine: its prompt's token ids, sampling parameters and id, the salt of its
    prefix-cache keys (None: vLLM's default) and its priority (lower first, where the engine schedules by
    priority)."""

    prompt_token_ids: Sequence[int]
    params: SamplingParams
    request_id: str
    cache_salt: str | None = None
    priority: int = 0


class AsyncLLMRunner:
    """One ``AsyncLLM`` with its own cores, port and process tree: a part of an `Engine`, not one.

    `EmbeddedPair` runs two (P and D), `Colocated` one; each starts, feeds and stops its runners.
    """

    def __init__(self, launch: EngineLaunch, *, core_slot: CoreSlot | None = None) -> None:
        self.launch = launch
        self.name = launch.name
        self.cores = list(launch.home_cores or launch.cores or [])
        """The cores every thread of the engine stays on (its compute threads are bound finer, to ``launch.cores``)."""
        self.side_channel_port = launch.side_channel_port
        self.pids: set[int] = set()
        self._llm: AsyncLLM | None = None
        self._readouts = Readouts()
        self.core_slot = core_slot
        """The engine's slot in the host's `CoreTable`: the requests in flight, for engines that borrow cores;
        released when the engine stops."""
        self.in_flight = 0
        """Requests sent to the engine that have not ended."""
        self.keeps_prefill_stats = True
        """Whether each request's prefill split is read out (False where vLLM lacks the targets: docs/vllm-patches.md)."""
        self._ipc_folder: str | None = None
        """The folder of the engine's ZMQ IPC sockets while it runs (`ipc_folder`)."""

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the engine (blocking, ~20 s on CPU): call it from a worker thread.

        The engine's environment (``launch.env``: its cores or its GPUs, its NIXL side-channel port, the
        plugin's settings) is set in this process while ``AsyncLLM`` is built, until its engine-core process
        exists (`spawn_turn`: engines of one process take turns for that part, then wait for their cores at
        the same time). That is where it takes effect: vLLM's checks in this process read it, and the
        engine-core process (forked or spawned) inherits it as it is at that moment; the engine core starts
        the workers (one per GPU with tensor parallelism), which inherit its environment in turn. So an
        engine given ``CUDA_VISIBLE_DEVICES=2,3`` computes on devices 2 and 3 only (its workers see them as
        ``cuda:0`` and ``cuda:1``), and the next engine, built after the variable is restored, sees its own.
        The checks vLLM makes in this process while building (e.g. the tensor-parallel size against the
        device count) see the engine's devices too: vLLM counts them through NVML, cached per value of the
        variable, without initialising CUDA here. Were CUDA already initialised in this process (by the
        caller), vLLM spawns its processes instead of forking them; they inherit the environment all the same.
        """
        warn_engine_features(self.launch.env)  # an untested vLLM, a feature whose targets moved: one warning each
        record_engine_start(kind="in-process", role=self.name)
        turn = SpawnTurn()
        self._ipc_folder = ipc_folder(self.name)
        env = {**quiet_env(), "VLLM_RPC_BASE_PATH": self._ipc_folder, **self.launch.env}
        try:
            with spawn_turn(env) as turn, stop_signals_blocked():
                self._llm = self._build()
        except Exception as exc:
            remove_ipc_folder(self._ipc_folder)  # what the failed start left running is reaped by the caller's shutdown
            log = f" (the engine's output: {turn.log_path})" if turn.log_path is not None else ""
            raise EngineStartError(f"the {self.name} engine did not start{log}: {exc}") from exc
        finally:
            self.pids = turn.processes()
        _RUNNING.add(self)
        _stop_first_at_exit()
        watch_pids(self.pids)
        self.keeps_prefill_stats = keep_prefill_stats(self.llm, self._readouts.prefill_stats)
        self.repin()
        logger.info("agentkv: %s engine up on %s (pids %s)", self.name, self.launch.where, sorted(self.pids))

    def _build(self) -> AsyncLLM:
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        settings = {"use_tqdm_on_load": False, **self.launch.engine_args}  # no progress bars in the caller's terminal
        if (kv_transfer := settings.pop("kv_transfer_config", None)) is not None:
            settings["kv_transfer_config"] = KVTransferConfig(**kv_transfer)
        # request metrics (RequestStateStats) need stats on
        args = AsyncEngineArgs(**settings, disable_log_stats=False)
        loggers = [self._stat_logger_factory(), no_prometheus_logger()]  # no vLLM metrics in the user's registry
        return AsyncLLM.from_engine_args(args, stat_loggers=loggers)

    async def start_async(self, progress: Callable[[str], None]) -> None:
        """`start` in a worker thread, with a progress line before and after."""
        progress(f"agentkv: starting the {self.name} engine on {self.launch.where}")
        started = time.perf_counter()
        await anyio.to_thread.run_sync(self.start)
        progress(f"agentkv: {self.name} engine up in {time.perf_counter() - started:.0f} s")

    async def shutdown_async(self) -> None:
        """`shutdown` in a worker thread; a process that had to be killed is logged."""
        killed = await anyio.to_thread.run_sync(self.shutdown)
        if killed:
            logger.warning("agentkv: %s engine processes %s had to be killed", self.name, sorted(killed))

    def repin(self) -> None:
        """Keep every thread of this engine's processes on its own cores (see `repin_threads`); an engine
        without cores of its own (on a GPU host) is left as vLLM placed it."""
        if not self.cores:
            return
        found = {child for pid in self.pids for child in descendants(pid)} - self.pids
        if found:
            self.pids |= found
            watch_pids(found)
        moved = repin_threads(self.pids, self.cores)
        if moved:
            logger.debug("agentkv: re-pinned %d threads of the %s engine to cores %s", moved, self.name, self.cores)

    def shutdown(self) -> set[int]:
        """Stop the engine and wait for its processes; returns pids that had to be killed."""
        llm, self._llm = self._llm, None
        _RUNNING.discard(self)
        if llm is not None:
            try:
                stop_output_handler(llm)
                llm.shutdown(timeout=_SHUTDOWN_TIMEOUT_S)
            except Exception:  # a dead engine may fail to shut down cleanly; its processes are reaped below
                logger.debug("agentkv: %s engine shutdown raised", self.name, exc_info=True)
            del llm
            gc.collect()  # run AsyncLLM.__del__ now, while the interpreter is whole
        killed = kill_and_reap(self.pids)
        forget_pids(self.pids)
        remove_ipc_folder(self._ipc_folder)
        self._ipc_folder = None
        if self.core_slot is not None:
            self.core_slot.release()
        return killed

    @property
    def llm(self) -> AsyncLLM:
        """The running engine."""
        if self._llm is None:
            raise EngineError(f"the {self.name} engine is not running")
        return self._llm

    @property
    def num_blocks(self) -> int:
        """Blocks in the engine's KV cache (vLLM ``cache_config.num_gpu_blocks``, set once the engine started)."""
        return int(self.llm.vllm_config.cache_config.num_gpu_blocks or 0)

    @property
    def block_size(self) -> int:
        """Tokens per KV block (a prefix cache holds whole blocks only)."""
        return int(self.llm.vllm_config.cache_config.block_size)

    @property
    def errored(self) -> bool:
        """Whether vLLM reports the engine dead."""
        return self._llm is not None and self._llm.errored

    # ----------------------------------------------------------------- requests

    async def generate(
        self, request: EngineRequest, *, in_ledger: bool = True, busy_from_first_output: bool = False
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream ``RequestOutput``s for one request, with errors translated to agentkv's.

        A request that runs to its end keeps its read-outs for `finish`; one that ends any
        other way (error, timeout, cancellation, the caller leaving early) drops them, so
        that it is not counted as in flight beside later requests. A request that moves no
        KV of a step (``in_ledger=False``: a pin's release) is not counted at all.

        ``busy_from_first_output``: the request counts as in flight (for the core table) only
        from its first output on: a push D waits, computing nothing, while P prefills, and P
        may use D's cores meanwhile.
        """
        from vllm.inputs import TokensPrompt

        llm = self.llm
        request_id = request.request_id
        if in_ledger:
            self._readouts.in_flight[request_id] = TransferLedger()
        ran_to_end = False
        counted = not busy_from_first_output
        if counted:
            self._count_request(1)
        try:
            prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
            if request.cache_salt is not None:
                prompt["cache_salt"] = request.cache_salt
            generated = llm.generate(prompt, request.params, request_id, priority=request.priority)
            async with contextlib.aclosing(generated) as outputs:
                async for output in outputs:  # closing vLLM's generator early aborts the request
                    if not counted:
                        counted = True
                        self._count_request(1)
                    yield output
            ran_to_end = True
        except Exception as exc:
            if isinstance(exc, EngineError | UserError):
                raise
            from vllm.exceptions import VLLMClientError
            from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError

            if isinstance(exc, VLLMClientError):  # refused when added: the engine did nothing
                raise refused(exc) from exc
            if llm.errored or isinstance(exc, VLLMEngineDeadError):  # the flag can lag the error
                raise EngineDeadError(f"the {self.name} engine died: {exc}") from exc
            raise EngineError(f"the {self.name} engine failed a request: {exc}") from exc
        finally:
            if counted:
                self._count_request(-1)
            if not ran_to_end:
                self.forget(request_id)

    def check(self, params: SamplingParams) -> None:
        """vLLM's checks of ``params`` against this engine's model (vocabulary, logprobs limit, bad words,
        grammar), as vLLM makes them when a request is added: refused, `UserError` naming the field. A pair
        checks D's before P works; a request's own refusal (`generate`) comes before any engine work too."""
        from vllm.exceptions import VLLMError

        llm, trial = self.llm, params.clone()
        config = llm.vllm_config
        try:
            trial.verify(llm.model_config, config.speculative_config, config.structured_outputs_config, llm.tokenizer)
            if llm.tokenizer is not None:
                trial.update_from_tokenizer(llm.tokenizer)
        except (ValueError, VLLMError) as exc:
            raise refused(exc) from exc

    def _count_request(self, delta: int) -> None:
        self.in_flight = max(0, self.in_flight + delta)
        if self.core_slot is not None:
            self.core_slot.set_in_flight(self.in_flight)

    async def run(
        self, request: EngineRequest, *, timeout_s: float, hold_ledger: bool = False
    ) -> tuple[RequestOutput | None, Any, TransferLedger]:
        """Run a request to its end: (final output or None, ``PrefillStats`` or None, transfer ledger).

        A request not done within ``timeout_s`` is aborted and raises `EngineError`. With
        ``hold_ledger`` the ledger goes on counting the engine's transfers after the request ended
        (a push P writes once its request is done) until `forget` is called.
        """
        final: RequestOutput | None = None
        try:
            with anyio.fail_after(timeout_s):
                async for output in self.generate(request):
                    final = output
        except TimeoutError as exc:
            raise EngineError(f"the {self.name} engine did not finish a request within {timeout_s} s") from exc
        if hold_ledger:
            ledger = self._readouts.in_flight.get(request.request_id, TransferLedger(shared=True))
            return final, self._readouts.prefill_stats.take(request.request_id), ledger
        stats, ledger = self.finish(request.request_id)
        return final, stats, ledger

    def finish(self, request_id: str) -> tuple[Any, TransferLedger]:
        """Take a finished request's prefill stats (or None) and its transfer ledger."""
        ledger = self._readouts.in_flight.pop(request_id, TransferLedger(shared=True))
        return self._readouts.prefill_stats.take(request_id), ledger

    def forget(self, request_id: str) -> None:
        """Drop the read-outs of a request that will not finish (aborted)."""
        self._readouts.in_flight.pop(request_id, None)
        self._readouts.prefill_stats.take(request_id)

    # ----------------------------------------------------------------- read-outs

    def _stat_logger_factory(self) -> Callable[..., Any]:
        return transfer_stat_logger(self._readouts.attribute, self._readouts.observe)

    def describe_state(self) -> str:
        """The scheduler's last report in words (running, waiting, KV loading, cache use), for errors."""
        return f"{self.name}: {self._readouts.describe()}"


class DecodeStream:
    """Iterate a decoding request as `TokenDelta`s; afterwards `result()` holds the rest.

    Shared by the pair (D's half of a step) and the colocated engine (the whole step).
    """

    def __init__(
        self,
        engine: AsyncLLMRunner,
        request: EngineRequest,
        *,
        idle_timeout_s: float,
        busy_from_first_output: bool = False,
        describe_also: Callable[[], str] | None = None,
    ) -> None:
        self._engine = engine
        self._describe_also = describe_also
        """What a stall's error also reports, beside this engine's scheduler (the pair's P and D's pins)."""
        self._busy_from_first_output = busy_from_first_output
        self._request = request
        self._idle_timeout_s = idle_timeout_s
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if request.params.logprobs is not None else None
        """One per token of `token_ids` when ``params`` ask for logprobs, else None."""
        self._text: list[str] = []
        self.first_token_at: float | None = None
        self._final: RequestOutput | None = None
        self._result: tuple[Any, Any, TransferLedger] | None = None

    @property
    def text(self) -> str:
        """The output text so far."""
        return "".join(self._text)

    async def __aiter__(self) -> AsyncGenerator[TokenDelta, None]:
        outputs = self._engine.generate(self._request, busy_from_first_output=self._busy_from_first_output)
        try:
            while True:
                with anyio.fail_after(self._idle_timeout_s):
                    try:
                        output = await anext(outputs)
                    except StopAsyncIteration:
                        break
                completion = output.outputs[0]
                if completion.token_ids and self.first_token_at is None:
                    self.first_token_at = time.perf_counter()
                self.token_ids.extend(completion.token_ids)
                self._text.append(completion.text)
                self._final = output
                logprobs = None
                if self.logprobs is not None:
                    logprobs = vllm_logprobs(completion.token_ids, completion.logprobs, self._request.params.logprobs)
                    self.logprobs.extend(logprobs)
                if completion.token_ids or completion.text:
                    yield TokenDelta(token_ids=list(completion.token_ids), text=completion.text, logprobs=logprobs)
        except TimeoutError as exc:
            states = self._engine.describe_state()
            if self._describe_also is not None:
                states += f"; {self._describe_also()}"
            raise EngineError(
                f"the {self._engine.name} engine made no progress for {self._idle_timeout_s} s ({states})"
            ) from exc
        finally:
            await outputs.aclose()  # a request left early is aborted, and its read-outs dropped
        stats, ledger = self._engine.finish(self._request.request_id)
        self._result = (self._final, stats, ledger)

    def result(self) -> tuple[Any, Any, TransferLedger]:
        """(final ``RequestOutput``, ``PrefillStats`` or None, transfer ledger)."""
        if self._result is None or self._result[0] is None:
            raise EngineError(f"the {self._engine.name} engine returned no output")
        return self._result

    def finished(self) -> tuple[Any, Any, TransferLedger, Any]:
        """`result` and the final output's completion; an output that did not end normally is an error."""
        output, stats, ledger = self.result()
        completion = output.outputs[0]
        if completion.finish_reason not in ("stop", "length"):
            raise EngineError(f"the {self._engine.name} engine ended the step with {completion.finish_reason!r}")
        return output, stats, ledger, completion

    def done(
        self,
        completion: Any,
        timings: StepTimings,
        *,
        first: TokenDelta | None = None,
        pin: Pin | None = None,
        pin_error: str | None = None,
    ) -> StepDone:
        """The step's end: its tokens (``first``, the answer's first token when another engine streamed it,
        then this stream's), its finish reason and timings, and the pin its engine keeps."""
        logprobs = self.logprobs
        if first is not None and logprobs is not None:
            logprobs = [*(first.logprobs or ()), *logprobs]
        return StepDone(
            token_ids=[*first.token_ids, *self.token_ids] if first is not None else self.token_ids,
            text=first.text + self.text if first is not None else self.text,
            finish_reason=completion.finish_reason,
            pin=pin,
            pin_error=pin_error,
            timings=timings,
            logprobs=logprobs,
            stopped_by_string=isinstance(getattr(completion, "stop_reason", None), str),
        )
