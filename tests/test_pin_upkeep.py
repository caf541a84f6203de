"""The repin after a stop string and the early transfer into P (src/agentkv/_session/_pin_upkeep.py; issue 30,
points 3 and 5), on the honest scripted pair (`HonestPairEngine`): it checks every pin given back (its own, unspent,
not expired, its exact tokens strictly extended by the prompt), so an upkeep step that broke the token-exact rule or
reused a pin is a violation. `StalledUpkeep` plays a fault on the upkeep steps alone (they start as soon as a turn is
kept, before a test could inject one).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from agentkv import Session
from agentkv._doubles._honest_pair import BLOCK_SIZE
from agentkv._session import _pin_upkeep
from agentkv.engines import StepEvent, StepRequest
from agentkv.testing import Fault, HonestPairEngine

pytestmark = pytest.mark.upkeep

USER = [{"role": "user", "content": "Count to three."}]
STOP = "two"
"""Ends `_respond`'s answer after ``One, ``."""


def _respond(request: StepRequest) -> str:
    return f"One, two, three. ({sum(request.prompt_token_ids) % 97})"


class StalledUpkeep(HonestPairEngine):
    """An honest pair that plays ``fault`` on every step of a session's upkeep whose id starts with ``kind``."""

    def __init__(self, kind: str, fault: Fault = "stall", **options: Any) -> None:
        super().__init__(_respond, **options)
        self._kind, self._fault = f"agentkv-{kind}-", fault

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        if request.request_id.startswith(self._kind):
            self.inject(self._fault)
        async for event in super().step(request):
            yield event


def _of(engine: HonestPairEngine, kind: str) -> list[Any]:
    return [record for record in engine.steps if record.request_id.startswith(f"agentkv-{kind}-")]


def _turn_steps(engine: HonestPairEngine) -> list[Any]:
    return [r for r in engine.steps if not r.request_id.startswith(("agentkv-repin-", "agentkv-prefetch-"))]


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while not condition():
        assert time.perf_counter() < deadline, "timed out"
        time.sleep(0.01)


def _stopped_then_next(session: Session, *, wait: Callable[[], bool] = lambda: True) -> tuple[Any, Any]:
    history: list[dict[str, Any]] = [*USER]
    stopped = session.step_sync(history, stop=STOP)
    assert stopped.finish_reason == "stop" and stopped.text == "One, "
    _wait_for(wait)
    history += [{"role": "assistant", "content": stopped.text}, {"role": "user", "content": "Go on."}]
    return stopped, session.step_sync(history)


# ----------------------------------------------------------------- the repin (a stop string ended the step)


def test_honest_pair_a_stop_string_ended_step_is_repinned_and_the_next_step_pulls() -> None:
    engine = HonestPairEngine(_respond)
    with Session(engine=engine, early_transfer=False) as session:
        _, after = _stopped_then_next(session, wait=lambda: session.pinned_tokens > 0)
        tokens, turns = session.token_ids, session.stats.turns
    (repin,) = _of(engine, "repin")
    assert not repin.forwarded and repin.placement == "decode" and len(repin.output_token_ids) == 1
    assert after.stats.handle_forwarded and after.stats.pulled_tokens > 0 and after.stats.miss_reason is None
    assert [t.repins for t in turns] == [0, 1]
    engine.assert_honest()
    reference = HonestPairEngine(_respond)  # no repin: the same conversation, token for token
    with Session(engine=reference, renew_pins=False, early_transfer=False) as plain:
        _stopped_then_next(plain)
        assert plain.token_ids == tokens


def test_honest_pair_without_renew_pins_a_stopped_step_is_not_repinned() -> None:
    engine = HonestPairEngine(_respond)
    with Session(engine=engine, renew_pins=False, early_transfer=True) as session:
        _, after = _stopped_then_next(session)
        turns = session.stats.turns
    assert not _of(engine, "repin") and _of(engine, "prefetch")[0].prompt_tokens > after.stats.prompt_tokens
    assert not after.stats.handle_forwarded and after.stats.miss_reason == "no_handle"
    assert [t.repins for t in turns] == [0, 0]
    engine.assert_honest()


def test_honest_pair_a_step_during_a_repin_waits_for_it_and_takes_its_pin() -> None:
    engine = StalledUpkeep("repin", stall_s=1.0)
    with Session(engine=engine, early_transfer=False) as session:
        started = time.perf_counter()
        _, after = _stopped_then_next(session)
        waited = time.perf_counter() - started
    assert _of(engine, "repin")[0].outcome == "done" and waited > 0.5
    assert after.stats.handle_forwarded and after.stats.pulled_tokens > 0
    assert session.stats.turns[1].repins == 1
    engine.assert_honest()


def test_honest_pair_closing_during_a_repin_cancels_it_quietly() -> None:
    engine = StalledUpkeep("repin", stall_s=30.0)
    with engine, Session(engine=engine, early_transfer=True) as session:
        session.step_sync(USER, stop=STOP)
        _wait_for(lambda: any(r.outcome == "running" for r in _of(engine, "repin")))
        started = time.perf_counter()
        session.close()
        assert time.perf_counter() - started < 5.0
        _wait_for(lambda: _of(engine, "repin")[0].outcome == "cancelled")
        assert session.pinned_tokens == 0 and engine.live_pins == 0
    engine.assert_honest()


def test_honest_pair_an_edit_during_a_repin_cancels_it_and_the_next_step_recomputes() -> None:
    engine = StalledUpkeep("repin", stall_s=30.0)
    with Session(engine=engine, early_transfer=False) as session:
        session.step_sync(USER, stop=STOP)
        _wait_for(lambda: any(r.outcome == "running" for r in _of(engine, "repin")))
        session.rewind()
        _wait_for(lambda: _of(engine, "repin")[0].outcome == "cancelled")
        after = session.run_sync("And then?")
    assert not after.steps[0].stats.handle_forwarded and after.stats.repins == 0
    assert engine.live_pins <= 1  # the new turn's pin alone
    engine.assert_honest()


def test_honest_pair_an_edit_after_a_repin_releases_its_pin() -> None:
    engine = HonestPairEngine(_respond)
    with Session(engine=engine, early_transfer=False) as session:
        session.step_sync(USER, stop=STOP)
        _wait_for(lambda: session.pinned_tokens > 0)
        session.rewind()
        _wait_for(lambda: engine.released == 1)
        assert engine.live_pins == 0
    engine.assert_honest()


# ----------------------------------------------------------------- the early transfer (prefetch into P)


def test_honest_pair_after_a_turn_the_prefetch_replaces_the_pin_and_the_next_step_takes_it() -> None:
    engine = HonestPairEngine(_respond)
    with Session(engine=engine, early_transfer=True) as session:
        session.run_sync("Capital of France?")
        _wait_for(lambda: bool(_of(engine, "prefetch")) and _of(engine, "prefetch")[0].outcome == "done")
        _wait_for(lambda: session.pinned_tokens == len(session.token_ids))  # the prefetch's pin: the conversation
        held = session.pinned_tokens
        after = session.run_sync("And Italy?")
        tokens = session.token_ids
    prefetch = _of(engine, "prefetch")[0]
    assert prefetch.forwarded and not prefetch.declined and prefetch.placement == "prefill"
    assert len(prefetch.output_token_ids) == 1 and prefetch.computed_tokens == 1  # P pulled the rest now
    step = after.steps[0].stats
    assert step.handle_forwarded and step.pulled_tokens == held and step.miss_reason is None
    assert after.stats.early_transfers == 1 and session.stats.turns[0].early_transfers == 0
    engine.assert_honest()
    reference = HonestPairEngine(_respond)  # no prefetch: the same answers, token for token
    with Session(engine=reference, early_transfer=False) as plain:
        plain.run_sync("Capital of France?")
        plain.run_sync("And Italy?")
        assert plain.token_ids == tokens


def test_honest_pair_without_early_transfer_the_next_step_takes_the_turns_pin() -> None:
    engine = HonestPairEngine(_respond)
    with Session(engine=engine, early_transfer=False) as session:
        session.run_sync("Capital of France?")
        after = session.run_sync("And Italy?")
    assert not _of(engine, "prefetch") and after.stats.early_transfers == 0
    assert after.steps[0].stats.handle_forwarded and after.steps[0].stats.pulled_tokens > 0
    engine.assert_honest()


def test_honest_pair_no_early_transfer_in_a_mode_without_push_back() -> None:
    engine = HonestPairEngine(_respond)
    with Session(engine=engine, mode="disaggregated") as session:
        session.run_sync("Capital of France?")
        session.run_sync("And Italy?")
    assert not _of(engine, "prefetch") and not _of(engine, "renew")
    engine.assert_honest()


def test_honest_pair_a_turn_during_the_prefetch_waits_for_it_and_takes_its_pin() -> None:
    engine = StalledUpkeep("prefetch", stall_s=1.0)
    with Session(engine=engine, early_transfer=True) as session:
        session.run_sync("Capital of France?")
        started = time.perf_counter()
        after = session.run_sync("And Italy?")  # the prefetch runs (stalled): the turn waits for it
        waited = time.perf_counter() - started
    assert _of(engine, "prefetch")[0].outcome == "done" and waited > 0.5
    step = after.steps[0].stats
    assert step.handle_forwarded and step.pulled_tokens > 0 and step.miss_reason is None
    assert after.stats.early_transfers == 1
    engine.assert_honest()


def test_honest_pair_closing_during_the_prefetch_cancels_it_quietly() -> None:
    engine = StalledUpkeep("prefetch", stall_s=5.0)  # turn 2 waits for the first prefetch: keep it short
    with engine, Session(engine=engine, early_transfer=True) as session:
        session.run_sync("Capital of France?")
        _wait_for(lambda: any(r.outcome == "running" for r in _of(engine, "prefetch")))
        started = time.perf_counter()
        session.close()
        assert time.perf_counter() - started < 5.0
        _wait_for(lambda: _of(engine, "prefetch")[0].outcome == "cancelled")
        assert session.pinned_tokens == 0
    engine.assert_honest()


@pytest.mark.parametrize("edit", ["rewind", "replace"])
def test_honest_pair_an_edit_during_the_prefetch_cancels_it(edit: str) -> None:
    engine = StalledUpkeep("prefetch", stall_s=5.0)  # turn 2 waits for the first prefetch: keep it short
    with Session(engine=engine, early_transfer=True) as session:
        session.run_sync("Capital of France?")
        session.run_sync("And Italy?")
        _wait_for(lambda: any(r.outcome == "running" for r in _of(engine, "prefetch")[1:]))
        if edit == "rewind":
            session.rewind()
        else:
            session.replace_message(1, "Capital of Spain?")
        _wait_for(lambda: _of(engine, "prefetch")[1].outcome == "cancelled")
        assert session.pinned_tokens == 0
        after = session.run_sync("And Spain?")
    assert not after.steps[0].stats.handle_forwarded and after.stats.early_transfers == 0
    engine.assert_honest()


@pytest.mark.parametrize("fault", ["error", "error_mid_stream"])
def test_honest_pair_a_failed_prefetch_drops_the_pin_quietly_and_the_next_step_recomputes(fault: Fault) -> None:
    engine = StalledUpkeep("prefetch", fault)
    with Session(engine=engine, early_transfer=True) as session:
        session.run_sync("Capital of France?")
        _wait_for(lambda: bool(_of(engine, "prefetch")) and _of(engine, "prefetch")[0].outcome == "error")
        _wait_for(lambda: session.pinned_tokens == 0)
        after = session.run_sync("And Italy?")
    step = after.steps[0].stats
    assert step.miss_reason == "no_handle" and not step.handle_forwarded and after.text
    assert after.stats.early_transfers == 0 and _turn_steps(engine)[1].outcome == "done"
    engine.assert_honest()


def test_honest_pair_a_pause_after_the_prefetch_renews_its_pin_from_ds_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefetch's pin holds the conversation's tokens exactly (no prompt strictly extends it): its renewal goes
    with no pin, on D alone, and releases it; the step after a pause longer than the TTL pulls the renewed pin."""
    monkeypatch.setattr(_pin_upkeep, "RENEW_LEAD_S", 0.3)
    engine = HonestPairEngine(_respond, pin_ttl_s=2.0)
    with Session(engine=engine, expiry_margin_s=0.2, early_transfer=True) as session:
        session.run_sync("Capital of France?")
        time.sleep(2.6)  # longer than the TTL: the prefetch's pin would have expired
        after = session.run_sync("And Italy?")
    (prefetch, *_) = _of(engine, "prefetch")
    renewals = _of(engine, "renew")
    assert prefetch.forwarded and renewals and all(not r.forwarded and r.placement == "decode" for r in renewals)
    assert engine.released >= len(renewals)  # each renewal released the pin it replaced
    step = after.steps[0].stats
    assert step.handle_forwarded and step.pulled_tokens > 0 and step.miss_reason is None
    assert after.stats.early_transfers == 1 and after.stats.pin_renewals == len(renewals)
    engine.assert_honest()


def _long_answer(request: StepRequest) -> str:
    return "The capital is Paris, a city on the Seine with many bridges, museums and cafes. " * 2


@pytest.mark.parametrize("early_transfer", [True, False])
def test_honest_pair_with_ps_cache_the_step_after_the_prefetch_pulls_at_most_a_partial_block(
    early_transfer: bool,
) -> None:
    engine = HonestPairEngine(_long_answer, prefill_cache=True)
    with Session(engine=engine, early_transfer=early_transfer) as session:
        first = session.run_sync("Capital of France?")
        if early_transfer:
            _wait_for(lambda: session.pinned_tokens == len(session.token_ids))
        after = session.run_sync("And Italy?")
    output = first.steps[0].stats.output_tokens
    step = after.steps[0].stats
    assert step.handle_forwarded and step.miss_reason is None
    if early_transfer:  # P pulled the previous output before the turn: now at most the partial last block
        assert step.pulled_tokens < BLOCK_SIZE and step.local_hit_tokens > output
        assert _of(engine, "prefetch")[0].pulled_tokens >= output - BLOCK_SIZE
    else:  # on the critical path: at least the previous output but its last token
        assert step.pulled_tokens >= output - 1
    engine.assert_honest()
