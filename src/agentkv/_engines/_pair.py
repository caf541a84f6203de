"""`EmbeddedPair`: a prefill engine P and a decode engine D in this process, joined by NIXL.

One step (DESIGN.md section 5): P prefills the prompt with ``max_tokens=1``, pulling the
conversation's earlier KV back from D when given D's handle; D pulls from P what it lacks,
decodes, pins its blocks and returns a new handle.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Unpack

import anyio
import anyio.to_thread

from .._errors import EngineDeadError, EngineError, SessionClosedError, UserError
from .._model import prepare_model_off_loop
from ._base import Engine, EngineInfo, Sampling, StepDone, StepEvent, StepRequest, StepTimings, pair_modes, prompt_split
from ._handle import KVHandle, parse_handle, parse_prefill_result, prefill_params, release_params
from ._pair_config import PairConfig, PairSettings, Role, pair_engine_launch
from ._system import free_port, split_cores
from ._vllm import AsyncLLMRunner, DecodeStream, TransferLedger, engine_seconds, vllm_sampling

__all__ = ["EmbeddedPair", "run_warmup_steps"]

logger = logging.getLogger("agentkv")


class EmbeddedPair(Engine):
    """Two vLLM engines (P, D) in the calling process, NIXL between them, push-back on by default.

    Its settings are a `PairConfig`: pass one as ``config``, or its fields as keyword
    arguments (``EmbeddedPair(max_model_len=2048, pin_ttl_s=60)``), or both (the keywords
    replace the config's fields). ``model`` is the config's ``model``.

    Args:
        model: a bundled model name or a local HF folder (default: the bundled SmolLM2-135M).
        config: the pair's settings (default: `PairConfig`'s defaults).
        progress: called with one line per start-up stage (default: the ``agentkv`` logger).
        **settings: `PairConfig` fields (``bidirectional``, ``prefill_prefix_cache``, ``cores``,
            ``max_model_len``, ``kv_cache_gib``, ``pin_ttl_s``, ``recompute_threshold``,
            ``connector_options``, ``idle_poll_ms``, ``warmup``, ``step_timeout_s``).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        config: PairConfig | None = None,
        progress: Callable[[str], None] | None = None,
        **settings: Unpack[PairSettings],
    ) -> None:
        super().__init__()
        self.config = PairConfig.of(config, model, **settings)
        self._progress = progress or (lambda line: logger.info("%s", line))
        self._p: AsyncLLMRunner | None = None
        self._d: AsyncLLMRunner | None = None
        self._info: EngineInfo | None = None

    @property
    def bidirectional(self) -> bool:
        """Whether D pins KV and P can pull it back."""
        return self.config.bidirectional

    @property
    def pin_ttl_s(self) -> float:
        """How long D pins a step's blocks."""
        return self.config.pin_ttl_s

    @property
    def prefill_prefix_cache(self) -> bool:
        """Whether P has its own prefix cache."""
        return self.config.prefill_prefix_cache

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise SessionClosedError(f"the {type(self).__name__} is not open")
        return self._info

    @property
    def pids(self) -> set[int]:
        """Every process the pair started (engine cores and workers of P and D)."""
        return {pid for engine in (self._p, self._d) if engine is not None for pid in engine.pids}

    @property
    def ports(self) -> list[int]:
        """The NIXL side-channel ports of P and D."""
        return [e.side_channel_port for e in (self._p, self._d) if e is not None and e.side_channel_port]

    # ----------------------------------------------------------------- lifecycle

    async def _start(self) -> None:
        config = self.config
        model_path = await prepare_model_off_loop(config.model, progress=self._progress)
        p_cores, d_cores = (list(c) for c in config.cores) if config.cores else split_cores()
        tag = uuid.uuid4().hex[:8]
        roles: tuple[tuple[Role, list[int]], ...] = (("prefill", p_cores), ("decode", d_cores))
        for role, cores in roles:
            launch = pair_engine_launch(
                config,
                role,
                model_path=model_path,
                cores=cores,
                engine_id=f"agentkv-{role}-{tag}",
                side_channel_port=free_port(),
            )
            runner = AsyncLLMRunner(launch)
            if role == "prefill":
                self._p = runner
            else:
                self._d = runner
            await runner.start_async(self._progress)
        self._info = EngineInfo(
            model_path=model_path,
            max_model_len=config.max_model_len,
            modes=pair_modes(push_back=config.bidirectional),
            extra={
                "prefill_cores": p_cores,
                "decode_cores": d_cores,
                "pin_ttl_s": config.pin_ttl_s,
                "prefill_prefix_cache": config.prefill_prefix_cache,
            },
        )

    async def _warm_up(self) -> None:
        if self.config.warmup:
            self._progress("agentkv: warming up (kernels, NIXL handshakes)")
            await run_warmup_steps(self, push_back=self.bidirectional)
        for engine in self._engines():
            engine.repin()  # threads that NIXL started during the handshakes

    async def _stop(self) -> None:
        engines = [e for e in (self._d, self._p) if e is not None]
        for engine in engines:
            await engine.shutdown_async()

    # ----------------------------------------------------------------- one step

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.check_open()
        if request.handle is not None and not self.bidirectional:
            raise UserError("this pair runs without bidirectional transfer: it takes no handle")
        try:
            async with contextlib.aclosing(self._step(request)) as events:  # a caller leaving early closes it now
                async for event in events:
                    yield event
        except EngineDeadError as exc:
            await self._mark_dead(exc)
            raise

    async def _step(self, request: StepRequest) -> AsyncGenerator[StepEvent, None]:
        p, d = self._engines()
        started = time.perf_counter()
        declined = False
        p_out, p_stats, p_ledger = await self._prefill(p, request, request.handle)
        if p_out is None and request.handle is not None:
            # P failed to read D's blocks (expired or failed): the handle is spent; recompute.
            declined = True
            p_out, p_stats, p_ledger = await self._prefill(p, request, None)
        if p_out is None:
            raise EngineError("the prefill engine failed the request")
        handoff = parse_prefill_result(p_out.kv_transfer_params)
        params = vllm_sampling(request.sampling, kv_transfer_params=handoff.as_decode_params(), stream=True)
        stream = DecodeStream(
            d,
            request.prompt_token_ids,
            params,
            f"{request.request_id}-d",
            idle_timeout_s=self.config.step_timeout_s,
            cache_salt=request.cache_salt,
        )
        async with contextlib.aclosing(aiter(stream)) as deltas:
            async for delta in deltas:
                yield delta
        d_out, d_stats, d_ledger = stream.result()
        completion = d_out.outputs[0]
        if completion.finish_reason not in ("stop", "length"):
            raise EngineError(f"the decode engine ended the step with {completion.finish_reason!r}")
        prefill_s, p_wait, _ = engine_seconds(p_out)
        _, d_wait, decode_s = engine_seconds(d_out)
        if p_stats is None:  # vLLM reported no split (not seen in 0.32): say so, rather than guess quietly
            logger.warning("agentkv: vLLM gave no prefill split for a step; its cached tokens are reported as local")
        split = (p_stats.num_local_cached_tokens, p_stats.num_external_cached_tokens) if p_stats is not None else None
        timings = StepTimings(
            ttft_s=stream.first_token_at - started if stream.first_token_at else time.perf_counter() - started,
            prefill_s=prefill_s,
            kv_wait_s=p_wait + d_wait,
            decode_s=decode_s,
            handoff_tokens=d_stats.num_external_cached_tokens if d_stats is not None else 0,
            pullback_declined=declined or p_ledger.expired > 0,
            **_transfer(p_ledger, d_ledger),
            **prompt_split(len(request.prompt_token_ids), split=split, cached_tokens=p_out.num_cached_tokens),
        )
        handle, handle_error = parse_handle(d_out.kv_transfer_params) if self.bidirectional else (None, None)
        yield StepDone(
            token_ids=stream.token_ids,
            text=stream.text,
            finish_reason=completion.finish_reason,
            handle=handle,
            handle_error=handle_error,
            timings=timings,
        )

    async def _prefill(
        self, p: AsyncLLMRunner, request: StepRequest, handle: KVHandle | None
    ) -> tuple[Any, Any, TransferLedger]:
        """Run P to completion; the output is None when P failed (e.g. declined an expired read)."""
        params = vllm_sampling(Sampling(max_tokens=1), kv_transfer_params=prefill_params(handle), stream=False)
        request_id = f"{request.request_id}-p{'h' if handle else ''}"
        final, stats, ledger = await p.run(
            request.prompt_token_ids,
            params,
            request_id,
            timeout_s=self.config.step_timeout_s,
            cache_salt=request.cache_salt,
        )
        if final is None or final.outputs[0].finish_reason == "error" or final.kv_transfer_params is None:
            return None, stats, ledger
        return final, stats, ledger

    # ----------------------------------------------------------------- pins

    async def release(self, handle: KVHandle) -> None:
        """Have D free the blocks ``handle`` pins, now rather than at their expiry.

        vLLM 0.32 has no call that frees a pin. What frees one is P's notification after a
        read, and P also sends it when it finds nothing to read (a full local hit). So P gets
        a one-token request carrying the handle with ``remote_num_tokens=0``: P reads
        nothing, notifies D, and D frees the blocks. The request is aborted after its first
        token, so that P does not keep its own block leased for a D that never comes. A pin
        within 10 s of its expiry is left to expire (D counts a notification that comes after
        expiry as an error).
        """
        if not self.is_open or self.is_dead or not self.bidirectional or self._p is None:
            return
        if time.perf_counter() + _RELEASE_MARGIN_S >= handle.remote_blocks_expiry_time:
            return
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=_RELEASE_MAX_TOKENS,
            ignore_eos=True,
            temperature=0.0,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": release_params(handle)},
        )
        outputs = self._p.generate([_RELEASE_TOKEN], params, f"agentkv-release-{uuid.uuid4().hex}", in_ledger=False)
        try:
            with anyio.fail_after(self.config.step_timeout_s):
                await anext(outputs)  # P has notified D before its first token
        except Exception as exc:  # best effort: a pin that is not released expires on D
            logger.debug("agentkv: releasing a pin failed: %s", exc)
        finally:
            await outputs.aclose()  # aborts the rest

    # ----------------------------------------------------------------- engines

    def _engines(self) -> tuple[AsyncLLMRunner, AsyncLLMRunner]:
        if self._p is None or self._d is None:
            raise SessionClosedError(f"the {type(self).__name__} is not open")
        for engine in (self._p, self._d):
            if engine.errored:
                raise EngineDeadError(f"the {engine.name} engine died")
        return self._p, self._d

    async def _mark_dead(self, exc: BaseException) -> None:
        if self._dead is None:
            logger.error("agentkv: an engine of the pair died; stopping the pair: %s", exc)
            self._dead = exc
            await self.aclose()


_RELEASE_MARGIN_S = 10.0
"""A pin closer than this to its expiry is left to expire (P declines reads within 5 s of it)."""
_RELEASE_TOKEN = 0
_RELEASE_MAX_TOKENS = 64
"""Far more than P runs before the abort arrives (a finished request would keep its block leased)."""


def _transfer(*ledgers: TransferLedger) -> dict[str, Any]:
    if any(ledger.shared for ledger in ledgers):
        return {"kv_bytes": None, "kv_transfer_s": None}
    return {
        "kv_bytes": sum(ledger.bytes for ledger in ledgers),
        "kv_transfer_s": sum(ledger.seconds for ledger in ledgers),
    }


async def run_warmup_steps(pair: Engine, *, push_back: bool) -> None:
    """Two short steps (the second pushing the first one's handle back): kernels and NIXL handshakes run now.

    The second prompt extends exactly what D holds (the first prompt and its output), and the
    handle goes through `choose_handle`, the rule every session step obeys. The last pin is
    released: nothing of the warm-up stays parked on D.
    """
    from .._pinning import Pin, choose_handle

    prompt = [1] + [28] * 300  # two CPU blocks of one repeated token: shapes and handshakes only
    pin: Pin | None = None
    for _ in range(2 if push_back else 1):
        handle, _reason = choose_handle(pin, prompt, push_back=push_back, expiry_margin_s=_RELEASE_MARGIN_S)
        request = StepRequest(
            request_id=f"agentkv-warmup-{uuid.uuid4().hex}",
            prompt_token_ids=prompt,
            sampling=Sampling(max_tokens=4),
            handle=handle,
        )
        done: StepDone | None = None
        async for event in pair.step(request):
            if isinstance(event, StepDone):
                done = event
        assert done is not None
        held = prompt + list(done.token_ids)
        pin = Pin(done.handle, held, done.handle_deadline) if done.handle is not None else None
        prompt = held + [28] * 40
    if pin is not None:
        await pair.release(pin.handle)
