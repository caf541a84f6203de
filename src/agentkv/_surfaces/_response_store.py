"""Where the front door keeps Responses-API responses, so that ``previous_response_id`` continues them.

A stored response holds the whole conversation through it, as the chat messages the pool
takes: the next request's conversation is the stored one plus its new input items. Two
stores: `MemoryResponseStore` (bounded, gone with the process) and `SqliteResponseStore`
(one table in one file: a server restarted on the same file continues its conversations).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import UserError
from .._model import cache_dir

__all__ = ["MemoryResponseStore", "ResponseStore", "SqliteResponseStore", "StoredResponse", "default_store_path"]


@dataclass(frozen=True)
class StoredResponse:
    """One response as ``previous_response_id`` continues it."""

    response_id: str
    conversation_id: str
    """The pool conversation its chain lands on (the ``x-session-id`` it was sent with, else its chain's first response id)."""
    messages: tuple[dict[str, Any], ...]
    """The conversation through this response: OpenAI chat messages, instructions excluded (they are not carried over)."""


class ResponseStore(ABC):
    """Responses by id. Implementations are safe to call from several threads."""

    @abstractmethod
    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None when it is unknown (never stored, or dropped)."""

    @abstractmethod
    def put(self, response: StoredResponse) -> None:
        """Keep ``response`` (a response id is stored once)."""

    def close(self) -> None:
        """Release what the store holds open (nothing by default)."""

    def __enter__(self) -> ResponseStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{name} must be a positive int, not {value!r}")
    return value


class MemoryResponseStore(ResponseStore):
    """Responses in this process, the least recently used dropped beyond ``max_responses``.

    Args:
        max_responses: the most responses kept.
    """

    def __init__(self, max_responses: int = 10_000) -> None:
        self.max_responses = _positive("max_responses", max_responses)
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

    def __len__(self) -> int:
        return len(self._responses)


def default_store_path() -> Path:
    """Where ``agentkv serve`` keeps responses by default: ``$AGENTKV_HOME/responses.sqlite3``."""
    return cache_dir().parent / "responses.sqlite3"


class SqliteResponseStore(ResponseStore):
    """Responses in one SQLite file (one table), kept across restarts; the oldest dropped beyond ``max_responses``.

    Args:
        path: the database file (created, with its folder, if missing).
        max_responses: the most responses kept.
    """

    def __init__(self, path: str | Path, *, max_responses: int = 100_000) -> None:
        self.path = Path(path).expanduser()
        self.max_responses = _positive("max_responses", max_responses)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS responses ("
            "response_id TEXT PRIMARY KEY, conversation_id TEXT NOT NULL, messages TEXT NOT NULL)"
        )

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT conversation_id, messages FROM responses WHERE response_id = ?", (response_id,)
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(response_id, row[0], tuple(json.loads(row[1])))

    def put(self, response: StoredResponse) -> None:
        messages = json.dumps(list(response.messages))
        with self._lock:
            cursor = self._db.execute(
                "INSERT OR REPLACE INTO responses (response_id, conversation_id, messages) VALUES (?, ?, ?)",
                (response.response_id, response.conversation_id, messages),
            )
            if cursor.lastrowid is not None and cursor.lastrowid > self.max_responses:
                self._db.execute("DELETE FROM responses WHERE rowid <= ?", (cursor.lastrowid - self.max_responses,))

    def close(self) -> None:
        with self._lock:
            self._db.close()
