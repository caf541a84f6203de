"""Placement that aims at a service-level objective (`Slo`): mode ``auto`` under load.

Alone on an idle pair, a step goes where its estimated time to first token is shorter
(src/agentkv/_engines/_placement.py). Under load the estimates must count what else is in
flight: a step on P waits behind P's queued prefills and pays the hop; a step on D alone waits
behind D's queued prefills, and its own prefill stalls every other step in flight for as long
as it and the prefills queued before it compute: those decoding on D share its forward passes,
and those whose first token comes meanwhile (prefilling on D ahead of it, or on P and handing
over to D) decode on D next. Of those, only the steps that can still meet the objective are at
stake: one whose first token or one of whose gaps already missed it, or whose first token is
due past its TTFT objective (the queue ahead of it on its engine), is lost to goodput whatever
D does. `choose_within_slo` compares both with what the pair knows in flight on each engine
(`EngineLoad` and the turns at stake, kept by src/agentkv/_engines/_step_ledger.py) and the
costs the pair learned (`PlacementCosts`), and places the step where more turns stay inside the
objective:

* D when its TTFT fits the SLO, its prefill keeps the token gaps of the turns at stake within
  the ITL objective (or none is at stake), and it is no slower than P; a gap while D prefills
  is D's usual gap (`PlacementCosts.gap_s`, learned from the pair's answers) plus the
  prefill's compute. Where P fits as well and that prefill would break any gap it spans, D
  waits until no turn in flight could still meet the objective, each counted at its earliest
  first token: on P the step keeps its turn, and the turns at stake are known from estimated
  times, which load on shared cores can miss;
* else P when its TTFT fits;
* else, P missing the TTFT by its queue (the compute queued there and the step's own, without
  the overhead the pair learned, which under load carries the other engine's contention), D
  when its TTFT fits and its prefill breaks the gaps of one turn at stake only: one turn is
  lost either way, and the prefill taken off P shortens the queue of every step waiting there
  (under load P is the pair's bottleneck);
* else the faster of the two, unless D's prefill would break the gaps of turns at stake (then
  P: one turn lost rather than several).

With nothing in flight this is the plain comparison of the two estimates, whatever the SLO.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import UserError
from ._placement import PlacementChoice, PlacementCosts, PrefillEngine

__all__ = ["DEFAULT_SLO", "EngineLoad", "Slo", "choose_within_slo"]


@dataclass(frozen=True)
class Slo:
    """A service-level objective per step: the first token within ``ttft_s`` seconds of the step's start, and no gap
    between two tokens longer than ``itl_s`` seconds. Mode ``auto`` places each step to keep the most turns inside it
    (``docs/performance.md``, "Per-step placement"); the other modes ignore it.

    Both are positive numbers of seconds (`UserError` otherwise).
    """

    ttft_s: float
    """Time to first token, from the step's start, in seconds."""
    itl_s: float
    """The longest gap between two tokens of an answer, in seconds."""

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise UserError(f"the SLO's {name} must be a positive number of seconds, not {value!r}")
            object.__setattr__(self, name, float(value))

    def __str__(self) -> str:
        return f"TTFT {self.ttft_s:g} s, ITL {self.itl_s:g} s"


DEFAULT_SLO = Slo(ttft_s=2.0, itl_s=0.2)
"""A pair's objective unless it is given one: the first token within 2 s, no token gap over 0.2 s.

On a GPU host these are an interactive agent's usual bounds (a turn starts answering within a couple of seconds,
tokens stream at 5 or more a second) and leave room for a D prefill of a few thousand tokens beside D's decodes.
On a CPU host (the 2-core test bed) a prefill costs milliseconds per token, so a prefill on D of more than about a
hundred tokens would exceed 0.2 s: with other turns in flight that can still meet the objective the step goes to
P, as it always did before the objective, while an idle pair still takes the faster placement (the SLO decides
nothing without load). Under heavy load on such a host no placement meets 2 s: each step then takes the faster
estimate unless that breaks the gaps of turns still inside the objective. Set the pair's own (``slo=``) for
another machine or workload.
"""


@dataclass(frozen=True)
class EngineLoad:
    """What the pair has in flight on one engine when a step is placed."""

    prefills: int = 0
    """Steps whose prefill runs (or waits) on the engine."""
    prefill_s: float = 0.0
    """The estimated compute of the steps whose prefill runs (or waits) on the engine (`PlacementCosts.compute_s`
    when each was placed)."""
    busy_s: float = 0.0
    """How long the oldest of those prefills has been in flight (the engine has computed since then)."""
    decodes: int = 0
    """Answers being decoded on the engine (D's decodes stall while a prefill on D computes)."""

    def queued_s(self) -> float:
        """The compute still ahead of a new step: what the prefills in flight need, less what the engine has
        computed since the oldest of them started."""
        return max(0.0, self.prefill_s - self.busy_s)


def choose_within_slo(
    costs: PlacementCosts,
    slo: Slo,
    *,
    on_prefill: int,
    on_decode: int,
    prefill_context: int,
    decode_context: int,
    prefill_load: EngineLoad,
    decode_load: EngineLoad,
    at_stake: Callable[[float], int],
    at_risk: Callable[[], int],
) -> PlacementChoice:
    """P or D for a step that computes ``on_prefill`` tokens after ``prefill_context`` (the pin) on P or ``on_decode``
    tokens after ``decode_context`` (the pin's whole blocks) on D alone, given what
    is in flight on each and ``at_stake(s)``, how many other steps in flight a prefill on D computing for the next
    ``s`` seconds would stall that can still meet ``slo``, and ``at_risk()``, how many steps in flight could still
    meet it, each counted at its earliest first token: the placement that keeps the most turns inside it (see the
    module's docstring).

    The reason gives both estimates (queue included), the stall a prefill on D imposes on the turns at stake, and
    the test that decided.
    """
    queued: dict[PrefillEngine, float] = {"prefill": prefill_load.queued_s(), "decode": decode_load.queued_s()}
    via_prefill = queued["prefill"] + costs.estimate("prefill", on_prefill, prefill_context)
    via_decode = queued["decode"] + costs.estimate("decode", on_decode, decode_context)
    # the steps at stake wait out the prefills queued on D as well as this one (vLLM may batch them into one pass),
    # on top of the pass that computes their own next tokens (D's usual gap: this prefill adds its tokens to it)
    stall_s = queued["decode"] + costs.added_s(on_decode, decode_context)
    stake = at_stake(via_decode)
    long_stall = costs.gap_s + stall_s > slo.itl_s
    breaks_gaps = stake > 0 and long_stall
    decode_fits = via_decode <= slo.ttft_s and not breaks_gaps
    prefill_fits = via_prefill <= slo.ttft_s
    # where P fits, a prefill on D that would break any gap it spans gains no turn: it takes the step only while no
    # turn in flight could still be kept, each at its earliest (the due times are estimates that load can miss)
    risked = 0
    if long_stall and decode_fits and prefill_fits and via_decode <= via_prefill:
        risked = at_risk()
    if decode_fits and via_decode <= via_prefill and not risked:
        engine: PrefillEngine = "decode"
        verdict = "D fits and is no slower"
    elif prefill_fits:
        engine = "prefill"
        if risked:
            verdict = f"P fits, D would risk {risked} turns in flight"
        elif decode_fits:
            verdict = "P fits, D is slower"
        else:
            verdict = "P fits" + _why_not_decode(via_decode, slo, breaks_gaps)
    elif breaks_gaps and via_decode <= slo.ttft_s and stake == 1:
        # the trade is for P's queue: it needs P to miss by the compute queued there and the step's own, its learned
        # overhead left out (under load that overhead carries the other engine's contention and runs seconds long)
        if queued["prefill"] + costs.compute_s(on_prefill, prefill_context) > slo.ttft_s:
            engine = "decode"
            verdict = "P misses the TTFT, D the gaps of 1 turn at stake: D, off P's queue"
        else:
            engine = "prefill"
            verdict = (
                "neither fits; D would break the gaps of the turns at stake (P misses by its overhead, not its queue)"
            )
    elif breaks_gaps:
        engine = "prefill"
        verdict = "neither fits; D would break the gaps of the turns at stake"
    else:
        engine = "decode" if via_decode <= via_prefill else "prefill"
        verdict = f"neither fits; {'D' if engine == 'decode' else 'P'} is faster"
    gaps = f"stall {stall_s:.3f} s on {stake} turns at stake (gap {costs.gap_s:.3f} s)" if stake else "no turn at stake"
    reason = (
        f"SLO {slo}: D {via_decode:.3f} s ({on_decode} tokens, {queued['decode']:.3f} s queued), "
        f"P {via_prefill:.3f} s ({on_prefill} tokens, {queued['prefill']:.3f} s queued), {gaps}: {verdict}"
    )
    return PlacementChoice(engine, reason)


def _why_not_decode(via_decode: float, slo: Slo, breaks_gaps: bool) -> str:
    if breaks_gaps:
        return ", D would break the gaps of the turns at stake"
    return ", D misses the TTFT" if via_decode > slo.ttft_s else ""
