"""Mode "auto" under an objective (`Slo`), without engines: the policy on synthetic loads and costs, the ledger
of what is in flight, and the pair layer that feeds one to the other (src/agentkv/_engines/_slo.py).

Costs in these tests are round: P 0.1 s fixed (its hop) + 1 ms a token, D 0.02 s fixed + 1 ms a token, unless a
test says otherwise; the objective 1 s to the first token, 0.1 s between tokens.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator
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
    at_stake: int | None = None,
) -> PlacementChoice:
    """The policy on these loads; the turns at stake, unless given, are D's decodes (all inside the objective)."""
    d = d or EngineLoad()
    return choose_within_slo(
        costs or _costs(),
        slo,
        on_prefill=on_prefill,
        on_decode=on_decode,
        prefill_context=0,
        decode_context=0,
        prefill_load=p or EngineLoad(),
        decode_load=d,
        at_stake=lambda _: d.decodes if at_stake is None else at_stake,
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
        "stall 0.060 s on 3 turns at stake (gap 0.000 s); turns lost on D 0, on P 0: neither loses a turn, D is no slower"
    )
    assert "no turn at stake" in _choose().reason


def test_a_deep_queue_on_p_sends_the_step_to_d() -> None:
    cheap_p = _costs(overhead_s={"prefill": 0.0, "decode": 0.3})  # alone, P wins: 0.05 s against 0.36 s
    assert _choose(cheap_p).engine == "prefill"
    deep = EngineLoad(prefills=4, running_s=0.5, waiting_s=1.0)  # 1.5 s of work ahead
    choice = _choose(cheap_p, p=deep)
    assert choice.engine == "decode"
    assert "P 1.550 s (50 tokens, 1.500 s queued)" in choice.reason
    assert choice.reason.endswith("turns lost on D 0, on P 1: D loses fewer")


def test_a_queue_the_slo_still_absorbs_keeps_the_faster_placement() -> None:
    cheap_p = _costs(overhead_s={"prefill": 0.0, "decode": 0.3})
    choice = _choose(cheap_p, p=EngineLoad(prefills=1, running_s=0.2))  # P 0.25 s, D 0.36 s: both fit
    assert choice.engine == "prefill" and "P 0.250 s (50 tokens, 0.200 s queued)" in choice.reason
    assert choice.reason.endswith("neither loses a turn, P is faster")


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
        "stall 0.300 s on 1 turns at stake (gap 0.000 s); turns lost on D 1 (1 by the stall), on P 0: P loses fewer"
    )


def test_a_decode_gap_is_d_s_usual_gap_plus_the_prefill() -> None:
    slow_pass = _costs()
    slow_pass.gap_s = 0.05  # D's passes over its decodes: 0.05 s each
    choice = _choose(slow_pass, on_prefill=200, on_decode=60, d=EngineLoad(decodes=3))  # 0.05 + 0.06 s > 0.1 s
    assert choice.engine == "prefill"
    assert "stall 0.060 s on 3 turns at stake (gap 0.050 s); turns lost on D 3 (3 by the stall)" in choice.reason
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
    queued_d = EngineLoad(prefills=1, running_s=0.05, decodes=4)  # 0.05 s ahead of it, 0.06 s its own
    choice = _choose(on_prefill=200, on_decode=60, d=queued_d)
    assert choice.engine == "prefill" and "stall 0.110 s on 4 turns at stake (gap 0.000 s); turns lost on D 4" in (
        choice.reason
    )


def test_a_d_prefill_that_misses_the_ttft_goes_to_p() -> None:
    queued_d = EngineLoad(prefills=1, running_s=1.5)  # 1.5 s of D's prefills ahead
    choice = _choose(on_prefill=200, on_decode=60, d=queued_d)
    assert choice.engine == "prefill" and choice.reason.endswith("turns lost on D 1, on P 0: P loses fewer")


def test_a_long_d_prefill_is_free_when_no_turn_in_flight_can_still_meet_the_objective() -> None:
    cheap_d = _costs(overhead_s={"prefill": 0.5, "decode": 0.0})
    lost = _choose(cheap_d, on_prefill=300, on_decode=300, d=EngineLoad(decodes=4), at_stake=0)
    assert lost.engine == "decode" and lost.reason.endswith(
        "no turn at stake; turns lost on D 0, on P 0: neither loses a turn, D is no slower"
    )
    prefilling = _choose(cheap_d, on_prefill=300, on_decode=300, at_stake=1)  # one still prefilling, within
    assert prefilling.engine == "prefill" and "on 1 turns at stake" in prefilling.reason


def test_when_neither_fits_the_faster_wins_unless_d_breaks_the_gaps() -> None:
    tight = Slo(ttft_s=0.01, itl_s=0.1)
    assert _choose(slo=tight, on_prefill=50, on_decode=60).reason.endswith("1 lost either way, D is no slower")
    assert _choose(slo=tight, on_prefill=20, on_decode=127).reason.endswith("1 lost either way, P is faster")
    cheap_d = _costs(overhead_s={"prefill": 0.5, "decode": 0.0})
    choice = _choose(cheap_d, tight, on_prefill=300, on_decode=300, d=EngineLoad(decodes=2))
    assert choice.engine == "prefill" and choice.reason.endswith("on D 3 (2 by the stall), on P 1: P loses fewer")


def test_when_p_misses_the_ttft_d_takes_a_step_that_breaks_the_gaps_of_one_turn_only() -> None:
    cheap_d = _costs(overhead_s={"prefill": 0.5, "decode": 0.0})
    queued_p = EngineLoad(prefills=3, waiting_s=0.9)  # 0.9 s ahead on P: 1.7 s to P's first token
    one = _choose(cheap_d, on_prefill=300, on_decode=300, p=queued_p, at_stake=1)
    assert one.engine == "decode" and one.reason.endswith(
        "stall 0.300 s on 1 turns at stake (gap 0.000 s); turns lost on D 1 (1 by the stall), on P 1: "
        "1 lost either way, D is no slower"
    )
    two = _choose(cheap_d, on_prefill=300, on_decode=300, p=queued_p, at_stake=2)  # two lost to keep one
    assert two.engine == "prefill" and two.reason.endswith("on D 2 (2 by the stall), on P 1: P loses fewer")
    queued_d = EngineLoad(prefills=1, running_s=0.8)  # D misses the TTFT too: it would keep no turn
    late = _choose(cheap_d, on_prefill=300, on_decode=300, p=queued_p, d=queued_d, at_stake=1)
    assert late.engine == "prefill" and late.reason.endswith("on D 2 (1 by the stall), on P 1: P loses fewer")


def test_a_step_on_p_that_would_push_the_steps_waiting_there_past_their_ttft_goes_to_d() -> None:
    cheap_p = _costs(overhead_s={"prefill": 0.0, "decode": 0.3})  # P faster: 0.25 s against 0.36 s
    waiting = EngineLoad(prefills=2, waiting_s=0.2)

    def choose(delayed: int) -> PlacementChoice:
        return choose_within_slo(
            cheap_p,
            SLO,
            on_prefill=50,
            on_decode=60,
            prefill_context=0,
            decode_context=0,
            prefill_load=waiting,
            decode_load=EngineLoad(),
            at_stake=lambda _: 0,
            delayed_on_prefill=lambda by_s: delayed if by_s == pytest.approx(0.05) else -99,
        )

    assert choose(0).engine == "prefill"
    pushed = choose(1)
    assert pushed.engine == "decode" and "0.200 s queued, 1 waiting turns delayed past the TTFT)" in pushed.reason
    assert pushed.reason.endswith("turns lost on D 0, on P 1: D loses fewer")


def test_the_queue_is_the_pass_in_progress_and_the_one_waiting_and_a_new_step_computes_at_its_pace() -> None:
    load = EngineLoad(prefills=3, running_s=0.4, waiting_s=0.2, slowdown=1.5)
    assert load.queued_s() == pytest.approx(0.6)
    assert load.under_load(0.2) == pytest.approx(0.3)
    assert EngineLoad(slowdown=1.5).under_load(0.2) == 0.2  # an idle engine: the compute model's own estimate


# ----------------------------------------------------------------- the ledger


def test_the_ledger_follows_each_step_from_its_prefill_to_its_decode() -> None:
    ledger = StepLedger()
    on_p = ledger.started("prefill", 0.1, now=10.0)
    on_d = ledger.started("decode", 0.04, now=11.0)
    ledger.started("prefill", 0.3, now=12.0)  # P computes on_p's pass (overrun): it waits for the next
    assert ledger.load("prefill", now=12.5) == EngineLoad(prefills=2, running_s=0.0, waiting_s=pytest.approx(0.3))
    assert ledger.load("decode", now=11.01) == EngineLoad(prefills=1, running_s=pytest.approx(0.03))
    ledger.token(on_p, now=12.6)  # P's prefill over: its answer decodes on D
    ledger.token(on_d, now=12.6)
    assert ledger.load("prefill", now=13.0) == EngineLoad(prefills=1, running_s=0.0)  # its pass began at 12.6
    assert ledger.load("prefill", now=12.7) == EngineLoad(prefills=1, running_s=pytest.approx(0.2))
    assert ledger.load("decode", now=13.0) == EngineLoad(decodes=2)
    ledger.ended(on_p)
    ledger.ended(on_p)  # twice: nothing more
    ledger.token(on_p)
    assert ledger.load("decode", now=13.0).decodes == 1 and len(ledger) == 2


def test_the_ledger_follows_each_engine_s_passes_and_learns_their_pace_under_load() -> None:
    ledger = StepLedger()
    a = ledger.started("prefill", 0.3, now=0.0)  # P idle: its pass begins now
    b = ledger.started("prefill", 0.5, now=0.1)  # both wait for the next pass, together
    c = ledger.started("prefill", 0.6, now=0.2)
    assert ledger.load("prefill", now=0.2) == EngineLoad(prefills=3, running_s=pytest.approx(0.1), waiting_s=1.1)
    ledger.token(a, now=0.5)  # a's pass took 0.5 s for 0.3 s of compute, its pull among it: no pace learned
    assert ledger.slowdown["prefill"] == 1.0
    assert ledger.load("prefill", now=0.6) == EngineLoad(prefills=2, running_s=pytest.approx(1.0))
    late = ledger.started("prefill", 0.2, now=0.6)  # after the pass began: it waits for the one after
    assert ledger.load("prefill", now=0.6).waiting_s == pytest.approx(0.2)
    ledger.token(b, now=2.0)  # b and c's pass began as a's ended: 1.5 s for 1.1 s of compute
    assert ledger.slowdown["prefill"] == pytest.approx(0.7 + 0.3 * 1.5 / 1.1)
    ledger.token(c, now=2.01)  # the same pass: nothing more learned, late's pass began at 2.0
    assert ledger.slowdown["prefill"] == pytest.approx(0.7 + 0.3 * 1.5 / 1.1)
    load = ledger.load("prefill", now=2.0)
    assert load.prefills == 1 and load.running_s == pytest.approx(0.2 * ledger.slowdown["prefill"])
    assert ledger.slowdown["decode"] == 1.0
    ledger.token(late, now=9.0)  # a stray pass of 35x its estimate teaches at most 4x
    assert ledger.slowdown["prefill"] <= 0.7 * 1.2 + 0.3 * 4.0 + 1e-9


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
    a = ledger.started("prefill", 0.3, now=0.0)  # its pass ends at 0.3 s: due at 0.4 s (P's 0.1 s)
    ledger.started("prefill", 0.5, now=0.1)  # the next pass, with c: 1.1 s after a's, due at 1.5 s
    ledger.started("prefill", 0.6, now=0.2)
    ledger.started("decode", 0.2, now=0.2)  # due at 0.42 s on D (D's 0.02 s)

    def stake(within_s: float, now: float = 0.2) -> int:
        return ledger.at_stake(slo, _costs(), within_s=within_s, now=now)

    assert [stake(s) for s in (0.1, 0.21, 0.3, 1.31, 9.0)] == [0, 1, 2, 4, 4]
    ledger.started("prefill", 1.0, now=0.2)  # joins the waiting pass: due at 2.5 s, and so are the other two
    assert stake(9.0) == 2  # all three past their 2 s
    ledger.token(a, now=0.25)  # a sooner than due: the next pass begins
    assert ledger.at_stake(slo, _costs(), within_s=9.0, now=2.5) == 0  # every one has waited past 2 s


def test_a_step_on_p_delays_the_steps_waiting_there_for_their_pass() -> None:
    slo = Slo(ttft_s=2.0, itl_s=0.5)
    ledger = StepLedger()
    a = ledger.started("prefill", 0.3, now=0.0)
    ledger.started("prefill", 0.5, now=0.1)  # waiting: due at 0.3 + 1.1 + 0.1 = 1.5 s, 1.4 s after its start
    ledger.started("prefill", 0.6, now=0.2)  # 1.3 s after its start

    def delayed(by_s: float) -> int:
        return ledger.delayed(slo, _costs(), by_s=by_s, now=0.2)

    assert [delayed(s) for s in (0.5, 0.65, 0.8)] == [0, 1, 2]
    ledger.token(a, now=0.3)  # their pass begins: a new step waits for the next one and delays neither
    assert delayed(5.0) == 0


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
        "stall 0.100 s on 1 turns at stake (gap 0.000 s); turns lost on D 0" in unstarted_pair._place(request).reason
    )  # 0.1 s: within
    unstarted_pair._ledger.started("decode", 0.01)  # a step prefilling on D decodes on D next
    unstarted_pair._ledger.started("prefill", 0.01)  # and so does one on P, once its KV is over
    assert "on 3 turns at stake" in unstarted_pair._place(request).reason
    unstarted_pair.in_flight.d = 9  # D's own count of requests (releases, repins among them) decides nothing
    assert "on 3 turns at stake" in unstarted_pair._place(request).reason
    unstarted_pair.slo = Slo(ttft_s=1.0, itl_s=0.05)  # changed while the pair runs: the next step reads it
    choice = unstarted_pair._place(request)
    assert choice.engine == "prefill" and "turns lost on D 3 (3 by the stall), on P 0" in choice.reason


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
async def test_the_pair_counts_its_steps_in_flight_and_learns_only_from_steps_alone() -> None:
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
        assert pair._ledger.load("prefill").queued_s() == pytest.approx(0.6, abs=0.01)  # no pin: 300 tokens on P, each
        pair.gates["a"][0].set()
        await anyio.wait_all_tasks_blocked()
        assert (pair._ledger.load("prefill").prefills, pair._ledger.load("decode").decodes) == (1, 1)  # a decodes
        await let_go("a")
        await let_go("b")
    assert len(pair._ledger) == 0
    # a and b prefilled side by side on P: neither teaches the compute (1 ms a token still) nor the overhead (their
    # waits are the queue's)
    assert len(pair.costs.compute) == 0 and pair.costs.overhead_s["prefill"] == 0.0
    pair.gates["c"] = (anyio.Event(), anyio.Event())
    for gate in pair.gates["c"]:
        gate.set()
    await run("c")  # alone on P: its 100 tokens in 0.5 s teach the compute, the rest of its 2 s the overhead
    assert pair.costs.compute_s(100, 0) == pytest.approx(0.5)
    assert pair.costs.overhead_s["prefill"] == pytest.approx(1.5)


@pytest.fixture
def unstarted_pair() -> Any:
    return _PlacingPair()
