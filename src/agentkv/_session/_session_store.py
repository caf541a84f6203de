"""Where a `SessionPool` keeps its sessions' snapshots, so that conversations resume after a restart.

A snapshot is saved after every step, under the conversation's id when it has one, else under
a digest of the messages it holds (`history_key`: the next request of that conversation starts
with those messages, so it finds the snapshot again); either key is its tenant's (`tenant_key`: a
tenant never reads another's snapshot). A restored session extends the saved
token ids exactly and recomputes its KV once (its first step's ``miss_reason`` is ``resumed``).

Two stores: `SqliteSessionStore` (a file, one door's) and `PostgresSessionStore` (a database several
doors share, each named conversation leased by the door that steps it: `leased`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
import uuid
from abc import abstractmethod
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from pydantic import ValidationError

from .._conversation._conversation import Message
from .._engines._base import SavedPin
from .._errors import SessionBusyError, StoreUnavailableError, UserError
from .._postgres import (
    PostgresTable,
    StoreLease,
    drop_lease,
    is_postgres_url,
    offer_pin,
    renew_leases,
    take_lease,
    take_pin_back,
)
from .._sqlite import STORE_TIMEOUT_S, SqliteTable, Store, positive, store_path
from .._store_table import StoreTable, tenant_key
from ._snapshot import SessionSnapshot

logger = logging.getLogger("agentkv")

__all__ = [
    "PostgresSessionStore",
    "SessionStore",
    "SqliteSessionStore",
    "check_session_store",
    "conversation_key",
    "history_key",
    "leased",
]


def conversation_key(conversation_id: str, tenant: str | None = None) -> str:
    """The store key of ``tenant``'s named conversation (None: the default tenant's)."""
    return tenant_key(tenant, f"conversation:{conversation_id}")


def history_key(messages: Sequence[Message], tenant: str | None = None) -> str:
    """The store key of ``tenant``'s unnamed conversation: a digest of its messages (through the model's last
    answer)."""
    dumped = json.dumps([m.model_dump(mode="json") for m in messages], sort_keys=True, separators=(",", ":"))
    return tenant_key(tenant, "history:" + hashlib.sha256(dumped.encode()).hexdigest())


class SessionStore(Store):
    """Session snapshots by key. Implementations are safe to call from several threads."""

    offers_pins = False
    """Whether `put` keeps the pin a step left for the door that steps the conversation next (a store several
    doors share, which then implements `lease` and `take_pin_back`); a store one door uses keeps none."""

    @abstractmethod
    def get(self, key: str) -> SessionSnapshot | None:
        """The snapshot saved under ``key``, or None (never saved, dropped, or unreadable)."""

    @abstractmethod
    def put(self, key: str, snapshot: SessionSnapshot, *, pin: SavedPin | None = None) -> int | None:
        """Save ``snapshot`` under ``key`` (replacing what was there), offering ``pin`` (given only where
        `offers_pins`). Returns the save's number where the store numbers saves for doors to compare (`lease`),
        else None. A store that cannot raises (`SqliteSessionStore`: `StoreUnavailableError`); the pool then does
        not answer the step it was saving."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Forget ``key`` (nothing happens when it is unknown)."""

    def lease(self, key: str) -> StoreLease | None:
        """Hold ``key`` for this store object's steps until `release` (a store several doors share: so that two
        never step one conversation at once); a live lease of another owner is a `SessionBusyError`. Calls nest:
        the key is given back at the last `release`. Returns what the outermost call found (`StoreLease`: the save's
        number, the pin the row offered, now this caller's), else None. By default nothing: a store one door
        uses needs no lease."""
        return None

    def release(self, key: str) -> None:
        """Give back what `lease` took (by default nothing)."""

    def take_pin_back(self, key: str, pin_id: str) -> bool:
        """Take the pin `put` offered under ``key`` off offer: True when no other door can have it (the caller may
        release it), False when one took it or a later save replaced it. By default True (nothing offered)."""
        return True

    def offer_pin(self, key: str, pin: SavedPin, *, written: int) -> bool:
        """Offer ``pin`` under ``key`` between saves (the session renewed its pin since the save numbered
        ``written``): True when offered; False, offering nothing, when the row moved on since, offers a pin
        already, or another door holds the conversation's lease. By default False (nothing offered)."""
        return False


@contextlib.asynccontextmanager
async def leased(store: SessionStore | None, key: str | None) -> AsyncIterator[StoreLease | None]:
    """The named conversation's lease in ``store`` (`SessionStore.lease`; ``key``: its `conversation_key`), held
    for the block, and what taking it found; nothing (None) for an unnamed conversation (None: its key, a digest
    of its history, changes at every step) or without a store."""
    if store is None or key is None or type(store).lease is SessionStore.lease:  # no thread for nothing
        yield None
        return
    lease = await anyio.to_thread.run_sync(store.lease, key)
    try:
        yield lease
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(store.release, key)


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

    def put(self, key: str, snapshot: SessionSnapshot, *, pin: SavedPin | None = None) -> int | None:
        return self._table.save(key, snapshot.model_dump_json())

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
        max_age_s: the most seconds a snapshot is kept after its last save (None: until ``max_sessions`` drops it).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_sessions: int = 100_000,
        timeout_s: float = STORE_TIMEOUT_S,
        max_age_s: float | None = None,
    ) -> None:
        columns, bound = ("key TEXT PRIMARY KEY", "snapshot TEXT NOT NULL"), positive("max_sessions", max_sessions)
        self._table = SqliteTable(
            path, table="sessions", columns=columns, max_rows=bound, max_age_s=max_age_s, timeout_s=timeout_s
        )
        self.path, self.timeout_s = self._table.path, self._table.timeout_s


class PostgresSessionStore(_TableSessionStore):
    """Session snapshots in a PostgreSQL database (its ``agentkv_sessions`` table: src/agentkv/_postgres.py
    says the layout), which several doors share: a conversation saved by one resumes on any; the oldest dropped
    beyond ``max_sessions``. Needs psycopg (``pip install 'agentkv-vllm[postgresql]'``).

    One owner at a time: a pool takes a named conversation's lease in ``agentkv_leases`` for each step, owned
    by this store object, renewed every third of ``lease_ttl_s`` while held (a thread of the store's); a step
    of a conversation whose lease another live owner holds is a `SessionBusyError`, and a lease whose owner
    died is taken over once it expires. Each door needs a store object of its own.

    A call that cannot reach the server, or that it does not answer within ``timeout_s``, raises
    `StoreUnavailableError` and keeps nothing; the next call tries again (on a new connection after a lost one).

    Args:
        url: ``postgresql://user:password@host:port/database`` (libpq's URL; ``postgres://`` too).
        max_sessions: the most snapshots kept.
        timeout_s: the most a call waits for the calls ahead of it, then for the server (a connection
            attempt: whole seconds, at least 2).
        lease_ttl_s: how long a lease outlives its last renewal: how long a dead door's conversations wait.
        max_age_s: the most seconds a snapshot is kept after its last save (None: until ``max_sessions`` drops it).
    """

    def __init__(
        self,
        url: str,
        *,
        max_sessions: int = 100_000,
        timeout_s: float = STORE_TIMEOUT_S,
        lease_ttl_s: float = 30.0,
        max_age_s: float | None = None,
    ) -> None:
        bound = positive("max_sessions", max_sessions)
        if isinstance(lease_ttl_s, bool) or not isinstance(lease_ttl_s, int | float) or not 0 < lease_ttl_s < 1e6:
            raise UserError(f"lease_ttl_s must be a positive number of seconds, not {lease_ttl_s!r}")
        self._table = self._leases = PostgresTable(
            url,
            table="agentkv_sessions",
            columns=("key", "snapshot", "pin", "pin_id"),
            max_rows=bound,
            timeout_s=timeout_s,
            max_age_s=max_age_s,
        )
        """The table, and the connection the leases' statements run on."""
        self.url: str = self._table.url
        """The database, its password hidden."""
        self.timeout_s = self._table.timeout_s
        self.lease_ttl_s = float(lease_ttl_s)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        """Whose leases this store's are (``agentkv_leases.owner``)."""
        self._held: dict[str, int] = {}
        """The keys leased, each with its holders' count."""
        self._held_lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    offers_pins = True

    def put(self, key: str, snapshot: SessionSnapshot, *, pin: SavedPin | None = None) -> int | None:
        saved = (pin.model_dump_json(), pin.id) if pin is not None else (None, None)
        return self._table.save(key, snapshot.model_dump_json(), *saved)

    def take_pin_back(self, key: str, pin_id: str) -> bool:
        return take_pin_back(self._leases, key, pin_id)

    def offer_pin(self, key: str, pin: SavedPin, *, written: int) -> bool:
        return offer_pin(self._leases, key, written, self.owner, pin.model_dump_json(), pin.id)

    def lease(self, key: str) -> StoreLease | None:
        with self._held_lock:
            if key in self._held:
                self._held[key] += 1
                return None
        lease = take_lease(self._leases, key, self.owner, self.lease_ttl_s)
        if lease is None:
            raise SessionBusyError(  # (the store's address is for the log, not for a client's error body)
                f"conversation {key.split('/', 1)[-1].removeprefix('conversation:')!r} is running a step on another "
                f"door (it holds the conversation's lease in the shared store); "
                f"retry later: a door that died gives it up within {self.lease_ttl_s:g} s"
            )
        with self._held_lock:
            self._held[key] = self._held.get(key, 0) + 1
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew, name="agentkv-lease-renewer", daemon=True)
                self._renewer.start()
        return lease

    def release(self, key: str) -> None:
        with self._held_lock:
            left = self._held.get(key, 0) - 1
            if left > 0:
                self._held[key] = left
                return
            self._held.pop(key, None)
        try:
            drop_lease(self._leases, key, self.owner)
        except (StoreUnavailableError, UserError) as exc:  # unreachable, or closed: it expires, no longer renewed
            logger.warning("agentkv: a lease could not be given back (%s); it expires in %g s", exc, self.lease_ttl_s)

    def _renew(self) -> None:
        """Renew the held leases every third of their time to live, until the store closes."""
        while not self._stop.wait(self.lease_ttl_s / 3):
            with self._held_lock:
                keys = list(self._held)
            if keys:
                with contextlib.suppress(StoreUnavailableError, UserError):  # logged by the table; retried next time
                    renew_leases(self._leases, keys, self.owner, self.lease_ttl_s)

    def close(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=self.timeout_s + 1)
        super().close()
