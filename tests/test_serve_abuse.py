"""A hostile or careless client (issue #52, points 6-11; docs/serve.md, "Serving many users", the table of bounds), on
`HonestPairEngine`: every abuse input gets its 4xx in OpenAI's error shape before it costs anything, nothing of it
is run or kept, and one tenant cannot take another's room. How fast each refusal comes while another tenant streams,
and the door's memory after 1,000 of them: scripts/bench_abuse.py (timings are not asserted here)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import pytest

from agentkv import SessionPool
from agentkv._engines._system import free_port
from agentkv.engines import StepEvent, StepRequest
from agentkv.serve import FrontDoor
from agentkv.testing import HonestPairEngine

KEYS = {"sk-alice-0123456789": "alice", "sk-bob-9876543210": "bob"}
ALICE, BOB = ({"authorization": f"Bearer {key}"} for key in KEYS)
BIG_ENUM = {"type": "string", "enum": [f"value-{i:07d}" for i in range(100_000)]}  # 2 MB
TOOL = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object", "properties": {}}}}


def respond(request: StepRequest) -> str:
    return "Done." if request.sampling.json_schema is None else json.dumps({"answer": "Done."})


Door = tuple[str, HonestPairEngine, SessionPool]


@pytest.fixture(scope="module")
def door() -> Iterator[Door]:
    with (
        HonestPairEngine(respond, max_model_len=4096) as engine,
        SessionPool(engine=engine, max_tokens=8, max_sessions=6) as pool,
        FrontDoor(pool, model_name="smol", api_keys=KEYS, port=free_port(), tenant_max_in_flight=4) as opened,
    ):
        yield opened.url, engine, pool
    engine.assert_honest()


def post(url: str, path: str, body: Any, key: dict[str, str] = ALICE, **options: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = key | {"content-type": "application/json"} | options.pop("headers", {})
    return httpx.post(url + path, content=content, headers=headers, timeout=120, **options)


def chat(content: str = "Hi", **fields: Any) -> dict[str, Any]:
    return {"model": "smol", "messages": [{"role": "user", "content": content}], **fields}


def refused(answer: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """The answer is ``status`` with OpenAI's error object (naming ``param`` when given)."""
    assert answer.status_code == status, answer.text[:500]
    error: dict[str, Any] = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/responses", {"input": "Hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ("/v1/responses", {"input": "Hi", "metadata": {"k" * 65: "v"}}, "metadata"),
        ("/v1/responses", {"input": "Hi", "metadata": {"k": "v" * 513}}, "metadata"),
        ("/v1/responses", {"input": "Hi", "metadata": {"k": "v" * 3_900_000}}, "metadata"),
        ("/v1/responses", {"input": "Hi", "metadata": {"k": 1}}, "metadata"),
        ("/v1/responses", {"input": "Hi", "user": "u" * 3_900_000}, "user"),
        ("/v1/chat/completions", chat(user="u" * 257), "user"),
        ("/v1/chat/completions", chat(request_id="r" * 100_000), "request_id"),
        ("/v1/chat/completions", chat(session_id="s" * 3_900_000), "session_id"),
        ("/v1/chat/completions", chat(prompt_cache_key="p\n"), "prompt_cache_key"),
        ("/v1/chat/completions", chat(conversation_id="c\x00"), "conversation_id"),
        ("/v1/responses", {"input": "Hi", "previous_response_id": "r\x00"}, "previous_response_id"),
    ],
)
def test_metadata_and_ids_past_their_bounds_are_400s_and_run_nothing(
    door: Door, path: str, body: dict[str, Any], param: str
) -> None:
    """Points 6 and 10: metadata and user (stored, echoed), a long request_id (repeated in every chunk) and
    session ids (listed, keyed) are bounded; the previous id of a response that cannot exist is a 404 like any."""
    url, engine, _ = door
    steps = len(engine.steps)
    status = 404 if param == "previous_response_id" else 400
    refused(post(url, path, body), status, param)
    assert len(engine.steps) == steps


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(
    door: Door, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Point 7: 3.9 MB of prompt is refused by its size (at least a token per longest-token characters), never
    rendered nor tokenized; a prompt under that bound goes on as before, off the event loop when large."""
    url, engine, _ = door
    from agentkv._conversation import _conversation

    encoded: list[int] = []
    original = _conversation.ChatRenderer.encode
    monkeypatch.setattr(
        _conversation.ChatRenderer, "encode", lambda self, text: encoded.append(len(text)) or original(self, text)
    )
    steps = len(engine.steps)
    error = refused(post(url, "/v1/chat/completions", chat("word " * 780_000)), 400)
    assert error["code"] == "context_length_exceeded" and "at least" in error["message"]
    assert encoded == [] and len(engine.steps) == steps
    big = post(url, "/v1/chat/completions", chat("a b " * 9_000))  # 36,000 characters: rendered off the loop
    refused(big, 400)  # tokenized, then over the double's 4,096 tokens
    assert encoded and len(engine.steps) == steps


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            chat(tools=[{**TOOL, "function": {**TOOL["function"], "parameters": BIG_ENUM}}]),
            "tools",
        ),
        (
            "/v1/chat/completions",
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": BIG_ENUM}}),
            "response_format",
        ),
        ("/v1/chat/completions", chat(structured_outputs={"json": BIG_ENUM}), "structured_outputs"),
        (
            "/v1/responses",
            {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": BIG_ENUM}}},
            "text",
        ),
        (
            "/v1/responses",
            {"input": "Hi", "tools": [{"type": "function", "name": "pick", "parameters": BIG_ENUM}]},
            "tools",
        ),
    ],
)
def test_a_schema_too_large_to_compile_quickly_is_a_400(
    door: Door, path: str, body: dict[str, Any], param: str
) -> None:
    """Point 8: every schema that becomes a grammar (tools' parameters, response_format, text.format,
    structured_outputs) is bounded in size before it is validated or compiled."""
    url, engine, _ = door
    steps = len(engine.steps)
    error = refused(post(url, path, body), 400, param)
    assert "64 KiB" in error["message"]
    assert len(engine.steps) == steps


def test_one_tenant_flooding_fresh_conversations_closes_its_own_not_anothers(door: Door) -> None:
    """Point 9: alice sends max_sessions fresh conversations; bob's session outlives them and pushes back."""
    url, _, pool = door
    first = post(url, "/v1/chat/completions", chat("Bob's question"), BOB, headers={"x-session-id": "b1"})
    assert first.status_code == 200
    history = [{"role": "user", "content": "Bob's question"}, first.json()["choices"][0]["message"]]
    for i in range(pool.max_sessions + 2):
        assert (
            post(url, "/v1/chat/completions", chat(f"Flood {i}"), headers={"x-session-id": f"f{i}"}).status_code == 200
        )
    assert pool.session_for("b1", tenant="bob") is not None
    again = post(
        url,
        "/v1/chat/completions",
        {"messages": [*history, {"role": "user", "content": "More?"}]},
        BOB,
        headers={"x-session-id": "b1"},
    )
    assert again.json()["agentkv"]["stats"]["handle_forwarded"]


def test_nesting_bad_bytes_and_unknown_routes_get_openai_errors(door: Door) -> None:
    """Point 11: JSON nested past the parser's bound is a 400 (was a 500); CR, LF or NUL in an id, a non-Latin-1
    header are 400s before the step (they dropped the connection after it ran and was kept); an unknown path is a
    404 and a wrong method a 405, both in OpenAI's shape; a non-Latin-1 user is fine (never echoed in a header)."""
    url, engine, pool = door
    steps, sessions = len(engine.steps), len(pool.sessions)
    deep = b'{"messages": [{"role": "user", "content": "Hi"}], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    refused(post(url, "/v1/chat/completions", deep), 400, "body")
    refused(post(url, "/v1/chat/completions", b"{not json"), 400)
    for bad in ("a\rb", "a\nb", "a\x00b"):
        refused(post(url, "/v1/chat/completions", chat(session_id=bad)), 400, "session_id")
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as raw:
        body = json.dumps(chat()).encode()
        raw.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: "
            + ALICE["authorization"].encode()
            + b"\r\nx-session-id: caf\xc3\xa9\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        answer = raw.recv(65536)
    assert answer.startswith(b"HTTP/1.1 400") and b'"param":"x-session-id"' in answer
    assert (len(engine.steps), len(pool.sessions)) == (steps, sessions)
    assert post(url, "/v1/chat/completions", chat(user="caf\u00e9 \u4e2d")).status_code == 200
    refused(httpx.get(url + "/v1/nowhere", headers=ALICE), 404)
    error = refused(httpx.get(url + "/v1/chat/completions", headers=ALICE), 405)
    assert error["code"] == "method_not_allowed"
    assert refused(httpx.put(url + "/health"), 405)


class HeldEngine(HonestPairEngine):
    """A step of 7 tokens at most waits until the test lets it go."""

    def __init__(self) -> None:
        super().__init__(respond)
        self.gate, self.holding = threading.Event(), threading.Event()

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        if request.sampling.max_tokens == 7:
            self.holding.set()
            await anyio.to_thread.run_sync(self.gate.wait, abandon_on_cancel=True)
        async for event in super().step(request):
            yield event


def test_a_tenant_past_its_steps_at_once_gets_429s_and_another_goes_on() -> None:
    """Point 10's other half: a tenant running ``tenant_max_in_flight`` steps gets a 429 for one more; another
    tenant's step is admitted meanwhile."""
    with (
        HeldEngine() as engine,
        SessionPool(engine=engine, max_tokens=8) as pool,
        FrontDoor(pool, api_keys=KEYS, port=free_port(), tenant_max_in_flight=1) as opened,
    ):
        url = opened.url
        held = threading.Thread(target=post, args=(url, "/v1/chat/completions", chat("Hold", max_tokens=7)))
        held.start()
        try:
            assert engine.holding.wait(60)
            error = refused(post(url, "/v1/chat/completions", chat("One more")), 429)
            assert error["code"] == "rate_limit_exceeded" and "your requests" in error["message"]
            assert post(url, "/v1/chat/completions", chat("Bob's"), BOB).status_code == 200
        finally:
            engine.gate.set()
            held.join(60)
        assert post(url, "/v1/chat/completions", chat("Again")).status_code == 200
    engine.assert_honest()
