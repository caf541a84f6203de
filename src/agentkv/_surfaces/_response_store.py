"""Where the front door keeps Responses-API responses, so that ``previous_response_id`` continues them
and ``GET /v1/responses/{id}`` answers them again.

A stored response holds the whole conversation through it, as the chat messages the pool
takes (the next request's conversation is the stored one plus its new input items), and the
``response`` object as it was returned. Every response is its tenant's: a store answers a tenant only with its
own (another tenant's id reads as one never stored), and with ``max_age_s`` forgets a response that old. Three
stores: `MemoryResponseStore` (bounded, gone with
the process), `SqliteResponseStore` (one table of its own in one file: a server restarted on
the same file continues its conversations) and `PostgresResponseStore` (a table in a PostgreSQL
database, which several servers share).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._postgres import PostgresTable
from .._sqlite import STORE_TIMEOUT_S, SqliteTable, Store, positive
from .._store_table import StoreTable, check_max_age, tenant_key

__all__ = ["MemoryResponseStore", "PostgresResponseStore", "ResponseStore", "SqliteResponseStore", "StoredResponse"]

logger = logging.getLogger("agentkv")


@dataclass(frozen=True)
class StoredResponse:
    """One response as ``previous_response_id`` continues it."""

    response_id: str
    conversation_id: str | None
    """The pool conversation its chain lands on: the ``x-session-id`` its chain was named with, or None for an
    unnamed chain (the pool then finds its session by the conversation's history)."""
    messages: tuple[dict[str, Any], ...]
    """The conversation through this response: OpenAI chat messages, instructions excluded (they are not carried over)."""
    response: dict[str, Any]
    """The ``response`` object as it was returned (``GET /v1/responses/{id}`` answers it again)."""


class ResponseStore(Store):
    """Responses by id, each a tenant's (``tenant``: None is the default tenant). Implementations are safe to call
    from several threads."""

    @abstractmethod
    def get(self, response_id: str, *, tenant: str | None = None) -> StoredResponse | None:
        """``tenant``'s stored response, or None when it is unknown to it (never stored, dropped, or another
        tenant's)."""

    @abstractmethod
    def put(self, response: StoredResponse, *, tenant: str | None = None) -> None:
        """Keep ``response`` as ``tenant``'s (a response id is stored once)."""

    @abstractmethod
    def delete(self, response_id: str, *, tenant: str | None = None) -> bool:
        """Forget ``tenant``'s response; False when it was unknown to it."""


class MemoryResponseStore(ResponseStore):
    """Responses in this process, the least recently used dropped beyond ``max_responses``.

    Args:
        max_responses: the most responses kept.
        max_age_s: the most seconds a response is kept after it was stored (None: until ``max_responses`` drops it).
    """

    def __init__(self, max_responses: int = 10_000, *, max_age_s: float | None = None) -> None:
        self.max_responses = positive("max_responses", max_responses)
        self.max_age_s = check_max_age(max_age_s)
        self._responses: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()
        """Each response with when it was stored, by its tenant's key, the least recently used first."""
        self._lock = threading.Lock()

    def get(self, response_id: str, *, tenant: str | None = None) -> StoredResponse | None:
        key = tenant_key(tenant, response_id)
        with self._lock:
            found = self._responses.get(key)
            if found is None:
                return None
            if self.max_age_s is not None and time.monotonic() - found[0] > self.max_age_s:
                del self._responses[key]
                return None
            self._responses.move_to_end(key)
            return found[1]

    def put(self, response: StoredResponse, *, tenant: str | None = None) -> None:
        key = tenant_key(tenant, response.response_id)
        with self._lock:
            self._responses[key] = (time.monotonic(), response)
            self._responses.move_to_end(key)
            while len(self._responses) > self.max_responses:
                self._responses.popitem(last=False)
            if self.max_age_s is not None:
                oldest = time.monotonic() - self.max_age_s
                for old in [k for k, (stored, _) in self._responses.items() if stored < oldest]:
                    del self._responses[old]

    def delete(self, response_id: str, *, tenant: str | None = None) -> bool:
        with self._lock:
            return self._responses.pop(tenant_key(tenant, response_id), None) is not None

    def __len__(self) -> int:
        return len(self._responses)


class _TableResponseStore(ResponseStore):
    """Responses in a `StoreTable` of (tenant's response id, conversation id, messages JSON, response JSON) rows
    (a subclass opens it: ``_table``)."""

    _table: StoreTable[Any]

    def get(self, response_id: str, *, tenant: str | None = None) -> StoredResponse | None:
        row = self._table.fetch(tenant_key(tenant, response_id))
        if row is None:
            return None
        return StoredResponse(response_id, row[0], tuple(json.loads(row[1])), json.loads(row[2]))

    def put(self, response: StoredResponse, *, tenant: str | None = None) -> None:
        messages, kept = json.dumps(list(response.messages)), json.dumps(response.response)
        self._table.save(tenant_key(tenant, response.response_id), response.conversation_id, messages, kept)

    def delete(self, response_id: str, *, tenant: str | None = None) -> bool:
        return self._table.remove(tenant_key(tenant, response_id))

    def close(self) -> None:
        self._table.close()


_COLUMNS = ("response_id TEXT PRIMARY KEY", "conversation_id TEXT", "messages TEXT NOT NULL", "response TEXT NOT NULL")


class SqliteResponseStore(_TableResponseStore):
    """Responses in one SQLite file (a table of their own, ``responses``), kept across restarts; the oldest
    dropped beyond ``max_responses``. A ``responses`` table of another layout (an older agentkv's) is
    replaced by an empty one, with a warning: its responses can no longer be continued.

    A call that cannot read or write the file (locked by another process past ``timeout_s``, full, read-only)
    raises `StoreUnavailableError` and keeps nothing (``agentkv serve`` answers 503); the next call tries again.

    Args:
        path: the database file (created, with its folder, if missing; other tables in it are left alone).
        max_responses: the most responses kept.
        timeout_s: the most a call waits for the file's write lock (another process's) before it fails.
        max_age_s: the most seconds a response is kept after it was stored (None: until ``max_responses`` drops it).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_responses: int = 100_000,
        timeout_s: float = STORE_TIMEOUT_S,
        max_age_s: float | None = None,
    ) -> None:
        self.max_responses = positive("max_responses", max_responses)
        self._table = SqliteTable(
            path,
            table="responses",
            columns=_COLUMNS,
            max_rows=self.max_responses,
            max_age_s=max_age_s,
            timeout_s=timeout_s,
        )
        self.path = self._table.path
        self.timeout_s = self._table.timeout_s


class PostgresResponseStore(_TableResponseStore):
    """Responses in a PostgreSQL database (its ``agentkv_responses`` table: src/agentkv/_postgres.py says the
    layout), which several servers share: a chain one server stored continues on any; the oldest dropped beyond
    ``max_responses``. Reached, timed and failing as `PostgresSessionStore` (a `StoreUnavailableError`, which
    ``agentkv serve`` answers with a 503); needs psycopg (``pip install 'agentkv-vllm[postgresql]'``).

    Args:
        url: the database's URL, as `PostgresSessionStore` takes it.
        max_responses: the most responses kept.
        timeout_s: the most a call waits, as `PostgresSessionStore`'s.
        max_age_s: the most seconds a response is kept after it was stored (None: until ``max_responses`` drops it).
    """

    def __init__(
        self,
        url: str,
        *,
        max_responses: int = 100_000,
        timeout_s: float = STORE_TIMEOUT_S,
        max_age_s: float | None = None,
    ) -> None:
        self.max_responses = positive("max_responses", max_responses)
        names = [column.split()[0] for column in _COLUMNS]
        self._table = PostgresTable(
            url,
            table="agentkv_responses",
            columns=names,
            max_rows=self.max_responses,
            timeout_s=timeout_s,
            max_age_s=max_age_s,
        )
        self.url: str = self._table.url
        """The database, its password hidden."""
        self.timeout_s = self._table.timeout_s
