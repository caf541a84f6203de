"""agentkv's stores on a PostgreSQL server (``agentkv serve --store postgresql://...``, `PostgresSessionStore`,
`PostgresResponseStore`): several doors on several machines share one database; same contract as the SQLite
file's stores (src/agentkv/_sqlite.py): bounded, safe across threads, a failing server a `StoreUnavailableError`
within a bounded time, nothing of a failed call kept.

**Driver.** psycopg 3, its sync API (the extra ``agentkv-vllm[postgresql]``): the stores are called from worker threads
(the pool's ``anyio.to_thread``, the front door's), not from an event loop, and psycopg is the kept driver with a
sync API (asyncpg is asyncio only). Each store object holds one connection behind one lock: a call waits for the
calls ahead of it, as the SQLite stores' do; every call is one statement, so one round trip.

**Layout** (schema version 4; every table's name starts with ``agentkv_``, other tables are left alone)::

    agentkv_schema    (version integer NOT NULL)                  one row: the layout's version
    agentkv_sessions  (key text PRIMARY KEY, snapshot text NOT NULL,
                       written bigint NOT NULL,                    SessionSnapshot JSON by key,
                       pin text, pin_id text,                      with the pin it offers (SavedPin JSON),
                       saved_at timestamptz NOT NULL)              and when it was written
    agentkv_responses (response_id text PRIMARY KEY, conversation_id text,
                       messages text NOT NULL, response text NOT NULL,
                       written bigint NOT NULL,                    stored Responses-API responses
                       saved_at timestamptz NOT NULL)
    agentkv_leases    (key text PRIMARY KEY, owner text NOT NULL,
                       expires timestamptz NOT NULL)               who steps a conversation, until when

Every key (``key``, ``response_id``) is a tenant's: ``<tenant>/<key>`` (src/agentkv/_store_table.py); version 4
made the rows of version 3 the default tenant's. ``saved_at`` is the server's clock at the row's last write: with a
``max_age_s`` a row older than that is not read, and the next write deletes it (indexed).

``written`` comes from a sequence of each table's own (``agentkv_sessions_written``, ...), indexed: a row written
or rewritten takes the next number, so the oldest-written rows have the smallest, as SQLite's rowids do. A save
is one statement that writes its row and drops the rows ``max_rows`` numbers or more behind it (the same rule as
`SqliteTable`'s; numbers lost to failed writes or deleted rows can leave fewer rows, never more).

**Leases: one owner at a time.** A door takes a named conversation's lease (`take_lease`) before it steps it
and drops it after (`drop_lease`); while it holds it, it renews it (`renew_leases`), so a lease outlives only a
door that died, by ``lease_ttl_s`` at most. A door that finds the lease held by another owner, not expired,
answers as it does for a busy session; an expired lease is taken over in the same statement that takes a free
one (an upsert whose update applies only to an expired row or one of the same owner). Rows, not PostgreSQL's
advisory locks: an advisory lock lives in one session, so it would pin the conversation to the store's single
connection (a connection lost and opened again, as after a server restart, drops every lock at once, silently
to the holder, and a pooler in transaction mode cannot keep one at all); a row names its owner and its
expiry, survives a reconnect, can be read by an operator (``SELECT * FROM agentkv_leases``), and its expiry
is the server's clock, one clock for every door. The cost: a row written before and after each named step.

**Pins: single use, offered once.** A conversation's row may offer the pin its last step left on a decode server
that the doors share (``pin``, a `SavedPin`; ``pin_id``, its id): the door that takes the lease next takes the
pin off the row in the same statement (`take_lease` returns it), so that no two doors ever push one handle back;
a door that wants to release a pin it offered takes it back first (`take_pin_back`), and releases it only if it
was still on offer (else another door may be reading it). A door that gives its session's pin to D between steps
(a renewal, a repin, the early transfer: src/agentkv/_session/_pin_upkeep.py) takes it back first the same way,
and offers the new pin only on the row as its last save left it, with no other owner's lease live (`offer_pin`).

**Migration.** Each new connection reads the layout's version (no ``agentkv_schema``: 0). One behind this
agentkv's is migrated in one transaction: it takes a transaction-wide advisory lock (doors opening a fresh
database at once take turns), creates ``agentkv_schema`` if it is missing, reads the version again, applies the
steps of ``_MIGRATIONS`` after it in order and writes the new version: a database is at one version or the
next, never between. A version newer than this agentkv knows (a newer agentkv migrated it) is
refused with a `UserError` at open: an older agentkv must not write a layout it does not know.

**Time.** ``connect_timeout`` is the store's timeout in whole seconds, at least 2 (libpq's and psycopg's floor),
and every statement runs under ``statement_timeout`` = the store's timeout less what the call waited for the
lock: a server that is down, slow or holding a lock is a `StoreUnavailableError` (code 503 at the door) within
about the store's timeout (a connection attempt: its whole seconds). A connection that failed is dropped;
when an old connection fails (the server restarted under it), the call is tried once more on a new one, which
is safe: every statement is idempotent (an upsert by key, a delete by key).
"""

from __future__ import annotations

import logging
import math
import re
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ._errors import StoreUnavailableError, UserError
from ._sqlite import store_timeout
from ._store_table import DEFAULT_TENANT, StoreTable

if TYPE_CHECKING:
    import psycopg

__all__ = [
    "SCHEMA_VERSION",
    "PostgresTable",
    "StoreLease",
    "drop_lease",
    "is_postgres_url",
    "offer_pin",
    "renew_leases",
    "shown_url",
    "take_lease",
    "take_pin_back",
]

logger = logging.getLogger("agentkv")

_SCHEMES = ("postgresql", "postgres")
"""The URL schemes of a PostgreSQL server (libpq takes both)."""

_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # 0 -> 1: the sessions and the responses
        "CREATE SEQUENCE agentkv_sessions_written",
        "CREATE TABLE agentkv_sessions (key text PRIMARY KEY, snapshot text NOT NULL,"
        " written bigint NOT NULL DEFAULT nextval('agentkv_sessions_written'))",
        "CREATE INDEX agentkv_sessions_by_written ON agentkv_sessions (written)",
        "CREATE SEQUENCE agentkv_responses_written",
        "CREATE TABLE agentkv_responses (response_id text PRIMARY KEY, conversation_id text,"
        " messages text NOT NULL, response text NOT NULL,"
        " written bigint NOT NULL DEFAULT nextval('agentkv_responses_written'))",
        "CREATE INDEX agentkv_responses_by_written ON agentkv_responses (written)",
    ),
    (  # 1 -> 2: one owner at a time
        "CREATE TABLE agentkv_leases (key text PRIMARY KEY, owner text NOT NULL, expires timestamptz NOT NULL)",
    ),
    (  # 2 -> 3: the pin a conversation's last step left on a decode server that several doors drive
        "ALTER TABLE agentkv_sessions ADD COLUMN pin text, ADD COLUMN pin_id text",
    ),
    (  # 3 -> 4: every key a tenant's (the rows so far the default tenant's), every row's write time
        f"UPDATE agentkv_sessions SET key = '{DEFAULT_TENANT}/' || key",
        f"UPDATE agentkv_responses SET response_id = '{DEFAULT_TENANT}/' || response_id",
        f"UPDATE agentkv_leases SET key = '{DEFAULT_TENANT}/' || key",
        "ALTER TABLE agentkv_sessions ADD COLUMN saved_at timestamptz NOT NULL DEFAULT now()",
        "CREATE INDEX agentkv_sessions_by_saved_at ON agentkv_sessions (saved_at)",
        "ALTER TABLE agentkv_responses ADD COLUMN saved_at timestamptz NOT NULL DEFAULT now()",
        "CREATE INDEX agentkv_responses_by_saved_at ON agentkv_responses (saved_at)",
    ),
)
"""Step ``i`` takes a database from version ``i`` to ``i + 1``; a new layout is a new step, never an edit."""

SCHEMA_VERSION = len(_MIGRATIONS)
"""The layout this agentkv writes."""

_MIGRATION_LOCK = 0x6167656E746B76
"""The advisory lock key the stores that open take turns on (``agentkv`` in ASCII)."""


def is_postgres_url(store: object) -> bool:
    """Whether ``store`` is a ``postgresql://`` or ``postgres://`` URL."""
    return isinstance(store, str) and store.split("://", 1)[0].lower() in _SCHEMES and "://" in store


def shown_url(url: str) -> str:
    """``url`` with its password (in the user part or the query) replaced by ``***``: for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    netloc = re.sub(r"^([^:@/]*):[^@]*@", r"\1:***@", parts.netloc)
    query = urllib.parse.urlencode(
        [(k, "***" if k == "password" else v) for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)],
        safe="*",
    )
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


def _psycopg(url: str) -> ModuleType:
    """psycopg, or a `UserError` saying how to install it."""
    try:
        import psycopg
    except ImportError as exc:
        raise UserError(
            f"the store {shown_url(url)} is a PostgreSQL database, which needs psycopg: "
            f"pip install 'agentkv-vllm[postgresql]'"
        ) from exc
    return psycopg


class PostgresTable(StoreTable["psycopg.Connection[tuple[Any, ...]]"]):
    """One table of agentkv's layout in a PostgreSQL database, through one connection, kept to ``max_rows`` rows.

    Opening checks the layout (and migrates it: the module's docstring). Every statement runs under one lock
    (the connection is used from worker threads); each call is one statement. A call that fails raises
    `StoreUnavailableError` naming the database (password hidden), within about ``timeout_s``, and keeps
    nothing; the next call tries again.

    Args:
        url: the database, ``postgresql://user:password@host:port/database?parameters`` (libpq's).
        table: the table's name (``agentkv_sessions``, ``agentkv_responses``).
        columns: its columns but ``written``, the key first.
        max_rows: the most rows kept.
        timeout_s: the most a call waits for the calls ahead of it, then for the server.
        max_age_s: the most seconds a row is kept after its last write (None: no bound).
    """

    def __init__(
        self,
        url: str,
        *,
        table: str,
        columns: Sequence[str],
        max_rows: int,
        timeout_s: float,
        max_age_s: float | None = None,
    ) -> None:
        self._psycopg = _psycopg(url)
        timeout_s = store_timeout(timeout_s)
        errors = self._psycopg.Error
        super().__init__(
            shown_url(url),
            table=table,
            columns=columns,
            max_rows=max_rows,
            max_age_s=max_age_s,
            timeout_s=timeout_s,
            errors=errors,
            said=_SAID,
        )
        self.url = self.where
        self._conninfo = url
        self._statement_ms = 0
        """The connection's ``statement_timeout``."""
        self._run("open", lambda db: None)

    def _young(self) -> str:
        """The SQL condition of a row younger than ``max_age_s`` (TRUE without it)."""
        return "TRUE" if self.max_age_s is None else f"saved_at >= now() - {self.max_age_s!r} * interval '1 second'"

    def fetch(self, key: str) -> tuple[Any, ...] | None:
        key_column, *rest = self.columns
        sql = f"SELECT {', '.join(rest)} FROM {self.table} WHERE {key_column} = %s AND {self._young()}"
        return self._run("read from", lambda db: db.execute(sql, (key,)).fetchone())

    def save(self, *values: object) -> int:
        """One statement: the row written (the key's replaced, taking the next ``written`` number, returned), and
        the rows ``max_rows`` numbers or more behind it dropped, and those older than ``max_age_s`` (never the
        key's: one statement changes a row once)."""
        key, *rest = self.columns
        updates = ", ".join(f"{column} = EXCLUDED.{column}" for column in rest)
        sql = (
            f"WITH saved AS (INSERT INTO {self.table} ({', '.join(self.columns)})"
            f" VALUES ({', '.join(['%s'] * len(self.columns))})"
            f" ON CONFLICT ({key}) DO UPDATE SET {updates}, written = EXCLUDED.written, saved_at = now()"
            " RETURNING written),"
            f" dropped AS (DELETE FROM {self.table} WHERE {key} <> %s"
            f" AND (written <= (SELECT written FROM saved) - %s OR NOT {self._young()}))"
            " SELECT written FROM saved"
        )

        def save(db: psycopg.Connection[tuple[Any, ...]]) -> int:
            row = db.execute(sql, (*values, values[0], self.max_rows)).fetchone()
            assert row is not None
            return int(row[0])

        return self._run("save to", save)

    def remove(self, key: str) -> bool:
        sql = f"DELETE FROM {self.table} WHERE {self.columns[0]} = %s"
        return self._run("save to", lambda db: db.execute(sql, (key,)).rowcount > 0)

    # ----------------------------------------------------------------- what PostgreSQL says

    def _connect(self, timeout_s: float) -> psycopg.Connection[tuple[Any, ...]]:
        """A new connection, the layout checked (and migrated) on it."""
        db: psycopg.Connection[tuple[Any, ...]] = self._psycopg.connect(
            self._conninfo, autocommit=True, connect_timeout=max(2, math.ceil(timeout_s)), application_name="agentkv"
        )
        try:
            self._statement_ms = 0
            self._bound(db, timeout_s)
            _migrate(db, self.url)
        except BaseException:
            db.close()
            raise
        return db

    def _bound(self, db: psycopg.Connection[tuple[Any, ...]], left_s: float) -> None:
        left_ms = max(1, int(left_s * 1000))
        if abs(self._statement_ms - left_ms) > 50:  # set again only after a wait for the lock (or one before)
            db.execute(f"SET statement_timeout = {left_ms}")
            self._statement_ms = left_ms

    def _fault_of(self, doing: str, exc: Exception | None) -> StoreUnavailableError:
        return _fault(self.url, doing, exc, self.timeout_s)

    def _retried(self, exc: Exception) -> bool:
        return _reason(exc) == "unreachable"  # the server restarted under an old connection

    def _keeps(self, fault: StoreUnavailableError, db: psycopg.Connection[tuple[Any, ...]]) -> bool:
        return fault.reason not in ("unreachable", "other") and not db.broken and not db.closed


@dataclass(frozen=True)
class StoreLease:
    """What taking a conversation's lease found (`take_lease`)."""

    written: int | None
    """The conversation's row's ``written`` number (None: no row): a door whose copy was saved under another
    number holds a stale one (another door stepped the conversation since)."""
    pin: str | None
    """The pin the row offered (`SavedPin` JSON), now taken off it: this door's alone."""
    took_over: bool
    """Taken from another owner whose lease had expired: it died, perhaps in a step that used the pin."""


def take_lease(table: PostgresTable, key: str, owner: str, ttl_s: float) -> StoreLease | None:
    """Take ``key``'s lease for ``owner`` until ``ttl_s`` from now (the server's clock), and the pin its session
    row offers: the `StoreLease` when it was free, expired or ``owner``'s already; None when another owner holds it.
    One statement (its parts all see the rows as they were before it)."""
    sql = (
        "WITH before AS (SELECT owner FROM agentkv_leases WHERE key = %(key)s),"
        " taken AS (INSERT INTO agentkv_leases (key, owner, expires)"
        " VALUES (%(key)s, %(owner)s, now() + %(ttl)s * interval '1 second')"
        " ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, expires = EXCLUDED.expires"
        " WHERE agentkv_leases.expires < now() OR agentkv_leases.owner = EXCLUDED.owner RETURNING 1),"
        " saved AS (SELECT written, pin FROM agentkv_sessions WHERE key = %(key)s),"
        " offered AS (UPDATE agentkv_sessions SET pin = NULL, pin_id = NULL"
        " WHERE key = %(key)s AND pin IS NOT NULL AND EXISTS (SELECT 1 FROM taken) RETURNING 1)"
        " SELECT EXISTS (SELECT 1 FROM taken), (SELECT written FROM saved), (SELECT pin FROM saved),"
        " (SELECT owner FROM before)"  # `offered` runs all the same: PostgreSQL runs every data-modifying WITH
    )

    def take(db: psycopg.Connection[tuple[Any, ...]]) -> StoreLease | None:
        row = db.execute(sql, {"key": key, "owner": owner, "ttl": ttl_s}).fetchone()
        assert row is not None
        taken, written, pin, before = row
        if not taken:
            return None
        return StoreLease(written, pin, took_over=before is not None and before != owner)

    return table._run("save to", take)


def take_pin_back(table: PostgresTable, key: str, pin_id: str) -> bool:
    """Take the pin ``pin_id`` off ``key``'s row: True when it was still offered there (no other door can have
    it now), False when it was taken or replaced meanwhile."""
    sql = "UPDATE agentkv_sessions SET pin = NULL, pin_id = NULL WHERE key = %s AND pin_id = %s"
    return table._run("save to", lambda db: db.execute(sql, (key, pin_id)).rowcount == 1)


def offer_pin(table: PostgresTable, key: str, written: int, owner: str, pin: str, pin_id: str) -> bool:
    """Offer a pin on ``key``'s row outside a save (a door renewed its session's pin between steps): True when it
    did; False, offering nothing, when the row moved on since the save numbered ``written`` (another door saved a
    step), offers a pin already, or another owner holds the conversation's live lease (it may be stepping it)."""
    sql = (
        "UPDATE agentkv_sessions SET pin = %(pin)s, pin_id = %(pin_id)s"
        " WHERE key = %(key)s AND written = %(written)s AND pin IS NULL AND NOT EXISTS"
        " (SELECT 1 FROM agentkv_leases WHERE key = %(key)s AND owner <> %(owner)s AND expires >= now())"
    )
    values = {"pin": pin, "pin_id": pin_id, "key": key, "written": written, "owner": owner}
    return table._run("save to", lambda db: db.execute(sql, values).rowcount == 1)


def renew_leases(table: PostgresTable, keys: Sequence[str], owner: str, ttl_s: float) -> None:
    """Move the expiry of ``owner``'s leases of ``keys`` to ``ttl_s`` from now."""
    sql = "UPDATE agentkv_leases SET expires = now() + %s * interval '1 second' WHERE owner = %s AND key = ANY(%s)"
    table._run("save to", lambda db: db.execute(sql, (ttl_s, owner, list(keys))))


def drop_lease(table: PostgresTable, key: str, owner: str) -> None:
    """Give ``key``'s lease back (nothing when ``owner`` no longer holds it)."""
    table._run(
        "save to", lambda db: db.execute("DELETE FROM agentkv_leases WHERE key = %s AND owner = %s", (key, owner))
    )


def _migrate(db: psycopg.Connection[tuple[Any, ...]], url: str) -> None:
    """Bring the database's layout to `SCHEMA_VERSION`, or refuse a newer one (a `UserError`). A database already
    there is only read; one behind is migrated in one transaction, under the advisory lock."""
    if _version(db, url) == SCHEMA_VERSION:
        return
    with db.transaction():
        db.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        db.execute("CREATE TABLE IF NOT EXISTS agentkv_schema (version integer NOT NULL)")
        found = _version(db, url)  # again, under the lock: another door may have migrated it meanwhile
        for version in range(found, SCHEMA_VERSION):
            for statement in _MIGRATIONS[version]:
                db.execute(statement)
        if found < SCHEMA_VERSION:
            db.execute("DELETE FROM agentkv_schema")
            db.execute("INSERT INTO agentkv_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
            logger.info("agentkv: the store %s's layout went from version %d to %d", url, found, SCHEMA_VERSION)


def _version(db: psycopg.Connection[tuple[Any, ...]], url: str) -> int:
    """The database's layout version (0: none yet); a newer one than this agentkv knows is a `UserError`."""
    row = db.execute("SELECT to_regclass('agentkv_schema') IS NOT NULL").fetchone()
    if row is None or not row[0]:
        return 0
    row = db.execute("SELECT max(version) FROM agentkv_schema").fetchone()
    found = int(row[0]) if row is not None and row[0] is not None else 0
    if found > SCHEMA_VERSION:
        raise UserError(
            f"the store {url} holds agentkv's tables in layout version {found}, newer than this agentkv's "
            f"({SCHEMA_VERSION}): a newer agentkv migrated it; upgrade agentkv to use it, or name another database"
        )
    return found


_SAID = {
    "unreachable": "unreachable",
    "timeout": "too slow",
    "locked": "locked",
    "full": "full",
    "read_only": "refusing writes",
    "other": "failing",
}
"""Each fault's reason, as a sentence says it."""


def _reason(exc: Exception | None) -> str:
    """What a psycopg error says of the server: ``unreachable``, ``timeout`` (``statement_timeout``), ``locked``,
    ``full``, ``read_only`` or ``other`` (None: the calls queued ahead of this one took the store's timeout)."""
    import psycopg

    if exc is None:
        return "timeout"
    state = str(getattr(exc, "sqlstate", None) or "")
    by_state = {"57014": "timeout", "55P03": "locked", "53100": "full", "25006": "read_only", "42501": "read_only"}
    if state in by_state:
        return by_state[state]
    if state.startswith(("08", "57P", "53300")) or (not state and isinstance(exc, psycopg.OperationalError)):
        return "unreachable"  # no connection, a lost one, a server shutting down or out of connections
    return "other"


def _fault(url: str, doing: str, exc: Exception | None, timeout_s: float) -> StoreUnavailableError:
    """The `StoreUnavailableError` of a psycopg error (None: the calls queued ahead of this one took
    ``timeout_s``): what failed, why, and what to do."""
    reason = _reason(exc)
    said = " ".join(str(exc).split()) if exc is not None else ""
    why = {
        "unreachable": f"the server could not be reached ({said}): check that it runs and takes connections",
        "timeout": (
            f"the server did not answer within {timeout_s:g} s (the store's timeout_s; agentkv serve --store-timeout-s)"
            if exc is not None
            else f"the calls ahead of this one have waited more than {timeout_s:g} s for the server"
        ),
        "locked": f"a lock it needs is held elsewhere past {timeout_s:g} s ({said})",
        "full": f"the server's disk is full ({said}): free space on it",
        "read_only": f"the server refuses this user's writes ({said}): a standby, or missing privileges",
        "other": f"{said} ({type(exc).__name__})",
    }[reason]
    retry = 1
    said_publicly = {  # without the driver's words, which name the server's host and port
        "unreachable": "the server could not be reached",
        "timeout": f"the server did not answer within {timeout_s:g} s",
        "locked": f"a lock it needs is held elsewhere past {timeout_s:g} s",
        "full": "the server's disk is full",
        "read_only": "the server refuses this user's writes",
        "other": f"the server failed ({type(exc).__name__})",
    }[reason]
    end = "nothing of this call was kept: retry after"
    return StoreUnavailableError(
        f"could not {doing} the store {url}: {why}; {end} {retry} s",
        path=url,
        reason=reason,
        retry_after_s=retry,
        public=f"could not {doing} the store: {said_publicly}; {end} {retry} s",
    )
