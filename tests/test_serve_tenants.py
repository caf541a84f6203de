"""Two tenants on one door (issue #52, points 1-5; docs/serve.md, "Serving many users"), on `HonestPairEngine`: every
move one tenant can make at the other's conversations, responses, cache and pins gets the answer an id that does not
exist gets, and changes nothing of the other's. The same moves on the real pair, on SQLite and PostgreSQL:
tests/test_serve_tenants_pair.py."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agentkv import SessionPool, SqliteSessionStore
from agentkv._engines._system import free_port
from agentkv.engines import StepEvent, StepRequest
from agentkv.serve import FrontDoor, SqliteResponseStore
from agentkv.testing import HonestPairEngine
from serve_cli import serve_with_doubles
from tenants import ALICE, BOB, KEYS, cached, not_found, stats

SECRET = "My card number is 4111 1111 1111 1111; keep it for the order."
PREFIX = "You are the support agent of a shop. " * 8  # a few of the double's 16-token blocks


class GatedEngine(HonestPairEngine):
    """A step whose prompt holds ``"WAIT"`` waits at the gate until the test opens it (a conversation held busy)."""

    def __init__(self) -> None:
        super().__init__(lambda request: "Noted.", prefill_cache=True)
        self.gate = threading.Event()
        self.waiting = threading.Event()

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        if self.tokenizer_text(request).count("WAIT"):
            self.waiting.set()
            await anyio.to_thread.run_sync(self.gate.wait, abandon_on_cancel=True)
        async for event in super().step(request):
            yield event

    def tokenizer_text(self, request: StepRequest) -> str:
        from agentkv._session._session_core import load_tokenizer

        return str(load_tokenizer(str(self.info.model_path)).decode(request.prompt_token_ids[-40:]))


Door = tuple[str, GatedEngine, SessionPool, Path]


@pytest.fixture
def door(tmp_path: Path) -> Iterator[Door]:
    path = tmp_path / "serve.sqlite3"
    with (
        GatedEngine() as engine,
        SqliteSessionStore(path) as sessions,
        SqliteResponseStore(path) as responses,
        SessionPool(engine=engine, store=sessions, max_tokens=16) as pool,
        FrontDoor(pool, model_name="smol", api_keys=KEYS, port=free_port(), store=responses) as opened,
    ):
        yield opened.url, engine, pool, path
    engine.assert_honest()


def chat(url: str, key: dict[str, str], content: str, **fields: Any) -> httpx.Response:
    headers = key | fields.pop("headers", {})
    body = {"model": "smol", "messages": [{"role": "user", "content": content}], **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def respond(url: str, key: dict[str, str], **fields: Any) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json={"model": "smol", **fields}, headers=key, timeout=60)


def test_liveness_and_readiness_say_nothing_and_a_tenant_lists_only_its_own(door: Door) -> None:
    """Point 1: ``/health`` needs no key and shows no conversation; ``/v1/sessions`` needs one and lists the
    caller's own; another tenant's conversation is as absent as one never named."""
    url, _, _, _ = door
    assert chat(url, ALICE, "Hello", headers={"x-session-id": "c1"}).status_code == 200
    health = httpx.get(url + "/health")
    assert health.json() == {"status": "ok"} and "c1" not in health.text
    assert httpx.get(url + "/ready").status_code == 200
    assert httpx.get(url + "/v1/sessions").status_code == 401
    assert [s["id"] for s in httpx.get(url + "/v1/sessions", headers=ALICE).json()["data"]] == ["c1"]
    assert httpx.get(url + "/v1/sessions", headers=BOB).json() == {"object": "list", "data": [], "total": 0}
    never = httpx.delete(url + "/v1/sessions/never-named", headers=BOB)
    assert never.status_code == 404
    other = httpx.delete(url + "/v1/sessions/c1", headers=BOB)
    assert other.status_code == 404 and other.json()["error"] == {
        **never.json()["error"],
        "message": "Session with id 'c1' not found.",
    }
    assert [s["id"] for s in httpx.get(url + "/v1/sessions", headers=ALICE).json()["data"]] == ["c1"]


def test_another_tenants_conversation_key_is_a_conversation_of_its_own(door: Door) -> None:
    """Point 1: while alice's ``c1`` runs a step, bob's ``c1`` is bob's (no 409), and it neither evicts alice's
    pin nor reads her history: her next step pushes her KV back."""
    url, engine, pool, _ = door
    first = chat(url, ALICE, SECRET, headers={"x-session-id": "c1"})
    assert stats(first)["turn"] == 1
    history = [{"role": "user", "content": SECRET}, first.json()["choices"][0]["message"]]
    held: list[httpx.Response] = []
    waiting = threading.Thread(
        target=lambda: held.append(chat(url, ALICE, "WAIT please", headers={"x-session-id": "busy"}))
    )
    waiting.start()
    assert engine.waiting.wait(60)
    try:
        assert chat(url, BOB, "My own", headers={"x-session-id": "busy"}).status_code == 200  # alice's is busy
        bobs = chat(url, BOB, SECRET, headers={"x-session-id": "c1"})
        assert stats(bobs)["turn"] == 1 and not stats(bobs)["handle_forwarded"]  # nothing of alice's read
    finally:
        engine.gate.set()
        waiting.join(60)
    assert held[0].status_code == 200
    body = {"model": "smol", "messages": [*history, {"role": "user", "content": "And the total?"}]}
    again = httpx.post(url + "/v1/chat/completions", json=body, headers=ALICE | {"x-session-id": "c1"}, timeout=60)
    assert stats(again)["turn"] == 2 and stats(again)["handle_forwarded"]  # her pin untouched
    assert pool.session_for("c1", tenant="alice") is not pool.session_for("c1", tenant="bob")


def test_another_tenants_response_is_as_absent_as_one_never_kept(door: Door) -> None:
    """Point 2: bob can neither read, delete nor continue alice's response (each a 404 exactly as for an id never
    kept), nor overwrite it with a request_id; ids are the door's own, a client's request_id only echoed."""
    url, _, _, _ = door
    kept = respond(url, ALICE, input=SECRET, metadata={"order": "42"})
    assert kept.status_code == 200
    rid = kept.json()["id"]
    assert rid.startswith("resp_")
    path = url + "/v1/responses/"
    for method in ("GET", "DELETE"):
        theirs = not_found(httpx.request(method, path + rid, headers=BOB), "response_not_found")
        never = not_found(httpx.request(method, path + "resp_" + "0" * 32, headers=BOB), "response_not_found")
        assert theirs | {"message": ""} == never | {"message": ""}
    continued = respond(url, BOB, input="What was my card?", previous_response_id=rid)
    never = respond(url, BOB, input="What was my card?", previous_response_id="resp_" + "0" * 32)
    assert not_found(continued, "previous_response_not_found")["param"] == "previous_response_id"
    assert not_found(never, "previous_response_not_found")["param"] == "previous_response_id"
    forged = respond(url, BOB, input="Not yours", request_id=rid)
    assert forged.status_code == 200 and forged.json()["id"] != rid and forged.headers["x-request-id"] == rid
    odd = respond(url, BOB, input="Odd", request_id="../../etc/passwd")
    assert odd.status_code == 200 and odd.json()["id"].startswith("resp_")
    assert httpx.get(path + "../../etc/passwd", headers=BOB).status_code == 404
    mine = httpx.get(path + rid, headers=ALICE)
    assert mine.status_code == 200 and mine.json() == kept.json()  # neither overwritten nor deleted
    chained = respond(url, ALICE, input="Thanks", previous_response_id=rid)
    assert chained.status_code == 200 and chained.json()["agentkv"]["stats"]["handle_forwarded"]


def test_the_prefix_cache_is_each_tenants_own(door: Door) -> None:
    """Point 3: a prefix alice's steps cached gives bob no hit (no oracle of what alice sent); within a tenant the
    cache still serves; a request's own cache_salt goes over the tenant's, as vLLM's does."""
    url, _, _, _ = door
    assert chat(url, ALICE, PREFIX + "Account 1234?").status_code == 200
    assert cached(chat(url, ALICE, PREFIX + "Account 9999?")) > 0  # alice's own prefix: hit
    assert cached(chat(url, BOB, PREFIX + "Account 1234?")) == 0  # the same prompt: no hit for bob
    assert cached(chat(url, BOB, PREFIX + "Account 5678?")) > 0  # bob's own, now cached
    assert cached(chat(url, BOB, PREFIX + "Account 0000?", cache_salt="other")) == 0
    assert cached(chat(url, BOB, PREFIX + "Account 1111?", cache_salt="other")) > 0
    bad = chat(url, BOB, "Hi", cache_salt="a/b")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_user_is_metadata_never_a_conversation(door: Door) -> None:
    """Point 4: two chats of one end user (``user``) are two conversations, neither a 409 nor the other's pin."""
    url, _, pool, _ = door
    one = chat(url, ALICE, "First chat", user="end-user-7")
    two = chat(url, ALICE, "Second chat", user="end-user-7")
    assert stats(one)["turn"] == stats(two)["turn"] == 1 and "x-session-id" not in two.headers
    assert pool.conversations_of("alice") == []
    assert chat(url, ALICE, "Hi", user="u" * 257).json()["error"]["param"] == "user"


def test_what_is_kept_is_the_owners_and_bad_ids_are_400s(door: Door) -> None:
    """Point 5: the store file is its owner's alone (0600); an id with a NUL, CR, LF or a non-Latin-1 letter is a
    400 before anything runs or is kept (it was a 503 naming PostgreSQL's address, a 500, a dropped connection);
    a tenant forgets its conversation: session and snapshot gone."""
    url, engine, pool, path = door
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    steps = len(engine.steps)
    for bad in ("a\x00b", "a\r\nb", "caf\u00e9", "", "x" * 257):
        answer = chat(url, ALICE, "Hi", session_id=bad)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "session_id", (bad, answer.text)
    answer = httpx.post(
        url + "/v1/chat/completions",
        content=json.dumps({"messages": [{"role": "user", "content": "Hi"}]}).encode(),
        headers=[(b"authorization", ALICE["authorization"].encode()), (b"x-session-id", "caf\u00e9".encode())],
        timeout=60,
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "x-session-id"
    assert len(engine.steps) == steps
    assert chat(url, ALICE, "Keep me", headers={"x-session-id": "gone"}).status_code == 200
    forgotten = httpx.delete(url + "/v1/sessions/gone", headers=ALICE)
    assert forgotten.json() == {"id": "gone", "object": "session", "deleted": True}
    assert pool.session_for("gone", tenant="alice") is None
    again = chat(url, ALICE, "Keep me", headers={"x-session-id": "gone"})
    assert stats(again)["turn"] == 1 and stats(again)["miss_reason"] != "resumed"  # nothing left to resume
    assert httpx.delete(url + "/v1/sessions/gone", headers=ALICE).status_code == 200
    assert httpx.delete(url + "/v1/sessions/gone", headers=ALICE).status_code == 404


def test_a_door_that_keeps_no_responses_finds_none(tmp_path: Path) -> None:
    """``keep_responses=False`` (``--no-store-responses``, as vLLM without its store): ``store`` is taken as false,
    so a response can be neither retrieved nor continued (404s), and the response says ``store: false``."""
    with (
        HonestPairEngine(lambda request: "Noted.") as engine,
        SessionPool(engine=engine, max_tokens=8) as pool,
        FrontDoor(pool, model_name="smol", port=free_port(), keep_responses=False) as opened,
    ):
        first = httpx.post(opened.url + "/v1/responses", json={"input": "Hi"}, timeout=60)
        assert first.status_code == 200 and first.json()["store"] is False
        rid = first.json()["id"]
        not_found(httpx.get(f"{opened.url}/v1/responses/{rid}"), "response_not_found")
        body = {"input": "Again", "previous_response_id": rid}
        not_found(httpx.post(opened.url + "/v1/responses", json=body, timeout=60), "previous_response_not_found")


def test_a_memory_store_forgets_a_response_past_its_age(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentkv.serve import MemoryResponseStore, StoredResponse

    now = [100.0]
    monkeypatch.setattr("agentkv._surfaces._response_store.time.monotonic", lambda: now[0])
    store = MemoryResponseStore(max_age_s=60.0)
    store.put(StoredResponse("r1", None, (), {}), tenant="alice")
    assert store.get("r1", tenant="alice") is not None and store.get("r1", tenant="bob") is None
    assert store.get("r1") is None  # the default tenant's are another's too
    now[0] += 61.0
    assert store.get("r1", tenant="alice") is None and len(store) == 0


def test_agentkv_serve_takes_keys_a_gateways_header_quotas_and_retention(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command line's keys (repeated, in a file, in the environment), the tenant header, the quotas, the
    retention and the responses' store reach the pool, the door and the stores; a malformed keys file stops it
    before anything starts, naming its line but never a key."""
    keys = tmp_path / "keys"
    keys.write_text("# tenant key\nalice sk-file-alice\nalice sk-file-alice-2  # rotated\nbob sk-file-bob\n")
    argv = ["serve", "--store", str(tmp_path / "s.sqlite3"), "--api-key", "k1", "--api-key", "k2"]
    argv += ["--api-keys-file", str(keys), "--tenant-header", "x-end-user", "--tenant-max-sessions", "3"]
    argv += ["--tenant-max-in-flight", "2", "--tenant-max-pinned-tokens", "5000", "--retention-s", "60"]
    argv += ["--no-store-responses", "--write-timeout-s", "5"]
    stores: list[Any] = []
    code, pool, door = serve_with_doubles(monkeypatch, argv, while_serving=lambda given: stores.append(given["store"]))
    assert code == 0
    assert door["api_key"] == ["k1", "k2"] and door["tenant_header"] == "x-end-user"
    assert door["api_keys"] == {"sk-file-alice": "alice", "sk-file-alice-2": "alice", "sk-file-bob": "bob"}
    assert (door["tenant_max_in_flight"], door["write_timeout_s"], door["keep_responses"]) == (2, 5.0, False)
    assert (pool["tenant_max_sessions"], pool["tenant_max_pinned_tokens"]) == (3, 5000)
    assert stores[0]._table.max_age_s == 60.0 and pool["store"]._table.max_age_s == 60.0
    monkeypatch.setenv("AGENTKV_API_KEY", "e1, e2")
    code, _, door = serve_with_doubles(monkeypatch, ["serve", "--store", "memory"])
    assert code == 0 and door["api_key"] == ["e1", "e2"] and door["keep_responses"] is True
    keys.write_text("alice sk-secret-key extra\n")
    code, pool, _ = serve_with_doubles(monkeypatch, ["serve", "--store", "memory", "--api-keys-file", str(keys)])
    said = capsys.readouterr().err
    assert code == 2 and "line 1: write one tenant and one key per line" in said and "sk-secret" not in said
    assert pool == {}  # refused before the pool was made
