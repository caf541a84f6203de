"""``POST /v1/completions`` (what a copilot's autocomplete sends), as vLLM 0.32's server answers it: a text or
token-id prompt continued as raw tokens (no chat template), streamed or not, with ``logprobs`` and ``echo``.

A request naming a conversation (the same keys as chat: src/agentkv/_surfaces/_conversation_keys.py) runs on its
tenant's completions session, which keeps the KV pinned on D between requests; an editor re-sends a growing file
prefix, so the next prompt usually shares only a prefix with what is pinned, and the pin is cut to the whole
blocks they share (src/agentkv/_session/_completion_api.py). A request naming none runs on a one-shot session.
What each field does: `COMPLETIONS_FIELDS` (docs/serve.md, "Completions").
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .._conversation._conversation import Message
from .._engines._sampling import SamplingOptions
from .._errors import UserError
from .._session._pool import SessionPool
from .._session._pool_completions import streamed_completion
from .._session._prompt_work import OFF_LOOP_CHARS, check_fits
from .._session._results import Step, TextDelta
from .._session._session import load_tokenizer
from ._conversation_keys import conversation_key
from ._logprobs import LogprobWriter
from ._openai_chat import (
    KeyFields,
    SamplingFields,
    StreamOptions,
    check_stream_options,
    given_options,
    read_body,
    sampling_options,
    structured_outputs,
)
from ._request_fields import CHAT_FIELDS, FieldRule

if TYPE_CHECKING:
    from ._serve_routes import DoorRoutes

__all__ = ["COMPLETIONS_FIELDS", "CompletionRequest", "read_completion_request", "serve_completion"]


def _rule(status: str, reason: str, *accepts: object) -> FieldRule:
    return FieldRule(status, reason, (None, *accepts) if status == "refused" else ())  # type: ignore[arg-type]


_SHARED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "logit_bias",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "user",
    "priority",
    "cache_salt",
    "session_id",
    "kv_transfer_params",
    "vllm_xargs",
    "response_format",
    "structured_outputs",
    "min_tokens",
    "spaces_between_special_tokens",
    "allowed_token_ids",
    "bad_words",
    "return_tokens_as_token_ids",
    "use_beam_search",
    "length_penalty",
    "watermarking",
    "truncate_prompt_tokens",
    "truncation_side",
    "prompt_logprobs",
    "logprob_token_ids",
    "return_token_ids",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "mm_payload",
    "return_mm_kwargs",
    "ec_transfer_params",
    "repetition_detection",
    "thinking_token_budget",
    "stream_interval",
)
"""The fields a completion shares with a chat completion, ruled as there (src/agentkv/_surfaces/_request_fields.py)."""

COMPLETIONS_FIELDS: dict[str, FieldRule] = {
    **{name: CHAT_FIELDS[name] for name in _SHARED},
    "prompt": _rule(
        "honoured",
        "one prompt: a string (tokenized with add_special_tokens, as vLLM) or token ids; a list of several prompts "
        "is refused (one completion per request)",
    ),
    "max_tokens": _rule("honoured", "the most tokens of the completion (16 when omitted, as vLLM)"),
    "logprobs": _rule(
        "honoured",
        "choices[0].logprobs with tokens, token_logprobs, top_logprobs (this many alternatives) and text_offset",
    ),
    "echo": _rule("honoured", "the prompt's text before the completion's (not with logprobs: see prompt_logprobs)"),
    "request_id": _rule(
        "honoured", "the reply's id, as vLLM writes it (cmpl-<request_id>), and the x-request-id header"
    ),
    "n": _rule("refused", "one choice per request: a session continues one conversation", 1),
    "suffix": _rule("refused", "insertion after a suffix is not served (vLLM refuses it too)"),
    "add_special_tokens": _rule(
        "refused", "a text prompt is tokenized with the tokenizer's special tokens, as vLLM's default does", True
    ),
    "prompt_embeds": _rule("refused", "prompts are text or token ids: embeddings are not served"),
    "conversation_id": CHAT_FIELDS["conversation_id"],
    "prompt_cache_key": CHAT_FIELDS["prompt_cache_key"],
}
"""Every field of ``POST /v1/completions`` (vLLM's `CompletionRequest`, and the two other conversation keys)."""


class CompletionRequest(SamplingFields, KeyFields):
    """A ``POST /v1/completions`` body: the fields agentkv honours, typed (`COMPLETIONS_FIELDS` rules the others)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool | None = False
    response_format: dict[str, Any] | None = None
    min_tokens: int | None = None
    spaces_between_special_tokens: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None

    def one_prompt(self) -> str | list[int]:
        """The request's one prompt (a list of one prompt is that prompt); several are a `UserError`."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise UserError("prompt: a list of several prompts is not supported: send one prompt per request")
            prompt = prompt[0]
        if not prompt:
            raise UserError("prompt: the prompt is empty")
        return prompt  # type: ignore[return-value]

    def sampling_options(self) -> SamplingOptions | None:
        """The request's `SamplingOptions` (only the fields it sets), ``logprobs`` the alternatives per token."""
        options = given_options(self)
        if self.logprobs is not None:
            options["logprobs"] = self.logprobs
        structured = structured_outputs(self.structured_outputs, self.response_format)
        if structured is not None:
            options["structured_outputs"] = structured
        return sampling_options(options, {}) if options else None


def read_completion_request(body: bytes) -> CompletionRequest:
    """The request, checked; anything agentkv cannot honour is a `UserError` naming it."""
    request = read_body(CompletionRequest, body, COMPLETIONS_FIELDS)
    request.one_prompt()
    check_stream_options(request.stream_options, request.stream)
    if request.echo and request.logprobs is not None:
        raise UserError(
            "echo with logprobs is not supported: it needs the prompt's logprobs, and most of the prompt is not "
            "computed (its KV is pulled back or cached)"
        )
    request.sampling_options()  # checked now: a bad option is a 400 before the step
    return request


class _Prompt:
    """A request's prompt as token ids, and its text (what ``echo`` writes)."""

    def __init__(self, tokenizer: Any, prompt: str | list[int], max_model_len: int) -> None:
        if isinstance(prompt, str):
            check_fits(
                tokenizer, held_tokens=0, messages=[Message(role="user", content=prompt)], max_model_len=max_model_len
            )
            self.token_ids = list(tokenizer.encode(prompt))
            self.text = prompt
        else:
            self.token_ids = list(prompt)
            self.text = ""
        self._tokenizer = tokenizer

    def echoed(self) -> str:
        """The prompt's text as vLLM echoes it (a token-id prompt decoded)."""
        return self.text or str(self._tokenizer.decode(self.token_ids))


class _Logprobs:
    """A completion's ``logprobs`` object, written as its tokens come (``text_offset`` runs on across chunks)."""

    def __init__(self, tokenizer: Any, top: int, *, as_token_ids: bool) -> None:
        self._writer = LogprobWriter(tokenizer, top + 1, as_token_ids=as_token_ids)  # the sampled one and ``top``
        self._offset = 0
        self.written = 0

    def block(self, step_logprobs: list[Any]) -> dict[str, Any]:
        entries = self._writer.content(step_logprobs)
        self.written += len(entries)
        offsets = []
        for entry in entries:
            offsets.append(self._offset)
            self._offset += len(entry["token"])
        return {
            "text_offset": offsets,
            "token_logprobs": [entry["logprob"] for entry in entries],
            "tokens": [entry["token"] for entry in entries],
            "top_logprobs": [{top["token"]: top["logprob"] for top in entry["top_logprobs"]} for entry in entries],
        }


def _usage(step: Step) -> dict[str, Any]:
    stats = step.stats
    return {
        "prompt_tokens": stats.prompt_tokens,
        "total_tokens": stats.prompt_tokens + stats.output_tokens,
        "completion_tokens": stats.output_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.prompt_tokens - stats.computed_tokens},
    }


def _head(request_id: str, created: int, model: str) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model}


def _choice(text: str, finish_reason: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _finish(step: Step) -> str:
    return "length" if step.finish_reason == "length" else "stop"


async def serve_completion(routes: DoorRoutes, request: Request) -> Response:
    """``POST /v1/completions`` on the door's pool: admitted, bounded and cancelled as the door's chat is."""
    settings, pool = routes.settings, routes.pool
    try:
        tenant = settings.tenants.tenant_of(request.headers)
        parsed = await routes.parsed(request, read_completion_request)
        settings.check_model(parsed.model)
        key = conversation_key(request.headers, parsed)
        options: dict[str, Any] = routes.step_options(tenant, key, parsed)
        tokenizer = await anyio.to_thread.run_sync(load_tokenizer, str(pool.engine.info.model_path))
        raw = parsed.one_prompt()
        max_model_len = pool.engine.info.max_model_len

        def read_prompt() -> _Prompt:
            return _Prompt(tokenizer, raw, max_model_len)

        large = isinstance(raw, str) and len(raw) >= OFF_LOOP_CHARS
        prompt = await anyio.to_thread.run_sync(read_prompt) if large else read_prompt()
        step_options: dict[str, Any] = {
            "max_tokens": parsed.max_tokens or max_model_len,
            "temperature": parsed.temperature,
            "seed": parsed.seed,
            "stop": parsed.stop or None,
            "sampling": parsed.sampling_options(),
        }
        logprobs = None
        if parsed.logprobs is not None:
            top = parsed.logprobs
            as_ids = bool(parsed.return_tokens_as_token_ids)
            logprobs = await anyio.to_thread.run_sync(lambda: _Logprobs(tokenizer, top, as_token_ids=as_ids))
        headers = routes.echoed(key, parsed.request_id)
        ids = (f"cmpl-{parsed.request_id or uuid.uuid4().hex}", int(time.time()), settings.model_name)
        if parsed.stream:
            return await routes.admission.stream(
                lambda: _stream(routes, request, pool, prompt, parsed, options, step_options, logprobs, ids, headers),
                tenant,
            )
        step = await routes._step(
            request,
            tenant,
            lambda: pool.complete(prompt.token_ids, **options, **step_options),
        )
    except Exception as exc:
        return routes.refuse(exc)
    routes.metrics.step(step.stats)
    text = (prompt.echoed() if parsed.echo else "") + step.text
    block = None if logprobs is None else logprobs.block(step.logprobs or [])
    body = _head(*ids) | {
        "choices": [_choice(text, _finish(step), block)],
        "usage": _usage(step),
        "agentkv": {"stats": step.stats.model_dump(mode="json")},
    }
    return JSONResponse(body, headers=headers)


async def _stream(
    routes: DoorRoutes,
    request: Request,
    pool: SessionPool,
    prompt: _Prompt,
    parsed: CompletionRequest,
    options: dict[str, Any],
    step_options: dict[str, Any],
    logprobs: _Logprobs | None,
    ids: tuple[str, int, str],
    headers: dict[str, str],
) -> Response:
    """Server-sent ``text_completion`` chunks, then usage (``stream_options.include_usage``) and ``[DONE]``; the
    first item is awaited before answering, so that a request refused at once gets its HTTP status."""
    deadline = anyio.current_time() + routes.settings.timeout_s
    items = streamed_completion(
        lambda on_delta: pool.complete(prompt.token_ids, **options, **step_options, on_delta=on_delta)
    )
    first = await routes._first(request, items)
    include_usage = parsed.stream_options is not None and bool(parsed.stream_options.include_usage)
    head = _head(*ids)

    def chunk(text: str, finish: str | None, block: dict[str, Any] | None) -> str:
        return f"data: {json.dumps(head | {'choices': [_choice(text, finish, block)]})}\n\n"

    async def events() -> AsyncIterator[str]:
        streamed, echo = "", bool(parsed.echo)
        try:
            item: TextDelta | Step = first
            while not isinstance(item, Step):
                if item.text or item.token_ids:
                    text = (prompt.echoed() if echo else "") + item.text
                    echo = False
                    streamed += item.text
                    yield chunk(text, None, None if logprobs is None else logprobs.block(item.logprobs or []))
                item = await routes._next(items, deadline)
            rest = item.text[len(streamed) :] if item.text.startswith(streamed) else ""
            block = None
            if logprobs is not None:
                block = logprobs.block((item.logprobs or [])[logprobs.written :])
            yield chunk(((prompt.echoed() if echo else "") + rest), _finish(item), block)
            if include_usage:
                usage = head | {
                    "choices": [],
                    "usage": _usage(item),
                    "agentkv": {"stats": item.stats.model_dump(mode="json")},
                }
                yield f"data: {json.dumps(usage)}\n\n"
            routes.metrics.step(item.stats)
            yield "data: [DONE]\n\n"
        except Exception as exc:  # after the status line: the error goes in the stream
            yield f"data: {bytes(routes.refuse(exc).body).decode()}\n\n"
        finally:
            await items.aclose()  # a client that went away cancels the step

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
