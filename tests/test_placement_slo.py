"""Mode "auto" under an objective (`Slo`), without engines: the policy on synthetic loads and costs, the ledger
of what is in flight, and the pair layer that feeds one to the other (src/agentkv/_engines/_slo.py).

Costs in these tests are round: P 0.1 s fixed (its hop) + 1 ms a token, D 0.02 s fixed + 1 ms a token, unless a
test says otherwise; the objective 1 s to the first token, 0.1 s between tokens.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Callable
from typing import Any

import anyio
import pytest

from agentkv import EmbeddedPair, UserError
from agentkv._engines._compute import ComputeCost, ComputeModel
from agentkv._engines._placement import PlacementChoice, PlacementCosts
from agentkv._engines._slo import DEFAULT_SLO, EngineLoad, choose_within_slo
from agentkv._engines._step_ledger import StepLedger
from agentkv.engines import Sampling, Slo, StepDone, StepEvent, StepRequest, StepTimings, TokenDelta
from test_placement import BLOCK, _pin, _PlacingPair, _request

SLO = Slo(ttft_s=1.0, itl_s=0.1)


def _costs(**changes: dict[str, float]) -> PlacementCosts:
    """Overheads 0.1 s on P and 0.02 s on D (unless ``overhead_s`` is given), compute 1 ms a token on either."""
    compute = ComputeModel(ComputeCost(pass_s=0.0, per_token_s=1e-3, per_attended_s=0.0))
    return PlacementCosts(overhead_s=changes.get("overhead_s", {"prefill": 0.1, "decode": 0.02}), compute=compute)


def _choose(
    costs: PlacementCosts | None = None,
    slo: Slo = SLO,
    *,
    on_prefill: int = 50,
    on_decode: int = 60,
    p: EngineLoad | None = None,
    d: EngineLoad | None = None,
    at_stake: int | Callable[[float], int] | None = None,
) -> PlacementChoice:
    """The policy on these loads; the turns at stake, unless given (a count for any window, or a function of the
    window), are D's decodes (all inside the objective)."""
    d = d or EngineLoad()
    count = d.decodes if at_stake is None else at_stake
    stake: Callable[[float], int] = count if callable(count) else lambda _: count
    return choose_within_slo(
        costs or _costs(),
        slo,
        on_prefill=on_prefill,
        on_decode=on_decode,
        prefill_context=0,
        decode_context=0,
        prefill_load=p or EngineLoad(),
        decode_load=d,
        at_stake=stake,
        at_risk=lambda: stake(math.inf),
    )


# ----------------------------------------------------------------- the objective


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "1"])
def test_an_slo_takes_positive_seconds_only(bad: Any) -> None:
    with pytest.raises(UserError, match="positive number of seconds"):
        Slo(ttft_s=bad, itl_s=0.1)
    with pytest.raises(UserError, match="itl_s"):
        Slo(ttft_s=1.0, itl_s=bad)


def test_an_slo_is_frozen_seconds_and_says_itself() -> None:
    slo = Slo(ttft_s=2, itl_s=0.25)
    assert (slo.ttft_s, slo.itl_s) == (2.0, 0.25) and isinstance(slo.ttft_s, float)
    assert str(slo) == "TTFT 2 s, ITL 0.25 s"
    with pytest.raises(AttributeError):
        slo.ttft_s = 3.0  # type: ignore[misc]


def test_every_pair_takes_an_slo_and_a_running_pair_changes_it() -> None:
    assert EmbeddedPair().slo == DEFAULT_SLO == Slo(ttft_s=2.0, itl_s=0.2)
    pair = EmbeddedPair(slo=SLO)
    assert pair.slo == pair.config.slo == SLO
    pair.slo = Slo(ttft_s=5.0, itl_s=0.5)  # what the bench does once its solo load measured one
    assert pair.slo.ttft_s == 5.0
    assert EmbeddedPair(slo=None).slo is None
    from agentkv._session._session_config import SessionConfig
    from agentkv._session._session_core import make_engine

    own = make_engine(SessionConfig.build(tools=(), engine_options={"slo": SLO}, mode="auto"))
    assert isinstance(own, EmbeddedPair) and own.slo == SLO  # a session's own pair takes it as an engine option
    with pytest.raises(UserError, match="slo takes an Slo"):
        EmbeddedPair(slo=(1.0, 0.1))  # type: ignore[typeddict-item]


# ----------------------------------------------------------------- the policy


@pytest.mark.parametrize("slo", [SLO, Slo(ttft_s=1e-3, itl_s=1e-3), Slo(ttft_s=1e3, itl_s=1e3)])
def test_an_idle_pair_takes_the_faster_estimate_whatever_the_slo(slo: Slo) -> None:
    assert _choose(slo=slo, on_prefill=50, on_decode=60).engine == "decode"  # 0.08 s against 0.15 s
    assert _choose(slo=slo, on_prefill=20, on_decode=127).engine == "prefill"  # 0.147 s against 0.12 s


def test_the_reason_gives_both_estimates_the_queue_the_stall_and_the_verdict() -> None:
    choice = _choose(on_prefill=50, on_decode=60, d=EngineLoad(decodes=3))
    assert choice.engine == "decode"
    assert choice.reason == (
        "SLO TTFT 1 s, ITL 0.1 s: D 0.080 s (60 tokens, 0.000 s queued), P 0.150 s (50 tokens, 0.000 s queued), "
        "stall 0.060 s on 3 turns at stake (gap 0.000 s): D fits and is no slower"
    )
    assert "no turn at stake" in _choose().reason


def test_a_deep_queue_on_p_sends_the_step_to_d() -> None:
    cheap_p = _costs(overhead_s={"prefill": 0.0, "decode": 0.3})  # alone, P wins: 0.05 s against 0.36 s
    assert _choose(cheap_p).engine == "prefill"
    deep = EngineLoad(prefills=4, prefill_s=2, busy_s=0.5)  # 2 s of work, 0.5 s of it done
    choice = _choose(cheap_p, p=deep)
    assert choice.engine == "decode"
    assert "P 1.550 s (50 tokens, 1.500 s queued)" in choice.reason and "D fits" in choice.reason


def test_a_queue_the_slo_still_absorbs_keeps_the_faster_placement() -> None:
    cheap_p = _costs(overhead_s={"prefill": 0.0, "decode": 0.3})
    choice = _choose(cheap_p, p=EngineLoad(prefills=1, prefill_s=0.2))  # P 0.25 s, D 0.36 s: both fit
    assert choice.engine == "prefill" and "P 0.250 s (50 tokens, 0.200 s queued)" in choice.reason
    assert choice.reason.endswith("P fits, D is slower")


def test_d_decoding_many_still_takes_a_short_step_whose_prefill_fits_the_gaps() -> None:
    many = EngineLoad(decodes=12)
    choice = _choose(on_decode=60, d=many)  # stalls each decode 0.06 s < 0.1 s
    assert choice.engine == "decode" and "stall 0.060 s on 12 turns at stake (gap" in choice.reason


def test_a_long_prompt_whose_d_prefill_would_break_the_gaps_goes_to_p() -> None:
    cheap_d = _costs(overhead_s={"prefill": 0.5, "decode": 0.0})  # D far faster even for 300 tokens
    assert _choose(cheap_d, on_prefill=300, on_decode=300).engine == "decode"  # nothing decodes on D
    choice = _choose(cheap_d, on_prefill=300, on_decode=300, d=EngineLoad(decodes=1))
    assert choice.engine == "prefill"
    assert choice.reason.endswith(
        "stall 0.300 s on 1 turns at stake (gap 0.000 s): P fits, D would break the gaps of the turns at stake"
    )


def test_a_decode_gap_is_d_s_usual_gap_plus_the_prefill() -> None:
    slow_pass = _costs()
    slow_pass.gap_s = 0.05  # D's passes over its decodes: 0.05 s each
    choice = _choose(slow_pass, on_prefill=200, on_decode=60, d=EngineLoad(decodes=3))  # 0.05 + 0.06 s > 0.1 s
    assert choice.engine == "prefill"
    assert "stall 0.060 s on 3 turns at stake (gap 0.050 s): P fits, D would break the gaps" in choice.reason
    assert _choose(slow_pass, on_prefill=200, on_decode=40, d=EngineLoad(decodes=3)).engine == "decode"  # 0.09 s


def test_the_pair_learns_d_s_gap_from_answers_long_enough_to_have_one() -> None:
    costs = PlacementCosts()
    costs.observe(
        "prefill", computed_tokens=10, context_tokens=0, ttft_s=0.2, prefill_s=0.1, decode_s=0.7, output_tokens=8
    )
    assert costs.gap_s == pytest.approx(0.1)  # 7 gaps in 0.7 s
    costs.observe(
        "decode", computed_tokens=10, context_tokens=0, ttft_s=0.2, prefill_s=0.1, decode_s=0.9, output_tokens=4
    )  # too short
    costs.observe(
        "decode", computed_tokens=10, context_tokens=0, ttft_s=0.2, prefill_s=0.1, decode_s=None, output_tokens=40
    )
    assert costs.gap_s == pytest.approx(0.1)
    costs.observe(
        "decode", computed_tokens=10, context_tokens=0, ttft_s=0.2, prefill_s=0.1, decode_s=1.8, output_tokens=10
    )
    assert costs.gap_s == pytest.approx(0.7 * 0.1 + 0.3 * 0.2)  # a running mean


def test_the_stall_is_what_the_prefill_adds_to_d_s_pass_not_a_pass_of_its_own() -> None:
    with_pass = _costs()
    with_pass.compute = ComputeModel(ComputeCost(pass_s=0.05, per_token_s=1e-3, per_attended_s=0.0))
    choice = _choose(with_pass, on_prefill=50, on_decode=60, d=EngineLoad(decodes=3))
    assert "D 0.130 s (60 tokens" in choice.reason and "stall 0.060 s on 3 turns" in choice.reason


def test_the_stall_counts_the_prefills_queued_on_d_before_the_step() -> None:
    queued_d = EngineLoad(prefills=1, prefill_s=0.05, decodes=4)  # 0.05 s ahead of it, 0.06 s its own
    choice = _choose(on_prefill=200, on_decode=60, d=queued_d)
    assert (
        choice.engine == "prefill"
        and "stall 0.110 s on 4 turns at stake (gap 0.000 s): P fits, D would break" in choice.reason
    )


def test_a_d_prefill_that_misses_the_ttft_goes_to_p() -> None:
    queued_d = EngineLoad(prefills=1, prefill_s=1.5)  # 1.5 s of D's prefills ahead
    choice = _choose(on_prefill=200, on_decode=60, d=queued_d)
    assert choice.engine == "prefill" and choice.reason.endswith("P fits, D misses the TTFT")


def test_a_long_d_prefill_is_free_when_no_turn_in_flight_can_still_meet_the_objective() -> None:
    cheap_d = _costs(overhead_s={"prefill": 0.5, "decode": 0.0})
    lost = _choose(cheap_d, on_prefill=300, on_decode=300, d=EngineLoad(decodes=4), at_stake=0)
    assert lost.engine == "decode" and lost.reason.endswith("no turn at stake: D fits and is no slower")
    prefilling = _choose(cheap_d, on_prefill=300, on_decode=300, at_stake=1)  # one still prefilling, within
    assert prefilling.engine == "prefill" and "on 1 turns at stake" in prefilling.reason


def test_where_p_fits_a_gap_breaking_d_prefill_waits_until_no_turn_in_flight_can_be_lost() -> None:
    cheap_d = _costs(overhead_s={"prefill": 0.5, "decode": 0.0})  # D 0.3 s, P 0.8 s: both fit, D the faster

    def due_later(within_s: float) -> int:  # one turn in flight, due after D's prefill by its estimate
        return 1 if within_s == math.inf else 0

    risky = _choose(cheap_d, on_prefill=300, on_decode=300, at_stake=due_later)
    assert risky.engine == "prefill" and risky.reason.endswith(
        "no turn at stake: P fits, D would risk 1 turns in flight"
    )
    assert _choose(cheap_d, on_prefill=300, on_decode=300, at_stake=lambda _: 0).engine == "decode"  # none at risk
    short = _choose(cheap_d, on_prefill=60, on_decode=60, at_stake=due_later)  # 0.06 s breaks no gap: no risk
    assert short.engine == "decode" and short.reason.endswith("D fits and is no slower")
    queued_p = EngineLoad(prefills=3, prefill_s=0.9)  # P misses its TTFT: D keeps this turn
    late_p = _choose(cheap_d, on_prefill=300, on_decode=300, p=queued_p, at_stake=due_later)
    assert late_p.engine == "decode" and late_p.reason.endswith("D fits and is no slower")


def test_when_neither_fits_the_faster_wins_unless_d_breaks_the_gaps() -> None:
    tight = Slo(ttft_s=0.01, itl_s=0.1)
    assert _choose(slo=tight, on_prefill=50, on_decode=60).reason.endswith("neither fits; D is faster")
    assert _choose(slo=tight, on_prefill=20, on_decode=127).reason.endswith("neither fits; P is faster")
    cheap_d = _costs(overhead_s={"prefill": 0.5, "decode": 0.0})
    choice = _choose(cheap_d, tight, on_prefill=300, on_decode=300, d=EngineLoad(decodes=2))
    assert choice.engine == "prefill" and choice.reason.endswith(
        "neither fits; D would break the gaps of the turns at stake"
    )


def test_when_p_misses_the_ttft_d_takes_a_step_that_breaks_the_gaps_of_one_turn_only() -> None:
    cheap_d = _costs(overhead_s={"prefill": 0.5, "decode": 0.0})
    queued_p = EngineLoad(prefills=3, prefill_s=0.9)  # 0.9 s ahead on P: 1.7 s to P's first token
    one = _choose(cheap_d, on_prefill=300, on_decode=300, p=queued_p, at_stake=1)
    assert one.engine == "decode" and one.reason.endswith(
        "stall 0.300 s on 1 turns at stake (gap 0.000 s): P misses the TTFT, D the gaps of 1 turn at stake: D, off P's queue"
    )
    two = _choose(cheap_d, on_prefill=300, on_decode=300, p=queued_p, at_stake=2)  # two lost to keep one
    assert two.engine == "prefill" and two.reason.endswith("neither fits; D would break the gaps of the turns at stake")
    queued_d = EngineLoad(prefills=1, prefill_s=0.8)  # D misses the TTFT too: it would keep no turn
    late = _choose(cheap_d, on_prefill=300, on_decode=300, p=queued_p, d=queued_d, at_stake=1)
    assert late.engine == "prefill" and late.reason.endswith(
        "neither fits; D would break the gaps of the turns at stake"
    )


def test_the_trade_is_for_p_s_queue_not_for_an_overhead_learned_under_load() -> None:
    slow_hop = _costs(overhead_s={"prefill": 1.0, "decode": 0.0})  # P's overhead learned under load: 1 s
    short_queue = EngineLoad(prefills=1, prefill_s=0.2)  # P 0.2 + 0.3 + 1.0 s misses; queue and compute 0.5 s do not
    kept = _choose(slow_hop, on_prefill=300, on_decode=300, p=short_queue, at_stake=1)
    assert kept.engine == "prefill" and kept.reason.endswith(
        "neither fits; D would break the gaps of the turns at stake (P misses by its overhead, not its queue)"
    )
    long_queue = EngineLoad(prefills=3, prefill_s=0.9)  # 0.9 + 0.3 s of compute miss without the overhead
    traded = _choose(slow_hop, on_prefill=300, on_decode=300, p=long_queue, at_stake=1)
    assert traded.engine == "decode" and traded.reason.endswith("D, off P's queue")


def test_the_queue_counts_what_the_engine_computed_since_its_oldest_prefill() -> None:
    assert EngineLoad(prefill_s=1.0, busy_s=0.4).queued_s() == pytest.approx(0.6)
    assert EngineLoad(prefill_s=1.0, busy_s=3.0).queued_s() == 0.0


# ----------------------------------------------------------------- the ledger


def test_the_ledger_follows_each_step_from_its_prefill_to_its_decode() -> None:
    ledger = StepLedger()
    on_p = ledger.started("prefill", 0.1, now=10.0)
    on_d = ledger.started("decode", 0.04, now=11.0)
    ledger.started("prefill", 0.3, now=12.0)
    assert ledger.load("prefill", now=12.5) == EngineLoad(prefills=2, prefill_s=0.4, busy_s=2.5, decodes=0)
    assert ledger.load("decode", now=12.5) == EngineLoad(prefills=1, prefill_s=0.04, busy_s=1.5, decodes=0)
    ledger.token(on_p, now=12.6)  # P's prefill over: its answer decodes on D
    ledger.token(on_d, now=12.6)
    assert ledger.load("prefill", now=13.0) == EngineLoad(prefills=1, prefill_s=0.3, busy_s=1.0)
    assert ledger.load("decode", now=13.0) == EngineLoad(decodes=2)
    ledger.ended(on_p)
    ledger.ended(on_p)  # twice: nothing more
    ledger.token(on_p)
    assert ledger.load("decode", now=13.0).decodes == 1 and len(ledger) == 2


def test_the_ledger_counts_the_decodes_in_flight_that_can_still_meet_the_objective() -> None:
    slo = Slo(ttft_s=2.0, itl_s=0.5)
    ledger = StepLedger()

    def stake(now: float) -> int:
        return ledger.at_stake(slo, _costs(), within_s=10.0, now=now)

    late = ledger.started("decode", 0.1, now=0.0)
    ledger.token(late, now=2.5)  # first token after 2.5 s: lost
    steady = ledger.started("prefill", 0.1, now=1.0)
    ledger.token(steady, now=1.5)
    ledger.token(steady, now=1.9)
    assert stake(1.95) == 1  # steady
    stalled = ledger.started("decode", 0.01, now=2.0)
    ledger.token(stalled, now=2.2)
    ledger.token(stalled, now=2.3)
    assert stake(2.35) == 2  # steady's open gap: 0.45 s
    assert stake(2.45) == 1  # steady's open gap is past 0.5 s now
    ledger.token(stalled, now=3.0)  # a gap of 0.7 s: lost even once its tokens flow again
    ledger.token(stalled, now=3.1)
    assert stake(3.15) == 0 and len(ledger) == 3


def test_a_prefill_in_flight_is_at_stake_when_its_first_token_is_due_in_the_window_and_in_time() -> None:
    slo = Slo(ttft_s=2.0, itl_s=0.5)
    ledger = StepLedger()
    ledger.started("prefill", 0.3, now=0.0)  # due at 0.4 s (300 tokens at 1 ms, P's 0.1 s): within 2 s
    ledger.started("prefill", 1.5, now=0.0)  # behind it: due at 1.9 s
    ledger.started("prefill", 0.5, now=0.0)  # due at 2.4 s: misses its 2 s whatever D does
    ledger.started("decode", 0.2, now=0.0)  # due at 0.22 s on D (D's 0.02 s)

    def stake(within_s: float) -> int:
        return ledger.at_stake(slo, _costs(), within_s=within_s, now=0.0)

    assert [stake(s) for s in (0.1, 0.3, 1.0, 2.0, 9.0)] == [0, 1, 2, 3, 3]
    assert ledger.at_stake(slo, _costs(), within_s=9.0, now=1.0) == 3  # a second later: 1 s computed of the queue
    assert ledger.at_stake(slo, _costs(), within_s=9.0, now=2.1) == 0  # every one has waited past 2 s


def test_at_its_earliest_a_prefill_in_flight_is_due_without_its_placement_s_overhead() -> None:
    slo = Slo(ttft_s=2.0, itl_s=0.5)
    ledger = StepLedger()
    ledger.started("prefill", 0.5, now=0.0)
    slow_hop = _costs(overhead_s={"prefill": 1.0, "decode": 0.0})  # an overhead learned under load: 1 s
    assert ledger.at_stake(slo, slow_hop, within_s=math.inf, now=1.2) == 0  # due at 2.2 s: lost, by the estimate
    assert ledger.at_stake(slo, slow_hop, within_s=math.inf, earliest=True, now=1.2) == 1  # could come at 1.2 s
    assert ledger.at_stake(slo, slow_hop, within_s=math.inf, earliest=True, now=2.1) == 0  # past 2 s already


# ----------------------------------------------------------------- the pair layer


def test_the_pair_places_by_its_slo_with_what_it_has_in_flight(unstarted_pair: Any) -> None:
    unstarted_pair.costs = _costs()
    unstarted_pair.slo = SLO
    request = _request("auto", pin=_pin(2 * BLOCK + 10), prompt=2 * BLOCK + 100)  # P 90 tokens, D 100
    choice = unstarted_pair._place(request)
    assert choice.engine == "decode" and "D 0.120 s (100 tokens" in choice.reason and "P 0.190 s (90" in choice.reason
    unstarted_pair._ledger = StepLedger(clock=lambda: 100.0)  # time stands still: every step stays within
    decoding = unstarted_pair._ledger.started("prefill", 0.01)
    unstarted_pair._ledger.token(decoding)  # one answer decoding on D
    assert (
        "stall 0.100 s on 1 turns at stake (gap 0.000 s): D fits" in unstarted_pair._place(request).reason
    )  # 0.1 s: within
    unstarted_pair._ledger.started("decode", 0.01)  # a step prefilling on D decodes on D next
    unstarted_pair._ledger.started("prefill", 0.01)  # and so does one on P, once its KV is over
    assert "on 3 turns at stake" in unstarted_pair._place(request).reason
    unstarted_pair.in_flight.d = 9  # D's own count of requests (releases, repins among them) decides nothing
    assert "on 3 turns at stake" in unstarted_pair._place(request).reason
    unstarted_pair.slo = Slo(ttft_s=1.0, itl_s=0.05)  # changed while the pair runs: the next step reads it
    choice = unstarted_pair._place(request)
    assert choice.engine == "prefill" and "D would break the gaps" in choice.reason


def test_where_p_fits_the_pair_risks_no_turn_that_could_still_be_kept_at_its_earliest(unstarted_pair: Any) -> None:
    unstarted_pair.costs = _costs(overhead_s={"prefill": 1.5, "decode": 0.0})  # P's overhead learned under load
    unstarted_pair.slo = Slo(ttft_s=2.0, itl_s=0.05)
    request = _request("auto", pin=_pin(2 * BLOCK + 10), prompt=2 * BLOCK + 100)  # D 0.1 s: breaks a 0.05 s gap
    assert unstarted_pair._place(request).engine == "decode"  # nothing in flight
    unstarted_pair._ledger = StepLedger(clock=lambda: 100.0)
    unstarted_pair._ledger.started("prefill", 0.2, now=99.0)  # due at 101.5 s by the estimate: lost (2.5 s)
    choice = unstarted_pair._place(request)  # but it could come now, within 2 s, so D would risk it
    assert choice.engine == "prefill" and choice.reason.endswith("P fits, D would risk 1 turns in flight")


def test_placement_asked_or_impossible_ignores_the_slo(unstarted_pair: Any) -> None:
    unstarted_pair.slo = Slo(ttft_s=1e-3, itl_s=1e-3)
    assert unstarted_pair._place(_request("decode", pin=_pin(256))) == PlacementChoice("decode", "asked")
    assert unstarted_pair._place(_request("auto", pin=None)).reason == "no pin to extend on D"


class _SteppingPair(_PlacingPair):
    """The placing pair with steps that hold at their first token and at their end until the test lets them go."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[str, tuple[anyio.Event, anyio.Event]] = {}

    async def _step(self, request: StepRequest, started: float, choice: PlacementChoice) -> AsyncGenerator[StepEvent]:
        first, done = self.gates[request.request_id]
        await first.wait()
        yield TokenDelta(token_ids=[7], text="a")
        await done.wait()
        timings = StepTimings(
            ttft_s=2.0, prefill_s=0.5, computed_tokens=100, prefill_engine=choice.engine, placement_reason=choice.reason
        )
        yield StepDone(token_ids=[7], text="a", finish_reason="stop", timings=timings)

    _step_via_prefill = _step_on_decode = _step  # type: ignore[assignment]


@pytest.mark.anyio
async def test_the_pair_counts_its_steps_in_flight_and_learns_without_their_queue() -> None:
    pair = _SteppingPair()
    pair.costs = _costs(overhead_s={"prefill": 0.0, "decode": 5.0})  # every step to P
    pair.gates = {name: (anyio.Event(), anyio.Event()) for name in ("a", "b")}

    async def run(request_id: str) -> None:
        request = StepRequest(request_id=request_id, prompt_token_ids=list(range(300)), sampling=Sampling())
        async for _ in pair._pinned_step(request):
            pass

    async def let_go(name: str) -> None:
        for gate in pair.gates[name]:
            gate.set()
            await anyio.wait_all_tasks_blocked()

    async with anyio.create_task_group() as group:
        group.start_soon(run, "a")
        await anyio.wait_all_tasks_blocked()
        group.start_soon(run, "b")
        await anyio.wait_all_tasks_blocked()
        assert pair._ledger.load("prefill").prefill_s == pytest.approx(0.6)  # no pin: 300 tokens on P, each
        pair.gates["a"][0].set()
        await anyio.wait_all_tasks_blocked()
        assert (pair._ledger.load("prefill").prefills, pair._ledger.load("decode").decodes) == (1, 1)  # a decodes
        await let_go("a")
        await let_go("b")
    assert len(pair._ledger) == 0
    # a and b prefilled side by side on P: neither teaches the compute (1 ms a token still); each learns its TTFT
    # (2 s) less its compute (100 tokens) and the queue estimated ahead of it (b: a's 300 tokens)
    assert len(pair.costs.compute) == 0
    assert pair.costs.overhead_s["prefill"] == pytest.approx(0.7 * 1.9 + 0.3 * 1.6, abs=1e-3)  # less a's head start
    pair.gates["c"] = (anyio.Event(), anyio.Event())
    for gate in pair.gates["c"]:
        gate.set()
    await run("c")  # alone on P: its 100 tokens in 0.5 s teach the compute
    assert pair.costs.compute_s(100, 0) == pytest.approx(0.5)
    assert pair.costs.overhead_s["prefill"] == pytest.approx(0.7 * (0.7 * 1.9 + 0.3 * 1.6) + 0.3 * 1.5, abs=1e-3)


@pytest.fixture
def unstarted_pair() -> Any:
    return _PlacingPair()
