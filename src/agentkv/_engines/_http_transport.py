"""The wire of an HTTP pair: two ``openai`` clients, the retry policy, request bodies, replies.

Knows ``/v1/completions`` with token ids and vLLM's ``kv_transfer_params``; knows nothing of
sessions, handles' meaning or capabilities. Errors of the ``openai`` client leave here as
agentkv's (`EngineUnavailableError`, `EngineError`; a request the server refused, `UserError`).

Retries (tenacity, `retrying`) cover transient failures: a refused connection while a
server starts, a dropped connection, a 5xx. Which calls may be retried is the caller's
choice (`transient` or `never_arrived`): a KV handle is single use.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import openai
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from .._errors import EngineError, EngineUnavailableError, UserError
from ._base import Sampling, TokenLogprob
from ._handle import SERVER_EXTRAS_FIELD
from ._platforms import Role
from ._vllm_sampling import LOGPROB_FLOOR, top_alternatives

__all__ = [
    "PairTransport",
    "ServerReply",
    "chunk_items",
    "completion_body",
    "completion_logprobs",
    "never_arrived",
    "retrying",
    "transient",
    "translated",
]

logger = logging.getLogger("agentkv")


@contextlib.contextmanager
def translated(role: Role) -> Iterator[None]:
    """Turn ``openai`` errors of calls to ``role``'s server into agentkv's errors."""
    try:
        yield
    except openai.APIConnectionError as exc:
        raise EngineUnavailableError(f"the {role} server could not be reached: {exc}") from exc
    except openai.APIStatusError as exc:
        if exc.status_code in (400, 422):  # vLLM refused the request (a sampling value): the caller's to fix
            raise UserError(f"the {role} server refused the request: {_server_message(exc)}") from exc
        raise EngineError(f"the {role} server answered {exc.status_code}: {exc.message}") from exc


def _server_message(exc: openai.APIStatusError) -> str:
    """The message of vLLM's error body (``{"error": {"message": ...}}``; the client keeps the inner object)."""
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        message = inner.get("message") if isinstance(inner, dict) else None
        if isinstance(message, str):
            return message
    return exc.message


def transient(exc: BaseException) -> bool:
    """A failure worth another try: no connection, a dropped one, or a 5xx."""
    return isinstance(exc, openai.APIConnectionError) or (
        isinstance(exc, openai.APIStatusError) and exc.status_code >= 500
    )


def never_arrived(exc: BaseException) -> bool:
    """The request surely did not reach the server (no connection was made)."""
    if not isinstance(exc, openai.APIConnectionError) or isinstance(exc, openai.APITimeoutError):
        return False
    cause: BaseException | None = exc.__cause__
    while cause is not None:  # openai's HTTP library wraps the OS error; its name differs between versions
        if isinstance(cause, ConnectionRefusedError) or type(cause).__name__ == "ConnectError":
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def retrying(*, attempts: int, role: str, only: Callable[[BaseException], bool] = transient) -> AsyncRetrying:
    """The retry policy of one server call: exponential back-off with jitter, ``attempts`` tries."""

    def log(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        logger.warning("agentkv: the %s server failed (%s); retrying (attempt %d)", role, error, state.attempt_number)

    return AsyncRetrying(
        retry=retry_if_exception(only),
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=0.2, max=2.0) + wait_random(0, 0.2),  # back-off with jitter
        before_sleep=log,
        reraise=True,
    )


@dataclass(frozen=True)
class ServerReply:
    """What one server said about one request, beyond the tokens."""

    kv_transfer_params: Any = None
    extras: dict[str, Any] | None = None
    """agentkv's server additions (see ``_server.py``); None from a stock vLLM server."""
    cached_tokens: int | None = None
    received_at: float = 0.0

    @classmethod
    def of(cls, extra: dict[str, Any], *, cached_tokens: int | None = None) -> ServerReply:
        """From a reply's fields beyond OpenAI's (``model_extra``)."""
        return cls(extra.get("kv_transfer_params"), extra.get(SERVER_EXTRAS_FIELD), cached_tokens, time.perf_counter())

    def split(self) -> tuple[int, int] | None:
        """(local, external) cached tokens from the server's ``PrefillStats`` (None: a stock server)."""
        prefill = self.extras.get("prefill") if self.extras else None
        return (int(prefill["local"]), int(prefill["external"])) if isinstance(prefill, dict) else None

    def seconds(self, name: str) -> float | None:
        value = (self.extras or {}).get("seconds", {}).get(name)
        return float(value) if value is not None else None

    def nixl(self) -> dict[str, float] | None:
        return (self.extras or {}).get("nixl")


def chunk_items(chunk: Any) -> list[tuple[Any, ServerReply | None]]:
    """What one streamed ``/v1/completions`` chunk tells a pair: ``(choice, None)`` for its tokens, and
    ``(None, reply)`` when it carries the end of the request (D's handle, agentkv's extras).

    agentkv's server ends a stream with a chunk of its own (no choices: the extras and the handle); a stock vLLM
    server from 0.33 on puts the handle on its last chunk that has choices (vLLM 0.32 streamed none); a chunk whose
    ``kv_transfer_params`` is null carries nothing of it.
    """
    extra = chunk.model_extra or {}
    items: list[tuple[Any, ServerReply | None]] = []
    if chunk.choices:
        items.append((chunk.choices[0], None))
        if extra.get("kv_transfer_params") is not None or extra.get(SERVER_EXTRAS_FIELD) is not None:
            items.append((None, ServerReply.of(extra)))
    elif "kv_transfer_params" in extra or SERVER_EXTRAS_FIELD in extra:
        items.append((None, ServerReply.of(extra)))
    return items


def completion_body(
    *,
    model: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    sampling: Sampling,
    kv_transfer_params: dict[str, Any] | None,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """A ``/v1/completions`` request with token ids (``kv_transfer_params=None``: a plain request, no KV transfer).

    Every sampling field goes in vLLM's names (those the ``openai`` client lacks in ``extra_body``), defaults
    included, so that the server's own defaults (the model's generation config) never replace agentkv's. A request
    for fewer tokens than the step's (P's one) caps ``min_tokens`` at them and leaves the stop strings out: over
    HTTP P's token is never the answer's first, D decodes it all.
    """
    options = sampling.options
    extra: dict[str, Any] = {
        "return_token_ids": True,
        "top_k": options.top_k,
        "min_p": options.min_p,
        "repetition_penalty": options.repetition_penalty,
        "min_tokens": min(options.min_tokens, max_tokens),
        "ignore_eos": options.ignore_eos,
        "stop_token_ids": list(options.stop_token_ids),
        "include_stop_str_in_output": options.include_stop_str_in_output,
        "skip_special_tokens": options.skip_special_tokens,
        "spaces_between_special_tokens": options.spaces_between_special_tokens,
        "bad_words": list(options.bad_words),
    }
    if options.allowed_token_ids is not None:
        extra["allowed_token_ids"] = list(options.allowed_token_ids)
    if sampling.structured is not None:
        extra["structured_outputs"] = sampling.structured
    if options.logprobs is not None:
        extra["return_tokens_as_token_ids"] = True  # tokens as "token_id:N" (`completion_logprobs`)
    if kv_transfer_params is not None:
        extra["kv_transfer_params"] = kv_transfer_params
    if cache_salt is not None:
        extra["cache_salt"] = cache_salt
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_token_ids),
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": options.top_p,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
        "seed": sampling.seed,
        "extra_body": extra,
    }
    if options.logit_bias is not None:
        body["logit_bias"] = {str(token_id): bias for token_id, bias in options.logit_bias.items()}
    if options.logprobs is not None:
        body["logprobs"] = options.logprobs
    if sampling.stop and max_tokens >= sampling.max_tokens:
        body["stop"] = list(sampling.stop)
    return body


def completion_logprobs(logprobs: Any, count: int) -> list[TokenLogprob]:
    """`TokenLogprob`s of a ``/v1/completions`` choice's ``logprobs`` (asked with ``return_tokens_as_token_ids``:
    tokens are ``"token_id:N"``), each with the ``count`` likeliest alternatives of its ``top_logprobs`` (which
    hold the chosen token too, OpenAI's ``logprobs + 1``)."""
    if logprobs is None:
        return []
    fields = logprobs if isinstance(logprobs, dict) else vars(logprobs)
    tokens, values = fields.get("tokens") or [], fields.get("token_logprobs") or []
    tops = fields.get("top_logprobs") or [None] * len(tokens)
    found = []
    for token, value, top in zip(tokens, values, tops, strict=False):
        alternatives = ((_token_id(key), float(lp)) for key, lp in (top or {}).items())
        found.append(
            TokenLogprob(
                token_id=_token_id(token),
                logprob=LOGPROB_FLOOR if value is None else float(value),
                top=top_alternatives(alternatives, count),
            )
        )
    return found


def _token_id(token: str) -> int:
    prefix, _, number = token.rpartition(":")
    if prefix != "token_id" or not number.lstrip("-").isdigit():
        raise EngineError(
            f"the server sent logprobs for {token!r}, not a token id (it needs return_tokens_as_token_ids)"
        )
    return int(number)


class PairTransport:
    """The ``openai`` clients of a pair's two servers, and the calls a step makes on them."""

    def __init__(self, *, attempts: int, step_timeout_s: float) -> None:
        self.attempts = attempts
        self.step_timeout_s = step_timeout_s
        self._clients: dict[Role, openai.AsyncOpenAI] = {}

    async def connect(self, urls: tuple[str, str]) -> list[Any]:
        """Point the clients at P's and D's servers (replacing old ones); return what each serves (``/v1/models``)."""
        await self.close()
        timeout = openai.Timeout(self.step_timeout_s, connect=10.0)
        roles: tuple[Role, Role] = ("prefill", "decode")
        for role, url in zip(roles, urls, strict=True):
            base = url.rstrip("/") + ("" if url.rstrip("/").endswith("/v1") else "/v1")
            self._clients[role] = openai.AsyncOpenAI(
                base_url=base, api_key=os.environ.get("AGENTKV_API_KEY", "agentkv"), timeout=timeout, max_retries=0
            )
        models = []
        for role in roles:
            with translated(role):
                async for attempt in retrying(attempts=self.attempts, role=role):
                    with attempt:
                        models.append((await self._clients[role].models.list()).data[0])
        return models

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()

    async def complete(self, role: Role, body: dict[str, Any]) -> tuple[Any, ServerReply]:
        """One non-streamed completion (no retry, no translation: the caller decides): its choice and reply."""
        response = await self._clients[role].completions.create(**body)
        usage = response.usage
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        reply = ServerReply.of(response.model_extra or {}, cached_tokens=getattr(details, "cached_tokens", None))
        return response.choices[0], reply

    async def stream(self, role: Role, body: dict[str, Any]) -> AsyncGenerator[tuple[Any, ServerReply | None]]:
        """A streamed completion: ``(choice, None)`` per chunk, then ``(None, reply)`` when the server sends one.

        Retried only when the request surely never arrived. A server that sends nothing for
        ``step_timeout_s`` fails the call with `EngineError`.
        """
        client = self._clients[role]
        stream: Any = None
        with translated(role):
            async for attempt in retrying(attempts=self.attempts, role=role, only=never_arrived):
                with attempt:
                    stream = await client.completions.create(**body, stream=True)
        chunks = _events_of(stream)
        try:
            while True:
                with anyio.fail_after(self.step_timeout_s), translated(role):
                    try:
                        chunk = await anext(chunks)
                    except StopAsyncIteration:
                        break
                for item in chunk_items(chunk):
                    yield item
        except TimeoutError as exc:
            raise EngineError(f"the {role} server sent nothing for {self.step_timeout_s} s") from exc
        finally:
            # the event generator too, not only the response: see `_events_of`
            with anyio.CancelScope(shield=True):
                await chunks.aclose()
                await stream.close()


def _events_of(stream: Any) -> Any:
    """The ``openai`` stream's own event generator, closed by our ``aclose`` with everything under it.

    ``aiter(stream)`` wraps that generator in another, and closing the wrapper leaves it (and
    httpx's generators under it) suspended in a reference cycle with the stream, for the cyclic
    garbage collector to finalize later, in whatever thread it runs: from another thread than
    the loop's, that raced with the loop ("Exception ignored in: <async_generator object
    AsyncResponseStream.__aiter__>: async generator already executing", seen in CI). Closed
    here, the generators under it are freed as their references go, on the loop.
    ``_iterator`` is the SDK's private name for it; without it, the wrapper.
    """
    events = getattr(stream, "_iterator", None)
    return events if inspect.isasyncgen(events) else aiter(stream)  # both have aclose
