"""The faults `HonestPairEngine` (src/agentkv/_doubles/_honest_pair.py) plays on request: `Fault`, and how a
``malformed_handle`` fault breaks D's handle (`Malformation`, `malformed`). Separate from the double itself:
tests draw from these names (`MALFORMATIONS`), and the list of what can go wrong reads on its own.
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

__all__ = ["MALFORMATIONS", "Fault", "Malformation", "malformed"]

Fault = Literal[
    "error",
    "error_mid_stream",
    "die",
    "die_mid_stream",
    "malformed_handle",
    "expired_handle",
    "near_expiry_handle",
    "expire_early",
    "decline",
    "stall",
]
"""A fault `HonestPairEngine.inject` plays on the next step:

* ``error`` / ``error_mid_stream``: raise `EngineError` before any output / after the first token delta;
* ``die`` / ``die_mid_stream``: the engine dies (`EngineDeadError`; it serves no more steps);
* ``malformed_handle``: D returns a malformed handle dict (see `Malformation`), parsed as a real engine parses it;
* ``expired_handle``: D returns a handle whose deadline has already passed;
* ``near_expiry_handle``: D returns a handle that expires within half the engine's ``forward_margin_s``;
* ``expire_early``: D frees this step's pin at once although the handle says later (its read is declined);
* ``decline``: P declines to read the handle pushed back with this step (it recomputes);
* ``stall``: the step hangs for ``stall_s`` after its first token delta (for cancellation tests).
"""

Malformation = Literal[
    "missing_key",
    "nan_expiry",
    "inf_expiry",
    "empty_blocks",
    "negative_block",
    "blank_host",
    "unknown_key",
    "not_a_dict",
]
"""How a ``malformed_handle`` fault breaks D's dict."""

MALFORMATIONS: tuple[Malformation, ...] = get_args(Malformation)
"""Every `Malformation`, for tests that draw one."""


def malformed(issued: dict[str, Any], how: Malformation) -> object:
    """What ``how`` makes of D's valid handle dict ``issued`` (a ``malformed_handle`` fault)."""
    raw = dict(issued)
    if how == "missing_key":
        del raw["remote_engine_id"]
    elif how == "nan_expiry":
        raw["remote_blocks_expiry_time"] = math.nan
    elif how == "inf_expiry":
        raw["remote_blocks_expiry_time"] = math.inf
    elif how == "empty_blocks":
        raw["remote_block_ids"] = [[]]
    elif how == "negative_block":
        raw["remote_block_ids"] = [[-1, *raw["remote_block_ids"][0][1:]]]
    elif how == "blank_host":
        raw["remote_host"] = "  "
    elif how == "unknown_key":
        raw["agentkv_unexpected"] = "x"
    else:
        return "not a dict"
    return raw
