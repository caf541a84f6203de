"""The pin: D's handle on a conversation's KV, and the rule for pushing it back (docs/concepts.md, "The token-exact rule").

vLLM never checks that a new prompt continues the tokens D holds; if it does not, P pulls
KV for the wrong tokens and its output (and prefix cache) are silently wrong. So a handle
is forwarded only when the new prompt extends the pinned tokens exactly, and the pin is
not expired or about to be.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .._stats._stats import MissReason
from ._handle import KVHandle

__all__ = ["Pin", "choose_handle", "miss_after_step"]


@dataclass(frozen=True)
class Pin:
    """D's handle and the tokens its blocks hold KV for (the prompt plus the output)."""

    handle: KVHandle
    tokens: list[int]
    deadline: float | None = None
    """When the pin expires, in this process's ``time.perf_counter()`` clock; None: the handle's own
    ``remote_blocks_expiry_time`` (D's clock, the same clock when D runs on this host)."""


def choose_handle(
    pin: Pin | None, prompt: list[int], *, push_back: bool, expiry_margin_s: float, now: float | None = None
) -> tuple[KVHandle | None, MissReason | None]:
    """The handle to push back with ``prompt``, or None and the reason why not."""
    if not push_back:
        return None, "push_back_off"
    if pin is None:
        return None, "no_handle"
    moment = time.perf_counter() if now is None else now
    deadline = pin.deadline if pin.deadline is not None else pin.handle.remote_blocks_expiry_time
    if moment + expiry_margin_s >= deadline:
        return None, "expired"
    held = pin.handle.remote_num_tokens
    if held > len(pin.tokens) or len(prompt) <= held or prompt[:held] != pin.tokens[:held]:
        return None, "prefix_mismatch"
    return pin.handle, None


def miss_after_step(
    handle: KVHandle | None,
    reason: MissReason | None,
    *,
    prompt_tokens: int,
    local_hit_tokens: int,
    pulled_tokens: int,
    declined: bool,
    placed_on_decode: bool = False,
    evicted: bool = False,
) -> MissReason | None:
    """The step's miss reason once the engine has answered (a step D prefilled from its own cache of the
    pin reused it: no miss; a handle whose pin the pair had released to make room was not used)."""
    if handle is None:
        return reason
    if evicted:
        return "evicted"
    if placed_on_decode:
        return None
    if declined:
        return "declined"
    if pulled_tokens == 0 and local_hit_tokens < min(handle.remote_num_tokens, prompt_tokens):
        return "below_threshold"
    return None
