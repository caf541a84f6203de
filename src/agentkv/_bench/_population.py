"""The bench's user population: the loads it runs (``--sessions 1,2,4``), when each session of a load starts, and
how long it pauses before each later turn (a tool's latency on the agentic workload, a user's think time on the
others). The draws are seeded and the same for every mode at a load; src/agentkv/_bench/_runner.py plays them.

Arrivals are a Poisson process: exponential gaps between sessions' starts, their mean half a solo turn (measured
at load 1 in the same run, so that the stagger scales with the machine) unless given. Think times are lognormal
(sigma 1: most pauses short, a few several times the mean, as tool runs are), drawn per session and turn.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from .._errors import UserError
from ._records import Population, TurnRecord, percentile

__all__ = [
    "AGENTIC_THINK_S",
    "ARRIVALS",
    "SOLO_TURN_SHARE",
    "Arrivals",
    "Plan",
    "check_loads",
    "parse_loads",
]

Arrivals = Literal["staggered", "barrier"]
ARRIVALS: tuple[Arrivals, ...] = get_args(Arrivals)
"""``staggered``: each session starts at its own seeded time and runs its own turns (no barrier); ``barrier``:
every session of a mode sends turn t together, modes take turns (the bench's run with one load)."""
AGENTIC_THINK_S = 2.0
"""Mean tool latency before each agentic step after the first, when staggered (a test run or a build: seconds)."""
SOLO_TURN_SHARE = 0.5
"""The mean gap between arrivals, as a share of a solo turn's mean wall time."""
_THINK_SIGMA = 1.0
"""The think times' lognormal sigma (their mean is the asked one: mu = ln(mean) - sigma^2 / 2)."""


def parse_loads(text: str) -> list[int]:
    """``--sessions``: ``"1,2,4"`` -> ``[1, 2, 4]`` (`check_loads`); a bad entry is refused by name."""
    loads = []
    for entry in (part.strip() for part in text.split(",")):
        try:
            loads.append(int(entry))
        except ValueError:
            raise UserError(f"--sessions takes whole numbers of sessions, comma-separated; not {entry!r}") from None
    return check_loads(loads)


def check_loads(loads: int | Sequence[int]) -> list[int]:
    """The loads in ascending order (load 1, the solo run that sizes the arrivals and the SLO, comes first);
    each at least 1, none twice."""
    given = [loads] if isinstance(loads, int) else list(loads)
    if not given:
        raise UserError("sessions: give at least one load")
    for load in given:
        if load < 1:
            raise UserError(f"sessions must be at least 1 (a load of {load})")
    twice = sorted({load for load in given if given.count(load) > 1})
    if twice:
        raise UserError(f"sessions: load {', '.join(map(str, twice))} given twice")
    return sorted(given)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the runner plays: the loads, the arrivals, the think time's mean, and their seed.

    Draws are made per load from their own seeded stream, so a load's schedule does not depend on the other
    loads in the list: draws in units of the mean (`starts`, `thinks`), scaled when played.
    """

    loads: list[int]
    arrivals: Arrivals
    think_mean_s: float
    arrival_mean_s: float | None
    """None until measured (`measured`): half a solo turn at load 1."""
    arrival_given: bool
    seed: int
    turns: int

    @classmethod
    def make(
        cls,
        loads: int | Sequence[int],
        *,
        turns: int,
        workload: str,
        arrivals: Arrivals | None = None,
        arrival_s: float | None = None,
        think_s: float | None = None,
        seed: int = 0,
    ) -> Plan:
        """The plan for ``loads``: by default staggered arrivals when there are several loads (a barrier for one,
        the bench's run before load sweeps) and, when staggered, `AGENTIC_THINK_S` on the agentic workload."""
        checked = check_loads(loads)
        arrivals = arrivals or ("staggered" if len(checked) > 1 else "barrier")
        if arrivals not in ARRIVALS:
            raise UserError(f"arrivals are {' or '.join(ARRIVALS)}, not {arrivals!r}")
        if think_s is None:
            think_s = AGENTIC_THINK_S if arrivals == "staggered" and workload == "agentic" else 0.0
        if not think_s >= 0:
            raise UserError(f"think time must be 0 s or more, not {think_s!r}")
        if think_s > 0 and arrivals == "barrier":
            raise UserError("think time needs staggered arrivals: under a barrier every session waits for the slowest")
        if arrival_s is not None and not arrival_s >= 0:
            raise UserError(f"the mean arrival gap must be 0 s or more, not {arrival_s!r}")
        if arrivals == "staggered" and arrival_s is None and any(load > 1 for load in checked) and 1 not in checked:
            raise UserError(
                "staggered arrivals are spaced by half a solo turn, measured at load 1: put 1 in the sessions "
                "or give the mean arrival gap (--arrival-s)"
            )
        return cls(
            loads=checked,
            arrivals=arrivals,
            think_mean_s=think_s,
            arrival_mean_s=arrival_s,
            arrival_given=arrival_s is not None,
            seed=seed,
            turns=turns,
        )

    def _stream(self, load: int) -> random.Random:
        return random.Random(f"agentkv-bench-population-{self.seed}-{load}")

    def starts(self, load: int) -> list[float]:
        """Each session's start at ``load``, in mean arrival gaps: 0, then exponential gaps."""
        rng = self._stream(load)
        starts = [0.0]
        for _ in range(load - 1):
            starts.append(starts[-1] + rng.expovariate(1.0))
        return starts

    def thinks(self, load: int) -> list[list[float]]:
        """Per session at ``load``: its pause before each turn from the second, in means (lognormal, mean 1)."""
        rng = self._stream(load)
        for _ in range(load - 1):
            rng.expovariate(1.0)  # the starts' draws come first in the stream
        mu = -(_THINK_SIGMA**2) / 2
        return [[rng.lognormvariate(mu, _THINK_SIGMA) for _ in range(self.turns - 1)] for _ in range(load)]

    def start_s(self, load: int, session: int) -> float:
        """Seconds from the round's start to ``session``'s first turn (0 under a barrier)."""
        if self.arrivals == "barrier" or self.arrival_mean_s is None:
            return 0.0
        return self.starts(load)[session] * self.arrival_mean_s

    def think_s(self, load: int, session: int, turn: int) -> float:
        """Seconds ``session`` pauses before ``turn`` (0 before the first)."""
        if turn == 1 or self.think_mean_s == 0:
            return 0.0
        return self.thinks(load)[session][turn - 2] * self.think_mean_s

    def measured(self, records: Sequence[TurnRecord]) -> Plan:
        """The plan with its arrival gap set from the solo turns in ``records`` (colocated's when it ran, else every
        mode's at load 1) if it was not set yet; unchanged when set or when no solo turn ran."""
        if self.arrival_mean_s is not None or self.arrivals == "barrier":
            return self
        solo = [r for r in records if r.load == 1]
        solo = [r for r in solo if r.mode == "colocated"] or solo
        if not solo:
            return self
        return dataclasses.replace(self, arrival_mean_s=SOLO_TURN_SHARE * statistics.fmean(r.wall_s for r in solo))

    def report(self) -> Population:
        """What was drawn, in seconds, for the report."""
        staggered = self.arrivals == "staggered"
        starts = {load: [self.start_s(load, s) for s in range(load)] for load in self.loads}
        thinks = {
            load: [[self.think_s(load, s, t) for t in range(2, self.turns + 1)] for s in range(load)]
            for load in self.loads
        }
        gaps = [b - a for row in starts.values() for a, b in zip(row, row[1:], strict=False)]
        pauses = [pause for rows in thinks.values() for row in rows for pause in row]
        return Population(
            arrivals=self.arrivals,
            arrival_mean_s=self.arrival_mean_s if staggered else None,
            arrival_mean_measured=staggered and not self.arrival_given,
            think_mean_s=self.think_mean_s,
            seed=self.seed,
            starts_s=starts,
            think_s=thinks,
            arrival_gap_drawn_mean_s=statistics.fmean(gaps) if staggered and gaps else None,
            arrival_gap_drawn_p90_s=percentile(gaps, 90) if staggered and gaps else None,
            think_drawn_mean_s=statistics.fmean(pauses) if self.think_mean_s and pauses else None,
            think_drawn_p90_s=percentile(pauses, 90) if self.think_mean_s and pauses else None,
        )
