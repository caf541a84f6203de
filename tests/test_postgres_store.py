"""The PostgreSQL stores (src/agentkv/_postgres.py) on a real server this module starts and stops
(tests/postgres_server.py): the responses' contract and bound, two doors on one database, the layout and its
version, a server that stops (503s within the store's timeout, nothing half-written, saving resumes when it is
back) or holds a lock, and the URL's way in (``agentkv serve --store postgresql://...``,
``SessionPool(store=url)``, psycopg missing). The sessions' contract runs on both stores in
tests/test_session_store.py. On engine doubles: no model runs here.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from agentkv import PostgresSessionStore, SessionBusyError, SessionPool, StoreUnavailableError, UserError
from agentkv._engines._system import free_port
from agentkv._postgres import _MIGRATIONS, SCHEMA_VERSION, shown_url
from agentkv._session._session_store import conversation_key
from agentkv._surfaces._cli import main
from agentkv.serve import FrontDoor, PostgresResponseStore, StoredResponse
from agentkv.testing import HonestPairEngine
from postgres_server import PostgresServer
from serve_cli import serve_with_doubles
from test_serve_responses import four_writers_on, kept
from test_store_faults import Chat, answer, resumed, stats, two_turns


@pytest.fixture
def server(postgres: PostgresServer) -> PostgresServer:
    return postgres


@pytest.fixture
def url(postgres_url: str) -> str:
    """The server's database, running and emptied."""
    return postgres_url


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def saved_turns(url: str, conversation: str) -> int:
    """How many turns the database holds for a named conversation (read by a store of the test's own)."""
    with PostgresSessionStore(url) as store:
        snapshot = store.get(conversation_key(conversation))
    assert snapshot is not None
    return len(snapshot.turns)


# ------------------------------------------------------------------ the contract


def test_the_response_store_keeps_deletes_and_bounds_what_it_is_given(url: str) -> None:
    with PostgresResponseStore(url, max_responses=50) as store:
        four_writers_on(store)
        assert store.delete("s-49") and store.get("s-49") is None
        assert not store.delete("s-49") and not store.delete("never")
    with PostgresResponseStore(url, max_responses=2) as bounded:
        bounded.put(kept("a", None, "1"))
        bounded.put(kept("b", None, "2"))
        bounded.put(kept("a", None, "3"))  # rewritten: now the newest
        bounded.put(kept("c", None, "4"))
        assert [bounded.get(r) for r in "abc"] == [kept("a", None, "3"), None, kept("c", None, "4")]
    with pytest.raises(UserError, match="max_responses"):
        PostgresResponseStore(url, max_responses=0)


def test_two_doors_on_one_database_continue_each_others_conversations(url: str) -> None:
    """A conversation saved by one pool (its own engine and store) resumes on another, token for token; each
    pool's responses store sees what the other kept."""
    messages: list[dict[str, Any]] = [user("One?")]
    with (
        PostgresSessionStore(url) as first_store,
        HonestPairEngine(answer) as first_engine,
        SessionPool(engine=first_engine, store=first_store) as first,
    ):
        for question in ("Two?", "Three?"):
            messages += [{"role": "assistant", "content": first.step_sync(messages, conversation_id="c1").text}]
            messages.append(user(question))
        tokens = first.sessions[0].token_ids
    with (
        PostgresSessionStore(url) as second_store,
        HonestPairEngine(answer) as second_engine,
        SessionPool(engine=second_engine, store=second_store) as second,
    ):
        third = second.step_sync(messages, conversation_id="c1")
        session = second.session_for("c1")
        assert session is not None and session.token_ids[: len(tokens)] == tokens
        assert third.stats.miss_reason == "resumed" and third.stats.turn == 3
        messages += [{"role": "assistant", "content": third.text}, user("Four?")]
        assert second.step_sync(messages, conversation_id="c1").stats.handle_forwarded
    second_engine.assert_honest()
    assert saved_turns(url, "c1") == 4
    with PostgresResponseStore(url) as one, PostgresResponseStore(url) as other:
        one.put(kept("r1", "c1", "x"))
        assert other.get("r1") == kept("r1", "c1", "x")


# ------------------------------------------------------------------ the layout


def test_a_fresh_database_gets_the_layout_once_whoever_opens_it(url: str) -> None:
    """Eight stores open a fresh database at once: each opens, the layout is made once (the advisory lock)."""
    opened: list[Any] = []
    failed: list[BaseException] = []

    def open_one(number: int) -> None:
        try:
            opened.append(PostgresSessionStore(url) if number % 2 else PostgresResponseStore(url))
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=open_one, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for store in opened:
        store.close()
    assert failed == [] and len(opened) == 8
    with psycopg.connect(url) as db:
        assert db.execute("SELECT version FROM agentkv_schema").fetchall() == [(SCHEMA_VERSION,)]
        tables = db.execute("SELECT tablename FROM pg_tables WHERE tablename LIKE 'agentkv_%' ORDER BY 1").fetchall()
    assert tables == [("agentkv_leases",), ("agentkv_responses",), ("agentkv_schema",), ("agentkv_sessions",)]


def test_an_older_layout_is_migrated_keeping_its_rows(url: str) -> None:
    """A database at layout version 1 (sessions and responses, no leases) is brought to this one at open."""
    with psycopg.connect(url) as db:
        db.execute("CREATE TABLE agentkv_schema (version integer NOT NULL)")
        for statement in _MIGRATIONS[0]:
            db.execute(statement)
        db.execute("INSERT INTO agentkv_schema (version) VALUES (1)")
        db.execute("INSERT INTO agentkv_responses (response_id, messages, response) VALUES ('r1', '[]', '{}')")
    with PostgresResponseStore(url) as store:
        assert store.get("r1") == StoredResponse("r1", None, (), {})
    with psycopg.connect(url) as db:
        assert db.execute("SELECT version FROM agentkv_schema").fetchall() == [(SCHEMA_VERSION,)]
        assert db.execute("SELECT count(*) FROM agentkv_leases").fetchone() == (0,)


def test_a_layout_before_tenants_is_migrated_its_rows_the_default_tenants(url: str) -> None:
    """Layout version 3 (no tenant in the keys, no write times): its sessions, responses and leases become the
    default tenant's, so a pool or a door with no key continues them; each row gets a write time."""
    with psycopg.connect(url) as db:
        db.execute("CREATE TABLE agentkv_schema (version integer NOT NULL)")
        for statements in _MIGRATIONS[:3]:
            for statement in statements:
                db.execute(statement)
        db.execute("INSERT INTO agentkv_schema (version) VALUES (3)")
        db.execute("INSERT INTO agentkv_responses (response_id, messages, response) VALUES ('r1', '[]', '{}')")
        db.execute("INSERT INTO agentkv_sessions (key, snapshot) VALUES ('conversation:c1', '{}')")
    with PostgresResponseStore(url) as store:
        assert store.get("r1") == StoredResponse("r1", None, (), {})
        assert store.get("r1", tenant="alice") is None
    with psycopg.connect(url) as db:
        assert db.execute("SELECT version FROM agentkv_schema").fetchall() == [(SCHEMA_VERSION,)]
        assert db.execute("SELECT key FROM agentkv_sessions").fetchall() == [(conversation_key("c1"),)]
        assert db.execute("SELECT count(*) FROM agentkv_responses WHERE saved_at <= now()").fetchone() == (1,)


def test_a_newer_layout_is_refused(url: str) -> None:
    with PostgresSessionStore(url):
        pass
    with psycopg.connect(url) as db:
        db.execute("UPDATE agentkv_schema SET version = %s", (SCHEMA_VERSION + 1,))
    newer = f"layout version {SCHEMA_VERSION + 1}, newer than this agentkv's \\({SCHEMA_VERSION}\\).*upgrade agentkv"
    for make in (PostgresSessionStore, PostgresResponseStore):
        with pytest.raises(UserError, match=newer):
            make(url)


# ------------------------------------------------------------------ faults


@contextlib.contextmanager
def door_on(url: str, *, timeout_s: float) -> Iterator[tuple[str, SessionPool]]:
    """The door, its pool and both stores on one database, as ``agentkv serve --store URL`` runs them."""
    with (
        PostgresSessionStore(url, timeout_s=timeout_s) as sessions,
        PostgresResponseStore(url, timeout_s=timeout_s) as responses,
        HonestPairEngine(answer) as engine,
        SessionPool(engine=engine, store=sessions, max_tokens=16) as pool,
        FrontDoor(pool, model_name="smol", port=free_port(), store=responses) as door,
    ):
        yield door.url, pool
    engine.assert_honest()


def refused(response: httpx.Response, url: str, why: str) -> None:
    """A 503 in OpenAI's error shape, with ``Retry-After``, saying what is wrong with the database but never its
    address (host, port: the log has them)."""
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["type"] == "service_unavailable" and error["code"] == "StoreUnavailableError"
    assert f"could not save to the store: {why}" in error["message"]
    assert "nothing of this call was kept" in error["message"]
    port = urllib.parse.urlsplit(url).port
    assert "127.0.0.1" not in response.text and str(port) not in response.text and "postgres" not in response.text


def test_a_stopped_server_gets_503s_and_saving_resumes_once_it_is_back(server: PostgresServer, url: str) -> None:
    """The server stops under a running door: each step is refused within the store's timeout, its conversation's
    last saved turn untouched (a named one's before it runs: its lease cannot be taken, and its live session is
    kept; an unnamed one's after, at its save, and its live session is closed); started again, saving goes on
    (the store's connection, lost with the server, is opened afresh), the unnamed conversation resumed from the
    store."""
    timeout_s = 1.0
    with door_on(url, timeout_s=timeout_s) as (door, pool):
        named, unnamed = Chat(door, "s1"), Chat(door)
        two_turns(named, unnamed)
        server.stop()
        try:
            for chat in (named, unnamed):
                started = time.monotonic()
                refused(chat.ask("Three?"), url, "the server could not be reached")
                assert time.monotonic() - started < timeout_s + 1.0  # the store's timeout, and the step
            assert pool.session_for("s1") is not None and len(pool.sessions) == 1  # the unnamed one's closed
        finally:
            server.start()
        assert saved_turns(url, "s1") == 2  # nothing of the refused turn
        assert stats(named.ask("Three?"))["handle_forwarded"]  # its live session, as it was
        resumed(unnamed.ask("Three?"), turn=3)
        for chat in (named, unnamed):
            assert stats(chat.ask("Four?"))["handle_forwarded"]
    assert saved_turns(url, "s1") == 4


def test_a_lock_held_elsewhere_is_a_timeout_within_the_stores_timeout(url: str) -> None:
    """Another session holds the sessions' table locked: a call is refused after the store's timeout (the
    server's statement_timeout), having changed nothing; released, the next call works."""
    timeout_s = 0.5
    with PostgresSessionStore(url, timeout_s=timeout_s) as store, psycopg.connect(url) as holder:
        with HonestPairEngine(answer) as engine, SessionPool(engine=engine, store=store) as pool:
            pool.step_sync([user("One?")], conversation_id="c1")
        saved = store.get(conversation_key("c1"))
        assert saved is not None
        holder.execute("LOCK TABLE agentkv_sessions IN ACCESS EXCLUSIVE MODE")  # until the holder commits
        for call in (lambda key: store.put(key, saved.model_copy(update={"turns": []})), store.get):
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="did not answer within 0.5 s") as raised:
                call(conversation_key("c1"))
            assert raised.value.reason == "timeout" and time.monotonic() - started < timeout_s + 1.0  # a busy CI
        holder.commit()
        assert store.get(conversation_key("c1")) == saved  # the refused put changed nothing


def test_a_password_is_never_shown(server: PostgresServer) -> None:
    port = free_port()  # nothing listens there
    secret = f"postgresql://postgres:s3cret@127.0.0.1:{port}/postgres?password=s3cret&sslmode=disable"
    with pytest.raises(StoreUnavailableError, match="the server could not be reached") as raised:
        PostgresSessionStore(secret, timeout_s=0.5)
    assert "s3cret" not in str(raised.value) and "s3cret" not in raised.value.path
    assert raised.value.reason == "unreachable"
    assert shown_url(secret) == f"postgresql://postgres:***@127.0.0.1:{port}/postgres?password=***&sslmode=disable"
    with PostgresSessionStore(server.url.replace("postgres@", "postgres:s3cret@")) as store:  # trust: taken
        assert store.url == server.url.replace("postgres@", "postgres:***@")


# ------------------------------------------------------------------ the URL's way in


def test_agentkv_serve_opens_both_stores_on_a_postgresql_url(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)  # the command sets it; put back after the test

    def serving(door: dict[str, Any]) -> None:
        door["store"].put(kept("r1", None, "x"))  # open while the door serves

    postgres = url.replace("postgresql://", "postgres://")  # libpq's other scheme
    argv = ["serve", "--store", postgres, "--store-timeout-s", "5"]
    code, pool, door = serve_with_doubles(monkeypatch, argv, while_serving=serving)
    assert code == 0
    assert isinstance(pool["store"], PostgresSessionStore) and isinstance(door["store"], PostgresResponseStore)
    assert pool["store"].timeout_s == door["store"].timeout_s == 5.0
    for store in (pool["store"], door["store"]):
        with pytest.raises(UserError, match="was closed"):
            store.get("r1")  # closed with the command
    with PostgresResponseStore(url) as responses:
        assert responses.get("r1") == kept("r1", None, "x")


def test_a_pool_given_a_url_opens_its_store_and_closes_it(url: str) -> None:
    with HonestPairEngine(answer) as engine, SessionPool(engine=engine, store=url) as pool:
        assert isinstance(pool.store, PostgresSessionStore)
        pool.step_sync([user("One?")], conversation_id="c1")
    with pytest.raises(UserError, match="was closed"):
        pool.store.get(conversation_key("c1"))
    assert saved_turns(url, "c1") == 1


def test_without_psycopg_a_url_says_how_to_install_it(
    url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg fails, as where it is not installed
    install = "needs psycopg: pip install 'agentkv-vllm\\[postgresql\\]'"
    for make in (PostgresSessionStore, PostgresResponseStore, lambda store: SessionPool(store=store)):
        with pytest.raises(UserError, match=install):
            make(url)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert main(["serve", "--store", url]) == 2
    assert "needs psycopg: pip install 'agentkv-vllm[postgresql]'" in capsys.readouterr().err


# ------------------------------------------------------------------ one owner at a time


def test_a_conversation_another_door_holds_is_busy_until_it_gives_it_back(url: str) -> None:
    """Door B's step of a conversation door A is stepping (A holds its lease) is a 409, as a busy session's;
    once A gives it back, B steps it. A's leases nest: given back at the last release."""
    key = conversation_key("c1")
    with PostgresSessionStore(url) as door_a, door_on(url, timeout_s=2.0) as (door_b, _pool):
        chat = Chat(door_b, "c1")
        door_a.lease(key)
        door_a.lease(key)  # a second step of A's, refused by A's pool as busy: nested
        busy = chat.ask("One?")
        assert busy.status_code == 409, busy.text
        assert busy.json()["error"]["code"] == "SessionBusyError"
        assert "conversation 'c1' is running a step on another door" in busy.json()["error"]["message"]
        door_a.release(key)
        assert chat.ask("One?").status_code == 409  # still A's
        door_a.release(key)
        assert stats(chat.ask("One?"))["turn"] == 1
        door_a.lease(key)  # B gave it back after its step
        door_a.release(key)
    assert saved_turns(url, "c1") == 1


def test_a_dead_doors_lease_expires_and_a_live_doors_is_renewed(url: str) -> None:
    key = conversation_key("c1")
    with PostgresSessionStore(url, lease_ttl_s=0.6) as other:
        live = PostgresSessionStore(url, lease_ttl_s=0.6)
        live.lease(key)
        time.sleep(1.5)  # over two lease times: renewed meanwhile
        with pytest.raises(SessionBusyError):
            other.lease(key)
        live.close()  # as a door that dies: no release, no renewal
        with pytest.raises(SessionBusyError):
            other.lease(key)
        time.sleep(0.8)
        other.lease(key)  # expired: taken over
        other.release(key)
    with psycopg.connect(url) as db:
        assert db.execute("SELECT count(*) FROM agentkv_leases").fetchone() == (0,)
