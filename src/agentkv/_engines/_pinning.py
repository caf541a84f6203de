"""The push-back rule: when a session gives a step the pin of the step before (docs/concepts.md, "The token-exact rule").

vLLM never checks that a new prompt continues the tokens D holds; if it does not, P pulls
KV for the wrong tokens and its output (and prefix cache) are silently wrong. So a pin is
given back only when the new prompt extends the pinned tokens exactly, and the pin is not
expired or about to be. The rule reads only what every engine's `Pin` says: how many tokens
it keeps (`Pin.tokens`) and until when (`Pin.expires_at`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .._stats._stats import MissReason
from ._base import Pin

__all__ = ["HeldPin", "choose_pin", "cut_to_prompt", "miss_after_step"]


@dataclass(frozen=True)
class HeldPin:
    """A pin as its user keeps it: the engine's `Pin` and the token ids of the step it came from."""

    pin: Pin
    token_ids: list[int]
    """The step's prompt followed by its output (the pin keeps KV for the first ``pin.tokens`` of them)."""


def choose_pin(
    held: HeldPin | None, prompt: list[int], *, push_back: bool, expiry_margin_s: float, now: float | None = None
) -> tuple[Pin | None, MissReason | None]:
    """The pin to give back with ``prompt``, or None and the reason why not."""
    if not push_back:
        return None, "push_back_off"
    if held is None:
        return None, "no_handle"
    moment = time.perf_counter() if now is None else now
    if moment + expiry_margin_s >= held.pin.expires_at:
        return None, "expired"
    kept = held.pin.tokens
    if kept > len(held.token_ids) or len(prompt) <= kept or prompt[:kept] != held.token_ids[:kept]:
        return None, "prefix_mismatch"
    return held.pin, None


def cut_to_prompt(held: HeldPin, prompt: list[int], cut: Callable[[Pin, int], Pin | None]) -> HeldPin | None:
    """``held`` cut to the tokens ``prompt`` shares with it, for a prompt that does not extend it (an editor's
    file prefix that grew by a line and lost the last answer): the pin's first whole blocks within the shared
    prefix, less the prompt's last token (P computes at least one), by the engine's ``cut`` (`Engine.cut_pin`).
    The cut pin then passes `choose_pin`: the new prompt extends exactly the tokens it keeps. None: no whole
    block is shared, or the engine cannot cut."""
    kept = held.token_ids[: held.pin.tokens]
    limit = min(len(kept), len(prompt) - 1)
    shared = next((i for i in range(limit) if kept[i] != prompt[i]), limit)
    if shared <= 0:
        return None
    pin = cut(held.pin, shared)
    if pin is None or pin.tokens > shared:
        return None
    return HeldPin(pin, held.token_ids)


def miss_after_step(
    pin: Pin | None,
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
    pin reused it: no miss; a pin the engine had released to make room was not used)."""
    if pin is None:
        return reason
    if evicted:
        return "evicted"
    if placed_on_decode:
        return None
    if declined:
        return "declined"
    if pulled_tokens == 0 and local_hit_tokens < min(pin.tokens, prompt_tokens):
        return "below_threshold"
    return None
