"""What the two servers of an HTTP pair are, found once when the pair opens.

Two one-token requests without ``kv_transfer_params`` (so neither server transfers or pins
any KV): a non-streamed one to P and a streamed one to D. agentkv's server (``agentkv
serve``, `LaunchedPair`'s) adds an ``agentkv`` object to every completion and ends every
stream with a chunk that holds it and D's handle; a stock vLLM server does neither (from 0.33 on its last streamed
chunk with choices carries the handle, which a probe that asks for none cannot see: its release says so).
Each server's ``/version`` and agentkv's
server's own word say what it runs (``_http_versions.py``). The answers decide, before the first user step and for the pair's whole life, what the
pair does: the engine never changes them mid-session. D's size (its KV blocks, for the pin
budget) comes from its ``/metrics``: vLLM publishes its cache configuration there as
``vllm:cache_config_info`` (stock and agentkv servers alike, unless started with
``--disable-log-stats``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from _agentkv_vllm._patches import AUTO_PLACEMENT

from .._errors import EngineError
from ._base import Sampling
from ._http_transport import PairTransport, completion_body, retrying, translated
from ._http_versions import ServerVersions, read_server_version, stock_streams_handle
from ._platforms import Role

__all__ = [
    "UNKNOWN_BLOCK_SIZE",
    "DecodeCapacity",
    "ServerCapabilities",
    "ServerKind",
    "decode_capacity",
    "parse_capacity",
    "probe_servers",
]

logger = logging.getLogger("agentkv")

ServerKind = Literal["agentkv", "vllm"]

PROBE_PROMPT = (1, 28, 28, 28)
"""Four token ids every vocabulary has: under one KV block, one token out."""


@dataclass(frozen=True, kw_only=True)
class ServerCapabilities:
    """The servers of a pair as the probe found them."""

    prefill_kind: ServerKind
    decode_kind: ServerKind
    handle_in_stream: bool
    """D's streamed responses end with its KV handle (agentkv's server: yes; stock vLLM: from 0.33 on)."""
    served_model: str
    max_model_len: int
    placement_off: str | None = "not probed"
    versions: dict[Role, ServerVersions] | None = None
    """What each server runs (vLLM, NIXL, the NIXL handshake version), as far as it says."""
    """Why D cannot take a step alone (see ``_server.py``'s ``features_off``); None: it can."""

    @property
    def server_kind(self) -> ServerKind:
        """``"agentkv"`` when both servers are agentkv's, else ``"vllm"``."""
        return "agentkv" if self.prefill_kind == self.decode_kind == "agentkv" else "vllm"

    @property
    def exact_split(self) -> bool:
        """P reports where its cached tokens came from (its own cache or pulled from D)."""
        return self.prefill_kind == "agentkv"


async def probe_servers(
    transport: PairTransport, models: list[Any], *, urls: tuple[str, str], attempts: int
) -> ServerCapabilities:
    """Ask each server one token (``models``: what each serves, from `PairTransport.connect`) and its versions
    (``GET /version`` at ``urls``, and agentkv's servers' own word)."""
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
    d_extras: Any = None
    with translated("decode"):
        async for attempt in retrying(attempts=attempts, role="decode"):
            with attempt:
                async for choice, reply in transport.stream("decode", body):
                    if choice is not None:
                        token_ids = token_ids or bool(getattr(choice, "token_ids", None))
                    elif reply is not None:
                        handle_in_stream = True
                        d_kind = "agentkv" if reply.extras is not None else d_kind
                        d_extras = reply.extras
    if not token_ids:
        raise EngineError("the decode server streams no token ids: it needs vLLM 0.32's `return_token_ids`")
    versions: dict[Role, ServerVersions] = {
        "prefill": ServerVersions.of(await read_server_version(urls[0]), p_reply.extras),
        "decode": ServerVersions.of(await read_server_version(urls[1]), d_extras),
    }
    if d_kind == "vllm":  # the probe asks for no handle: a stock server's streams carry one by its release
        handle_in_stream = stock_streams_handle(versions["decode"].vllm)
    placement_off = "the decode server is a stock vLLM server"
    if d_kind == "agentkv":
        off = d_extras.get("features_off") if isinstance(d_extras, dict) else None
        placement_off = "the decode server does not say" if off is None else off.get(AUTO_PLACEMENT)
    return ServerCapabilities(
        prefill_kind="agentkv" if p_reply.extras is not None else "vllm",
        decode_kind=d_kind,
        placement_off=placement_off,
        handle_in_stream=handle_in_stream,
        served_model=served_model,
        max_model_len=min(lengths) if lengths else 4096,
        versions=versions,
    )


async def _with_retries(transport: PairTransport, role: Role, body: dict[str, Any], *, attempts: int) -> Any:
    with translated(role):
        async for attempt in retrying(attempts=attempts, role=role):
            with attempt:
                return await transport.complete(role, body)
    raise AssertionError("unreachable: tenacity re-raises the last error")


@dataclass(frozen=True)
class DecodeCapacity:
    """D's KV cache: its blocks (None: not published) and tokens per block."""

    blocks: int | None
    block_size: int


UNKNOWN_BLOCK_SIZE = 16
"""vLLM's default block size on GPUs, assumed when D publishes no cache configuration."""


def parse_capacity(metrics_text: str) -> DecodeCapacity | None:
    """D's capacity from a vLLM server's Prometheus text: the smallest engine's ``num_gpu_blocks`` (a request
    runs on one engine) and its ``block_size``; None when the text has no ``vllm:cache_config_info``."""
    found: list[DecodeCapacity] = []
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "vllm:cache_config_info":
            continue
        for sample in family.samples:
            blocks, size = sample.labels.get("num_gpu_blocks", ""), sample.labels.get("block_size", "")
            if blocks.isdigit() and size.isdigit():
                found.append(DecodeCapacity(int(blocks), int(size)))
    return min(found, key=lambda capacity: capacity.blocks or 0) if found else None


async def decode_capacity(decode_url: str, *, timeout_s: float = 10.0) -> DecodeCapacity:
    """Ask D's server for its size (``GET /metrics``); unknown, with one warning, when it does not say."""
    root = decode_url.rstrip("/").removesuffix("/v1")
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(f"{root}/metrics")
            response.raise_for_status()
        capacity = parse_capacity(response.text)
    except (httpx.HTTPError, ValueError) as exc:
        logger.debug("agentkv: reading %s/metrics failed: %s", root, exc)
        capacity = None
    if capacity is None:
        logger.warning(
            "agentkv: the decode server at %s publishes no vllm:cache_config_info on /metrics (started with "
            "--disable-log-stats?): its pins are bounded only by max_pinned_blocks, counted in blocks of %d tokens",
            decode_url,
            UNKNOWN_BLOCK_SIZE,
        )
        return DecodeCapacity(None, UNKNOWN_BLOCK_SIZE)
    return capacity
