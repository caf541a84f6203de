"""One SQLite file shared by the front door's stores: opened once per store, safe across threads, bounded; a
failing file (locked, full, read-only) is a `StoreUnavailableError` within a bounded time."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sqlite3
import time
from abc import ABC
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

from ._errors import StoreUnavailableError, UserError
from ._model import home_dir
from ._store_table import DEFAULT_TENANT, StoreTable

__all__ = [
    "STORE_TIMEOUT_S",
    "SqliteTable",
    "Store",
    "default_store_path",
    "fault_reason",
    "positive",
    "store_fault",
    "store_path",
    "store_timeout",
]

logger = logging.getLogger("agentkv")

_T = TypeVar("_T")

STORE_TIMEOUT_S = 2.0
"""How long a store's call waits for the file's write lock (another process's) before it fails; bounded so
that a locked file gets a quick 503, not a stalled door."""

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
"""A URL's scheme (two characters at least: ``C://`` is a Windows drive)."""


def default_store_path() -> Path:
    """Where ``agentkv serve`` keeps sessions and responses by default: ``$AGENTKV_HOME/serve.sqlite3``."""
    return home_dir() / "serve.sqlite3"


def store_path(path: str | Path) -> Path:
    """The SQLite file a store is kept in: ``path``, refused (a `UserError`) when it is a URL (a database
    server's ``postgresql://...`` would otherwise become a folder of that name): a PostgreSQL URL is the
    PostgreSQL stores' (src/agentkv/_postgres.py), any other agentkv cannot open."""
    found = _URL.match(path) if isinstance(path, str) else None
    if found is not None:
        scheme = found.group(1)
        if scheme.lower() in ("postgresql", "postgres"):
            raise UserError(
                f"the store {path!r} is a {scheme}:// URL, not a SQLite file's path: PostgresSessionStore(url) "
                f"and PostgresResponseStore(url) keep sessions and responses there (SessionPool(store=url) and "
                f"agentkv serve --store url open them)"
            )
        raise UserError(
            f"the store {path!r} is a {scheme}:// URL, which agentkv cannot open: a store is a SQLite file's path "
            f"(created if missing), e.g. ./serve.sqlite3, or a postgresql:// URL (agentkv serve --store also takes "
            f"'memory'); "
            f"write ./{path} for a file whose path really starts with {scheme}://"
        )
    return Path(path).expanduser()


def positive(name: str, value: int) -> int:
    """``value``, checked to be a positive int (a `UserError` naming ``name`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{name} must be a positive int, not {value!r}")
    return value


class Store(ABC):  # noqa: B024 (no abstract method of its own: the stores that derive from it have theirs)
    """What every store has: ``close`` (nothing to release by default) and ``with`` closing it."""

    def close(self) -> None:
        """Release what the store holds open (nothing by default)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SqliteTable(StoreTable[sqlite3.Connection]):
    """A connection to one table of a SQLite file (created with its folder), kept to ``max_rows`` rows and, with
    ``max_age_s``, to rows written within that many seconds.

    The file is created readable and writable by its owner only (mode 0600; SQLite gives its ``-wal`` and
    ``-shm`` files the same mode), a folder it makes likewise (0700): the rows hold whole conversations.

    Every row carries its write time (a last column, ``saved_at``, seconds since the epoch), and every key its
    tenant (src/agentkv/_store_table.py). A table of the layout before both (the given columns alone: agentkv
    before 2026-12) is migrated in place, in one transaction: its rows become `DEFAULT_TENANT`'s, written now. A
    table of the same name with other columns (another layout) is replaced by an
    empty one, with a warning; other tables in the file are left alone. Every statement runs
    under one lock (the connection is used from worker threads). Rows are written with
    ``INSERT OR REPLACE``, which gives a rewritten row a new rowid, so the oldest-written rows
    have the smallest: `save` drops those beyond ``max_rows``, in the same transaction.

    A store that fails (its file locked by another process, the disk or the database full, the file
    read-only, the disk failing) raises `StoreUnavailableError` naming the file, within ``timeout_s``
    of the call (waiting for other threads' calls included), and keeps nothing of the call: each
    write is one transaction, rolled back whole. The next call tries again: after a fault that the
    open connection does not outlive (read-only, I/O), on a connection opened afresh, which sees the
    file as it is then (made writable again, say).

    Args:
        path: the database file.
        table: the table's name.
        columns: its column definitions (``"name TYPE constraints"``), in order, the key first.
        max_rows: the most rows kept.
        max_age_s: the most seconds a row is kept after its last write (None: no bound).
        timeout_s: the most one call waits for the file's write lock (another process's) or for the
            calls ahead of it.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        table: str,
        columns: Sequence[str],
        max_rows: int,
        max_age_s: float | None = None,
        timeout_s: float = STORE_TIMEOUT_S,
    ) -> None:
        self.path = store_path(path)
        names = [column.split()[0] for column in columns]
        timeout_s = store_timeout(timeout_s)
        super().__init__(
            str(self.path),
            table=table,
            columns=names,
            max_rows=max_rows,
            max_age_s=max_age_s,
            timeout_s=timeout_s,
            errors=sqlite3.Error,
            said=_SAID,
        )
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # there already (or it cannot be made: the open below says why)
            # O_EXCL: a file that exists is never opened here, for closing a descriptor of a file drops every POSIX
            # lock this process holds on it, another store's connection's included (SQLite's own opens avoid it)
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))  # empty: an empty database
        try:
            self._run("open", functools.partial(self._create, columns))
        except BaseException:
            self.close()
            raise

    def _create(self, columns: Sequence[str], db: sqlite3.Connection) -> None:
        db.execute("BEGIN IMMEDIATE")  # one process at a time checks, migrates and replaces the table
        table, key = self.table, self.columns[0]
        try:
            found = tuple(row[1] for row in db.execute(f"PRAGMA table_info({table})"))
            if found == self.columns:  # the layout before tenants and ages: its rows become the default tenant's
                db.execute(f"ALTER TABLE {table} ADD COLUMN {_SAVED_AT} REAL NOT NULL DEFAULT 0")
                db.execute(
                    f"UPDATE {table} SET {_SAVED_AT} = ?, {key} = ? || {key}", (time.time(), DEFAULT_TENANT + "/")
                )
                logger.info("agentkv: %s's %s migrated: its rows are tenant %r's", self.path, table, DEFAULT_TENANT)
            elif found and found != (*self.columns, _SAVED_AT):
                (count,) = db.execute(f"SELECT count(*) FROM {table}").fetchone()
                logger.warning(
                    "agentkv: %s holds %s in an older layout; its %d rows are dropped", self.path, table, count
                )
                db.execute(f"DROP TABLE {table}")
            db.execute(
                f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(columns)}, {_SAVED_AT} REAL NOT NULL DEFAULT 0)"
            )
            db.execute(f"CREATE INDEX IF NOT EXISTS {table}_by_{_SAVED_AT} ON {table} ({_SAVED_AT})")
        except BaseException:
            _roll_back(db)
            raise
        db.execute("COMMIT")

    def _oldest_kept(self) -> float:
        """The write time of the oldest row kept (``-inf`` without ``max_age_s``)."""
        return float("-inf") if self.max_age_s is None else time.time() - self.max_age_s

    def fetch(self, key: str) -> tuple[Any, ...] | None:
        key_column, *rest = self.columns
        sql = f"SELECT {', '.join(rest)} FROM {self.table} WHERE {key_column} = ? AND {_SAVED_AT} >= ?"

        def run(db: sqlite3.Connection) -> tuple[Any, ...] | None:
            row: tuple[Any, ...] | None = db.execute(sql, (key, self._oldest_kept())).fetchone()
            return row

        return self._run("read from", run)

    def save(self, *values: object) -> None:
        names = ", ".join((*self.columns, _SAVED_AT))
        sql = f"INSERT OR REPLACE INTO {self.table} ({names}) VALUES ({', '.join('?' * (len(values) + 1))})"

        def run(db: sqlite3.Connection) -> None:
            cursor = db.execute(sql, (*values, time.time()))
            if cursor.lastrowid is not None and cursor.lastrowid > self.max_rows:
                db.execute(f"DELETE FROM {self.table} WHERE rowid <= ?", (cursor.lastrowid - self.max_rows,))
            if self.max_age_s is not None:
                db.execute(f"DELETE FROM {self.table} WHERE {_SAVED_AT} < ?", (self._oldest_kept(),))

        self._run("save to", functools.partial(_transaction, run))

    def remove(self, key: str) -> bool:
        sql = f"DELETE FROM {self.table} WHERE {self.columns[0]} = ?"
        return self._run("save to", functools.partial(_transaction, lambda db: db.execute(sql, (key,)).rowcount > 0))

    # ----------------------------------------------------------------- what SQLite says

    def _connect(self, timeout_s: float) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=timeout_s)
        try:
            db.execute("PRAGMA journal_mode=WAL")
        except BaseException:
            db.close()
            raise
        return db

    def _bound(self, db: sqlite3.Connection, left_s: float) -> None:
        db.execute(f"PRAGMA busy_timeout = {int(left_s * 1000)}")

    def _fault_of(self, doing: str, exc: Exception | None) -> StoreUnavailableError:
        assert exc is None or isinstance(exc, sqlite3.Error)
        return store_fault(self.path, doing, exc, self.timeout_s)

    def _retried(self, exc: Exception) -> bool:
        assert isinstance(exc, sqlite3.Error)
        return fault_reason(exc) == "read_only"  # a connection opened while the file was read-only stays so

    def _keeps(self, fault: StoreUnavailableError, db: sqlite3.Connection) -> bool:
        """A lock held elsewhere, or a full disk, leaves the connection sound; after the others the file is opened
        afresh, to see it as it is then."""
        return fault.reason in ("locked", "full")


_SAVED_AT = "saved_at"
"""The column every table adds last: when its row was written (seconds since the epoch)."""

_SAID = {
    "locked": "locked by another process",
    "full": "full",
    "read_only": "read-only",
    "io": "failing to read or write its disk",
    "other": "failing",
}
"""Each fault's reason, as a sentence says it."""


def fault_reason(exc: sqlite3.Error | None) -> str:
    """What a SQLite error says of the store: ``locked``, ``full``, ``read_only``, ``io`` or ``other`` (None: the
    calls queued ahead of this one took the store's timeout, which a lock held elsewhere does: ``locked``)."""
    name = str(getattr(exc, "sqlite_errorname", "")) if exc is not None else "SQLITE_BUSY"
    reasons = {
        "SQLITE_BUSY": "locked",
        "SQLITE_LOCKED": "locked",
        "SQLITE_FULL": "full",
        "SQLITE_READONLY": "read_only",
        "SQLITE_IOERR": "io",
        "SQLITE_CANTOPEN": "io",
    }
    return next((reason for prefix, reason in reasons.items() if name.startswith(prefix)), "other")


def store_fault(path: Path, doing: str, exc: sqlite3.Error | None, timeout_s: float) -> StoreUnavailableError:
    """The `StoreUnavailableError` of a SQLite error (None: the calls queued ahead of this one took ``timeout_s``):
    what failed, why, and what to do."""
    reason = fault_reason(exc)
    held = (
        f"another process has held its write lock for more than {timeout_s:g} s"
        if exc is not None
        else f"the calls ahead of this one have waited more than {timeout_s:g} s for its write lock, which "
        f"another process holds"
    )
    why = {
        "locked": f"the database is locked: {held} (the store's timeout_s; agentkv serve --store-timeout-s)",
        "full": "the database or disk is full: free space on its disk",
        "read_only": "the file is read-only to this process: make the file and its folder writable",
        "io": f"the disk could not be read or written ({exc}): check the disk and the file",
        "other": f"{exc} ({getattr(exc, 'sqlite_errorname', None) or type(exc).__name__}): check the file "
        f"(PRAGMA integrity_check)",
    }[reason]
    retry = 1
    end = f"{why}; nothing of this call was kept: retry after {retry} s"
    return StoreUnavailableError(
        f"could not {doing} the store {path}: {end}",
        path=str(path),
        reason=reason,
        retry_after_s=retry,
        public=f"could not {doing} the store: {end}",
    )


def store_timeout(value: float) -> float:
    """``value``, checked to be a positive number of seconds (a `UserError` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise UserError(f"timeout_s must be a positive number of seconds, not {value!r}")
    return float(value)


def _transaction(run: Callable[[sqlite3.Connection], _T], db: sqlite3.Connection) -> _T:
    """``run(db)`` as one write transaction, rolled back whole if it fails."""
    db.execute("BEGIN IMMEDIATE")
    try:
        result = run(db)
        db.execute("COMMIT")
    except BaseException:
        _roll_back(db)
        raise
    return result


def _roll_back(db: sqlite3.Connection) -> None:
    """End the connection's open transaction, if SQLite has not ended it already (best effort: it may be failing)."""
    if db.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            db.execute("ROLLBACK")
