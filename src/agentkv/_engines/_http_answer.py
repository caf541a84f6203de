"""What one step of an HTTP pair learns from its servers' replies, beside the tokens.

`DecodeAnswer` collects D's answer as it streams (token ids, texts, logprobs, the finish
reason, and D's last reply, which carries its handle). The rest reads agentkv's server
additions (``src/agentkv/_engines/_server.py``): `NixlBaseline` turns each server's NIXL
totals into per-step differences (`moved_kv`: a step's bytes and seconds, when it was the
pair's only one), and `decode_pin` makes D's handle the step's `Pin`, its expiry carried into this
process's clock.
`HTTPPair` (``src/agentkv/_engines/_http.py``) builds the step's `StepDone` from them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from .._errors import EngineError
from ._base import Pin, TokenDelta, TokenLogprob
from ._handle import KVHandle, parse_handle, pin_of
from ._http_transport import ServerReply, completion_logprobs
from ._platforms import Role

__all__ = ["NOTHING_MOVED", "DecodeAnswer", "NixlBaseline", "decode_pin", "moved_kv"]


@dataclass
class NixlBaseline:
    """Each server's NIXL totals as of its latest reply (for per-step differences)."""

    totals: dict[str, dict[str, float]] = field(default_factory=dict[str, dict[str, float]])

    def advance(self, role: Role, reply: ServerReply) -> dict[str, float] | None:
        """Record ``reply``'s totals; return the difference from the previous ones."""
        now, before = reply.nixl(), self.totals.get(role)
        if now is None:
            return None
        self.totals[role] = {key: max(now[key], (before or now)[key]) for key in now}
        return None if before is None else {key: now[key] - before[key] for key in now}


@dataclass
class DecodeAnswer:
    """D's answer as it streams: tokens, texts, the finish reason, and D's last reply (its handle)."""

    token_ids: list[int] = field(default_factory=list[int])
    texts: list[str] = field(default_factory=list[str])
    first_token_at: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    """What ended the output as vLLM's server says (a stop string, a stop token id; None: end of sequence, length)."""
    reply: ServerReply = field(default_factory=ServerReply)
    logprobs_count: int | None = None
    """The alternatives per token the step asked for (`SamplingOptions.logprobs`); None: no logprobs."""
    logprobs: list[TokenLogprob] | None = None

    async def collect(self, outputs: AsyncIterator[tuple[Any, ServerReply | None]]) -> AsyncIterator[TokenDelta]:
        async for choice, reply in outputs:
            if reply is not None:
                self.reply = reply
                continue
            ids = list(getattr(choice, "token_ids", None) or [])
            if choice.text and not ids:  # the history is token ids: text alone would break the exact-prefix rule
                raise EngineError("the decode server returned text without token ids (it needs `return_token_ids`)")
            if ids and self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self.token_ids.extend(ids)
            self.texts.append(choice.text)
            self.finish_reason = choice.finish_reason or self.finish_reason
            stop_reason = getattr(choice, "stop_reason", None)
            self.stop_reason = stop_reason if stop_reason is not None else self.stop_reason
            logprobs = None
            if self.logprobs_count is not None:
                logprobs = completion_logprobs(getattr(choice, "logprobs", None), self.logprobs_count)
                if len(logprobs) != len(ids):
                    raise EngineError(f"the decode server sent logprobs for {len(logprobs)} of {len(ids)} tokens")
                self.logprobs = [*(self.logprobs or ()), *logprobs]
            if ids or choice.text:
                yield TokenDelta(token_ids=ids, text=choice.text, logprobs=logprobs)


NOTHING_MOVED = {"bytes": 0.0, "seconds": 0.0, "expired": 0.0}
"""P's NIXL differences for a step on D alone."""


def moved_kv(p_moved: dict[str, float] | None, d_moved: dict[str, float] | None, *, alone: bool) -> dict[str, Any]:
    """A step's ``kv_bytes`` and ``kv_transfer_s``: what P and D moved, known only for a step alone on the pair."""
    if not alone or p_moved is None or d_moved is None:
        return {"kv_bytes": None, "kv_transfer_s": None}
    return {
        "kv_bytes": int(p_moved["bytes"] + d_moved["bytes"]),
        "kv_transfer_s": p_moved["seconds"] + d_moved["seconds"],
    }


def decode_pin(reply: ServerReply) -> tuple[Pin | None, str | None]:
    """The `Pin` of D's handle in its last ``reply`` (None: D returned none), or None and why it is malformed."""
    handle, problem = parse_handle(reply.kv_transfer_params)
    return pin_of(handle, deadline=_local_deadline(handle, reply)), problem


def _local_deadline(handle: KVHandle | None, reply: ServerReply) -> float | None:
    """``handle``'s expiry in this process's clock, from D's clock in its reply (None: no clock sent)."""
    clock = (reply.extras or {}).get("clock")
    if handle is None or clock is None:
        return None
    return reply.received_at + (handle.remote_blocks_expiry_time - float(clock))
