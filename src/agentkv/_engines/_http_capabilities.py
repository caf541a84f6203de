"""What the two servers of an HTTP pair are, found once when the pair opens.

Two one-token requests without ``kv_transfer_params`` (so neither server transfers or pins
any KV): a non-streamed one to P and a streamed one to D. agentkv's server (``agentkv
serve``, `LaunchedPair`'s) adds an ``agentkv`` object to every completion and ends every
stream with a chunk that holds it and D's handle; a stock vLLM 0.32 server does neither.
The answers decide, before the first user step and for the pair's whole life, what the
pair does: the engine never changes them mid-session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .._errors import EngineError
from ._base import Sampling
from ._http_transport import PairTransport, Role, completion_body, retrying, translated

__all__ = ["ServerCapabilities", "ServerKind", "probe_servers"]

ServerKind = Literal["agentkv", "vllm"]

PROBE_PROMPT = (1, 28, 28, 28)
"""Four token ids every vocabulary has: under one KV block, one token out."""


@dataclass(frozen=True, kw_only=True)
class ServerCapabilities:
    """The servers of a pair as the probe found them."""

    prefill_kind: ServerKind
    decode_kind: ServerKind
    handle_in_stream: bool
    """D's streamed responses end with its KV handle (agentkv's server: yes; stock vLLM 0.32: no)."""
    served_model: str
    max_model_len: int

    @property
    def server_kind(self) -> ServerKind:
        """``"agentkv"`` when both servers are agentkv's, else ``"vllm"``."""
        return "agentkv" if self.prefill_kind == self.decode_kind == "agentkv" else "vllm"

    @property
    def exact_split(self) -> bool:
        """P reports where its cached tokens came from (its own cache or pulled from D)."""
        return self.prefill_kind == "agentkv"


async def probe_servers(transport: PairTransport, models: list[Any], *, attempts: int) -> ServerCapabilities:
    """Ask each server one token (``models``: what each serves, from `PairTransport.connect`)."""
    served_model = models[1].id
    lengths = [length for model in models if (length := getattr(model, "max_model_len", None))]
    body = completion_body(
        model=served_model,
        prompt_token_ids=PROBE_PROMPT,
        max_tokens=1,
        sampling=Sampling(max_tokens=1),
        kv_transfer_params=None,
    )
    _, p_reply = await _with_retries(transport, "prefill", body, attempts=attempts)
    d_kind: ServerKind = "vllm"
    handle_in_stream = False
    token_ids = False
    with translated("decode"):
        async for attempt in retrying(attempts=attempts, role="decode"):
            with attempt:
                async for choice, reply in transport.stream("decode", body):
                    if choice is not None:
                        token_ids = token_ids or bool(getattr(choice, "token_ids", None))
                    elif reply is not None:
                        handle_in_stream = True
                        d_kind = "agentkv" if reply.extras is not None else d_kind
    if not token_ids:
        raise EngineError("the decode server streams no token ids: it needs vLLM 0.32's `return_token_ids`")
    return ServerCapabilities(
        prefill_kind="agentkv" if p_reply.extras is not None else "vllm",
        decode_kind=d_kind,
        handle_in_stream=handle_in_stream,
        served_model=served_model,
        max_model_len=min(lengths) if lengths else 4096,
    )


async def _with_retries(transport: PairTransport, role: Role, body: dict[str, Any], *, attempts: int) -> Any:
    with translated(role):
        async for attempt in retrying(attempts=attempts, role=role):
            with attempt:
                return await transport.complete(role, body)
    raise AssertionError("unreachable: tenacity re-raises the last error")
