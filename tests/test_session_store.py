"""Sessions saved and resumed: `Session.snapshot` / `restore`, and `SessionPool(store=...)` across a restart (a
new pool on a new engine, the same store), each store case on a SQLite file and on a PostgreSQL server
(tests/postgres_server.py: one for the module, started only when a PostgreSQL case runs); store arguments that
are neither a SQLite file's path nor a PostgreSQL URL (given to the stores, the pool or ``agentkv serve
--store``) refused.

Logic on `HonestPairEngine`, which checks every pushed-back handle; no model runs here.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentkv import (
    PostgresSessionStore,
    Session,
    SessionPool,
    SessionSnapshot,
    SessionStore,
    SqliteSessionStore,
    UserError,
    tool,
)
from agentkv._session._session_store import conversation_key
from agentkv._surfaces._cli import main
from agentkv.serve import SqliteResponseStore
from agentkv.testing import HonestPairEngine
from postgres_server import PostgresServer, postgres_server


def answer(request: Any) -> str:
    return "Sure: forty-two, as far as I can tell."


@tool
def add_numbers(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


MakeStore = Callable[..., SessionStore]


@pytest.fixture(params=["sqlite", "postgresql"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeStore]:
    """Opens the test's session store (a SQLite file; or a PostgreSQL database, emptied first) with the options
    given; each is closed after the test."""
    server: PostgresServer | None = None
    if request.param == "postgresql":
        server = request.getfixturevalue("postgres")
        server.reset()
    with contextlib.ExitStack() as opened:

        def make(**options: Any) -> SessionStore:
            if server is None:
                return opened.enter_context(SqliteSessionStore(tmp_path / "serve.sqlite3", **options))
            return opened.enter_context(PostgresSessionStore(server.url, **options))

        yield make


@pytest.fixture
def store(make_store: MakeStore) -> SessionStore:
    return make_store()


def on_the_table(store: SessionStore, sql: str, *parameters: object) -> list[tuple[Any, ...]]:
    """A statement on the store's table (``{sessions}`` in ``sql``; ``?`` for each parameter), run on a connection
    of the test's own; the rows it returned."""
    if isinstance(store, SqliteSessionStore):
        with contextlib.closing(sqlite3.connect(store.path)) as db, db:
            return db.execute(sql.format(sessions="sessions"), parameters).fetchall()
    import psycopg

    assert isinstance(store, PostgresSessionStore)
    with psycopg.connect(store.url) as db:
        cursor = db.execute(sql.format(sessions="agentkv_sessions").replace("?", "%s"), parameters)  # type: ignore[arg-type]
        return cursor.fetchall() if cursor.description is not None else []


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def said(reply: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": reply.text}


def test_a_restored_session_extends_the_saved_tokens_and_says_resumed() -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, user("One?")]
    with HonestPairEngine(answer) as first_engine, Session(engine=first_engine) as first:
        messages.append(said(first.step_sync(messages)))
        messages.append(user("Two?"))
        messages.append(said(first.step_sync(messages)))
        snapshot = SessionSnapshot.model_validate_json(first.snapshot().model_dump_json())  # through JSON
        saved_stats = first.stats
    assert snapshot.tokens and len(snapshot.turns) == 2
    messages.append(user("Three?"))
    with HonestPairEngine(answer) as second_engine, Session(engine=second_engine) as second:
        second.restore(snapshot)
        assert second.token_ids == snapshot.tokens and second.stats == saved_stats
        third = second.step_sync(messages)
        assert third.stats.miss_reason == "resumed" and not third.stats.handle_forwarded
        assert third.stats.turn == 3 and third.stats.computed_tokens == third.stats.prompt_tokens
        assert second.token_ids[: len(snapshot.tokens)] == snapshot.tokens  # extended, never re-tokenized
        messages.append(said(third))
        messages.append(user("Four?"))
        fourth = second.step_sync(messages)
        assert fourth.stats.handle_forwarded and fourth.stats.miss_reason is None
    second_engine.assert_honest()


def test_restore_refuses_another_models_snapshot_and_a_running_session() -> None:
    with HonestPairEngine(answer) as engine, Session(engine=engine) as session:
        session.step_sync([user("Hi")])
        snapshot = session.snapshot()
        with pytest.raises(UserError, match="made on model 'elsewhere'"):
            session.restore(snapshot.model_copy(update={"model": "elsewhere"}))
        broken = snapshot.model_copy(update={"tokens": snapshot.tokens[:-3]})
        with pytest.raises(UserError, match="do not fit"):
            session.restore(broken)
        assert session.token_ids == snapshot.tokens  # a refused restore changed nothing


def test_restore_of_what_is_not_a_snapshot_is_a_user_error_naming_what_it_takes() -> None:
    with HonestPairEngine(answer) as engine, Session(engine=engine) as session:
        session.step_sync([user("Hi")])
        snapshot, tokens = session.snapshot(), session.token_ids
        for wrong in (snapshot.model_dump(), snapshot.model_dump_json(), None):
            with pytest.raises(UserError, match="restore takes a SessionSnapshot"):
                session.restore(wrong)  # type: ignore[arg-type]
        assert session.token_ids == tokens  # nothing changed
        session.restore(SessionSnapshot.model_validate_json(snapshot.model_dump_json()))  # how a saved one comes back


def test_only_the_first_step_after_a_restore_says_resumed() -> None:
    """A turn of `Session.run` after a restore: its first step has no pin (``resumed``); a later step of that turn
    that has none (the first step's pin came back malformed and was dropped) says ``no_handle``, as anywhere."""
    outputs = iter(['{"tool_calls": [{"name": "add_numbers", "arguments": {"a": 1, "b": 2}}]}', '{"answer": "3"}'] * 2)
    with (
        HonestPairEngine(lambda request: next(outputs)) as engine,
        Session(engine=engine, tools=[add_numbers], tool_choice="required") as session,
    ):
        session.run_sync("1 + 2?")
        snapshot = session.snapshot()
        session.restore(snapshot)
        engine.inject("malformed_handle")  # the first step's pin never reaches the session
        result = session.run_sync("Again: 1 + 2?")
    assert [s.stats.miss_reason for s in result.steps] == ["resumed", "no_handle"]
    engine.assert_honest()


def test_an_empty_sessions_snapshot_restores_an_empty_session() -> None:
    with (
        HonestPairEngine(answer) as engine,
        Session(engine=engine, system="Be brief.") as empty,
        Session(engine=engine) as busy,
    ):
        snapshot = SessionSnapshot.model_validate_json(empty.snapshot().model_dump_json())  # through JSON
        assert snapshot.tokens == [] and snapshot.segments == [] and snapshot.turns == []
        empty.restore(snapshot)  # onto itself: still empty
        assert empty.token_ids == [] and empty.stats.turns == []
        busy.step_sync([user("One?")])
        busy.restore(snapshot)  # onto a session with a turn: emptied
        assert busy.token_ids == [] and busy.messages == empty.messages and busy.stats.turns == []
        with pytest.raises(UserError, match="do not fit"):
            busy.restore(snapshot.model_copy(update={"tokens": [1, 2]}))  # tokens without the segments they render
        assert busy.token_ids == []
        again = busy.step_sync([user("Two?")])  # usable: a new first turn
        assert again.stats.turn == 1 and again.stats.miss_reason == "resumed" and len(busy.stats.turns) == 1
    engine.assert_honest()


@pytest.mark.parametrize("url", ["mysql://root@127.0.0.1:3306/agents", "sqlite:///srv/serve.sqlite3"])
def test_a_store_url_is_refused_naming_its_scheme(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    scheme = url.split(":")[0]
    for make in (SqliteSessionStore, SqliteResponseStore, lambda store: SessionPool(store=store)):
        with pytest.raises(UserError, match=f"'{re.escape(url)}' is a {scheme}:// URL.*SQLite file's path"):
            make(url)
    for postgres in ("postgresql://db.example/agents", "postgres://db.example/agents"):  # not a SQLite store's
        with pytest.raises(
            UserError, match="is a postgres(ql)?:// URL, not a SQLite file's path: PostgresSessionStore"
        ):
            SqliteSessionStore(postgres)
    assert list(tmp_path.iterdir()) == []  # no folder named after the URL
    with pytest.raises(UserError, match="SqliteSessionStore"):
        SessionPool(store=str(tmp_path / "s.sqlite3"))  # type: ignore[arg-type]  # a path is not a store
    with SqliteSessionStore(str(tmp_path / "kept" / "s.sqlite3")) as kept:  # a path is taken as it is
        assert kept.path == tmp_path / "kept" / "s.sqlite3" and kept.path.exists()


def test_serve_refuses_a_store_url_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)  # the command sets it; put back after the test
    assert main(["serve", "--store", "mysql://root@127.0.0.1:3306/agents"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("agentkv serve: error: the store 'mysql://") and "mysql:// URL" in error
    assert "SQLite file's path" in error and "'memory'" in error
    assert list(tmp_path.iterdir()) == []  # no SQLite file under ./mysql:/...


def test_a_named_conversation_resumes_from_the_store_after_a_restart(store: SessionStore) -> None:
    messages: list[dict[str, Any]] = [user("One?")]
    with HonestPairEngine(answer) as engine, SessionPool(engine=engine, store=store) as pool:
        messages.append(said(pool.step_sync(messages, conversation_id="c1")))
        messages.append(user("Two?"))
        messages.append(said(pool.step_sync(messages, conversation_id="c1")))
        tokens = pool.sessions[0].token_ids
    messages.append(user("Three?"))
    with HonestPairEngine(answer) as restarted, SessionPool(engine=restarted, store=store) as pool:
        third = pool.step_sync(messages, conversation_id="c1")
        session = pool.session_for("c1")
        assert session is not None and session.token_ids[: len(tokens)] == tokens
        assert third.stats.miss_reason == "resumed" and third.stats.turn == 3
        assert [t.turn for t in session.stats.turns] == [1, 2, 3]
        messages.append(said(third))
        messages.append(user("Four?"))
        assert pool.step_sync(messages, conversation_id="c1").stats.handle_forwarded
        other = pool.step_sync([user("One?")], conversation_id="c2")  # never saved: a new conversation
        assert other.stats.miss_reason == "no_handle"
    restarted.assert_honest()


def test_an_unnamed_conversation_resumes_by_its_history(store: SessionStore) -> None:
    messages: list[dict[str, Any]] = [user("One?")]
    with HonestPairEngine(answer) as engine, SessionPool(engine=engine, store=store) as pool:
        messages.append(said(pool.step_sync(messages)))
        messages.append(user("Two?"))
        messages.append(said(pool.step_sync(messages)))
        tokens = pool.sessions[0].token_ids
    keys = [row[0] for row in on_the_table(store, "SELECT key FROM {sessions}")]
    assert len(keys) == 1 and keys[0].startswith(
        "default/history:"
    )  # the first step's key was replaced by the second's
    with HonestPairEngine(answer) as restarted, SessionPool(engine=restarted, store=store) as pool:
        third = pool.step_sync([*messages, user("Three?")])
        assert third.stats.miss_reason == "resumed"
        assert pool.sessions[0].token_ids[: len(tokens)] == tokens
        edited = [user("One, edited?"), *messages[1:], user("Three?")]
        assert pool.step_sync(edited).stats.miss_reason == "no_handle"  # no saved history fits: a new session
        assert len(pool.sessions) == 2


def test_a_session_closed_when_idle_resumes_from_the_store(store: SessionStore) -> None:
    with HonestPairEngine(answer) as engine, SessionPool(engine=engine, store=store, max_sessions=1) as pool:
        a: list[dict[str, Any]] = [user("About apples?")]
        a.append(said(pool.step_sync(a, conversation_id="a")))
        pool.step_sync([user("About boats?")], conversation_id="b")  # closes a (over max_sessions)
        assert pool.session_for("a") is None
        a.append(user("More?"))
        again = pool.step_sync(a, conversation_id="a")
        assert again.stats.miss_reason == "resumed" and again.stats.turn == 2
    engine.assert_honest()


def test_an_unreadable_row_is_rebuilt_from_the_messages(store: SessionStore) -> None:
    on_the_table(
        store, "INSERT INTO {sessions} (key, snapshot) VALUES (?, ?)", conversation_key("c1"), '{"version": 99}'
    )
    assert store.get(conversation_key("c1")) is None
    with HonestPairEngine(answer) as engine, SessionPool(engine=engine, store=store) as pool:
        reply = pool.step_sync(
            [user("One?"), {"role": "assistant", "content": "Yes."}, user("Two?")], conversation_id="c1"
        )
        assert reply.stats.miss_reason == "no_handle"
    assert store.get(conversation_key("c1")) is not None  # saved again, readable


def test_the_store_keeps_at_most_max_sessions(make_store: MakeStore) -> None:
    bounded = make_store(max_sessions=2)
    with HonestPairEngine(answer) as engine, SessionPool(engine=engine, store=bounded) as pool:
        for name in ("one", "two", "three"):
            pool.step_sync([user(name)], conversation_id=name)
        assert [bounded.get(conversation_key(n)) is not None for n in ("one", "two", "three")] == [False, True, True]
        pool.step_sync([user("two"), {"role": "assistant", "content": "Yes."}, user("more")], conversation_id="two")
        pool.step_sync([user("four")], conversation_id="four")  # drops three, the oldest written: two was rewritten
    assert [bounded.get(conversation_key(n)) is not None for n in ("two", "three", "four")] == [True, False, True]
    assert len(on_the_table(bounded, "SELECT key FROM {sessions}")) == 2
    with pytest.raises(UserError, match="max_sessions"):
        make_store(max_sessions=0)


def aged(store: SessionStore, seconds: float) -> None:
    """Make every snapshot of ``store`` ``seconds`` older (its write time moved back)."""
    if isinstance(store, SqliteSessionStore):
        on_the_table(store, "UPDATE {sessions} SET saved_at = saved_at - ?", seconds)
    else:
        on_the_table(store, "UPDATE {sessions} SET saved_at = saved_at - ? * interval '1 second'", seconds)


def test_a_snapshot_past_the_retention_is_neither_read_nor_kept(make_store: MakeStore) -> None:
    """``max_age_s`` (``agentkv serve --retention-s``): a snapshot written longer ago is not read (the conversation
    starts afresh), and the next save deletes it."""
    store = make_store(max_age_s=3600.0)
    with HonestPairEngine(answer) as engine, SessionPool(engine=engine, store=store) as pool:
        pool.step_sync([user("Old?")], conversation_id="old")
        assert store.get(conversation_key("old")) is not None
        aged(store, 7200.0)
        assert store.get(conversation_key("old")) is None
        pool.step_sync([user("New?")], conversation_id="new")
    assert [row[0] for row in on_the_table(store, "SELECT key FROM {sessions}")] == [conversation_key("new")]
    with pytest.raises(UserError, match="max_age_s must be None or a positive number"):
        make_store(max_age_s=0)


def test_each_tenants_snapshots_are_its_own(store: SessionStore) -> None:
    """The same name under two tenants is two snapshots; an unnamed conversation's digest is its tenant's too."""
    with HonestPairEngine(answer) as engine, SessionPool(engine=engine, store=store) as pool:
        pool.step_sync([user("Alice's")], conversation_id="c1", tenant="alice")
        pool.step_sync([user("Bob's")], conversation_id="c1", tenant="bob")
        pool.step_sync([user("Unnamed"), {"role": "assistant", "content": "Yes."}, user("More")], tenant="bob")
    keys = sorted(row[0] for row in on_the_table(store, "SELECT key FROM {sessions}"))
    assert keys[:2] == ["alice/conversation:c1", "bob/conversation:c1"] and keys[2].startswith("bob/history:")
    alices = store.get(conversation_key("c1", "alice"))
    assert alices is not None and "Alice's" in alices.model_dump_json()
    assert store.get(conversation_key("c1")) is None  # the default tenant has none


def test_a_file_of_the_layout_before_tenants_is_migrated_keeping_its_conversations(tmp_path: Path) -> None:
    """A sessions table of (key, snapshot) rows, as agentkv wrote it before tenants and retention, is migrated in
    place: its rows become the default tenant's, so a pool (or a door with no key) resumes them."""
    path = tmp_path / "serve.sqlite3"
    with SqliteSessionStore(tmp_path / "new.sqlite3") as fresh:
        with HonestPairEngine(answer) as engine, SessionPool(engine=engine, store=fresh) as pool:
            pool.step_sync([user("One?")], conversation_id="c1")
        snapshot = fresh.get(conversation_key("c1"))
    assert snapshot is not None
    with contextlib.closing(sqlite3.connect(path)) as old, old:
        old.execute("CREATE TABLE sessions (key TEXT PRIMARY KEY, snapshot TEXT NOT NULL)")
        old.execute("INSERT INTO sessions VALUES (?, ?)", ("conversation:c1", snapshot.model_dump_json()))
    with SqliteSessionStore(path) as store:
        assert store.get(conversation_key("c1")) == snapshot
        with HonestPairEngine(answer) as engine, SessionPool(engine=engine, store=store) as pool:
            reply = pool.step_sync(
                [user("One?"), {"role": "assistant", "content": answer(None)}, user("Two?")], conversation_id="c1"
            )
            assert reply.stats.miss_reason == "resumed" and reply.stats.turn == 2


def test_the_file_is_its_owners_alone(tmp_path: Path) -> None:
    """Created 0600 (conversations in plaintext), in a folder made 0700."""
    path = tmp_path / "home" / "serve.sqlite3"
    with SqliteSessionStore(path):
        pass
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
