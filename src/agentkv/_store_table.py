"""What every store's table shares (src/agentkv/_sqlite.py's `SqliteTable`, src/agentkv/_postgres.py's
`PostgresTable`): rows by key (`fetch`, `save`, `remove`), bounded in count and in age; one connection behind one
lock, each call within the store's timeout, a failing call a `StoreUnavailableError` logged once (and the end of
the fault), the call tried once more on a new connection after a fault that an old connection may not outlive.

**Tenants.** Every key is a tenant's (`tenant_key`): ``<tenant>/<key>``, a tenant's name never holding a ``/``,
so that no key of one tenant is ever another's. A caller that names no tenant is `DEFAULT_TENANT`'s (a
`SessionPool` used from Python, a door with no API key); rows of a layout from before tenants are migrated to it.

**Age.** Each row carries when it was last written (``saved_at``); with ``max_age_s`` a row older than that is
not read, and is deleted by the next write (the retention of ``agentkv serve --retention-s``)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from ._errors import StoreUnavailableError, UserError

__all__ = ["DEFAULT_TENANT", "StoreTable", "check_max_age", "tenant_key"]

DEFAULT_TENANT = "default"
"""The tenant of a caller that names none."""


def tenant_key(tenant: str | None, key: str) -> str:
    """``key`` as ``tenant``'s row's key (None: `DEFAULT_TENANT`'s). A tenant's name holds no ``/``."""
    name = DEFAULT_TENANT if tenant is None else tenant
    if not name or "/" in name:
        raise UserError(f"a tenant's name is not empty and holds no '/', not {name!r}")
    return f"{name}/{key}"


def check_max_age(max_age_s: float | None) -> float | None:
    """``max_age_s``, checked to be None or a positive number of seconds (a `UserError` otherwise)."""
    if max_age_s is None:
        return None
    if isinstance(max_age_s, bool) or not isinstance(max_age_s, int | float) or not 0 < max_age_s < float("inf"):
        raise UserError(f"max_age_s must be None or a positive number of seconds, not {max_age_s!r}")
    return float(max_age_s)


logger = logging.getLogger("agentkv")


class _Connection(Protocol):
    def close(self) -> None: ...


_C = TypeVar("_C", bound=_Connection)
_T = TypeVar("_T")


class StoreTable(ABC, Generic[_C]):
    """A table of rows by key (its first column), kept to ``max_rows`` rows, the oldest written dropped first;
    through a connection ``_C``, opened when a call needs it, used under one lock (calls come from worker
    threads).

    A call raises `StoreUnavailableError` within about ``timeout_s`` (waiting for the calls ahead of it
    included) when the driver raises one of ``errors``, and the subclass's fault says why. The next call tries
    again: on a connection opened afresh after a fault the subclass does not keep its connection through.

    Args:
        where: the store as messages name it (a file's path, a URL without its password).
        table: the table's name.
        columns: its columns' names, the key first.
        max_rows: the most rows kept.
        max_age_s: the most seconds a row is kept after it was written (None: no bound).
        timeout_s: the most a call waits, for the lock and then for the database.
        errors: the driver's base error.
        said: each fault's reason, as the line that logs its end says it.
    """

    def __init__(
        self,
        where: str,
        *,
        table: str,
        columns: Sequence[str],
        max_rows: int,
        max_age_s: float | None = None,
        timeout_s: float,
        errors: type[Exception],
        said: dict[str, str],
    ) -> None:
        self.where = where
        self.table = table
        self.columns = tuple(columns)
        self.max_rows = max_rows
        self.max_age_s = check_max_age(max_age_s)
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self._errors = errors
        self._said = said
        self._db: _C | None = None
        self._fault: StoreUnavailableError | None = None
        """The last fault, until a call like the one that met it succeeds, or a write (logged once, and its end)."""
        self._fault_doing = ""
        self._closed = False

    # ----------------------------------------------------------------- rows

    @abstractmethod
    def fetch(self, key: str) -> tuple[Any, ...] | None:
        """The key's row, without its key (the other columns, in order), or None (also when older than
        ``max_age_s``)."""

    @abstractmethod
    def save(self, *values: object) -> int | None:
        """Write a row (every column's value, the key first), replacing the key's; drop the oldest written beyond
        ``max_rows`` and those older than ``max_age_s``; all in one transaction. Returns the row's ``written``
        number where the table numbers its writes for others to compare (PostgreSQL's), else None."""

    @abstractmethod
    def remove(self, key: str) -> bool:
        """Delete the key's row; False when there was none."""

    # ----------------------------------------------------------------- what a store's driver says

    @abstractmethod
    def _connect(self, timeout_s: float) -> _C:
        """A new connection, opened within ``timeout_s``."""

    @abstractmethod
    def _bound(self, db: _C, left_s: float) -> None:
        """Make the connection's next statement wait at most ``left_s`` for the database."""

    @abstractmethod
    def _fault_of(self, doing: str, exc: Exception | None) -> StoreUnavailableError:
        """The fault ``exc`` is (None: the calls ahead of this one took ``timeout_s``)."""

    @abstractmethod
    def _retried(self, exc: Exception) -> bool:
        """Whether a call that met ``exc`` on an old connection is tried once more, on a new one."""

    @abstractmethod
    def _keeps(self, fault: StoreUnavailableError, db: _C) -> bool:
        """Whether the connection outlives ``fault``."""

    # ----------------------------------------------------------------- calls

    def _run(self, doing: str, action: Callable[[_C], _T]) -> _T:
        """``action`` on the connection (opened if there is none), under the lock, within ``timeout_s``; a driver's
        error is a `StoreUnavailableError` (``doing`` says what failed: "save to", "read from", "open")."""
        started = time.monotonic()
        if not self.lock.acquire(timeout=self.timeout_s):
            raise self._failed(doing, None)
        try:
            if self._closed:
                raise UserError("this store was closed: open a new one to use it")  # (its address is for logs)
            try:
                fresh = self._db is None
                try:
                    result = self._call(action, started)
                except self._errors as exc:
                    if fresh or not self._retried(exc):
                        raise
                    self._drop()
                    result = self._call(action, started)
            except self._errors as exc:
                raise self._failed(doing, exc) from exc
            if self._fault is not None and (doing == "save to" or self._fault_doing == doing):  # reads may pass
                logger.warning(
                    "agentkv: the store %s works again (it was %s)", self.where, self._said[self._fault.reason]
                )
                self._fault = None
            return result
        finally:
            self.lock.release()

    def _call(self, action: Callable[[_C], _T], started: float) -> _T:
        """``action`` on the connection (opened if there is none), waiting for the database what is left of
        ``timeout_s`` since ``started`` (called with the lock held)."""
        left_s = max(0.001, self.timeout_s - (time.monotonic() - started))
        if self._db is None:
            self._db = self._connect(left_s)
        self._bound(self._db, left_s)
        return action(self._db)

    def _drop(self) -> None:
        """Close the connection (the next call opens a new one; called with the lock held)."""
        if self._db is not None:
            with contextlib.suppress(Exception):
                self._db.close()
            self._db = None

    def _failed(self, doing: str, exc: Exception | None) -> StoreUnavailableError:
        """The fault ``exc`` is (None: the calls ahead of this one took ``timeout_s``), logged when it is new; the
        connection closed unless it outlives the fault."""
        fault = self._fault_of(doing, exc)
        if exc is not None and self._db is not None and not self._keeps(fault, self._db):
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
