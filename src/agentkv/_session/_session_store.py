"""Where a `SessionPool` keeps its sessions' snapshots, so that conversations resume after a restart.

A snapshot is saved after every step, under the conversation's id when it has one, else under
a digest of the messages it holds (`history_key`: the next request of that conversation starts
with those messages, so it finds the snapshot again). A restored session extends the saved
token ids exactly and recomputes its KV once (its first step's ``miss_reason`` is ``resumed``).
"""

from __future__ import annotations

import hashlib
import json
from abc import abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .._conversation._conversation import Message
from .._errors import UserError
from .._postgres import PostgresTable, is_postgres_url
from .._sqlite import STORE_TIMEOUT_S, SqliteTable, Store, positive, store_path
from .._store_table import StoreTable
from ._snapshot import SessionSnapshot

__all__ = [
    "PostgresSessionStore",
    "SessionStore",
    "SqliteSessionStore",
    "check_session_store",
    "conversation_key",
    "history_key",
]


def conversation_key(conversation_id: str) -> str:
    """The store key of a named conversation."""
    return f"conversation:{conversation_id}"


def history_key(messages: Sequence[Message]) -> str:
    """The store key of an unnamed conversation: a digest of its messages (through the model's last answer)."""
    dumped = json.dumps([m.model_dump(mode="json") for m in messages], sort_keys=True, separators=(",", ":"))
    return "history:" + hashlib.sha256(dumped.encode()).hexdigest()


class SessionStore(Store):
    """Session snapshots by key. Implementations are safe to call from several threads."""

    @abstractmethod
    def get(self, key: str) -> SessionSnapshot | None:
        """The snapshot saved under ``key``, or None (never saved, dropped, or unreadable)."""

    @abstractmethod
    def put(self, key: str, snapshot: SessionSnapshot) -> None:
        """Save ``snapshot`` under ``key`` (replacing what was there). A store that cannot raises (`SqliteSessionStore`:
        `StoreUnavailableError`); the pool then does not answer the step it was saving."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Forget ``key`` (nothing happens when it is unknown)."""


def check_session_store(store: object) -> SessionStore | None:
    """``store`` as `SessionPool` takes it: a `SessionStore`, None, or a ``postgresql://`` URL (a
    `PostgresSessionStore` opened on it, which the pool closes); anything else is a `UserError` (a URL's names
    its scheme: `store_path`)."""
    if store is None or isinstance(store, SessionStore):
        return store
    if is_postgres_url(store):
        assert isinstance(store, str)
        return PostgresSessionStore(store)
    if isinstance(store, str | Path):
        path = str(store_path(store))
        raise UserError(f"store takes a SessionStore, not a path: SqliteSessionStore({path!r}) keeps snapshots there")
    raise UserError(f"store must be a SessionStore (e.g. SqliteSessionStore(path)), not {type(store).__name__}")


class _TableSessionStore(SessionStore):
    """Snapshots as JSON in a `StoreTable` of (key, snapshot) rows (a subclass opens it: ``_table``)."""

    _table: StoreTable[Any]

    def get(self, key: str) -> SessionSnapshot | None:
        row = self._table.fetch(key)
        if row is None:
            return None
        try:
            return SessionSnapshot.model_validate_json(str(row[0]))
        except ValidationError:  # written by another version: the conversation is rebuilt from its messages
            return None

    def put(self, key: str, snapshot: SessionSnapshot) -> None:
        self._table.save(key, snapshot.model_dump_json())

    def delete(self, key: str) -> None:
        self._table.remove(key)

    def close(self) -> None:
        self._table.close()


class SqliteSessionStore(_TableSessionStore):
    """Session snapshots in a table of one SQLite file, kept across restarts; the oldest dropped beyond ``max_sessions``.

    A call that cannot read or write the file (locked by another process past ``timeout_s``, full, read-only)
    raises `StoreUnavailableError` and keeps nothing; the next call tries again.

    Args:
        path: the database file (created, with its folder, if missing); ``agentkv serve`` shares it with its responses.
        max_sessions: the most snapshots kept.
        timeout_s: the most a call waits for the file's write lock (another process's) before it fails.
    """

    def __init__(self, path: str | Path, *, max_sessions: int = 100_000, timeout_s: float = STORE_TIMEOUT_S) -> None:
        columns, bound = ("key TEXT PRIMARY KEY", "snapshot TEXT NOT NULL"), positive("max_sessions", max_sessions)
        self._table = SqliteTable(path, table="sessions", columns=columns, max_rows=bound, timeout_s=timeout_s)
        self.path, self.timeout_s = self._table.path, self._table.timeout_s


class PostgresSessionStore(_TableSessionStore):
    """Session snapshots in a PostgreSQL database (its ``agentkv_sessions`` table: src/agentkv/_postgres.py
    says the layout), which several doors share: a conversation saved by one resumes on any; the oldest dropped
    beyond ``max_sessions``. Needs psycopg (``pip install 'agentkv[postgresql]'``).

    A call that cannot reach the server, or that it does not answer within ``timeout_s``, raises
    `StoreUnavailableError` and keeps nothing; the next call tries again (on a new connection after a lost one).

    Args:
        url: ``postgresql://user:password@host:port/database`` (libpq's URL; ``postgres://`` too).
        max_sessions: the most snapshots kept.
        timeout_s: the most a call waits for the calls ahead of it, then for the server (a connection
            attempt: whole seconds, at least 2).
    """

    def __init__(self, url: str, *, max_sessions: int = 100_000, timeout_s: float = STORE_TIMEOUT_S) -> None:
        bound = positive("max_sessions", max_sessions)
        self._table = PostgresTable(
            url, table="agentkv_sessions", columns=("key", "snapshot"), max_rows=bound, timeout_s=timeout_s
        )
        self.url: str = self._table.url
        """The database, its password hidden."""
        self.timeout_s = self._table.timeout_s
