"""Pins that outlive the agent's pause (src/agentkv/_session/_pin_upkeep.py; issue 30, point 4).

A `HonestPairEngine` with a short pin TTL stands in for the pair: it checks every pin given back (its own, unspent,
not expired, its exact tokens strictly extended by the prompt), so a renewal that broke the token-exact rule, reused
a pin or let one expire is a violation. The TTL (2 s), the session's expiry margin (0.2 s) and the renewal's lead
(0.3 s, patched) are short so that a pause longer than the TTL takes seconds: the renewal is due 1.5 s after a pin.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentkv import Session, SessionPool, SqliteSessionStore
from agentkv._session import _pin_upkeep as _renewal
from agentkv.testing import HonestPairEngine

TTL_S = 2.0
MARGIN_S = 0.2
PAUSE_S = TTL_S + 0.6
"""Longer than the TTL: without a renewal the pin has expired."""


@pytest.fixture(autouse=True)
def short_lead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_renewal, "RENEW_LEAD_S", 0.3)


def _engine(**options: Any) -> HonestPairEngine:
    return HonestPairEngine(pin_ttl_s=TTL_S, **options)


def _renewals(engine: HonestPairEngine) -> list[Any]:
    return [record for record in engine.steps if record.request_id.startswith("agentkv-renew-")]


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while not condition():
        assert time.perf_counter() < deadline, "timed out"
        time.sleep(0.01)


def test_a_pause_longer_than_the_ttl_pulls_the_renewed_pin_and_changes_no_answer() -> None:
    engine = _engine()
    with Session(engine=engine, expiry_margin_s=MARGIN_S, early_transfer=False) as session:
        session.run_sync("Capital of France?")
        time.sleep(PAUSE_S)
        after = session.run_sync("And Italy?")
        tokens, texts = session.token_ids, [m.content for m in session.messages]
    step = after.steps[0].stats
    assert step.handle_forwarded and step.pulled_tokens > 0 and step.miss_reason is None
    assert after.stats.pin_renewals >= 1 and session.stats.turns[0].pin_renewals == 0
    renewals = _renewals(engine)
    assert len(renewals) == after.stats.pin_renewals
    assert all(r.forwarded and not r.declined and len(r.output_token_ids) == 1 for r in renewals)
    engine.assert_honest()
    reference = HonestPairEngine()  # no pause, no renewal: the same conversation token for token
    with Session(engine=reference, expiry_margin_s=MARGIN_S, early_transfer=False) as plain:
        plain.run_sync("Capital of France?")
        plain.run_sync("And Italy?")
        assert plain.token_ids == tokens and [m.content for m in plain.messages] == texts


def test_without_renewals_the_pin_expires() -> None:
    engine = _engine()
    with Session(engine=engine, expiry_margin_s=MARGIN_S, renew_pins=False, early_transfer=False) as session:
        session.run_sync("Capital of France?")
        time.sleep(PAUSE_S)
        after = session.run_sync("And Italy?")
    step = after.steps[0].stats
    assert step.miss_reason == "expired" and not step.handle_forwarded and step.pulled_tokens == 0
    assert after.stats.pin_renewals == 0 and not _renewals(engine)
    engine.assert_honest()


def test_the_step_api_renews_between_a_turns_steps() -> None:
    """A caller-run tool longer than the TTL: the step after it, in the same turn, pulls."""
    engine = _engine()
    with Session(engine=engine, expiry_margin_s=MARGIN_S, early_transfer=False) as session:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Run the tests."}]
        reply = session.step_sync(messages)
        messages.append(reply.message.model_dump(exclude_none=True))
        time.sleep(PAUSE_S)
        messages.append({"role": "user", "content": "They passed."})
        again = session.step_sync(messages)
    assert again.stats.pulled_tokens > 0 and again.stats.miss_reason is None
    assert session.stats.turns[-1].pin_renewals >= 1
    engine.assert_honest()


def test_a_step_that_starts_during_a_renewal_waits_for_it_and_pulls() -> None:
    engine = _engine(stall_s=1.0)
    with Session(engine=engine, expiry_margin_s=MARGIN_S, early_transfer=False) as session:
        session.run_sync("Capital of France?")
        engine.inject("stall")  # played by the next step: the renewal, 1.5 s from now
        _wait_for(lambda: any(r.outcome == "running" for r in _renewals(engine)))
        started = time.perf_counter()
        after = session.run_sync("And Italy?")
        waited = time.perf_counter() - started
    renewal = _renewals(engine)[0]
    assert renewal.outcome == "done" and waited > 0.5  # the step waited for the stalled renewal
    step = after.steps[0].stats
    assert step.handle_forwarded and step.pulled_tokens > 0 and step.miss_reason is None
    assert after.stats.pin_renewals == 1
    engine.assert_honest()


@pytest.mark.anyio
async def test_closing_cancels_a_pending_renewal_and_leaves_no_task() -> None:
    async with _engine() as engine:
        tasks = asyncio.all_tasks()
        async with Session(engine=engine, expiry_margin_s=MARGIN_S, early_transfer=False) as session:
            await session.run("Capital of France?")
            assert session._upkeep._wake is not None  # scheduled, not yet due
        await asyncio.sleep(0.05)
        assert asyncio.all_tasks() <= tasks
        assert not _renewals(engine) and engine.live_pins == 0  # the pin was released at close
        engine.assert_honest()


def test_closing_during_a_renewal_cancels_it_quietly() -> None:
    engine = _engine(stall_s=30.0)
    with engine, Session(engine=engine, expiry_margin_s=MARGIN_S, early_transfer=False) as session:
        session.run_sync("Capital of France?")
        engine.inject("stall")
        _wait_for(lambda: any(r.outcome == "running" for r in _renewals(engine)))
        started = time.perf_counter()
        session.close()
        assert time.perf_counter() - started < 5.0
        _wait_for(lambda: _renewals(engine)[0].outcome == "cancelled")
        assert session.pinned_tokens == 0
    engine.assert_honest()


EDITS: dict[str, Callable[[Session], None]] = {
    "rewind": lambda session: session.rewind(),
    "replace": lambda session: session.replace_message(1, "Capital of Spain?"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edit_cancels_the_renewal(edit: str) -> None:
    engine = _engine()
    with Session(engine=engine, expiry_margin_s=MARGIN_S, early_transfer=False) as session:
        session.run_sync("Capital of France?")
        session.run_sync("And Italy?")
        EDITS[edit](session)
        time.sleep(PAUSE_S)
        assert not _renewals(engine) and engine.released == 1
        after = session.run_sync("And Spain?")
    assert not after.steps[0].stats.handle_forwarded
    engine.assert_honest()


def test_an_edit_during_a_renewal_cancels_it_and_releases_nothing_it_did_not_get() -> None:
    engine = _engine(stall_s=30.0)
    with Session(engine=engine, expiry_margin_s=MARGIN_S, early_transfer=False) as session:
        session.run_sync("Capital of France?")
        session.run_sync("And Italy?")
        engine.inject("stall")
        _wait_for(lambda: any(r.outcome == "running" for r in _renewals(engine)))
        session.rewind()
        _wait_for(lambda: _renewals(engine)[0].outcome == "cancelled")
        after = session.run_sync("And Spain?")
    assert not after.steps[0].stats.handle_forwarded and after.stats.pin_renewals == 0
    engine.assert_honest()


def test_a_failed_renewal_drops_the_pin_and_the_next_step_recomputes() -> None:
    engine = _engine()
    with Session(engine=engine, expiry_margin_s=MARGIN_S, early_transfer=False) as session:
        session.run_sync("Capital of France?")
        engine.inject("error")  # the renewal's step fails
        _wait_for(lambda: any(r.outcome == "error" for r in _renewals(engine)))
        _wait_for(lambda: session.pinned_tokens == 0)
        after = session.run_sync("And Italy?")
    step = after.steps[0].stats
    assert step.miss_reason == "no_handle" and not step.handle_forwarded and step.pulled_tokens == 0
    assert after.stats.pin_renewals == 0 and after.text
    engine.assert_honest()


def test_renewals_stop_after_the_idle_bound() -> None:
    engine = _engine()
    with Session(engine=engine, expiry_margin_s=MARGIN_S, renew_pins_for_s=1.0, early_transfer=False) as session:
        session.run_sync("Capital of France?")  # its renewal would be due after 1.5 s: past the bound
        time.sleep(PAUSE_S)
        after = session.run_sync("And Italy?")
    assert not _renewals(engine) and after.steps[0].stats.miss_reason == "expired"
    engine.assert_honest()


def test_a_pools_sessions_renew_their_pins(tmp_path: Path) -> None:
    """Whatever the store (one that offers pins to other doors takes each back first: tests/test_pins_travel.py)."""

    class OfferingStore(SqliteSessionStore):
        offers_pins = True

    engine = _engine()
    with SqliteSessionStore(tmp_path / "a.db") as plain, OfferingStore(tmp_path / "b.db") as offering:
        assert SessionPool(engine=engine, store=plain)._config.renew_pins
        assert SessionPool(engine=engine, store=offering, early_transfer=True)._config.early_transfer
    with SessionPool(engine=engine, expiry_margin_s=MARGIN_S, early_transfer=False) as pool:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Capital of France?"}]
        reply = pool.step_sync(messages, conversation_id="c1")
        messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "And Italy?"}]
        time.sleep(PAUSE_S)
        again = pool.step_sync(messages, conversation_id="c1")
    assert again.stats.pulled_tokens > 0 and again.stats.miss_reason is None
    engine.assert_honest()
