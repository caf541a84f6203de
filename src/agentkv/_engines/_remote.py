"""`RemotePair`: a P/D pair of vLLM servers that someone else runs, on this host or others."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ._base import Pin, SavedPin
from ._handle import handle_of, parse_handle, pin_of
from ._http import HTTPPair
from ._pair_config import Transfer
from ._slo import DEFAULT_SLO, Slo

__all__ = ["RemotePair"]


class RemotePair(HTTPPair):
    """A prefill server and a decode server already running (``agentkv engine`` or ``vllm serve``).

    The servers must run vLLM's NIXL connector (P ``kv_producer``, D ``kv_consumer``, with
    ``bidirectional_kv_xfer`` for push-back) on one model, and the same vLLM release (their NIXL handshake
    versions must match: a pair that cannot handshake is refused at open, naming both servers' versions). The
    session tokenizes locally and sends token ids, with the model the servers serve (``GET /v1/models``), read
    when the pair opens; a ``model`` that is not theirs is refused by name.

    What the session gets depends on the servers. The pair asks each server for one token
    when it opens (`capabilities`, `server_kind`, `handle_in_stream`) and decides then:

    * servers started with ``agentkv engine``: token streaming **and** push-back, the exact
      prefill split, NIXL bytes (with ``exclusive=True``);
    * stock vLLM servers from 0.33 on: token streaming and push-back (the last streamed chunk
      carries D's handle); cached tokens are reported as local, and no NIXL bytes;
    * stock vLLM 0.32 servers: only with ``decode_streaming=False`` (push-back, each answer
      arrives whole). Their decode server streams no KV handle, so opening with
      ``decode_streaming=True`` raises `UserError` saying what to run instead (see ``docs/engines.md``).

    Args:
        prefill_url: P's base URL (``http://host:port``).
        decode_url: D's base URL.
        model: the model the servers serve, for its tokenizer and chat template (a bundled
            name, a local HF folder or a Hugging Face id ``org/name[@revision]``); default: the one the servers
            say they serve, prepared as ``--model`` prepares one (an HF id from the HF cache, a bundled model, or
            their folder when this host has it). One that is not theirs is refused (`UserError`) at open.
        push_back: forward D's handle to P (needs ``bidirectional_kv_xfer`` on the servers).
        transfer: what the servers' connector does: ``"pull"`` (vLLM's ``NixlConnector``) or ``"push"``
            (``agentkv engine --transfer push``); each step then speaks that protocol. A push pair's first step
            sends P before D, to learn P's NIXL coordinates from its reply; later steps send both at once.
        decode_streaming: stream D's tokens (see above).
        exclusive: this pair is the servers' only client, so differences of their NIXL
            totals between two replies are this session's (``kv_bytes``); otherwise None.
        max_pinned_blocks: at most this many of D's KV blocks pinned by this pair's sessions (None: as many
            as leave room for the steps in flight). D's size is read from its ``/metrics`` when the pair opens;
            pins past the budget are released, least recently pinned first (see `PairLayer`). The budget
            counts this pair's pins only: other clients of the same D are not seen.
        slo: the objective mode ``auto`` places steps for (`Slo`; default 2 s to the first token, 0.2 s between
            tokens, explained in `Slo`'s documentation; the ``slo`` attribute
            changes it while the pair runs; None: a step goes to D alone only while D has nothing in flight).
        attempts: tries per server call on transient errors (refused connection, 5xx).
        warmup: run two short steps at open (kernels, NIXL handshakes).
        step_timeout_s: a server that sends nothing for this long fails the step.
        progress: called with one line per stage (default: the ``agentkv`` logger).
    """

    def __init__(
        self,
        prefill_url: str,
        decode_url: str,
        *,
        model: str | os.PathLike[str] | None = None,
        push_back: bool = True,
        decode_streaming: bool = True,
        exclusive: bool = False,
        transfer: Transfer = "pull",
        max_pinned_blocks: int | None = None,
        slo: Slo | None = DEFAULT_SLO,
        attempts: int = 4,
        warmup: bool = True,
        step_timeout_s: float = 300.0,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(
            model,
            step_timeout_s=step_timeout_s,
            attempts=attempts,
            warmup=warmup,
            progress=progress,
            push_back=push_back,
            decode_streaming=decode_streaming,
            exclusive=exclusive,
            transfer=transfer,
            max_pinned_blocks=max_pinned_blocks,
            slo=slo,
        )
        self._urls = (prefill_url, decode_url)

    async def _start(self) -> None:
        await self._open_servers(*self._urls, kind="remote")

    # ----------------------------------------------------------------- pins that travel

    def saved_pin(self, pin: Pin) -> SavedPin | None:
        """D's handle with its expiry in wall-clock time: several doors driving the same servers (each its own
        `RemotePair` on the same D URL) take a conversation's pin over from one another through their shared
        store (src/agentkv/_session/_pool.py says when a door may). Pull pairs only."""
        if self._transfer_is_push():
            return None
        handle = handle_of(pin)
        return SavedPin(
            id=handle.remote_request_id,
            server=self._urls[1],
            tokens=pin.tokens,
            expires_unix=time.time() + (pin.expires_at - time.perf_counter()),
            ref=handle.model_dump(),
        )

    def adopt_pin(self, saved: SavedPin) -> Pin | None:
        """The saved handle, when it names this pair's D (the same URL), is well formed and is not about to
        expire: its expiry back in this process's clock, and counted in D's budget of pins like this pair's own."""
        if self._transfer_is_push() or saved.server != self._urls[1]:
            return None
        handle, _ = parse_handle(saved.ref)
        if (
            handle is None
            or handle.remote_engine_id in self._retired_engines
            or handle.remote_num_tokens != saved.tokens
        ):
            return None
        deadline = time.perf_counter() + (saved.expires_unix - time.time())
        if deadline <= time.perf_counter():
            return None
        self._pin_budget().pinned(handle, deadline=deadline)
        return pin_of(handle, deadline=deadline)
