"""One SQLite file shared by the front door's stores: opened once per store, safe across threads, bounded; a
failing file (locked, full, read-only) is a `StoreUnavailableError` within a bounded time."""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import sqlite3
import threading
import time
from abc import ABC
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

from ._errors import StoreUnavailableError, UserError
from ._model import home_dir

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
    """The SQLite file a store is kept in: ``path``, refused (a `UserError`) when it is a URL, which agentkv
    cannot open (a database server's ``postgresql://...`` would otherwise become a folder of that name)."""
    found = _URL.match(path) if isinstance(path, str) else None
    if found is not None:
        scheme = found.group(1)
        raise UserError(
            f"the store {path!r} is a {scheme}:// URL, which agentkv cannot open: a store is a SQLite file's path "
            f"(created if missing), e.g. ./serve.sqlite3 (agentkv serve --store also takes 'memory'); "
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


class SqliteTable:
    """A connection to one table of a SQLite file (created with its folder), kept to ``max_rows`` rows.

    A table of the same name with other columns (an older agentkv's layout) is replaced by an
    empty one, with a warning; other tables in the file are left alone. Every statement runs
    under one lock (the connection is used from worker threads). Rows are written with
    ``INSERT OR REPLACE``, which gives a rewritten row a new rowid, so the oldest-written rows
    have the smallest: `write` drops those beyond ``max_rows``, in the same transaction.

    A store that fails (its file locked by another process, the disk or the database full, the file
    read-only, the disk failing) raises `StoreUnavailableError` naming the file, within ``timeout_s``
    of the call (waiting for other threads' calls included), and keeps nothing of the call: each
    write is one transaction, rolled back whole. The next call tries again: after a fault that the
    open connection does not outlive (read-only, I/O), on a connection opened afresh, which sees the
    file as it is then (made writable again, say).

    Args:
        path: the database file.
        table: the table's name.
        columns: its column definitions (``"name TYPE constraints"``), in order.
        max_rows: the most rows kept.
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
        timeout_s: float = STORE_TIMEOUT_S,
    ) -> None:
        self.path = store_path(path)
        self.table = table
        self.max_rows = max_rows
        self.timeout_s = store_timeout(timeout_s)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._fault: StoreUnavailableError | None = None
        """The last fault, until a call like the one that met it succeeds, or a write (logged once, and its end)."""
        self._fault_doing = ""
        self._closed = False
        try:
            self._run("open", functools.partial(self._create, columns))
        except BaseException:
            self.close()
            raise

    def _create(self, columns: Sequence[str], db: sqlite3.Connection) -> None:
        db.execute("BEGIN IMMEDIATE")  # one process at a time checks and replaces the table
        try:
            names = tuple(column.split()[0] for column in columns)
            found = tuple(row[1] for row in db.execute(f"PRAGMA table_info({self.table})"))
            if found and found != names:
                (count,) = db.execute(f"SELECT count(*) FROM {self.table}").fetchone()
                logger.warning(
                    "agentkv: %s holds %s in an older layout; its %d rows are dropped", self.path, self.table, count
                )
                db.execute(f"DROP TABLE {self.table}")
            db.execute(f"CREATE TABLE IF NOT EXISTS {self.table} ({', '.join(columns)})")
        except BaseException:
            _roll_back(db)
            raise
        db.execute("COMMIT")

    def read(self, sql: str, *parameters: object) -> tuple[Any, ...] | None:
        """The first row of a query, or None."""

        def run(db: sqlite3.Connection) -> tuple[Any, ...] | None:
            row: tuple[Any, ...] | None = db.execute(sql, parameters).fetchone()
            return row

        return self._run("read from", run)

    def write(self, sql: str, *parameters: object) -> int:
        """Run an insert (then drop the oldest rows beyond the bound) or a delete, as one transaction; the rows it
        changed."""

        def run(db: sqlite3.Connection) -> int:
            db.execute("BEGIN IMMEDIATE")
            try:
                cursor = db.execute(sql, parameters)
                changed = cursor.rowcount
                if sql.lstrip().upper().startswith("INSERT") and cursor.lastrowid is not None:
                    if cursor.lastrowid > self.max_rows:
                        db.execute(f"DELETE FROM {self.table} WHERE rowid <= ?", (cursor.lastrowid - self.max_rows,))
                db.execute("COMMIT")
            except BaseException:
                _roll_back(db)
                raise
            return changed

        return self._run("save to", run)

    def _run(self, doing: str, action: Callable[[sqlite3.Connection], _T]) -> _T:
        """``action`` on the connection (opened if there is none), under the lock, all within ``timeout_s``; a
        SQLite error is a `StoreUnavailableError` (``doing`` says what failed: "save to", "read from", "open")."""
        started = time.monotonic()
        if not self.lock.acquire(timeout=self.timeout_s):
            raise self._failed(doing, None)
        try:
            if self._closed:
                raise UserError(f"the store {self.path} was closed: open a new one to use it")
            try:
                fresh = self._db is None
                try:
                    result = self._call(action, started)
                except sqlite3.Error as exc:
                    if fresh or fault_reason(exc) != "read_only":
                        raise
                    self._drop()  # a connection opened while the file was read-only stays so: once more, on a new one
                    result = self._call(action, started)
            except sqlite3.Error as exc:
                raise self._failed(doing, exc) from exc
            if self._fault is not None and (doing == "save to" or self._fault_doing == doing):  # reads may pass
                logger.warning("agentkv: the store %s works again (it was %s)", self.path, _SAID[self._fault.reason])
                self._fault = None
            return result
        finally:
            self.lock.release()

    def _call(self, action: Callable[[sqlite3.Connection], _T], started: float) -> _T:
        """``action`` on the connection (opened if there is none), waiting for SQLite's lock what is left of
        ``timeout_s`` since ``started`` (called with the lock held)."""
        left_s = max(0.001, self.timeout_s - (time.monotonic() - started))
        if self._db is None:
            self._db = self._connect(left_s)
        self._db.execute(f"PRAGMA busy_timeout = {int(left_s * 1000)}")
        return action(self._db)

    def _connect(self, timeout_s: float) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=timeout_s)
        try:
            db.execute("PRAGMA journal_mode=WAL")
        except BaseException:
            db.close()
            raise
        return db

    def _drop(self) -> None:
        """Close the connection (the next call opens a new one; called with the lock held)."""
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None

    def _failed(self, doing: str, exc: sqlite3.Error | None) -> StoreUnavailableError:
        """The fault ``exc`` is (None: the calls ahead of this one took ``timeout_s``), logged when it is new. After
        one the connection may not outlive (all but ``locked`` and ``full``), the connection is closed: the next
        call opens the file afresh and sees it as it is then."""
        fault = store_fault(self.path, doing, exc, self.timeout_s)
        if exc is not None and fault.reason not in ("locked", "full"):
            self._drop()
        if self._fault is None or self._fault.reason != fault.reason:
            logger.warning("agentkv: %s", fault)
        if exc is not None:
            self._fault, self._fault_doing = fault, doing
        return fault

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self._drop()


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
    return StoreUnavailableError(
        f"could not {doing} the store {path}: {why}; nothing of this call was kept: retry after {retry} s",
        path=str(path),
        reason=reason,
        retry_after_s=retry,
    )


def store_timeout(value: float) -> float:
    """``value``, checked to be a positive number of seconds (a `UserError` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise UserError(f"timeout_s must be a positive number of seconds, not {value!r}")
    return float(value)


def _roll_back(db: sqlite3.Connection) -> None:
    """End the connection's open transaction, if SQLite has not ended it already (best effort: it may be failing)."""
    if db.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            db.execute("ROLLBACK")
