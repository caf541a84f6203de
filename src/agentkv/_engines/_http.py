"""The HTTP pair engine: one step as two ``/v1/completions`` calls, P's then D's.

Shared by `LaunchedPair` (servers agentkv starts) and `RemotePair` (servers someone else
runs). The protocol is the embedded pair's (DESIGN.md section 5), over HTTP: P gets the
prompt as token ids with ``max_tokens=1`` and D's handle, D streams the output (token ids
and text) and, at the end, its new handle.

Three parts: the wire (`PairTransport`: clients, retries, request bodies), what the
servers are (`ServerCapabilities`, probed once at open) and this engine, which runs steps
with both. A handle is single use, so a P request that may have reached P is never sent
again with the same handle: the retry goes without it (the step then reports
``miss_reason="declined"``). D is retried only when the request surely never arrived
(connection refused): P's blocks are D's to read once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import EngineError, EngineUnavailableError, SessionClosedError, UserError
from .._model import prepare_model_off_loop
from ._base import (
    Engine,
    EngineInfo,
    Sampling,
    StepDone,
    StepEvent,
    StepRequest,
    StepTimings,
    TokenDelta,
    pair_modes,
    prompt_split,
)
from ._handle import KVHandle, PushSource, parse_handle, parse_prefill_result, prefill_params, release_params
from ._http_capabilities import ServerCapabilities, ServerKind, probe_servers
from ._http_transport import (
    PairTransport,
    Role,
    ServerReply,
    completion_body,
    never_arrived,
    retrying,
    translated,
)
from ._pair_config import Transfer
from ._push import PushedStep

__all__ = ["HTTPPair", "stock_decode_streaming_error"]

logger = logging.getLogger("agentkv")

_RELEASE_MARGIN_S = 10.0
"""A pin closer than this to its expiry is left to expire (P declines reads within 5 s of it)."""
_RELEASE_MAX_TOKENS = 64
"""Far more than P runs before the client's disconnect aborts the request (a finished one keeps its block leased)."""


@dataclass
class _Baseline:
    """Each server's NIXL totals as of its latest reply (for per-step differences)."""

    totals: dict[str, dict[str, float]] = field(default_factory=dict[str, dict[str, float]])

    def advance(self, role: Role, reply: ServerReply) -> dict[str, float] | None:
        """Record ``reply``'s totals; return the difference from the previous ones."""
        now, before = reply.nixl(), self.totals.get(role)
        if now is None:
            return None
        self.totals[role] = {key: max(now[key], (before or now)[key]) for key in now}
        return None if before is None else {key: now[key] - before[key] for key in now}


def stock_decode_streaming_error(decode_url: str) -> UserError:
    """Why a stock vLLM decode server cannot stream to a session, and what to run instead."""
    return UserError(
        f"the decode server at {decode_url} is a stock vLLM server: its streamed responses carry no "
        "KV handle (vLLM 0.32 returns it only in non-streamed responses), so push-back cannot work, "
        "and with bidirectional_kv_xfer it keeps every step's KV pinned for decoder_kv_blocks_ttl "
        "(480 s) where nothing can free it. Run the decode server with `agentkv engine --role decode` "
        "(streaming and push-back), or pass decode_streaming=False (push-back; each answer arrives whole)."
    )


class HTTPPair(Engine):
    """A P/D pair of vLLM OpenAI API servers, driven with the ``openai`` client.

    Subclasses give the servers' URLs: their `_start` calls `_open_servers`. The rest is shared.
    """

    _agentkv_servers = False
    """The pair started agentkv's own servers: a decode server that streams no handle then lacks agentkv's
    streamed handle on this vLLM (docs/vllm-patches.md), and the pair takes D's answers whole instead."""

    def __init__(
        self,
        model: str | os.PathLike[str] | None,
        *,
        step_timeout_s: float,
        attempts: int,
        warmup: bool,
        progress: Callable[[str], None] | None,
        push_back: bool = True,
        decode_streaming: bool = True,
        exclusive: bool = False,
        transfer: Transfer = "pull",
    ) -> None:
        super().__init__()
        if attempts < 1:
            raise UserError("attempts must be at least 1")
        self._model = model
        self._warmup = warmup
        self._progress = progress or (lambda line: logger.info("%s", line))
        self._transport = PairTransport(attempts=attempts, step_timeout_s=step_timeout_s)
        self._wants_push_back = push_back
        self._decode_streaming = decode_streaming
        self._exclusive = exclusive
        """The pair is the servers' only client: differences of their NIXL totals are this pair's."""
        self._urls = ("", "")
        self._capabilities: ServerCapabilities | None = None
        self._info: EngineInfo | None = None
        self._baseline = _Baseline()
        self._in_flight = 0
        self._started_steps = 0
        self._transfer = transfer
        self._prefill_coordinates: tuple[str, str, int] | None = None
        """P's NIXL engine id, host and side-channel port, which D needs to register for a push."""
        self._retired_engines: set[str] = set()
        """Engine ids of servers that are gone: their handles are dropped, never sent to P."""

    # ----------------------------------------------------------------- what it is

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            self._require_open()
            raise SessionClosedError(f"the {type(self).__name__} is not open")
        return self._info

    @property
    def decode_streaming(self) -> bool:
        """Whether D's tokens are streamed (else one non-streamed reply per step: see `RemotePair`)."""
        return self._decode_streaming

    @property
    def urls(self) -> tuple[str, str]:
        """The URLs of P's and D's servers."""
        return self._urls

    @property
    def capabilities(self) -> ServerCapabilities | None:
        """What the servers are, as probed when the pair opened (None before)."""
        return self._capabilities

    @property
    def handle_in_stream(self) -> bool | None:
        """Whether D's streamed responses carry the KV handle (agentkv's server: yes; stock vLLM 0.32: no)."""
        return self._capabilities.handle_in_stream if self._capabilities else None

    @property
    def server_kind(self) -> ServerKind | None:
        """``"agentkv"`` (agentkv's entry point: exact prefill split, NIXL totals) or ``"vllm"``; None before open."""
        return self._capabilities.server_kind if self._capabilities else None

    # ----------------------------------------------------------------- opening

    async def _open_servers(
        self, prefill_url: str, decode_url: str, *, kind: str, model_path: Path | None = None
    ) -> None:
        """Connect to the servers, probe what they are, and decide once what the pair does.

        ``model_path``: the prepared model folder, when the caller already has it.
        """
        if model_path is None:
            model_path = await prepare_model_off_loop(self._model, progress=self._progress)
        self._urls = (prefill_url, decode_url)
        models = await self._transport.connect(self._urls)
        capabilities = await probe_servers(self._transport, models, attempts=self._transport.attempts)
        if self._decode_streaming and not capabilities.handle_in_stream:
            if not self._agentkv_servers:
                raise stock_decode_streaming_error(decode_url)
            logger.warning(
                "agentkv: the decode server at %s streams no KV handle (agentkv's streamed handle is off on this "
                "vLLM: see its log); each answer arrives whole, push-back still works",
                decode_url,
            )
            self._decode_streaming = False
        if not capabilities.exact_split:
            logger.warning(
                "agentkv: the prefill server at %s is a stock vLLM server: it does not report where cached "
                "tokens came from, so they are all reported as local_hit_tokens (`agentkv engine --role prefill` "
                "reports the split)",
                prefill_url,
            )
        self._capabilities = capabilities
        self._info = EngineInfo(
            model_path=model_path,
            max_model_len=capabilities.max_model_len,
            modes=pair_modes(push_back=self._wants_push_back),
            extra={
                "transport": kind,
                "prefill_url": prefill_url,
                "decode_url": decode_url,
                "server_kind": capabilities.server_kind,
                "transfer": self._transfer,
            },
        )

    async def _reconnect(self, prefill_url: str, decode_url: str) -> None:
        """Point the clients at new URLs of the same servers (a restart): nothing is probed again."""
        self._urls = (prefill_url, decode_url)
        await self._transport.connect(self._urls)
        self._info = dataclasses.replace(
            self.info, extra={**self.info.extra, "prefill_url": prefill_url, "decode_url": decode_url}
        )

    async def _warm_up(self) -> None:
        if self._warmup:
            self._progress("agentkv: warming up the servers (kernels, NIXL handshakes)")
            from ._pair import run_warmup_steps

            await run_warmup_steps(self, push_back=self.info.push_back)

    async def _stop(self) -> None:
        await self._transport.close()

    # ----------------------------------------------------------------- pins

    async def release(self, handle: KVHandle) -> None:
        """Have D free the blocks ``handle`` pins now (see `EmbeddedPair.release`): P reads none of them.

        P gets a one-token prompt with the handle and ``remote_num_tokens=0``, streamed; the
        stream is closed after its first chunk, which aborts the request on P so that P keeps
        no block leased for a D that never comes. Best effort: a failure is logged, the pin expires.
        """
        if not self.is_open or not self.info.push_back or handle.remote_engine_id in self._retired_engines:
            return
        if time.perf_counter() + _RELEASE_MARGIN_S >= handle.remote_blocks_expiry_time:
            return  # a same-host clock is the only one this can check; another host's pin may just expire
        assert self._capabilities is not None
        body = completion_body(
            model=self._capabilities.served_model,
            prompt_token_ids=[0],
            max_tokens=_RELEASE_MAX_TOKENS,
            sampling=Sampling(max_tokens=_RELEASE_MAX_TOKENS),
            kv_transfer_params=release_params(handle),
        )
        body["extra_body"]["ignore_eos"] = True
        try:
            async with contextlib.aclosing(self._transport.stream("prefill", body)) as chunks:
                async for _ in chunks:
                    break  # P has notified D before its first token
        except Exception as exc:  # best effort: a pin that is not released expires on D
            logger.debug("agentkv: releasing a pin failed: %s", exc)

    # ----------------------------------------------------------------- one step

    async def _before_step(self) -> None:
        """Hook: make sure the servers are there (a launched pair restarts a dead one)."""

    async def _server_gone(self) -> str | None:
        """Hook: which server is gone and why, when that is known (a launched pair checks its processes)."""
        return None

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.check_open()
        if request.handle is not None and not self.info.push_back:
            raise UserError("this pair runs without push-back: it takes no handle")
        await self._before_step()
        self._in_flight += 1
        self._started_steps += 1
        alone_from = self._started_steps if self._in_flight == 1 else None
        try:
            async for event in self._step(request, alone_from):
                yield event
        except EngineUnavailableError as exc:
            gone = await self._server_gone()
            if gone is None:
                raise
            raise EngineUnavailableError(f"{gone}; the conversation is kept, and the next step restarts it") from exc
        finally:
            self._in_flight -= 1

    async def _step(self, request: StepRequest, alone_from: int | None) -> AsyncIterator[StepEvent]:
        started = time.perf_counter()
        pushed: PushedStep[tuple[Any, ServerReply | None], tuple[ServerReply, bool]] | None = None
        if self._transfer == "push":
            pushed = await self._pushed_halves(request)
            outputs: AsyncIterator[tuple[Any, ServerReply | None]] = aiter(pushed)
        else:
            p_reply, declined = await self._prefill(request)
            handoff = parse_prefill_result(p_reply.kv_transfer_params)
            body = self._body(
                request, max_tokens=request.sampling.max_tokens, kv_transfer_params=handoff.as_decode_params()
            )
            outputs = self._decode(body)
        token_ids: list[int] = []
        texts: list[str] = []
        first_token_at: float | None = None
        finish_reason: str | None = None
        d_reply = ServerReply()
        async for choice, reply in outputs:
            if reply is not None:
                d_reply = reply
                continue
            ids = list(getattr(choice, "token_ids", None) or [])
            if choice.text and not ids:  # the history is token ids: text alone would break the exact-prefix rule
                raise EngineError("the decode server returned text without token ids (it needs `return_token_ids`)")
            if ids and first_token_at is None:
                first_token_at = time.perf_counter()
            token_ids.extend(ids)
            texts.append(choice.text)
            finish_reason = choice.finish_reason or finish_reason
            if ids or choice.text:
                yield TokenDelta(token_ids=ids, text=choice.text)
        if pushed is not None:
            p_reply, declined = pushed.prefill_result
        if finish_reason not in ("stop", "length"):
            raise EngineError(f"the decode server ended the step with {finish_reason!r}")
        handle, handle_error = parse_handle(d_reply.kv_transfer_params) if self.info.push_back else (None, None)
        p_moved, d_moved = self._baseline.advance("prefill", p_reply), self._baseline.advance("decode", d_reply)
        alone = alone_from is not None and alone_from == self._started_steps and self._exclusive
        yield StepDone(
            token_ids=token_ids,
            text="".join(texts),
            finish_reason=finish_reason,
            handle=handle,
            handle_deadline=_local_deadline(handle, d_reply),
            handle_error=handle_error,
            timings=StepTimings(
                ttft_s=(first_token_at or time.perf_counter()) - started,
                prefill_s=p_reply.seconds("prefill"),
                kv_wait_s=(p_reply.seconds("wait") or 0.0) + (d_reply.seconds("wait") or 0.0),
                decode_s=d_reply.seconds("decode"),
                handoff_tokens=(d_reply.split() or (0, 0))[1],
                pullback_declined=declined or bool(alone and p_moved and p_moved["expired"] > 0),
                **_moved(p_moved, d_moved, alone=alone),
                # a stock server reports one cached count: local and pulled cannot be told apart (warned at open)
                **prompt_split(
                    len(request.prompt_token_ids), split=p_reply.split(), cached_tokens=p_reply.cached_tokens
                ),
            ),
        )

    async def _pushed_halves(
        self, request: StepRequest
    ) -> PushedStep[tuple[Any, ServerReply | None], tuple[ServerReply, bool]]:
        """A pushed step's P and D under one ``X-Request-Id`` (see `PushedStep`), sent together once P's NIXL
        coordinates are known; the first step of a remote pair sends P first and learns them from its reply."""
        shared = uuid.uuid4().hex
        prefill: Awaitable[tuple[ServerReply, bool]]
        if self._prefill_coordinates is None:
            result = await self._prefill(request, request_id=shared)
            handoff = parse_prefill_result(result[0].kv_transfer_params)
            self._prefill_coordinates = (handoff.remote_engine_id, handoff.remote_host, handoff.remote_port)
            served_id = handoff.remote_request_id
            prefill = _ready(result)
        else:
            served_id = f"cmpl-{shared}-0"  # the id vLLM's server gives the single prompt of X-Request-Id `shared`
            prefill = self._prefill(request, request_id=shared)
        engine_id, host, port = self._prefill_coordinates
        source = PushSource(remote_engine_id=engine_id, remote_host=host, remote_port=port, remote_request_id=served_id)
        body = self._body(
            request,
            max_tokens=request.sampling.max_tokens,
            kv_transfer_params=source.as_decode_params(),
            request_id=shared,
        )

        async def rescue() -> bool:
            await self._prefill(dataclasses.replace(request, handle=None), request_id=shared)  # raises if it failed
            return True

        return PushedStep(prefill, self._decode(body), rescue, timeout_s=self._transport.step_timeout_s)

    async def _prefill(self, request: StepRequest, *, request_id: str | None = None) -> tuple[ServerReply, bool]:
        """P's reply, and whether the handle was dropped (P declined it, or it may have been spent).

        ``request_id``: the ``X-Request-Id`` P gets (a pushed step's, which D waits on), or none.
        """
        handle: KVHandle | None = request.handle
        dropped = False
        if handle is not None and handle.remote_engine_id in self._retired_engines:
            handle, dropped = None, True  # the server that pinned it was restarted: its blocks are gone
        with translated("prefill"):
            async for attempt in retrying(attempts=self._transport.attempts, role="prefill"):
                with attempt:
                    try:
                        _, reply = await self._transport.complete(
                            "prefill",
                            self._body(
                                request,
                                max_tokens=1,
                                kv_transfer_params=prefill_params(handle),
                                request_id=request_id,
                            ),
                        )
                    except Exception as exc:
                        if handle is not None and not never_arrived(exc):
                            handle, dropped = None, True  # it may have been read: never send it twice
                        raise
            if reply.kv_transfer_params is None and handle is not None:  # P could not read D's blocks
                dropped = True
                _, reply = await self._transport.complete(
                    "prefill",
                    self._body(request, max_tokens=1, kv_transfer_params=prefill_params(None), request_id=request_id),
                )
        if reply.kv_transfer_params is None:
            raise EngineError("the prefill server returned no kv_transfer_params (is it a kv_producer with NIXL?)")
        return reply, dropped

    async def _decode(self, body: dict[str, Any]) -> AsyncGenerator[tuple[Any, ServerReply | None], None]:
        """D's output: ``(choice, None)`` per chunk, then ``(None, reply)`` with the handle when sent."""
        if self._decode_streaming:
            async with contextlib.aclosing(self._transport.stream("decode", body)) as chunks:
                async for item in chunks:
                    yield item
            return
        with translated("decode"):
            choice, reply = await self._transport.complete("decode", body)
        yield choice, None
        yield None, reply

    def _body(
        self,
        request: StepRequest,
        *,
        max_tokens: int,
        kv_transfer_params: dict[str, Any],
        request_id: str | None = None,
    ) -> dict[str, Any]:
        assert self._capabilities is not None
        body = completion_body(
            model=self._capabilities.served_model,
            prompt_token_ids=request.prompt_token_ids,
            max_tokens=max_tokens,
            sampling=request.sampling,
            kv_transfer_params=kv_transfer_params,
            cache_salt=request.cache_salt,
        )
        if request_id is not None:
            body["extra_headers"] = {"X-Request-Id": request_id}
        return body


async def _ready(value: Any) -> Any:
    return value


def _moved(p_moved: dict[str, float] | None, d_moved: dict[str, float] | None, *, alone: bool) -> dict[str, Any]:
    if not alone or p_moved is None or d_moved is None:
        return {"kv_bytes": None, "kv_transfer_s": None}
    return {
        "kv_bytes": int(p_moved["bytes"] + d_moved["bytes"]),
        "kv_transfer_s": p_moved["seconds"] + d_moved["seconds"],
    }


def _local_deadline(handle: KVHandle | None, reply: ServerReply) -> float | None:
    clock = (reply.extras or {}).get("clock")
    if handle is None or clock is None:
        return None
    return reply.received_at + (handle.remote_blocks_expiry_time - float(clock))
