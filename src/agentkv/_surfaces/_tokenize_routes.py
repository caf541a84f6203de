"""``POST /tokenize`` and ``POST /detokenize`` as ``vllm serve`` serves them (vllm/entrypoints/serve/tokenize/), on
the pool's tokenizer.

``/tokenize`` takes a ``prompt`` (its ids as the tokenizer writes them, ``add_special_tokens`` true by default) or
``messages`` (rendered with the model's chat template, ``add_generation_prompt`` true and ``add_special_tokens``
false by default, ``continue_final_message``, ``tools``, ``chat_template_kwargs`` as for chat completions) and
answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with ``return_token_strs``).
``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``, decoded as vLLM decodes it (special tokens kept).

Like the other model routes: the caller's tenant first (an API key when the door has one), the body read within
the door's limit, at most ``max_messages`` messages, a model name checked as chat completions check it, and the
template, the tokenizer and the parsing of a large body off the event loop. A request's own ``chat_template`` is
refused, as by vLLM without ``--trust-request-chat-template``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .._conversation._template_kwargs import template_arguments, template_kwargs_key
from .._errors import UserError
from .._session._pool import SessionPool
from .._session._session import load_tokenizer
from ._bounds import check_template_kwargs, parse_json
from ._limits import check_items, read_body
from ._openai_chat import validated
from ._serve_routes import ServeSettings

__all__ = ["TokenizeRoutes"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    return_token_strs: bool | None = False


class TokenizePrompt(_Request):
    """vLLM's ``TokenizeCompletionRequest``."""

    prompt: str
    add_special_tokens: bool = True


class TokenizeChat(_Request):
    """vLLM's ``TokenizeChatRequest`` (text messages)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class Detokenize(BaseModel):
    """vLLM's ``DetokenizeRequest``."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


def _text(content: Any) -> Any:
    """A message's content as the template takes it: a list of text parts joined by newlines, as vLLM's string
    content format joins them; anything else as given."""
    if isinstance(content, list):
        parts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        return "\n".join(str(part) for part in parts)
    return content


def _conversation(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the template: text contents; an assistant's tool-call arguments as
    objects (JSON text parsed); an empty ``tool_calls`` left out."""
    shown: list[dict[str, Any]] = []
    for message in messages:
        item = {**message, "content": _text(message.get("content"))}
        calls = item.get("tool_calls")
        if item.get("role") == "assistant" and isinstance(calls, list):
            if not calls:
                item.pop("tool_calls")
            else:
                item["tool_calls"] = [_call(call) for call in calls]
        shown.append(item)
    return shown


def _call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise UserError("messages: assistant tool_calls entries must be objects.")
    function = dict(call["function"])
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except ValueError:
            raise UserError("messages: a tool call's arguments are not JSON") from None
    return {**call, "function": function}


@functools.lru_cache(maxsize=4)
def _vocabulary_size(tokenizer: Any) -> int:
    """How many token ids the tokenizer has (its added tokens included)."""
    return len(tokenizer.get_vocab())


@dataclass(frozen=True)
class TokenizeRoutes:
    """``/tokenize`` and ``/detokenize`` over the pool's tokenizer; ``refuse`` writes every refusal."""

    pool: SessionPool
    settings: ServeSettings
    refuse: Callable[[BaseException], Response]

    def table(self) -> list[Route]:
        return [
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ]

    async def _body(self, request: Request) -> Any:
        self.settings.tenants.tenant_of(request.headers)
        body = await read_body(request, self.settings.max_request_bytes)
        return await anyio.to_thread.run_sync(parse_json, body)

    def _tokenizer(self) -> Any:
        return load_tokenizer(str(self.pool.engine.info.model_path))

    async def tokenize(self, request: Request) -> Response:
        try:
            raw = await self._body(request)
            answer = await anyio.to_thread.run_sync(self._tokenize, raw)
        except Exception as exc:
            return self.refuse(exc)
        return JSONResponse(answer)

    def _tokenize(self, raw: Any) -> dict[str, Any]:
        chat = isinstance(raw, dict) and "messages" in raw and "prompt" not in raw
        parsed: TokenizeChat | TokenizePrompt = validated(TokenizeChat, raw) if chat else validated(TokenizePrompt, raw)
        self.settings.check_model(parsed.model)
        tokenizer = self._tokenizer()
        if isinstance(parsed, TokenizeChat):
            text = self._render(tokenizer, parsed)
        else:
            text = parsed.prompt
        ids = [int(token) for token in tokenizer.encode(text, add_special_tokens=parsed.add_special_tokens)]
        strs = [str(piece) for piece in tokenizer.convert_ids_to_tokens(ids)] if parsed.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": self.pool.engine.info.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    def _render(self, tokenizer: Any, parsed: TokenizeChat) -> str:
        """The chat template's text of the request's messages, as vLLM renders it."""
        from jinja2.exceptions import TemplateError as JinjaTemplateError

        check_items("messages", len(parsed.messages), self.settings.max_messages)
        kwargs = parsed.chat_template_kwargs or {}
        check_template_kwargs(kwargs)
        if parsed.chat_template is not None or kwargs.get("chat_template") is not None:
            raise UserError(
                "Chat template is passed with request, but --trust-request-chat-template is not set. "
                "Refused request with untrusted chat template."
            )
        if parsed.continue_final_message and parsed.add_generation_prompt:
            raise UserError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        template_kwargs_key(kwargs)  # refuses what vLLM refuses
        extra = template_arguments(tokenizer, kwargs)
        if parsed.continue_final_message:
            extra["continue_final_message"] = True
        try:
            return str(
                tokenizer.apply_chat_template(
                    _conversation(parsed.messages),
                    tools=parsed.tools,
                    tokenize=False,
                    add_generation_prompt=parsed.add_generation_prompt,
                    **extra,
                )
            )
        except JinjaTemplateError as exc:
            raise UserError(f"messages: the model's chat template refuses them: {exc}") from None

    async def detokenize(self, request: Request) -> Response:
        try:
            raw = await self._body(request)
            answer = await anyio.to_thread.run_sync(self._detokenize, raw)
        except Exception as exc:
            return self.refuse(exc)
        return JSONResponse(answer)

    def _detokenize(self, raw: Any) -> dict[str, Any]:
        parsed = validated(Detokenize, raw)
        self.settings.check_model(parsed.model)
        tokenizer = self._tokenizer()
        size = _vocabulary_size(tokenizer)
        outside = next((token for token in parsed.tokens if not 0 <= token < size), None)
        if outside is not None:
            raise UserError(f"tokens: token id {outside} is out of vocabulary (the vocabulary has {size} tokens)")
        return {"prompt": str(tokenizer.decode(parsed.tokens))}
