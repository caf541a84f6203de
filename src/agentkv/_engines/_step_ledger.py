"""What a pair has in flight on each engine, for placement under load (`EngineLoad` in
src/agentkv/_engines/_slo.py).

Every step of a pair goes through `PairLayer._pinned_step` (src/agentkv/_engines/_pair_layer.py),
which tells the ledger where it placed the step and how many prompt tokens it computes there
(`started`), when each of its tokens came (`token`: after the first its prefill is over, it
decodes on D) and when it ended (`ended`). A step placed on P counts as P's prefill until its
first token, transfers included; every step decodes on D after it.

The token times tell which steps can still meet an objective (`at_stake`): a prefill on D
stalls every other step in flight, but a step whose first token or one of whose gaps already
missed the objective is lost to goodput whatever comes next.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ._placement import PrefillEngine
from ._slo import EngineLoad, Slo

__all__ = ["StepLedger"]


@dataclass
class _Step:
    engine: PrefillEngine
    tokens: int
    started: float
    last_token: float | None = None
    """When its latest token came (None: none yet, it still prefills)."""
    ttft_s: float | None = None
    worst_gap_s: float = 0.0

    @property
    def decoding(self) -> bool:
        return self.last_token is not None

    def within(self, slo: Slo, now: float) -> bool:
        """Whether the step can still meet ``slo``: its first token (or the wait for it) and every gap so far
        (the one open now included) within the objective."""
        if self.last_token is None:
            return now - self.started <= slo.ttft_s
        assert self.ttft_s is not None
        return self.ttft_s <= slo.ttft_s and max(self.worst_gap_s, now - self.last_token) <= slo.itl_s


class StepLedger:
    """The steps in flight on a pair: which engine prefills each, with how many tokens, and which decode on D."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        """Seconds, for the times a caller does not give (``now=``)."""
        self._steps: dict[int, _Step] = {}
        self._next = 0

    def started(self, engine: PrefillEngine, tokens: int, *, now: float | None = None) -> int:
        """A step placed on ``engine``, which computes ``tokens`` of its prompt there; its key in the ledger."""
        self._next += 1
        self._steps[self._next] = _Step(engine, tokens, self._clock() if now is None else now)
        return self._next

    def token(self, key: int, *, now: float | None = None) -> None:
        """The step yielded tokens: after the first its prefill is over and it decodes on D."""
        step = self._steps.get(key)
        if step is None:
            return
        now = self._clock() if now is None else now
        if step.last_token is None:
            step.ttft_s = now - step.started
        else:
            step.worst_gap_s = max(step.worst_gap_s, now - step.last_token)
        step.last_token = now

    def ended(self, key: int) -> None:
        self._steps.pop(key, None)

    def load(self, engine: PrefillEngine, *, now: float | None = None) -> EngineLoad:
        """What is in flight on ``engine``: its prefills' tokens and age, and (D) the answers decoding on it."""
        now = self._clock() if now is None else now
        prefilling = [step for step in self._steps.values() if step.engine == engine and not step.decoding]
        decodes = sum(step.decoding for step in self._steps.values()) if engine == "decode" else 0
        return EngineLoad(
            prefills=len(prefilling),
            prefill_tokens=sum(step.tokens for step in prefilling),
            busy_s=max((now - step.started for step in prefilling), default=0.0),
            decodes=decodes,
        )

    def at_stake(self, slo: Slo, *, now: float | None = None) -> int:
        """The steps in flight that can still meet ``slo``, on either engine: those a prefill on D would stall
        (those decoding on D, and those still prefilling, which decode on D next) and whose turns it would lose."""
        now = self._clock() if now is None else now
        return sum(step.within(slo, now) for step in self._steps.values())

    def __len__(self) -> int:
        return len(self._steps)
