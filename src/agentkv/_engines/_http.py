"""The HTTP half of a pair: one step as two ``/v1/completions`` calls with the ``openai`` client.

Shared by `LaunchedPair` (servers agentkv starts) and `RemotePair` (servers someone else
runs). The protocol is the embedded pair's (DESIGN.md section 5), over HTTP: P gets the
prompt as token ids with ``max_tokens=1`` and D's handle, D streams the output (token ids
and text) and, at the end, its new handle.

Retries (tenacity, `retrying`) cover transient failures: a refused connection while a
server starts, a dropped connection, a 5xx. A handle is single-use, so a P request that may
have reached P is never sent again with the same handle: the retry goes without it (the
step then reports ``miss_reason="declined"``). D is retried only when the request surely
never arrived (connection refused): P's blocks are D's to read once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import openai
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from .._errors import EngineError, EngineUnavailableError, UserError
from .._model import prepare_model
from ._base import Engine, EngineInfo, Sampling, StepDone, StepEvent, StepRequest, StepTimings, TokenDelta
from ._handle import SERVER_EXTRAS_FIELD, KVHandle, parse_handle, parse_prefill_result, prefill_params

__all__ = ["HTTPPair", "retrying"]

logger = logging.getLogger("agentkv")


@contextlib.contextmanager
def _translated(role: str) -> Iterator[None]:
    """Turn ``openai`` errors of calls to ``role``'s server into agentkv's errors."""
    try:
        yield
    except openai.APIConnectionError as exc:
        raise EngineUnavailableError(f"the {role} server could not be reached: {exc}") from exc
    except openai.APIStatusError as exc:
        raise EngineError(f"the {role} server answered {exc.status_code}: {exc.message}") from exc


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, openai.APIConnectionError) or (
        isinstance(exc, openai.APIStatusError) and exc.status_code >= 500
    )


def _never_arrived(exc: BaseException) -> bool:
    """The request surely did not reach the server (no connection was made)."""
    if not isinstance(exc, openai.APIConnectionError) or isinstance(exc, openai.APITimeoutError):
        return False
    cause: BaseException | None = exc.__cause__
    while cause is not None:  # openai's HTTP library wraps the OS error; its name differs between versions
        if isinstance(cause, ConnectionRefusedError) or type(cause).__name__ == "ConnectError":
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def retrying(*, attempts: int, role: str, only: Callable[[BaseException], bool] = _transient) -> AsyncRetrying:
    """The retry policy of one server call: exponential back-off with jitter, ``attempts`` tries."""

    def log(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        logger.warning("agentkv: the %s server failed (%s); retrying (attempt %d)", role, error, state.attempt_number)

    return AsyncRetrying(
        retry=retry_if_exception(only),
        stop=stop_after_attempt(attempts),
        wait=wait_exponential_jitter(initial=0.2, max=2.0),
        before_sleep=log,
        reraise=True,
    )


@dataclass
class _Reply:
    """What one server said about one request, beyond the tokens."""

    kv_transfer_params: Any = None
    extras: dict[str, Any] | None = None
    """agentkv's server additions (see ``_server.py``); None from a stock vLLM server."""
    cached_tokens: int | None = None
    received_at: float = 0.0

    @classmethod
    def of(cls, extra: dict[str, Any], *, cached_tokens: int | None = None) -> _Reply:
        """From a reply's fields beyond OpenAI's (``model_extra``)."""
        return cls(extra.get("kv_transfer_params"), extra.get(SERVER_EXTRAS_FIELD), cached_tokens, time.perf_counter())

    def split(self) -> dict[str, int] | None:
        prefill = self.extras.get("prefill") if self.extras else None
        return prefill if isinstance(prefill, dict) else None

    def seconds(self, name: str) -> float | None:
        value = (self.extras or {}).get("seconds", {}).get(name)
        return float(value) if value is not None else None

    def nixl(self) -> dict[str, float] | None:
        return (self.extras or {}).get("nixl")


@dataclass
class _Baseline:
    """Each server's NIXL totals as of its latest reply (for per-step differences)."""

    totals: dict[str, dict[str, float]] = field(default_factory=dict[str, dict[str, float]])

    def advance(self, role: str, reply: _Reply) -> dict[str, float] | None:
        """Record ``reply``'s totals; return the difference from the previous ones."""
        now, before = reply.nixl(), self.totals.get(role)
        if now is None:
            return None
        self.totals[role] = {key: max(now[key], (before or now)[key]) for key in now}
        return None if before is None else {key: now[key] - before[key] for key in now}


class HTTPPair(Engine):
    """A P/D pair of vLLM OpenAI API servers, driven with the ``openai`` client.

    Subclasses give the servers' URLs (`_start` calls `_connect`). The rest is shared.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None,
        *,
        step_timeout_s: float,
        attempts: int,
        warmup: bool,
        progress: Callable[[str], None] | None,
    ) -> None:
        super().__init__()
        if attempts < 1:
            raise UserError("attempts must be at least 1")
        self._model = model
        self._step_timeout_s = step_timeout_s
        self._attempts = attempts
        self._warmup = warmup
        self._progress = progress or (lambda line: logger.info("%s", line))
        self.decode_streaming = True
        """Stream D's tokens (else one non-streamed reply per step: see `RemotePair`)."""
        self._exclusive = False
        """The pair is the servers' only client: differences of their NIXL totals are this pair's."""
        self._clients: dict[str, openai.AsyncOpenAI] = {}
        self._served_model = ""
        self._urls = ("", "")
        self._info: EngineInfo | None = None
        self._push_back = True
        self.handle_in_stream: bool | None = None
        """Whether D's streamed responses carry the KV handle (agentkv's server: yes; stock vLLM 0.32: no).

        None until the first streamed step."""
        self.server_kind: str | None = None
        """``"agentkv"`` (agentkv's entry point: exact prefill split, NIXL totals) or ``"vllm"``."""
        self._baseline = _Baseline()
        self._in_flight = 0
        self._started_steps = 0
        self._warned_split = False
        self._retired_engines: set[str] = set()
        """Engine ids of servers that are gone: their handles are dropped, never sent to P."""

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineError(f"{type(self).__name__} is not open")
        return self._info

    @property
    def urls(self) -> tuple[str, str]:
        """The URLs of P's and D's servers."""
        return self._urls

    # ----------------------------------------------------------------- connecting

    async def _connect(self, prefill_url: str, decode_url: str, *, push_back: bool, kind: str) -> None:
        """Point the clients at the servers and read what they serve (model, context length)."""
        model_path: Path = await anyio.to_thread.run_sync(lambda: prepare_model(self._model, progress=self._progress))
        timeout = openai.Timeout(self._step_timeout_s, connect=10.0)
        self._urls = (prefill_url, decode_url)
        for role, url in (("prefill", prefill_url), ("decode", decode_url)):
            old = self._clients.pop(role, None)
            if old is not None:
                await old.close()
            base = url.rstrip("/") + ("" if url.rstrip("/").endswith("/v1") else "/v1")
            self._clients[role] = openai.AsyncOpenAI(
                base_url=base, api_key=os.environ.get("AGENTKV_API_KEY", "agentkv"), timeout=timeout, max_retries=0
            )
        models = []
        for role in ("prefill", "decode"):
            with _translated(role):
                async for attempt in retrying(attempts=self._attempts, role=role):
                    with attempt:
                        models.append((await self._clients[role].models.list()).data[0])
        self._served_model = models[1].id
        lengths = [getattr(model, "max_model_len", None) for model in models]
        max_model_len = min(length for length in lengths if length) if any(lengths) else 4096
        self._push_back = push_back
        self._info = EngineInfo(
            kind="pair",
            model_path=model_path,
            max_model_len=max_model_len,
            push_back=push_back,
            extra={"transport": kind, "prefill_url": prefill_url, "decode_url": decode_url},
        )

    async def _warm_up(self) -> None:
        if self._warmup:
            self._progress("agentkv: warming up the servers (kernels, NIXL handshakes)")
            from ._pair import run_warmup_steps

            await run_warmup_steps(self, push_back=self._push_back)

    def _no_handle_in_stream(self) -> None:
        """D streamed no KV handle: say so plainly, and run without push-back from now on."""
        self.handle_in_stream = False
        if not self._push_back:
            return
        self._push_back = False
        extra = {**self.info.extra, "push_back_off_because": "no KV handle in the decode server's streams"}
        self._info = dataclasses.replace(self.info, push_back=False, extra=extra)
        logger.warning(
            "agentkv: the decode server streams no KV handle (stock vLLM 0.32 sends it only in "
            "non-streamed responses): push-back is OFF for this pair. Serve with `agentkv serve`, "
            "or pass decode_streaming=False to keep push-back without token streaming."
        )

    async def _stop(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()

    # ----------------------------------------------------------------- one step

    async def _before_step(self) -> None:
        """Hook: make sure the servers are there (a launched pair restarts a dead one)."""

    async def _server_gone(self) -> str | None:
        """Hook: which server is gone and why, when that is known (a launched pair checks its processes)."""
        return None

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.check_open()
        if request.handle is not None and not self._push_back:
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
        p_reply, declined = await self._prefill(request)
        handoff = parse_prefill_result(p_reply.kv_transfer_params)
        body = self._body(request, max_tokens=request.sampling.max_tokens, kv_transfer_params=handoff.model_dump())
        token_ids: list[int] = []
        texts: list[str] = []
        first_token_at: float | None = None
        finish_reason: str | None = None
        d_reply = _Reply()
        async for choice, reply in self._decode(body):
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
        if finish_reason not in ("stop", "length"):
            raise EngineError(f"the decode server ended the step with {finish_reason!r}")
        if self.decode_streaming and d_reply.kv_transfer_params is None:
            self._no_handle_in_stream()
        elif self.decode_streaming:
            self.handle_in_stream = True
        handle = parse_handle(d_reply.kv_transfer_params) if self._push_back else None
        p_moved, d_moved = self._baseline.advance("prefill", p_reply), self._baseline.advance("decode", d_reply)
        alone = alone_from is not None and alone_from == self._started_steps and self._exclusive
        yield StepDone(
            token_ids=token_ids,
            text="".join(texts),
            finish_reason=finish_reason,
            handle=handle,
            handle_deadline=_local_deadline(handle, d_reply),
            timings=StepTimings(
                ttft_s=(first_token_at or time.perf_counter()) - started,
                prefill_s=p_reply.seconds("prefill"),
                kv_wait_s=(p_reply.seconds("wait") or 0.0) + (d_reply.seconds("wait") or 0.0),
                decode_s=d_reply.seconds("decode"),
                handoff_tokens=(d_reply.split() or {}).get("external", 0),
                pullback_declined=declined or bool(alone and p_moved and p_moved["expired"] > 0),
                **_moved(p_moved, d_moved, alone=alone),
                **self._prompt_split(p_reply, len(request.prompt_token_ids)),
            ),
        )

    async def _prefill(self, request: StepRequest) -> tuple[_Reply, bool]:
        """P's reply, and whether the handle was dropped (P declined it, or it may have been spent)."""
        handle: KVHandle | None = request.handle
        dropped = False
        if handle is not None and handle.remote_engine_id in self._retired_engines:
            handle, dropped = None, True  # the server that pinned it was restarted: its blocks are gone
        with _translated("prefill"):
            async for attempt in retrying(attempts=self._attempts, role="prefill"):
                with attempt:
                    try:
                        reply = await self._complete("prefill", self._body(request, max_tokens=1, handle=handle))
                    except Exception as exc:
                        if handle is not None and not _never_arrived(exc):
                            handle, dropped = None, True  # it may have been read: never send it twice
                        raise
            if reply.kv_transfer_params is None and handle is not None:  # P could not read D's blocks
                dropped = True
                reply = await self._complete("prefill", self._body(request, max_tokens=1, handle=None))
        if reply.kv_transfer_params is None:
            raise EngineError("the prefill server returned no kv_transfer_params (is it a kv_producer with NIXL?)")
        return reply, dropped

    async def _complete(self, role: str, body: dict[str, Any]) -> _Reply:
        response = await self._clients[role].completions.create(**body)
        usage = response.usage
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        return _Reply.of(response.model_extra or {}, cached_tokens=getattr(details, "cached_tokens", None))

    async def _decode(self, body: dict[str, Any]) -> AsyncIterator[tuple[Any, _Reply | None]]:
        """D's output: ``(choice, None)`` per chunk, then ``(None, reply)`` with the handle when sent."""
        client = self._clients["decode"]
        if not self.decode_streaming:
            with _translated("decode"):
                response = await client.completions.create(**body)
            yield response.choices[0], None
            yield None, _Reply.of(response.model_extra or {})
            return
        stream: Any = None
        with _translated("decode"):
            async for attempt in retrying(attempts=self._attempts, role="decode", only=_never_arrived):
                with attempt:
                    stream = await client.completions.create(**body, stream=True)
        chunks = aiter(stream)
        try:
            while True:
                with anyio.fail_after(self._step_timeout_s), _translated("decode"):
                    try:
                        chunk = await anext(chunks)
                    except StopAsyncIteration:
                        break
                extra = chunk.model_extra or {}
                if chunk.choices:
                    yield chunk.choices[0], None
                elif "kv_transfer_params" in extra or SERVER_EXTRAS_FIELD in extra:
                    yield None, _Reply.of(extra)
        except TimeoutError as exc:
            raise EngineError(f"the decode server sent nothing for {self._step_timeout_s} s") from exc
        finally:
            await stream.close()

    def _body(
        self,
        request: StepRequest,
        *,
        max_tokens: int,
        handle: KVHandle | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A ``/v1/completions`` request: P's (``max_tokens=1``, the handle) or D's (P's transfer params)."""
        if kv_transfer_params is None:
            kv_transfer_params = prefill_params(handle)
        sampling: Sampling = request.sampling
        extra: dict[str, Any] = {"kv_transfer_params": kv_transfer_params, "return_token_ids": True}
        if request.cache_salt is not None:
            extra["cache_salt"] = request.cache_salt
        if sampling.json_schema is not None and max_tokens > 1:
            extra["structured_outputs"] = {"json": sampling.json_schema}
        return {
            "model": self._served_model,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
            "extra_body": extra,
        }

    def _prompt_split(self, reply: _Reply, prompt_tokens: int) -> dict[str, int]:
        split = reply.split()
        if split is not None:
            self.server_kind = "agentkv"
            local, pulled = int(split["local"]), int(split["external"])
        else:  # a stock server reports one cached count: local and pulled cannot be told apart
            self.server_kind = "vllm"
            if not self._warned_split:
                self._warned_split = True
                logger.warning(
                    "agentkv: the prefill server does not report where cached tokens came from; "
                    "they are all reported as local_hit_tokens (serve with `agentkv serve` for the split)"
                )
            local, pulled = min(reply.cached_tokens or 0, prompt_tokens), 0
        return {"local_hit_tokens": local, "pulled_tokens": pulled, "computed_tokens": prompt_tokens - local - pulled}


def _moved(p_moved: dict[str, float] | None, d_moved: dict[str, float] | None, *, alone: bool) -> dict[str, Any]:
    if not alone or p_moved is None or d_moved is None:
        return {"kv_bytes": None, "kv_transfer_s": None}
    return {
        "kv_bytes": int(p_moved["bytes"] + d_moved["bytes"]),
        "kv_transfer_s": p_moved["seconds"] + d_moved["seconds"],
    }


def _local_deadline(handle: KVHandle | None, reply: _Reply) -> float | None:
    clock = (reply.extras or {}).get("clock")
    if handle is None or clock is None:
        return None
    return reply.received_at + (handle.remote_blocks_expiry_time - float(clock))
