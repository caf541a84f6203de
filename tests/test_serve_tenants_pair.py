"""Two tenants on the real door (issue #52, done-when 1): the real pair over real NIXL, the door's stores on SQLite
and on a real PostgreSQL server. Every cross-tenant move of the issue's points 1-5 gets the answer an id that never
existed gets (404s), the other tenant's prefix gives ``cached_tokens`` 0, and the victim's pin is untouched: its
next turn pulls its KV back. The logic, move by move and on every abuse input: tests/test_serve_tenants.py."""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv import EmbeddedPair, PostgresSessionStore, SessionPool, SqliteSessionStore
from agentkv._engines._system import free_port
from agentkv.serve import FrontDoor, PostgresResponseStore, SqliteResponseStore
from tenants import ALICE, BOB, KEYS, cached, not_found, stats

pytestmark = pytest.mark.pair

SECRET = "You are the billing assistant of a shop. My card number is 4111 1111 1111 1111. What do I owe?"
NOWHERE = "resp_" + "0" * 32


@contextlib.contextmanager
def door_on(pair: EmbeddedPair, kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """The door on the pair with both stores on SQLite or PostgreSQL; its URL."""
    with contextlib.ExitStack() as stack:
        if kind == "sqlite":
            path = tmp_path / "serve.sqlite3"
            sessions: Any = stack.enter_context(SqliteSessionStore(path))
            responses: Any = stack.enter_context(SqliteResponseStore(path))
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # point 5: its owner's alone
        else:
            url = request.getfixturevalue("postgres_url")
            sessions = stack.enter_context(PostgresSessionStore(url))
            responses = stack.enter_context(PostgresResponseStore(url))
        pool = stack.enter_context(
            SessionPool(engine=pair, store=sessions, max_tokens=8, cache_salt=f"tenants-{kind}-{uuid.uuid4().hex}")
        )
        door = stack.enter_context(FrontDoor(pool, model_name="smol", api_keys=KEYS, port=free_port(), store=responses))
        yield door.url


def chat(url: str, key: dict[str, str], messages: list[dict[str, Any]], **fields: Any) -> httpx.Response:
    headers = key | fields.pop("headers", {})
    body = {"model": "smol", "messages": messages, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=300)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_one_tenant_reaches_nothing_of_anothers_on_the_real_pair(
    pair: EmbeddedPair, kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    with door_on(pair, kind, tmp_path, request) as url:
        asked = [{"role": "user", "content": SECRET}]
        first = chat(url, ALICE, asked, headers={"x-session-id": "c1"})
        assert stats(first)["turn"] == 1

        # 1: nothing listed without a key, nor to another tenant; its conversation id is bob's own
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert httpx.get(url + "/v1/sessions", headers=BOB).json()["data"] == []
        not_found(httpx.delete(url + "/v1/sessions/c1", headers=BOB), "not_found")
        # 3: alice's exact prompt, under her conversation's name, gives bob no cached token
        bobs = chat(url, BOB, asked, headers={"x-session-id": "c1"})
        assert stats(bobs)["turn"] == 1 and cached(bobs) == 0

        # 2: her response is as absent to him as one never kept, and his request_id cannot overwrite it
        kept = httpx.post(url + "/v1/responses", json={"model": "smol", "input": SECRET}, headers=ALICE, timeout=300)
        assert kept.status_code == 200, kept.text
        rid = kept.json()["id"]
        for method in ("GET", "DELETE"):
            not_found(httpx.request(method, f"{url}/v1/responses/{rid}", headers=BOB), "response_not_found")
            not_found(httpx.request(method, f"{url}/v1/responses/{NOWHERE}", headers=BOB), "response_not_found")
        body = {"model": "smol", "input": "And my card?", "previous_response_id": rid}
        not_found(httpx.post(url + "/v1/responses", json=body, headers=BOB, timeout=300), "previous_response_not_found")
        forged = {"model": "smol", "input": "Mine now", "request_id": rid}
        assert httpx.post(url + "/v1/responses", json=forged, headers=BOB, timeout=300).json()["id"] != rid
        assert httpx.get(f"{url}/v1/responses/{rid}", headers=ALICE).json() == kept.json()

        # 4: user is metadata: two chats of one end user are two conversations
        one = chat(url, BOB, [{"role": "user", "content": "First chat"}], user="end-user-7")
        two = chat(url, BOB, [{"role": "user", "content": "Second chat"}], user="end-user-7")
        assert stats(one)["turn"] == stats(two)["turn"] == 1

        # 5: an id with a NUL is a 400 (it was a 503 naming the database's address), before anything runs
        bad = chat(url, BOB, asked, session_id="a\x00b")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id"

        # her pin untouched by all of it: her next turn pulls her conversation's KV back from D
        asked.append(first.json()["choices"][0]["message"])
        asked.append({"role": "user", "content": "Thanks. And the due date?"})
        again = chat(url, ALICE, asked, headers={"x-session-id": "c1"})
        assert stats(again)["turn"] == 2 and stats(again)["handle_forwarded"] and stats(again)["pulled_tokens"] > 0
        assert cached(again) > 0
