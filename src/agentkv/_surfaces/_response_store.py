"""Where the front door keeps Responses-API responses, so that ``previous_response_id`` continues them
and ``GET /v1/responses/{id}`` answers them again.

A stored response holds the whole conversation through it, as the chat messages the pool
takes (the next request's conversation is the stored one plus its new input items), and the
``response`` object as it was returned. Three stores: `MemoryResponseStore` (bounded, gone with
the process), `SqliteResponseStore` (one table of its own in one file: a server restarted on
the same file continues its conversations) and `PostgresResponseStore` (a table in a PostgreSQL
database, which several servers share).
"""

from __future__ import annotations

import json
import logging
import threading
from abc import abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._postgres import PostgresTable
from .._sqlite import STORE_TIMEOUT_S, SqliteTable, Store, positive
from .._store_table import StoreTable

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
    """Responses by id. Implementations are safe to call from several threads."""

    @abstractmethod
    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None when it is unknown (never stored, or dropped)."""

    @abstractmethod
    def put(self, response: StoredResponse) -> None:
        """Keep ``response`` (a response id is stored once)."""

    @abstractmethod
    def delete(self, response_id: str) -> bool:
        """Forget the response; False when it was unknown."""


class MemoryResponseStore(ResponseStore):
    """Responses in this process, the least recently used dropped beyond ``max_responses``.

    Args:
        max_responses: the most responses kept.
    """

    def __init__(self, max_responses: int = 10_000) -> None:
        self.max_responses = positive("max_responses", max_responses)
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            found = self._responses.get(response_id)
            if found is not None:
                self._responses.move_to_end(response_id)
            return found

    def put(self, response: StoredResponse) -> None:
        with self._lock:
            self._responses[response.response_id] = response
            self._responses.move_to_end(response.response_id)
            while len(self._responses) > self.max_responses:
                self._responses.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._responses.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._responses)


class _TableResponseStore(ResponseStore):
    """Responses in a `StoreTable` of (response id, conversation id, messages JSON, response JSON) rows (a
    subclass opens it: ``_table``)."""

    _table: StoreTable[Any]

    def get(self, response_id: str) -> StoredResponse | None:
        row = self._table.fetch(response_id)
        if row is None:
            return None
        return StoredResponse(response_id, row[0], tuple(json.loads(row[1])), json.loads(row[2]))

    def put(self, response: StoredResponse) -> None:
        messages, kept = json.dumps(list(response.messages)), json.dumps(response.response)
        self._table.save(response.response_id, response.conversation_id, messages, kept)

    def delete(self, response_id: str) -> bool:
        return self._table.remove(response_id)

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
    """

    def __init__(self, path: str | Path, *, max_responses: int = 100_000, timeout_s: float = STORE_TIMEOUT_S) -> None:
        self.max_responses = positive("max_responses", max_responses)
        self._table = SqliteTable(
            path, table="responses", columns=_COLUMNS, max_rows=self.max_responses, timeout_s=timeout_s
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
    """

    def __init__(self, url: str, *, max_responses: int = 100_000, timeout_s: float = STORE_TIMEOUT_S) -> None:
        self.max_responses = positive("max_responses", max_responses)
        names = [column.split()[0] for column in _COLUMNS]
        self._table = PostgresTable(
            url, table="agentkv_responses", columns=names, max_rows=self.max_responses, timeout_s=timeout_s
        )
        self.url: str = self._table.url
        """The database, its password hidden."""
        self.timeout_s = self._table.timeout_s
