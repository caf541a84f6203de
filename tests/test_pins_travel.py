"""A conversation's pin travels with it between doors that share a PostgreSQL store and a decode server
(src/agentkv/_session/_pool.py, `SessionPool._member_for`; the store's side: src/agentkv/_postgres.py, "Pins").

Two pools stand for two doors, each with its own `PostgresSessionStore` on one real server
(tests/postgres_server.py) and its own `HonestPairEngine` on one shared D (``decode_of``): the double checks every
pin given back against D's record (single use, the exact tokens, never after its release) and every release (never
of a pin already read or released), so a door that pushed back a pin another door had used, or released one that
another door took, is a violation. Scripted engines: they test the pools' and the store's logic, not the KV.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any

import psycopg
import pytest

from agentkv import PostgresSessionStore, SessionPool, StepReply
from agentkv._session import _pin_upkeep
from agentkv._session._session_store import conversation_key
from agentkv.testing import HonestPairEngine


class Doors:
    """Two doors (pools) on one database and one D; `ask` sends a conversation's next turn to one of them."""

    def __init__(
        self, url: str, stack: ExitStack, *, lease_ttl_s: float = 30.0, pin_ttl_s: float = 3600.0, **options: Any
    ) -> None:
        first = HonestPairEngine(pin_ttl_s=pin_ttl_s)
        self.engines = [first, HonestPairEngine(decode_of=first, pin_ttl_s=pin_ttl_s)]
        self.stores = [stack.enter_context(PostgresSessionStore(url, lease_ttl_s=lease_ttl_s)) for _ in range(2)]
        self.pools = [
            stack.enter_context(SessionPool(engine=engine, store=store, **options))
            for engine, store in zip(self.engines, self.stores, strict=True)
        ]
        self.messages: dict[str, list[dict[str, Any]]] = {}

    def ask(self, door: int, conversation: str, text: str) -> StepReply:
        messages = self.messages.setdefault(conversation, [])
        messages.append({"role": "user", "content": text})
        reply = self.pools[door].step_sync(messages, conversation_id=conversation)
        messages.append({"role": "assistant", "content": reply.text})
        return reply

    def assert_honest(self) -> None:
        for engine in self.engines:
            engine.assert_honest()


def offered(url: str, conversation: str) -> str | None:
    """The id of the pin the conversation's row offers."""
    with psycopg.connect(url) as db:
        row = db.execute("SELECT pin_id FROM agentkv_sessions WHERE key = %s", (conversation_key(conversation),))
        found = row.fetchone()
    return None if found is None else found[0]


def pulled(reply: StepReply) -> bool:
    return reply.stats.handle_forwarded and reply.stats.pulled_tokens > 0 and reply.stats.miss_reason is None


def test_a_conversation_that_moves_between_doors_pulls_its_kv_back_on_each(postgres_url: str) -> None:
    """A -> B -> A: each move pushes back the pin the other door left (pulled, not recomputed); the door it comes
    back to drops its stale copy (its pin was used by the other door: not pushed back, not released); the
    answers are one door's."""
    with ExitStack() as stack:
        doors = Doors(postgres_url, stack)
        assert doors.ask(0, "c1", "One?").stats.miss_reason == "no_handle"
        assert pulled(doors.ask(0, "c1", "Two?"))
        assert offered(postgres_url, "c1") is not None
        moved = doors.ask(1, "c1", "Three?")
        assert pulled(moved) and moved.stats.turn == 3
        back = doors.ask(0, "c1", "Four?")
        assert pulled(back) and back.stats.turn == 4
        doors.assert_honest()
        tokens = doors.pools[0].sessions[0].token_ids
    with ExitStack() as stack:  # the same conversation on one door
        alone = Doors(postgres_url, stack)
        for text in ("One?", "Two?", "Three?", "Four?"):
            alone.ask(0, "c2", text)
        assert alone.pools[0].sessions[0].token_ids == tokens
    # closed: A's pin taken back off offer and released; B's stale copy's pin (A pulled it) left alone
    assert (doors.engines[0].released, doors.engines[1].released) == (1, 0)


def test_a_door_releases_only_a_pin_it_took_back_off_offer(postgres_url: str) -> None:
    """Door A's copy of c1 goes stale when B steps c1 (B took A's pin): A closing it releases nothing; B closing
    releases its own pin, taken off offer first, so a later door resumes without it (recomputes once)."""
    with ExitStack() as stack:
        doors = Doors(postgres_url, stack)
        doors.ask(0, "c1", "One?")
        doors.ask(1, "c1", "Two?")
        stack.close()  # both doors close: A's old pin is B's (used), B's is taken back and released
        doors.assert_honest()
        assert (doors.engines[0].released, doors.engines[1].released) == (0, 1)
    assert offered(postgres_url, "c1") is None
    with ExitStack() as stack:
        later = Doors(postgres_url, stack)
        later.messages["c1"] = doors.messages["c1"]
        assert later.ask(0, "c1", "Three?").stats.miss_reason == "resumed"
        later.assert_honest()


def test_a_pin_left_by_a_door_that_died_mid_step_is_never_pushed_back(postgres_url: str) -> None:
    """A door that dies holding the lease may have used the offered pin in a step it never saved: the door that
    takes the expired lease over takes the pin off offer and recomputes."""
    with ExitStack() as stack:
        doors = Doors(postgres_url, stack, lease_ttl_s=0.5)
        doors.ask(0, "c1", "One?")
        assert offered(postgres_url, "c1") is not None
        dead = PostgresSessionStore(postgres_url, lease_ttl_s=0.5)
        dead.lease(conversation_key("c1"))
        dead.close()  # as a door that dies mid-step: no release, no renewal
        time.sleep(0.8)
        taken_over = doors.ask(1, "c1", "Two?")
        assert taken_over.stats.miss_reason == "resumed" and not taken_over.stats.handle_forwarded
        assert offered(postgres_url, "c1") not in (None, "")  # B's own pin now
        assert pulled(doors.ask(0, "c1", "Three?"))
        doors.assert_honest()


def test_a_store_one_door_uses_offers_no_pin(tmp_path: Any) -> None:
    """SQLite's store keeps no pin (one door: nothing to hand over), and its pool sets no release guard."""
    from agentkv import SqliteSessionStore

    engine = HonestPairEngine()
    with SqliteSessionStore(tmp_path / "s.db") as store, SessionPool(engine=engine, store=store) as pool:
        pool.step_sync([{"role": "user", "content": "One?"}], conversation_id="c1")
        assert engine._guard is None and not store.offers_pins


def test_a_remote_pairs_pin_travels_by_wall_clock_and_only_to_the_same_decode_server() -> None:
    """`RemotePair.saved_pin` / `adopt_pin` (mapping level: no server): D's handle unchanged, its deadline moved
    from this process's clock to wall time and back; another D's pin, a push pair's, an expired one: not adopted."""
    from agentkv import RemotePair
    from agentkv._engines._handle import KVHandle, pin_of
    from agentkv._engines._http_capabilities import DecodeCapacity
    from test_handle import d_reply

    def pair(decode_url: str, **options: Any) -> RemotePair:
        made = RemotePair("http://p:8100", decode_url, **options)
        made._decode_capacity = DecodeCapacity(blocks=1000, block_size=16)
        return made

    deadline = time.perf_counter() + 120
    handle = KVHandle.model_validate(d_reply(remote_blocks_expiry_time=deadline))
    saved = pair("http://d:8200").saved_pin(pin_of(handle, deadline=deadline))
    assert saved is not None and saved.server == "http://d:8200" and saved.ref == handle.model_dump()
    assert abs(saved.expires_unix - (time.time() + 120)) < 0.5
    adopted = pair("http://d:8200").adopt_pin(saved)
    assert adopted is not None and adopted.ref == handle and adopted.tokens == 300
    assert abs(adopted.expires_at - deadline) < 0.5
    assert pair("http://elsewhere:8200").adopt_pin(saved) is None
    assert pair("http://d:8200", transfer="push").adopt_pin(saved) is None
    assert pair("http://d:8200").adopt_pin(saved.model_copy(update={"expires_unix": time.time() - 1})) is None


def test_a_closed_session_leaves_no_offer_behind_even_when_its_release_is_skipped(postgres_url: str) -> None:
    """A pair skips the release of a pin about to expire (the guard is not asked): closing the session still
    forgets the pin's entry, so a door that closes idle sessions after their pins expired does not grow."""
    with ExitStack() as stack:
        doors = Doors(postgres_url, stack)
        for name in ("c1", "c2"):
            doors.ask(0, name, "One?")
        pool, engine = doors.pools[0], doors.engines[0]
        assert len(pool._offered) == 2

        async def skipped(pin: Any) -> None:  # as PairLayer._release near a pin's expiry: nothing asked, nothing sent
            return None

        engine.release = skipped  # type: ignore[method-assign]
        pool.idle_ttl_s = 1e-9
        doors.ask(0, "c2", "Two?")  # the step's idle sweep closes c1
        assert pool.conversations == ["c2"] and len(pool._offered) == 1


def test_a_pin_another_door_took_and_did_not_save_is_never_pushed_back(postgres_url: str) -> None:
    """A -> B -> A where B's step is not saved (its store failed: B drops the conversation, whose pin, A's, it had
    taken off offer and pushed back): A's copy is not stale by the store's number, yet its pin is used. The lease
    tells (no pin came off offer): A keeps its session, drops the pin (not released: the guard finds it off offer)
    and recomputes once, never pushing back a used pin; its next step pulls again."""
    from agentkv import StoreUnavailableError

    with ExitStack() as stack:
        doors = Doors(postgres_url, stack)
        doors.ask(0, "c1", "One?")
        assert offered(postgres_url, "c1") is not None

        def down(*_: Any, **__: Any) -> None:
            raise StoreUnavailableError("the store is down", path="postgresql://test", reason="down")

        doors.stores[1].put = down  # type: ignore[method-assign]
        try:
            doors.ask(1, "c1", "Two?")
        except StoreUnavailableError:
            doors.messages["c1"].pop()  # not answered: the client asks again
        else:
            raise AssertionError("B's step was answered without being saved")
        assert offered(postgres_url, "c1") is None  # B took A's pin off offer and pushed it back
        again = doors.ask(0, "c1", "Two?")
        assert again.stats.miss_reason == "no_handle" and not again.stats.handle_forwarded
        assert pulled(doors.ask(0, "c1", "Three?"))
        doors.assert_honest()  # the dropped pin was neither pushed back nor released
        assert list(doors.pools[0]._offered) == [offered(postgres_url, "c1")]  # the guard's entry for it went too


TTL_S, MARGIN_S = 2.0, 0.2
"""Pins of 2 s and a margin of 0.2 s (tests/test_pin_renewal.py's): a renewal is due about 1.5 s after a pin."""


def renewals(engine: HonestPairEngine) -> int:
    return sum(record.request_id.startswith("agentkv-renew-") for record in engine.steps)


def test_a_pin_renewed_between_steps_is_offered_in_place_of_the_old(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pause longer than the pin's TTL on door A: A renews the pin (taking the old one off offer first) and
    offers the new one on the conversation's row, so door B, taking the lease, pulls the live pin."""
    monkeypatch.setattr(_pin_upkeep, "RENEW_LEAD_S", 0.3)
    with ExitStack() as stack:
        doors = Doors(postgres_url, stack, pin_ttl_s=TTL_S, expiry_margin_s=MARGIN_S)
        doors.ask(0, "c1", "One?")
        first = offered(postgres_url, "c1")
        time.sleep(TTL_S + 0.6)
        assert renewals(doors.engines[0]) >= 1
        renewed = offered(postgres_url, "c1")
        assert renewed not in (None, first)
        moved = doors.ask(1, "c1", "Two?")
        assert pulled(moved)
        doors.assert_honest()


def test_a_renewal_leaves_a_pin_another_door_took_off_offer(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Door B takes the conversation's lease (and so A's pin, off offer) before A's renewal is due: A's renewal
    finds its pin taken and is not made (no pin given back twice, none released that B holds); A's next step
    recomputes."""
    monkeypatch.setattr(_pin_upkeep, "RENEW_LEAD_S", 0.3)
    with ExitStack() as stack:
        doors = Doors(postgres_url, stack, pin_ttl_s=TTL_S, expiry_margin_s=MARGIN_S)
        doors.ask(0, "c1", "One?")
        key = conversation_key("c1")
        assert doors.stores[1].lease(key) is not None  # as a door that then steps it, slowly
        try:
            time.sleep(TTL_S + 0.6)
            assert renewals(doors.engines[0]) == 0 and offered(postgres_url, "c1") is None
        finally:
            doors.stores[1].release(key)
        again = doors.ask(0, "c1", "Two?")
        assert again.stats.miss_reason == "no_handle" and not again.stats.handle_forwarded
        doors.assert_honest()


@pytest.mark.upkeep
def test_the_early_transfers_pin_is_the_one_offered(postgres_url: str) -> None:
    """With the early transfer, a step's pin goes to P right after it (D pins anew): the door offers the new pin
    (the save's, or after it), and the next door pulls it."""
    with ExitStack() as stack:
        doors = Doors(postgres_url, stack, early_transfer=True)
        doors.ask(0, "c1", "One?")
        pool = doors.pools[0]
        deadline = time.monotonic() + 10
        while not any(r.request_id.startswith("agentkv-prefetch-") for r in doors.engines[0].steps):
            assert time.monotonic() < deadline, "no prefetch"
            time.sleep(0.01)
        deadline = time.monotonic() + 10
        while pool.sessions[0]._upkeep.renewing is not None or offered(postgres_url, "c1") is None:
            assert time.monotonic() < deadline, "the prefetched pin was not offered"
            time.sleep(0.01)
        moved = doors.ask(1, "c1", "Two?")
        assert pulled(moved)
        doors.assert_honest()


def test_a_pin_is_offered_between_saves_only_on_the_row_as_its_door_left_it(postgres_url: str) -> None:
    """`PostgresSessionStore.offer_pin` (the store's side of a renewal's offer): refused while the row offers a pin,
    once another save numbered it anew, and while another door's lease is live; made under no lease or one's own."""
    from agentkv._engines._base import SavedPin

    def pin(name: str) -> SavedPin:
        return SavedPin(id=name, server="http://d", tokens=1, expires_unix=time.time() + 60, ref={})

    key = conversation_key("c1")
    with ExitStack() as stack:
        doors = Doors(postgres_url, stack)
        doors.ask(0, "c1", "One?")
        door, other = doors.stores
        written, first = doors.pools[0]._members[0].written, offered(postgres_url, "c1")
        assert written is not None and first is not None
        assert not door.offer_pin(key, pin("p2"), written=written)  # the row offers a pin already
        assert door.take_pin_back(key, first)
        assert not door.offer_pin(key, pin("p2"), written=written + 1)  # another save since
        other.lease(key)
        try:
            assert not door.offer_pin(key, pin("p2"), written=written)  # another door may be stepping it
        finally:
            other.release(key)
        door.lease(key)
        try:
            assert door.offer_pin(key, pin("p2"), written=written) and offered(postgres_url, "c1") == "p2"
        finally:
            door.release(key)
        assert door.take_pin_back(key, "p2") and door.offer_pin(key, pin("p3"), written=written)
        assert offered(postgres_url, "c1") == "p3"
