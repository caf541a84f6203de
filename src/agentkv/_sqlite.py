"""One SQLite file shared by the front door's stores: opened once per store, safe across threads, bounded."""

from __future__ import annotations

import logging
import sqlite3
import threading
from abc import ABC
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

from ._errors import UserError
from ._model import cache_dir

__all__ = ["SqliteTable", "Store", "default_store_path", "positive"]

logger = logging.getLogger("agentkv")


def default_store_path() -> Path:
    """Where ``agentkv serve`` keeps sessions and responses by default: ``$AGENTKV_HOME/serve.sqlite3``."""
    return cache_dir().parent / "serve.sqlite3"


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
    have the smallest: `write` drops those beyond ``max_rows``.

    Args:
        path: the database file.
        table: the table's name.
        columns: its column definitions (``"name TYPE constraints"``), in order.
        max_rows: the most rows kept.
    """

    def __init__(self, path: str | Path, *, table: str, columns: Sequence[str], max_rows: int) -> None:
        self.path = Path(path).expanduser()
        self.table = table
        self.max_rows = max_rows
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self.db.execute("PRAGMA journal_mode=WAL")
        self._create(columns)

    def _create(self, columns: Sequence[str]) -> None:
        self.db.execute("BEGIN IMMEDIATE")  # one process at a time checks and replaces the table
        try:
            names = tuple(column.split()[0] for column in columns)
            found = tuple(row[1] for row in self.db.execute(f"PRAGMA table_info({self.table})"))
            if found and found != names:
                (count,) = self.db.execute(f"SELECT count(*) FROM {self.table}").fetchone()
                logger.warning(
                    "agentkv: %s holds %s in an older layout; its %d rows are dropped", self.path, self.table, count
                )
                self.db.execute(f"DROP TABLE {self.table}")
            self.db.execute(f"CREATE TABLE IF NOT EXISTS {self.table} ({', '.join(columns)})")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def read(self, sql: str, *parameters: object) -> tuple[Any, ...] | None:
        """The first row of a query, or None."""
        with self.lock:
            row: tuple[Any, ...] | None = self.db.execute(sql, parameters).fetchone()
            return row

    def write(self, sql: str, *parameters: object) -> int:
        """Run an insert (then drop the oldest rows beyond the bound) or a delete; the rows it changed."""
        with self.lock:
            cursor = self.db.execute(sql, parameters)
            changed = cursor.rowcount
            if sql.lstrip().upper().startswith("INSERT") and cursor.lastrowid is not None:
                if cursor.lastrowid > self.max_rows:
                    self.db.execute(f"DELETE FROM {self.table} WHERE rowid <= ?", (cursor.lastrowid - self.max_rows,))
            return changed

    def close(self) -> None:
        with self.lock:
            self.db.close()
