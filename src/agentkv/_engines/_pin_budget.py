"""The pins of a pair's D, bounded so that they never fill D's KV cache.

vLLM never evicts a pinned block: a pin is freed by P's read, its release, or its expiry
(8 minutes by default). A D whose cache is all pins can schedule nothing; requests wait
until pins expire. Seen here: 8 concurrent agentic sessions on the default 1 GiB float32
cache (182 blocks of 128 tokens), D 98% full of pins, no request running, two waiting.
A conversation of 2k tokens pins 16 blocks, so about 10 such conversations fill it.

So the pair keeps a ledger of the pins it handed out. Before a step it reserves the blocks
the step will need on D; when the pins held plus the steps in flight would not fit, it
releases the least recently pinned conversations first. A session that later pushes an
evicted handle back gets a recompute (``miss_reason="evicted"``), never wrong KV.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from ._handle import KVHandle

__all__ = ["PinBudget"]

_EVICTED_REMEMBERED = 4096
"""How many evicted handles are remembered (a session holds one pin at a time)."""


@dataclass(frozen=True)
class _Pin:
    handle: KVHandle
    blocks: frozenset[int]
    deadline: float
    """When D frees the blocks, in this process's ``time.perf_counter()`` clock."""


class PinBudget:
    """D's pins and the blocks reserved by steps in flight, against D's ``capacity_blocks``.

    ``max_pinned_blocks`` caps the pins alone (None: whatever leaves room for the steps in flight).
    ``capacity_blocks`` None: D's size is not known (a server that publishes no metrics), and only
    ``max_pinned_blocks`` bounds the pins.
    """

    def __init__(self, capacity_blocks: int | None, block_size: int, *, max_pinned_blocks: int | None = None) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.max_pinned_blocks = max_pinned_blocks
        self._pins: OrderedDict[str, _Pin] = OrderedDict()
        """Live pins by D's request id, least recently pinned first."""
        self._reserved: dict[str, int] = {}
        """Blocks each step in flight may still allocate on D, by the step's request id."""
        self._extended: dict[str, str] = {}
        """The pin each step in flight extends (its blocks are the step's prefix on D), by the step's request id."""
        self._evicted: deque[str] = deque(maxlen=_EVICTED_REMEMBERED)

    # ----------------------------------------------------------------- reading

    @property
    def pinned_blocks(self) -> int:
        """Distinct blocks the live pins hold (conversations that share a prefix share its blocks)."""
        self._drop_expired()
        return len(frozenset().union(*(pin.blocks for pin in self._pins.values())))

    @property
    def reserved_blocks(self) -> int:
        return sum(self._reserved.values())

    def describe(self) -> str:
        """The ledger in words, for an error about a stalled D."""
        of = f" of D's {self.capacity_blocks}" if self.capacity_blocks is not None else ""
        return (
            f"{len(self._pins)} pins holding {self.pinned_blocks} blocks, {self.reserved_blocks} reserved by "
            f"{len(self._reserved)} steps in flight{of}"
        )

    def was_evicted(self, handle: KVHandle) -> bool:
        """Whether the budget released ``handle``'s pin (its blocks may hold another conversation now)."""
        return handle.remote_request_id in self._evicted

    # ----------------------------------------------------------------- changes

    def pinned(self, handle: KVHandle, *, deadline: float | None = None) -> None:
        """D returned ``handle``: its blocks stay held until read, released or expired.

        ``deadline``: its expiry in this process's clock when D's clock is another host's (the pin's `Pin.expires_at`).
        """
        expires = deadline if deadline is not None else handle.remote_blocks_expiry_time
        self._pins[handle.remote_request_id] = _Pin(handle, frozenset(handle.remote_block_ids[0]), expires)

    def gone(self, handle: KVHandle) -> None:
        """``handle``'s pin was released (or a step that extended it ended, see `finished`)."""
        self._pins.pop(handle.remote_request_id, None)

    def reserve(self, step_id: str, *, tokens: int, reused: KVHandle | None) -> list[tuple[KVHandle, float]]:
        """Reserve D's blocks for a step of ``tokens`` (prompt + answer); the pins to release to make room, each
        with its expiry in this process's clock (D's may be another host's).

        ``reused``: the pin the step extends. Its blocks stay held on D for the whole step (P reads
        them, and D's new request finds them in its cache as its prefix), so the pin stays counted,
        is never evicted, and only the step's new blocks are reserved; `finished` drops it.
        """
        next_pin = math.ceil(tokens / self.block_size)
        held_by_reused = 0
        if reused is not None and reused.remote_request_id in self._pins:
            held_by_reused = len(self._pins[reused.remote_request_id].blocks)
            self._extended[step_id] = reused.remote_request_id
        self._reserved[step_id] = max(1, next_pin - held_by_reused)
        return self._evict_while_over(next_pin=next_pin - held_by_reused)

    def make_room(self) -> list[tuple[KVHandle, float]]:
        """After a step ended with a new pin: the pins to release so that the steps still in flight keep their
        reservations (each step's pin is larger than what it reserved, its answer; unchecked, the new pins of
        ending steps crowded out those waiting on D, which then waited for blocks until pins expired)."""
        return self._evict_while_over(next_pin=None)

    def _evict_while_over(self, *, next_pin: int | None) -> list[tuple[KVHandle, float]]:
        """Evict the least recently pinned conversations (never one a step extends) until the budget holds
        (``next_pin`` None: D's size alone; ``max_pinned_blocks`` caps the pins as a step starts)."""
        evict: list[tuple[KVHandle, float]] = []
        while self._over_budget(next_pin=next_pin):
            oldest = next((key for key in self._pins if key not in self._extended.values()), None)
            if oldest is None:
                break
            pin = self._pins.pop(oldest)
            self._evicted.append(oldest)
            evict.append((pin.handle, pin.deadline))
        return evict

    def finished(self, step_id: str) -> None:
        """The step ended: its reservation is over, and the pin it extended is replaced by its own (`pinned`)."""
        self._reserved.pop(step_id, None)
        extended = self._extended.pop(step_id, None)
        if extended is not None:
            self._pins.pop(extended, None)

    # ----------------------------------------------------------------- internals

    def _over_budget(self, *, next_pin: int | None) -> bool:
        """Whether the pins and the reservations overflow D, or the pins with the step's ``next_pin`` new blocks
        pass the cap (not checked with ``next_pin`` None)."""
        pinned = self.pinned_blocks
        if self.max_pinned_blocks is not None and next_pin is not None and pinned + next_pin > self.max_pinned_blocks:
            return True
        return self.capacity_blocks is not None and pinned + self.reserved_blocks > self.capacity_blocks

    def _drop_expired(self) -> None:
        now = time.perf_counter()
        for key in [key for key, pin in self._pins.items() if pin.deadline <= now]:
            del self._pins[key]
