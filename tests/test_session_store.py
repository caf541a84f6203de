"""Sessions saved and resumed: `Session.snapshot` / `restore`, and `SessionPool(store=SqliteSessionStore(...))`
across a restart (a new pool on a new engine, the same file); store arguments that are no SQLite file's path
(a URL given to the stores, the pool or ``agentkv serve --store``) refused.

Logic on `HonestPairEngine`, which checks every pushed-back handle; no model runs here.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentkv import Session, SessionPool, SessionSnapshot, SqliteSessionStore, UserError
from agentkv._surfaces._cli import main
from agentkv.serve import SqliteResponseStore
from agentkv.testing import HonestPairEngine


def answer(request: Any) -> str:
    return "Sure: forty-two, as far as I can tell."


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteSessionStore]:
    with SqliteSessionStore(tmp_path / "serve.sqlite3") as opened:
        yield opened  # type: ignore[misc]


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


@pytest.mark.parametrize("url", ["postgresql://postgres@127.0.0.1:55432/postgres", "sqlite:///srv/serve.sqlite3"])
def test_a_store_url_is_refused_naming_its_scheme(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    scheme = url.split(":")[0]
    for make in (SqliteSessionStore, SqliteResponseStore, lambda store: SessionPool(store=store)):
        with pytest.raises(UserError, match=f"'{re.escape(url)}' is a {scheme}:// URL.*SQLite file's path"):
            make(url)
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
    assert main(["serve", "--store", "postgresql://postgres@127.0.0.1:55432/postgres"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("agentkv serve: error: the store 'postgresql://") and "postgresql:// URL" in error
    assert "SQLite file's path" in error and "'memory'" in error
    assert list(tmp_path.iterdir()) == []  # no SQLite file under ./postgresql:/...


def test_a_named_conversation_resumes_from_the_store_after_a_restart(store: SqliteSessionStore) -> None:
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


def test_an_unnamed_conversation_resumes_by_its_history(store: SqliteSessionStore) -> None:
    messages: list[dict[str, Any]] = [user("One?")]
    with HonestPairEngine(answer) as engine, SessionPool(engine=engine, store=store) as pool:
        messages.append(said(pool.step_sync(messages)))
        messages.append(user("Two?"))
        messages.append(said(pool.step_sync(messages)))
        tokens = pool.sessions[0].token_ids
    keys = [row[0] for row in sqlite3.connect(store.path).execute("SELECT key FROM sessions")]
    assert len(keys) == 1 and keys[0].startswith("history:")  # the first step's key was replaced by the second's
    with HonestPairEngine(answer) as restarted, SessionPool(engine=restarted, store=store) as pool:
        third = pool.step_sync([*messages, user("Three?")])
        assert third.stats.miss_reason == "resumed"
        assert pool.sessions[0].token_ids[: len(tokens)] == tokens
        edited = [user("One, edited?"), *messages[1:], user("Three?")]
        assert pool.step_sync(edited).stats.miss_reason == "no_handle"  # no saved history fits: a new session
        assert len(pool.sessions) == 2


def test_a_session_closed_when_idle_resumes_from_the_store(store: SqliteSessionStore) -> None:
    with HonestPairEngine(answer) as engine, SessionPool(engine=engine, store=store, max_sessions=1) as pool:
        a: list[dict[str, Any]] = [user("About apples?")]
        a.append(said(pool.step_sync(a, conversation_id="a")))
        pool.step_sync([user("About boats?")], conversation_id="b")  # closes a (over max_sessions)
        assert pool.session_for("a") is None
        a.append(user("More?"))
        again = pool.step_sync(a, conversation_id="a")
        assert again.stats.miss_reason == "resumed" and again.stats.turn == 2
    engine.assert_honest()


def test_an_unreadable_row_is_rebuilt_from_the_messages(store: SqliteSessionStore) -> None:
    with sqlite3.connect(store.path) as db:
        db.execute("INSERT INTO sessions (key, snapshot) VALUES ('conversation:c1', '{\"version\": 99}')")
    assert store.get("conversation:c1") is None
    with HonestPairEngine(answer) as engine, SessionPool(engine=engine, store=store) as pool:
        reply = pool.step_sync(
            [user("One?"), {"role": "assistant", "content": "Yes."}, user("Two?")], conversation_id="c1"
        )
        assert reply.stats.miss_reason == "no_handle"
    assert store.get("conversation:c1") is not None  # saved again, readable


def test_the_store_keeps_at_most_max_sessions(tmp_path: Path) -> None:
    with SqliteSessionStore(tmp_path / "s.sqlite3", max_sessions=2) as bounded:
        with HonestPairEngine(answer) as engine, SessionPool(engine=engine, store=bounded) as pool:
            for name in ("one", "two", "three"):
                pool.step_sync([user(name)], conversation_id=name)
        assert [bounded.get(f"conversation:{n}") is not None for n in ("one", "two", "three")] == [False, True, True]
    with pytest.raises(UserError, match="max_sessions"):
        SqliteSessionStore(tmp_path / "t.sqlite3", max_sessions=0)
