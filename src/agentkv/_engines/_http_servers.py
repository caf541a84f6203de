"""`HTTPServers`: the two servers of an `HTTPPair` (src/agentkv/_engines/_http.py), what they are, and how the pair
opens on them.

The pair's state (its transport, the servers' capabilities, D's capacity, the counts its steps keep), the
properties that read it, and opening: connect, probe once, and decide what the pair does (whether D streams,
whether steps are placed). Separate from the steps themselves, which `HTTPPair` runs over this state.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path

from .._errors import UserError
from ._base import EngineInfo
from ._http_answer import NixlBaseline
from ._http_capabilities import (
    UNKNOWN_BLOCK_SIZE,
    DecodeCapacity,
    ServerCapabilities,
    ServerKind,
    decode_capacity,
    probe_servers,
)
from ._http_model import ServedModel, resolve_served_model
from ._http_transport import PairTransport
from ._http_versions import check_handshake
from ._pair_config import Transfer
from ._pair_layer import PairLayer
from ._platforms import Role
from ._slo import DEFAULT_SLO, Slo

__all__ = ["HTTPServers", "stock_decode_streaming_error"]

logger = logging.getLogger("agentkv")


def stock_decode_streaming_error(decode_url: str) -> UserError:
    """Why a stock vLLM decode server cannot stream to a session, and what to run instead."""
    return UserError(
        f"the decode server at {decode_url} is a stock vLLM server whose streamed responses carry no "
        "KV handle (vLLM 0.32 returns it only in non-streamed responses; from 0.33 on the last streamed chunk "
        "carries it), so push-back cannot work, and with bidirectional_kv_xfer it keeps every step's KV pinned for "
        "decoder_kv_blocks_ttl (480 s) where nothing can free it. Run the decode server with `agentkv engine --role "
        "decode` or stock vLLM 0.33 or later (streaming and push-back), or pass decode_streaming=False (push-back; "
        "each answer arrives whole)."
    )


class HTTPServers(PairLayer):
    """The P and D servers of an `HTTPPair`: the pair's state, what the servers are, and opening on them."""

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
        max_pinned_blocks: int | None = None,
        slo: Slo | None = DEFAULT_SLO,
    ) -> None:
        super().__init__(max_pinned_blocks=max_pinned_blocks, slo=slo)
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
        self._baseline = NixlBaseline()
        self._in_flight = 0
        self._started_steps = 0
        self._transfer = transfer
        self._prefill_coordinates: tuple[str, str, int] | None = None
        """P's NIXL engine id, host and side-channel port, which D needs to register for a push."""
        self._retired_engines: set[str] = set()
        """Engine ids of servers that are gone: their handles are dropped, never sent to P."""
        self._decode_capacity = DecodeCapacity(None, UNKNOWN_BLOCK_SIZE)
        self._busy: dict[Role, int] = {"prefill": 0, "decode": 0}
        """This pair's requests in flight on each server (what placement compares)."""
        self._alone_from: dict[str, int | None] = {}
        """Per step in flight: the step count when it started alone (see `step`), for NIXL differences."""

    # ----------------------------------------------------------------- what it is

    @property
    def info(self) -> EngineInfo:
        return self._info_once_started(self._info)

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

        ``model_path``: the prepared model folder, when the caller already has it (servers it started); otherwise
        the servers' model, or the one the pair was given if the servers serve it (`resolve_served_model`).
        P and D must run vLLM releases that handshake (`check_handshake`).
        """
        self._urls = (prefill_url, decode_url)
        models = await self._transport.connect(self._urls)
        if model_path is None:  # the servers' model, or the one named if they serve it (`resolve_served_model`)
            served: dict[Role, ServedModel] = {
                "prefill": ServedModel.of(models[0]),
                "decode": ServedModel.of(models[1]),
            }
            model_path = await resolve_served_model(served, self._model, self._urls)
        capabilities = await probe_servers(self._transport, models, urls=self._urls, attempts=self._transport.attempts)
        assert capabilities.versions is not None
        check_handshake(capabilities.versions, self._urls)
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
        self._decode_capacity = await decode_capacity(decode_url)
        self._placement_off = capabilities.placement_off if self._transfer == "pull" else "a push pair"
        if not self._wants_push_back:
            self._placement_off = "the pair runs without push-back"
        self._info = EngineInfo(
            model_path=model_path,
            max_model_len=capabilities.max_model_len,
            pins=self._wants_push_back,
            disaggregated=True,
            places_steps=self._placement_off is None,
            details={
                "transport": kind,
                "prefill_url": prefill_url,
                "decode_url": decode_url,
                "server_kind": capabilities.server_kind,
                "transfer": self._transfer,
                "decode_kv_blocks": self._decode_capacity.blocks,
                "served_model": capabilities.served_model,
                "versions": {role: found.as_dict() for role, found in capabilities.versions.items()},
            },
        )

    async def _reconnect(self, prefill_url: str, decode_url: str) -> None:
        """Point the clients at new URLs of the same servers (a restart): nothing is probed again."""
        self._urls = (prefill_url, decode_url)
        await self._transport.connect(self._urls)
        self._info = dataclasses.replace(
            self.info, details={**self.info.details, "prefill_url": prefill_url, "decode_url": decode_url}
        )

    async def _warm_up(self) -> None:
        if self._warmup:
            self._progress("agentkv: warming up the servers (kernels, NIXL handshakes)")
            await self._calibrate()

    async def _stop(self) -> None:
        await self._transport.close()
