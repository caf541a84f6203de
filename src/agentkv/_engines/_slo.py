"""Placement that aims at a service-level objective (`Slo`): mode ``auto`` under load.

Alone on an idle pair, a step goes where its estimated time to first token is shorter
(src/agentkv/_engines/_placement.py). Under load the estimates must count what else is in
flight. vLLM computes an engine's waiting prefills in one pass: a step on P waits for the pass in
progress, then computes in the next with every prefill waiting there, and pays the hop; a step on
D alone does the same on D, and its own prefill stalls every other step in flight for as long as
it and the prefills queued before it compute: those decoding on D share its forward passes, and
those whose first token comes meanwhile (prefilling on D ahead of it, or on P and handing over to
D) decode on D next. A step on P, in turn, lengthens the pass that the steps waiting on P will
share with it. Of those, only the steps that can still meet the objective are at stake: one whose
first token or one of whose gaps already missed it, or whose first token is due past its TTFT
objective anyway, is lost to goodput whatever the new step does. `choose_within_slo` counts, with
what the pair knows in flight on each engine (`EngineLoad` and the turns at stake, kept by
src/agentkv/_engines/_step_ledger.py) and the costs the pair learned (`PlacementCosts`), the turns
each placement would lose:

* on D: the step itself when its estimate misses the TTFT, and the turns at stake when its
  prefill breaks their gaps (a gap while D prefills is D's usual gap, `PlacementCosts.gap_s`,
  learned from the pair's answers, plus what is queued on D and the prefill's own compute);
* on P: the step itself when its estimate misses the TTFT, and the steps waiting on P whose
  first token it would push past their TTFT objective;

and places the step where fewer are lost, the faster estimate when as many. With nothing in
flight this is the plain comparison of the two estimates, whatever the SLO.
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
    """What the pair has in flight on one engine when a step is placed.

    vLLM computes an engine's waiting prefills together: a prefill that arrives while a pass computes waits for the
    next, with every prefill that arrives meanwhile, and their first tokens all come when that pass ends. So the
    queue is the pass in progress (what it has left) and the pass that waits (all of it)."""

    prefills: int = 0
    """Steps whose prefill runs (or waits) on the engine."""
    running_s: float = 0.0
    """What the pass in progress has left to compute (seconds, slowdown included)."""
    waiting_s: float = 0.0
    """The compute of the prefills waiting for the next pass (seconds, slowdown included): a new step joins them."""
    decodes: int = 0
    """Answers being decoded on the engine (D's decodes stall while a prefill on D computes)."""
    slowdown: float = 1.0
    """How much longer the engine's passes took under load than the compute model's estimate (learned by
    src/agentkv/_engines/_step_ledger.py): a step that joins a queue computes at that pace."""

    def queued_s(self) -> float:
        """The compute still ahead of a new step's first token, besides its own."""
        return self.running_s + self.waiting_s

    def under_load(self, compute_s: float) -> float:
        """A new step's own compute on this engine: at the pace of a pass under load when it joins a queue."""
        return compute_s * self.slowdown if self.prefills else compute_s


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
    delayed_on_prefill: Callable[[float], int] = lambda _: 0,
) -> PlacementChoice:
    """P or D for a step that computes ``on_prefill`` tokens after ``prefill_context`` (the pin) on P or ``on_decode``
    tokens after ``decode_context`` (the pin's whole blocks) on D alone, given what is in flight on each,
    ``at_stake(s)``, how many other steps in flight a prefill on D computing for the next ``s`` seconds would stall
    that can still meet ``slo``, and ``delayed_on_prefill(s)``, how many steps waiting on P for their pass would miss
    their TTFT objective if that pass computed ``s`` seconds more: the placement that loses the fewer turns (see the
    module's docstring), the faster of the two when both lose as many.

    The reason gives both estimates (queue included), the turns each would lose, and the verdict.
    """
    own: dict[PrefillEngine, float] = {
        "prefill": prefill_load.under_load(costs.compute_s(on_prefill, prefill_context)),
        "decode": decode_load.under_load(costs.compute_s(on_decode, decode_context)),
    }
    via_prefill = prefill_load.queued_s() + own["prefill"] + costs.overhead_s["prefill"]
    via_decode = decode_load.queued_s() + own["decode"] + costs.overhead_s["decode"]
    # the steps at stake wait out the prefills queued on D as well as this one (vLLM batches them into one pass),
    # on top of the pass that computes their own next tokens (D's usual gap: this prefill adds its tokens to it)
    stall_s = decode_load.queued_s() + decode_load.under_load(costs.added_s(on_decode, decode_context))
    stake = at_stake(via_decode)
    breaks_gaps = stake > 0 and costs.gap_s + stall_s > slo.itl_s
    delayed = delayed_on_prefill(own["prefill"])
    lost_on_decode = (via_decode > slo.ttft_s) + (stake if breaks_gaps else 0)
    lost_on_prefill = (via_prefill > slo.ttft_s) + delayed
    engine: PrefillEngine
    if lost_on_decode != lost_on_prefill:
        engine = "decode" if lost_on_decode < lost_on_prefill else "prefill"
        verdict = f"{'D' if engine == 'decode' else 'P'} loses fewer"
    else:
        engine = "decode" if via_decode <= via_prefill else "prefill"
        either = f"{lost_on_decode} lost either way" if lost_on_decode else "neither loses a turn"
        verdict = f"{either}, {'D is no slower' if engine == 'decode' else 'P is faster'}"
    gaps = f"stall {stall_s:.3f} s on {stake} turns at stake (gap {costs.gap_s:.3f} s)" if stake else "no turn at stake"
    reason = (
        f"SLO {slo}: D {via_decode:.3f} s ({on_decode} tokens, {decode_load.queued_s():.3f} s queued), "
        f"P {via_prefill:.3f} s ({on_prefill} tokens, {prefill_load.queued_s():.3f} s queued"
        f"{f', {delayed} waiting turns delayed past the TTFT' if delayed else ''}), {gaps}; "
        f"turns lost on D {lost_on_decode}{f' ({stake} by the stall)' if breaks_gaps else ''}, on P {lost_on_prefill}: {verdict}"
    )
    return PlacementChoice(engine, reason)
