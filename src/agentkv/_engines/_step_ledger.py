"""What a pair has in flight on each engine, for placement under load (`EngineLoad` in
src/agentkv/_engines/_slo.py).

Every step of a pair goes through `PairLayer._pinned_step` (src/agentkv/_engines/_pair_layer.py),
which tells the ledger where it placed the step and how long its prefill there is estimated to
compute (`started`), when each of its tokens came (`token`: after the first its prefill is over, it
decodes on D) and when it ended (`ended`). A step placed on P counts as P's prefill until its
first token, transfers included; every step decodes on D after it.

vLLM computes an engine's waiting prefills together: the ledger follows each engine's passes. A
pass ends when a step's first token comes (every prefill of that pass has its first token then);
the prefills that arrived before that moment form the next pass, those that arrive later wait for
the one after it. A pass that began when the one before it ended (its prefills had waited) ran
under load: how much longer it took than the compute model's estimate of its prefills is the
engine's slowdown (`StepLedger.slowdown`), by which the queue's estimates are scaled.

The token times tell which steps a prefill on D would cost a turn (`at_stake`): such a prefill
stalls the steps decoding on D and those whose first token comes while it computes (those
prefilling on D ahead of it, those on P that hand over to D meanwhile), but a step whose first
token or one of whose gaps misses the objective is lost to goodput whatever D does; and which steps
waiting on P a longer pass would push past their objective (`delayed`).
"""

from __future__ import annotations

import math
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
    computed: bool = False
    """Its pass is over (another step of the same pass had its first token): its own comes any moment."""

    @property
    def decoding(self) -> bool:
        return self.last_token is not None

    def met_so_far(self, slo: Slo, now: float) -> bool:
        """Whether a decoding step still meets ``slo``: its first token and every gap so far (the one open now
        included) within the objective."""
        if self.last_token is None or self.ttft_s is None:
            return False
        return self.ttft_s <= slo.ttft_s and max(self.worst_gap_s, now - self.last_token) <= slo.itl_s


_SLOWDOWN_SMOOTHING = 0.3
"""Weight of the newest pass in an engine's slowdown (from 1: a pass or two do not set it)."""
_SLOWDOWN_RANGE = (0.5, 4.0)
"""The slowdowns a pass may teach (a pass timed by a stray first token teaches nothing wild)."""


@dataclass
class _Pass:
    """An engine's queue: the pass in progress (its prefills, when it began) and the prefills waiting for the next."""

    running: list[_Step]
    waiting: list[_Step]
    began: float

    def due(self, now: float, slowdown: float) -> tuple[float, float]:
        """When the pass in progress and the waiting one are due to end, from ``now`` (compute only)."""
        running = now + max(0.0, slowdown * sum(step.compute_s for step in self.running) - (now - self.began))
        return running, running + slowdown * sum(step.compute_s for step in self.waiting)


class StepLedger:
    """The steps in flight on a pair: which engine prefills each, for how long, and which decode on D."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        """Seconds, for the times a caller does not give (``now=``)."""
        self._steps: dict[int, _Step] = {}
        self._next = 0
        self._pass_ended: dict[PrefillEngine, float] = {}
        """When each engine's latest pass ended (a first token came)."""
        self.slowdown: dict[PrefillEngine, float] = {"prefill": 1.0, "decode": 1.0}
        """By engine, how much longer its passes under load took than the compute model's estimate of their
        prefills (a running mean)."""

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
            if not step.computed:
                self._pass_over(step, now)
        else:
            step.worst_gap_s = max(step.worst_gap_s, now - step.last_token)
        step.last_token = now

    def _pass_over(self, first: _Step, now: float) -> None:
        """``first``'s first token: the pass in progress on its engine is over (with ``first`` in it, should the
        ledger have had it waiting), and its slowdown learned when it ran under load."""
        queue = self._queue(first.engine)
        if queue is None:
            return
        ended = [step for step in queue.running + queue.waiting if step.started <= max(queue.began, first.started)]
        for step in ended:
            step.computed = True
        estimate = sum(step.compute_s for step in ended)
        if queue.began > ended[0].started and estimate > 0:  # it began as the one before it ended: under load
            low, high = _SLOWDOWN_RANGE
            observed = min(high, max(low, (now - queue.began) / estimate))
            current = self.slowdown[first.engine]
            self.slowdown[first.engine] = (1 - _SLOWDOWN_SMOOTHING) * current + _SLOWDOWN_SMOOTHING * observed
        self._pass_ended[first.engine] = now

    def _queue(self, engine: PrefillEngine) -> _Pass | None:
        """The prefills on ``engine`` that still compute: the pass in progress and those waiting for the next."""
        queue = sorted(
            (
                step
                for step in self._steps.values()
                if step.engine == engine and not step.decoding and not step.computed
            ),
            key=lambda step: step.started,
        )
        if not queue:
            return None
        began = max(queue[0].started, self._pass_ended.get(engine, -math.inf))
        running = [step for step in queue if step.started <= began]
        return _Pass(running, [step for step in queue if step.started > began], began)

    def ended(self, key: int) -> None:
        self._steps.pop(key, None)

    def load(self, engine: PrefillEngine, *, now: float | None = None) -> EngineLoad:
        """What is in flight on ``engine``: its queue's compute and (D) the answers decoding on it."""
        now = self._clock() if now is None else now
        decodes = sum(step.decoding for step in self._steps.values()) if engine == "decode" else 0
        slowdown = self.slowdown[engine]
        queue = self._queue(engine)
        if queue is None:
            return EngineLoad(decodes=decodes, slowdown=slowdown)
        running_due, waiting_due = queue.due(now, slowdown)
        return EngineLoad(
            prefills=len(queue.running) + len(queue.waiting),
            running_s=running_due - now,
            waiting_s=waiting_due - running_due,
            decodes=decodes,
            slowdown=slowdown,
        )

    def at_stake(self, slo: Slo, costs: PlacementCosts, *, within_s: float, now: float | None = None) -> int:
        """How many steps in flight a prefill on D that computes for the next ``within_s`` seconds would stall and
        that can still meet ``slo``: those decoding on D whose tokens met it so far, and those still prefilling whose
        first token is due within ``within_s`` and within their TTFT objective. A prefill's first token is due when
        its pass ends (`_Pass.due`), plus its placement's overhead (``costs``)."""
        now = self._clock() if now is None else now
        stake = sum(step.met_so_far(slo, now) for step in self._steps.values() if step.decoding)
        engine: PrefillEngine
        for engine in ("prefill", "decode"):
            for step, due in self._dues(engine, costs, now):
                stake += due <= now + within_s and due - step.started <= slo.ttft_s
        return stake

    def delayed(self, slo: Slo, costs: PlacementCosts, *, by_s: float, now: float | None = None) -> int:
        """How many steps waiting on P for their pass would miss their TTFT objective if that pass computed ``by_s``
        seconds more (a new step on P joins it), of those that meet it now."""
        now = self._clock() if now is None else now
        queue = self._queue("prefill")
        waiting = set() if queue is None else {id(step) for step in queue.waiting}
        return sum(
            due - step.started <= slo.ttft_s < due + by_s - step.started
            for step, due in self._dues("prefill", costs, now)
            if id(step) in waiting
        )

    def _dues(self, engine: PrefillEngine, costs: PlacementCosts, now: float) -> list[tuple[_Step, float]]:
        """Each prefill on ``engine`` not yet at its first token, and when that token is due (now, for one whose
        pass is over)."""
        ended = [step for step in self._steps.values() if step.engine == engine and step.computed and not step.decoding]
        dues = [(step, now) for step in ended]
        queue = self._queue(engine)
        if queue is None:
            return dues
        running_due, waiting_due = queue.due(now, self.slowdown[engine])
        overhead = costs.overhead_s[engine]
        dues += [(step, running_due + overhead) for step in queue.running]
        return dues + [(step, waiting_due + overhead) for step in queue.waiting]

    def __len__(self) -> int:
        return len(self._steps)
