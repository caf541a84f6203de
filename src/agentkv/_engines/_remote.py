"""`RemotePair`: a P/D pair of vLLM servers that someone else runs, on this host or others."""

from __future__ import annotations

import os
from collections.abc import Callable

from ._http import HTTPPair

__all__ = ["RemotePair"]


class RemotePair(HTTPPair):
    """A prefill server and a decode server already running (``agentkv serve`` or ``vllm serve``).

    The servers must run vLLM's NIXL connector (P ``kv_producer``, D ``kv_consumer``, with
    ``bidirectional_kv_xfer`` for push-back) on the model named by ``model``: the session
    tokenizes locally and sends token ids.

    What the session gets depends on the servers, and the pair says which
    (`server_kind`, `handle_in_stream`, ``info.push_back``):

    * servers started with ``agentkv serve``: token streaming **and** push-back, the exact
      prefill split, NIXL bytes (with ``exclusive=True``);
    * stock vLLM 0.32 servers stream no KV handle: push-back is turned off (a warning says
      so) unless ``decode_streaming=False``, which keeps push-back and gives up token
      streaming (the answer arrives in one piece); cached tokens are reported as local.

    Args:
        prefill_url: P's base URL (``http://host:port``).
        decode_url: D's base URL.
        model: the model the servers serve, for its tokenizer and chat template (a bundled
            name or a local HF folder; default: the bundled SmolLM2-135M).
        push_back: forward D's handle to P (needs ``bidirectional_kv_xfer`` on the servers).
        decode_streaming: stream D's tokens (see above).
        exclusive: this pair is the servers' only client, so differences of their NIXL
            totals between two replies are this session's (``kv_bytes``); otherwise None.
        attempts: tries per server call on transient errors (refused connection, 5xx).
        warmup: run two short steps at open (NIXL handshakes, and the stream check).
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
        attempts: int = 4,
        warmup: bool = True,
        step_timeout_s: float = 300.0,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(model, step_timeout_s=step_timeout_s, attempts=attempts, warmup=warmup, progress=progress)
        self.decode_streaming = decode_streaming
        self._exclusive = exclusive
        self._urls = (prefill_url, decode_url)
        self._wants_push_back = push_back

    async def _start(self) -> None:
        await self._connect(*self._urls, push_back=self._wants_push_back, kind="remote")
