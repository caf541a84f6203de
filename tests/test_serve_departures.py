"""Clients that vanish and a door that stops, on `HonestPairEngine` (the door's logic; no model runs here).

A client that goes away mid-step (plain or streamed, chat or Responses) cancels its step: the engine sees it
cancelled at once, not after its 60 s stall, and the conversation's next request works (turn numbers say the
cancelled step changed nothing). A door that stops ends every request in flight with an error its client
reads (a 503, an error chunk, an ``error`` event) and leaves no step running. A hundred connections opened
and dropped, at every moment of a request, leave no file descriptor, task, thread, connection or session
behind. The real pair's engines after a disconnect: tests/test_serve_pair.py; ``agentkv serve`` under
signals: tests/test_serve_signals.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from agentkv import SessionPool
from agentkv._engines._system import free_port
from agentkv.engines import StepRequest
from agentkv.serve import FrontDoor
from agentkv.testing import HonestPairEngine

Served = tuple[HonestPairEngine, SessionPool]
STALL_S = 60.0
"""How long a stalled step would run: every check below happens far sooner."""


def respond(request: StepRequest) -> str:
    return "A plain answer."


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with HonestPairEngine(respond, stall_s=STALL_S) as engine, SessionPool(engine=engine, max_tokens=32) as pool:
        yield engine, pool
    engine.assert_honest()


@pytest.fixture
def door(served: Served) -> Iterator[FrontDoor]:
    with FrontDoor(served[1], model_name="m", port=free_port()) as opened:
        yield opened


def wait_for(condition: Callable[[], bool], *, within_s: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        time.sleep(0.01)


def body(api: str, text: str, *, stream: bool) -> dict[str, Any]:
    if api == "chat":
        return {"model": "m", "messages": [{"role": "user", "content": text}], "stream": stream}
    return {"model": "m", "input": text, "stream": stream}


def path(api: str) -> str:
    return "/v1/chat/completions" if api == "chat" else "/v1/responses"


def send(door: FrontDoor, api: str, payload: dict[str, Any], *, session: str | None = None) -> socket.socket:
    """A raw HTTP request on a connection of its own, left open for the caller to read or drop."""
    data = json.dumps(payload).encode()
    named = f"x-session-id: {session}\r\n" if session else ""
    head = (
        f"POST {path(api)} HTTP/1.1\r\nhost: agentkv\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n{named}\r\n"
    )
    port = int(door.url.rsplit(":", 1)[1])
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    connection.sendall(head.encode() + data)
    return connection


def read_until(connection: socket.socket, marker: bytes) -> bytes:
    received = b""
    while marker not in received:
        part = connection.recv(65536)
        assert part, f"the connection closed before {marker!r}: {received!r}"
        received += part
    return received


def stalled_step(engine: HonestPairEngine, before: int) -> Callable[[], bool]:
    return lambda: len(engine.steps) > before and engine.steps[-1].outcome == "running"


def turn_of(answer: dict[str, Any]) -> int:
    return int(answer["agentkv"]["stats"]["turn"])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_client_that_leaves_mid_step_cancels_it_and_its_conversation_goes_on(
    served: Served, door: FrontDoor, api: str, stream: bool
) -> None:
    engine, pool = served
    session = f"leaves-{api}-{stream}"
    first = httpx.post(
        door.url + path(api), json=body(api, "One?", stream=False), headers={"x-session-id": session}, timeout=30
    )
    assert first.status_code == 200 and turn_of(first.json()) == 1
    engine.inject("stall")
    before = len(engine.steps)
    connection = send(door, api, body(api, "Two?", stream=stream), session=session)
    if stream:
        read_until(connection, b"data:")  # the step has begun answering
    wait_for(stalled_step(engine, before), what="the step reached the engine")
    started = time.monotonic()
    connection.close()
    wait_for(lambda: engine.steps[-1].outcome == "cancelled", what="the vanished client's step was cancelled")
    assert time.monotonic() - started < STALL_S / 10
    again = httpx.post(
        door.url + path(api), json=body(api, "Two?", stream=False), headers={"x-session-id": session}, timeout=30
    )
    assert again.status_code == 200, again.text  # not 409: the cancelled step left the conversation idle
    assert turn_of(again.json()) == 2  # and changed nothing in it
    assert pool.session_for(session) is not None


def _stream_lines(url: str, api: str, text: str, lines: list[str]) -> None:
    with httpx.stream("POST", url + path(api), json=body(api, text, stream=True), timeout=30) as answer:
        for line in answer.iter_lines():
            lines.append(line)  # one by one: the test sees the stream begin


def test_a_stopping_door_ends_its_requests_in_flight_with_errors_their_clients_read(served: Served) -> None:
    """A plain chat request, a chat stream and a Responses stream, each stalled mid-step, when the door stops."""
    engine, pool = served
    door = FrontDoor(pool, model_name="m", port=free_port()).start()
    plain: list[httpx.Response] = []
    chat_lines: list[str] = []
    event_lines: list[str] = []
    clients = [
        threading.Thread(
            target=lambda: plain.append(
                httpx.post(door.url + path("chat"), json=body("chat", "A?", stream=False), timeout=30)
            )
        ),
        threading.Thread(target=_stream_lines, args=(door.url, "chat", "B?", chat_lines)),
        threading.Thread(target=_stream_lines, args=(door.url, "responses", "C?", event_lines)),
    ]
    # a stream's answer begins once the door has its first token (before that a stop gets it a 503, as a plain
    # request): each stream is stalled mid-answer, after its first lines reached the client
    begun = [lambda: True, lambda: bool(chat_lines), lambda: bool(event_lines)]
    for client, has_begun in zip(clients, begun, strict=True):
        engine.inject("stall")
        before = len(engine.steps)
        client.start()
        wait_for(stalled_step(engine, before), what="the step reached the engine")
        wait_for(has_begun, what="the stream began")
    stalled = engine.steps[-3:]
    started = time.monotonic()
    door.stop()
    assert time.monotonic() - started < 5.0
    for client in clients:
        client.join(timeout=10)
        assert not client.is_alive()
    assert [step.outcome for step in stalled] == ["cancelled"] * 3
    assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "server_stopping"
    chat_data = [line.removeprefix("data: ") for line in chat_lines if line.startswith("data: ")]
    assert json.loads(chat_data[-1])["error"]["code"] == "server_stopping"  # the last chunk: an error, then the end
    events = [json.loads(line.removeprefix("data: ")) for line in event_lines if line.startswith("data: ")]
    assert events[-1]["type"] == "error" and events[-1]["code"] == "server_stopping"
    assert all(not session.stats.turns or session.stats.turns[-1].steps for session in pool.sessions)
    reply = pool.step_sync([{"role": "user", "content": "After the door stopped"}])
    assert reply.text == "A plain answer."  # the pool runs on: no step of the door's is left holding it


def _counts(door: FrontDoor, pool: SessionPool) -> dict[str, int]:
    assert pool.home is not None

    async def pool_tasks() -> int:
        return len(asyncio.all_tasks())

    state = door._server.server_state
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "connections": len(state.connections),
        "server tasks": len(state.tasks),
        "pool tasks": pool.home.call(pool_tasks),
        "sessions": len(pool.sessions),
    }


def test_a_hundred_dropped_connections_leave_nothing_behind(
    served: Served, door: FrontDoor, caplog: pytest.LogCaptureFixture
) -> None:
    """25 connections dropped before a request, 25 halfway through a body, 25 plain and 25 streamed requests
    dropped mid-step (chat and Responses, named and unnamed conversations): nothing logged, nothing left."""
    engine, pool = served
    httpx.post(door.url + path("chat"), json=body("chat", "Warm up", stream=False), timeout=30)  # its first use
    wait_for(lambda: _counts(door, pool)["connections"] == 0, what="the warm-up's connection closed at the door")
    before = _counts(door, pool)
    port = int(door.url.rsplit(":", 1)[1])
    for number in range(100):
        kind, api = number % 4, ("chat", "responses")[number // 4 % 2]
        session = f"dropped-{number}" if number % 8 < 4 else None
        if kind == 0:
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
        elif kind == 1:
            connection = socket.create_connection(("127.0.0.1", port), timeout=10)
            connection.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nhost: a\r\ncontent-length: 999\r\n\r\n{"mess')
            connection.close()
        else:
            engine.inject("stall")
            steps = len(engine.steps)
            connection = send(door, api, body(api, f"Dropped {number}?", stream=kind == 3), session=session)
            if kind == 3:
                read_until(connection, b"data:")
            wait_for(stalled_step(engine, steps), what=f"connection {number}'s step reached the engine")
            connection.close()
            wait_for(lambda: engine.steps[-1].outcome == "cancelled", what=f"connection {number}'s step cancelled")
    engine.clear_faults()
    wait_for(lambda: _counts(door, pool) == before, within_s=10, what=f"{_counts(door, pool)} back to {before}")
    assert all(step.outcome != "running" for step in engine.steps)
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING] == []
