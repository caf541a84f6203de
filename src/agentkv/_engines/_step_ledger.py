"""What a pair has in flight on each engine, for placement under load (`EngineLoad` in
src/agentkv/_engines/_slo.py).

Every step of a pair goes through `PairLayer._pinned_step` (src/agentkv/_engines/_pair_layer.py),
which tells the ledger where it placed the step and how many prompt tokens it computes there
(`started`), when its first token came (`first_token`: its prefill is over, it decodes on D)
and when it ended (`ended`). A step placed on P counts as P's prefill until its first token,
transfers included; every step decodes on D after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ._placement import PrefillEngine
from ._slo import EngineLoad

__all__ = ["StepLedger"]


@dataclass
class _Step:
    engine: PrefillEngine
    tokens: int
    started: float
    decoding: bool = False


class StepLedger:
    """The steps in flight on a pair: which engine prefills each, with how many tokens, and which decode on D."""

    def __init__(self) -> None:
        self._steps: dict[int, _Step] = {}
        self._next = 0

    def started(self, engine: PrefillEngine, tokens: int, *, now: float | None = None) -> int:
        """A step placed on ``engine``, which computes ``tokens`` of its prompt there; its key in the ledger."""
        self._next += 1
        self._steps[self._next] = _Step(engine, tokens, time.perf_counter() if now is None else now)
        return self._next

    def first_token(self, key: int) -> None:
        """The step's prefill is over: it decodes on D from now."""
        step = self._steps.get(key)
        if step is not None:
            step.decoding = True

    def ended(self, key: int) -> None:
        self._steps.pop(key, None)

    def load(self, engine: PrefillEngine, *, now: float | None = None) -> EngineLoad:
        """What is in flight on ``engine``: its prefills' tokens and age, and (D) the answers decoding on it."""
        now = time.perf_counter() if now is None else now
        prefilling = [step for step in self._steps.values() if step.engine == engine and not step.decoding]
        decodes = sum(step.decoding for step in self._steps.values()) if engine == "decode" else 0
        return EngineLoad(
            prefills=len(prefilling),
            prefill_tokens=sum(step.tokens for step in prefilling),
            busy_s=max((now - step.started for step in prefilling), default=0.0),
            decodes=decodes,
        )

    def __len__(self) -> int:
        return len(self._steps)
