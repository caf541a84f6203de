"""Fault injection: engine processes that die or stall mid-step, reads P declines, pins that expire.

Each fault ends in a clear agentkv error or a transparent recompute, the session stays usable
(or is clearly closed), and no process is left. The randomized counterpart on the honest double
is tests/test_random_sessions.py; a launched pair's server restart is in tests/test_launched.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentkv import EmbeddedPair, EngineDeadError, EngineError, LifecycleState, Session, TextDelta
from agentkv._engines._handle import handle_of, pin_of
from agentkv._engines._pair_layer import run_warmup_steps
from agentkv._engines._pinning import HeldPin
from agentkv._engines._system import alive
from agentkv.testing import HonestPairEngine
from freed import assert_ports_freed, running_pids
from test_lifecycle import _engine_core_pid
from test_pair import QUESTIONS, SYSTEM, _assert_invariant

MAX_TOKENS = 8


# ----------------------------------------------------------------- on the honest double (unit tier)


@pytest.mark.anyio
async def test_the_warm_up_obeys_the_push_back_rule(model_path: Path) -> None:
    """The warm-up's second step pushes the first one's handle back with a prompt that extends what D holds."""
    async with HonestPairEngine(model_path=model_path) as engine:
        await run_warmup_steps(engine, push_back=True)
        engine.assert_honest()
        assert [step.forwarded for step in engine.steps] == [False, True]
        assert not engine.steps[1].declined
        assert engine.live_pins == 0  # nothing of the warm-up stays pinned on D


@pytest.mark.anyio
async def test_a_cancelled_scope_still_closes_the_sessions_own_engine(model_path: Path) -> None:
    """``move_on_after`` around ``async with Session(...)``: the engine the session opened is stopped."""
    engine = HonestPairEngine(model_path=model_path)
    with anyio.CancelScope() as scope:
        async with Session(engine=engine) as session:
            await session.run("hello")
            scope.cancel()
            await anyio.sleep(10)
    assert scope.cancelled_caught
    assert engine.state is LifecycleState.CLOSED and engine.stopped
    assert engine.live_pins == 0  # the session released its pin on the way out


@pytest.mark.anyio
async def test_a_cancelled_scope_during_a_turn_releases_its_pin(model_path: Path) -> None:
    async with HonestPairEngine(model_path=model_path) as engine, Session(engine=engine) as session:
        await session.run("hello")
        before = session.token_ids
        engine.inject("stall")
        with anyio.move_on_after(0.05):
            await session.run("and then?")
        assert session.token_ids == before
        assert (await session.run("and then?")).steps[0].stats.miss_reason is not None  # no stale forward
    engine.assert_honest()
    assert engine.live_pins == 0


# ----------------------------------------------------------------- on the real pair


def _forge_pin(session: Session, *, handle_expires_in_s: float, session_deadline_in_s: float) -> None:
    """Make the session's pin expire (as P sees it: the handle; as the session sees it: `Pin.expires_at`)."""
    held = session._pin
    assert held is not None, "the session holds no pin"
    now = time.perf_counter()
    handle = handle_of(held.pin).model_copy(update={"remote_blocks_expiry_time": now + handle_expires_in_s})
    session._pin = HeldPin(pin_of(handle, deadline=now + session_deadline_in_s), held.token_ids)


@pytest.mark.pair
def test_a_declined_read_and_an_expired_pin_recompute_transparently(pair: EmbeddedPair) -> None:
    with Session(engine=pair, system=SYSTEM, max_tokens=MAX_TOKENS, cache_salt="faults-declined") as session:
        session.run_sync(QUESTIONS[0])
        # P declines a read within 5 s of the pin's expiry; the session thinks it has 1000 s left.
        _forge_pin(session, handle_expires_in_s=2.0, session_deadline_in_s=1000.0)
        declined = session.run_sync(QUESTIONS[1])
        step = declined.steps[0].stats
        _assert_invariant(step)
        assert declined.text
        assert step.handle_forwarded and step.miss_reason == "declined" and step.pulled_tokens == 0

        pulled = session.run_sync(QUESTIONS[2]).steps[0].stats  # push-back resumes with the new pin
        assert pulled.handle_forwarded and pulled.miss_reason is None and pulled.pulled_tokens > 0

        # A pin the session sees as expired is not pushed back: P computes, nothing breaks.
        _forge_pin(session, handle_expires_in_s=1000.0, session_deadline_in_s=1.0)
        expired = session.run_sync("And f9?").steps[0].stats
        _assert_invariant(expired)
        assert not expired.handle_forwarded and expired.miss_reason == "expired" and expired.pulled_tokens == 0
        again = session.run_sync("And f11?").steps[0].stats
        assert again.handle_forwarded and again.pulled_tokens > 0
    assert [m.role for m in session.messages].count("assistant") == 5


@contextlib.contextmanager
def _stopped(pids: Iterable[int]) -> Iterator[None]:
    """SIGSTOP the processes for the block (a stalled engine), SIGCONT them after."""
    stopped = alive(pids)
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in alive(stopped):
            os.kill(pid, signal.SIGCONT)


def _wait_gone(pids: set[int], timeout_s: float = 30.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


def _killing_generate(engine: Any) -> Callable[..., AsyncIterator[Any]]:
    """A `generate` for P's engine that SIGKILLs P's engine core as the step's prefill is submitted."""
    original = engine.generate
    core = _engine_core_pid(engine.pids)

    def generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        outputs = original(*args, **kwargs)
        if alive({core}):
            os.kill(core, signal.SIGKILL)
        return outputs  # type: ignore[no-any-return]

    return generate


@pytest.mark.pair
@pytest.mark.nightly
def test_stalled_and_dying_engines_fail_the_step_clearly_and_the_session_goes_on(
    pair: EmbeddedPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session that owns its pair, beside the shared one: P stalls (EngineError after step_timeout_s), P dies
    mid-prefill and D dies mid-step (EngineDeadError, the pair's processes all stopped); the session starts a
    new pair on new ports. At the end the two pairs it opened left no process and no port behind, and the
    shared pair was never disturbed.

    One test, because each pair it starts costs about a minute: it also covers a second pair running beside
    the first. (Killed engines do leave file descriptors and a /dev/shm segment in this process, which
    engines closed in order do not: tests/test_leaks.py and the push pair's fixture in test_push_pair.py
    check those; docs/reliability.md lists the leak.)
    """
    running_before = running_pids()
    options = {"max_model_len": 1024, "pin_ttl_s": 30.0, "warmup": False, "step_timeout_s": 10.0}
    with Session(system=SYSTEM, max_tokens=MAX_TOKENS, engine_options=options) as session:
        session.run_sync(QUESTIONS[0])
        first = session.engine
        assert isinstance(first, EmbeddedPair) and first._p is not None
        first_pids, ports = first.pids, set(first.ports)
        assert not ports & set(pair.ports) and not first_pids & pair.pids  # a second pair: its own ports, processes
        assert session.run_sync(QUESTIONS[1]).steps[0].stats.pulled_tokens > 0  # and it pushes back

        # P stalls: the step fails with EngineError once no progress came for step_timeout_s.
        before = session.messages
        with _stopped(first._p.pids), pytest.raises(EngineError):
            session.run_sync(QUESTIONS[1])
        assert session.messages == before
        resumed = session.run_sync(QUESTIONS[1])  # P runs again: the session goes on
        assert resumed.text
        if session.engine is first:  # the pair survived the stall: its transfer records were released
            assert resumed.steps[0].stats.kv_bytes is not None and resumed.steps[0].stats.kv_bytes > 0

        # P dies with a prefill in flight.
        dead = session.engine
        assert isinstance(dead, EmbeddedPair) and dead._p is not None
        first_pids |= dead.pids
        ports |= set(dead.ports)
        monkeypatch.setattr(dead._p, "generate", _killing_generate(dead._p))
        before = session.messages
        with pytest.raises(EngineDeadError):
            session.run_sync(QUESTIONS[2])
        assert session.messages == before
        assert _wait_gone(first_pids) == set()  # the dead pair's other processes were stopped too

        # The session replaces the pair it owns; the conversation goes on.
        again = session.run_sync(QUESTIONS[2])
        second = session.engine
        assert again.text and second is not dead and isinstance(second, EmbeddedPair) and second._d is not None
        assert [m.role for m in session.messages][-2:] == ["user", "assistant"]
        assert not set(second.ports) & ports  # the new pair took new ports

        # D dies mid-step, after its first token.
        d_core = _engine_core_pid(second._d.pids)
        second_pids = second.pids
        ports |= set(second.ports)

        def kill_d(event: object) -> None:
            if isinstance(event, TextDelta) and alive({d_core}):
                os.kill(d_core, signal.SIGKILL)

        before = session.messages
        with pytest.raises(EngineDeadError):
            session.run_sync("And f5?", on_event=kill_d)
        assert session.messages == before
        assert _wait_gone(second_pids) == set()
    assert_ports_freed(ports, running_before=running_before)
    with Session(engine=pair, system=SYSTEM, max_tokens=4) as shared:  # the shared pair still serves
        assert shared.run_sync(QUESTIONS[0]).text
