"""Session modes: how a session runs on its engine, read off what the engine can do (`EngineInfo`'s flags).

An engine says what it can do (keep KV and take a pin back, run prefill and decode apart, place a
pinned step where its KV is); the modes are the session's names for the ways of using that
(docs/concepts.md, "Modes").
"""

from __future__ import annotations

from typing import Literal

from .._engines._base import EngineInfo

__all__ = ["Mode", "modes_of", "natural_mode", "off_reason", "pushes_back"]

Mode = Literal["auto", "bidirectional", "disaggregated", "colocated"]
"""How a session runs on its engine: on a pair with KV pushed back to P, on a pair without, or on one engine.

``"auto"`` is push-back where the pair places each step: on P with push-back, or on D alone
from D's own cache of the pinned conversation, whichever its measured costs say is faster.
"""

_MODE_PREFERENCE: tuple[Mode, ...] = ("bidirectional", "auto", "disaggregated", "colocated")

_NEEDS: dict[Mode, str] = {"bidirectional": "pins", "auto": "places_steps"}
"""The engine flag a mode needs beyond the engine's kind (``"auto"`` needs `EngineInfo.pins` too)."""


def modes_of(info: EngineInfo) -> frozenset[Mode]:
    """The modes a session can run on an engine that reports ``info``.

    A pair (``disaggregated``) serves "disaggregated"; "bidirectional" too when it keeps pins, and
    "auto" when it also places steps. A single engine serves "colocated" (a pin it keeps is not
    used: no mode pushes back to one engine). A double standing in for both serves both kinds' modes.
    """
    modes: set[Mode] = set()
    if info.disaggregated is not True:
        modes.add("colocated")
    if info.disaggregated is not False:
        modes.add("disaggregated")
        if info.pins:
            modes.add("bidirectional")
            if info.places_steps:
                modes.add("auto")
    return frozenset(modes)


def natural_mode(info: EngineInfo) -> Mode:
    """The mode of a session that asks for none: the first served of bidirectional, disaggregated, colocated."""
    served = modes_of(info)
    return next(mode for mode in _MODE_PREFERENCE if mode in served)


def pushes_back(mode: Mode) -> bool:
    """Whether a session in ``mode`` gives each step the pin of the step before (the push-back rule)."""
    return mode in ("bidirectional", "auto")


def off_reason(info: EngineInfo, mode: Mode) -> str | None:
    """Why the engine cannot serve ``mode``, where it said (`EngineInfo.off_reasons`)."""
    flag = _NEEDS.get(mode)
    return info.off_reasons.get(flag) if flag is not None else None
