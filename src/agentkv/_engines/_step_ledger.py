"""What a pair has in flight on each engine, for placement under load (`EngineLoad` in
src/agentkv/_engines/_slo.py).

Every step of a pair goes through `PairLayer._pinned_step` (src/agentkv/_engines/_pair_layer.py),
which tells the ledger where it placed the step and how long its prefill there is estimated to
compute (`started`), when each of its tokens came (`token`: after the first its prefill is over, it
decodes on D) and when it ended (`ended`). A step placed on P counts as P's prefill until its
first token, transfers included; every step decodes on D after it.

The token times tell which steps a prefill on D would cost a turn (`at_stake`): such a prefill
stalls the steps decoding on D and those whose first token comes while it computes (those
prefilling on D ahead of it, those on P that hand over to D meanwhile), but a step whose first
token or one of whose gaps misses the objective anyway is lost to goodput whatever D does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ._placement import PlacementCosts, PrefillEngine
from ._slo import EngineLoad, Slo

__all__ = ["StepLedger"]


@dataclass
class _Step:
    engine: PrefillEngine
    compute_s: float
    """Its prefill's estimated compute."""
    started: float
    last_token: float | None = None
    """When its latest token came (None: none yet, it still prefills)."""
    ttft_s: float | None = None
    worst_gap_s: float = 0.0
    crowded: bool = False
    """Another prefill ran (or waited) on its engine while it prefilled: its prefill's time is not its own."""

    @property
    def decoding(self) -> bool:
        return self.last_token is not None

    def met_so_far(self, slo: Slo, now: float) -> bool:
        """Whether a decoding step still meets ``slo``: its first token and every gap so far (the one open now
        included) within the objective."""
        if self.last_token is None or self.ttft_s is None:
            return False
        return self.ttft_s <= slo.ttft_s and max(self.worst_gap_s, now - self.last_token) <= slo.itl_s


class StepLedger:
    """The steps in flight on a pair: which engine prefills each, for how long, and which decode on D."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        """Seconds, for the times a caller does not give (``now=``)."""
        self._steps: dict[int, _Step] = {}
        self._next = 0

    def started(self, engine: PrefillEngine, compute_s: float, *, now: float | None = None) -> int:
        """A step placed on ``engine``, whose prefill there is estimated to compute for ``compute_s``; its key in the
        ledger."""
        step = _Step(engine, compute_s, self._clock() if now is None else now)
        for other in self._steps.values():
            if other.engine == engine and not other.decoding:
                other.crowded = step.crowded = True
        self._next += 1
        self._steps[self._next] = step
        return self._next

    def prefilled_alone(self, key: int) -> bool:
        """Whether the step's prefill had its engine to itself (no other prefill there meanwhile)."""
        step = self._steps.get(key)
        return step is not None and not step.crowded

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
        """What is in flight on ``engine``: its prefills' compute and age, and (D) the answers decoding on it."""
        now = self._clock() if now is None else now
        prefilling = [step for step in self._steps.values() if step.engine == engine and not step.decoding]
        decodes = sum(step.decoding for step in self._steps.values()) if engine == "decode" else 0
        return EngineLoad(
            prefills=len(prefilling),
            prefill_s=sum(step.compute_s for step in prefilling),
            busy_s=max((now - step.started for step in prefilling), default=0.0),
            decodes=decodes,
        )

    def at_stake(
        self, slo: Slo, costs: PlacementCosts, *, within_s: float, earliest: bool = False, now: float | None = None
    ) -> int:
        """How many steps in flight a prefill on D that computes for the next ``within_s`` seconds would stall and
        that can still meet ``slo``: those decoding on D whose tokens met it so far, and those still prefilling whose
        first token is due within ``within_s`` and within their TTFT objective. A prefill's first token is due once
        its engine's older prefills and its own are computed (less what the engine computed since the oldest
        started, as `EngineLoad.queued_s`), plus its placement's overhead (``costs``); at the ``earliest``, without
        that overhead (the turns that could still be kept, were the overhead learned under load too long)."""
        now = self._clock() if now is None else now
        stake = sum(step.met_so_far(slo, now) for step in self._steps.values() if step.decoding)
        engine: PrefillEngine
        for engine in ("prefill", "decode"):
            queue = sorted(
                (step for step in self._steps.values() if step.engine == engine and not step.decoding),
                key=lambda step: step.started,
            )
            if not queue:
                continue
            busy_s, compute_s = now - queue[0].started, 0.0
            for step in queue:
                compute_s += step.compute_s
                due = now + max(0.0, compute_s - busy_s) + (0.0 if earliest else costs.overhead_s[engine])
                stake += due <= now + within_s and due - step.started <= slo.ttft_s
        return stake

    def __len__(self) -> int:
        return len(self._steps)
