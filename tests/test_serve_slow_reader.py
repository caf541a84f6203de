"""A client that stops reading its stream (issue #31, "Clients that vanish"; issue #52, point 10), on
`HonestPairEngine`.

The door's writes to a client that never reads fill the kernel's socket buffers and then wait on
back-pressure; that wait is its step's alone. Other conversations, streamed and plain, complete meanwhile,
and once the slow client closes its socket the door lets go of the stuck stream and is back to what it was;
a client that neither reads nor closes is dropped by the write time-out, its place given back. How long the
others take beside it is measured by scripts/bench_abuse.py, not asserted here: this test ran flaky under load
while it asserted it, because the door, once the engine had answered the slow client, still wrote its 160,000
chunks until the buffers filled (a fixed 0.2 s sleep assumed they had), and the round of others it timed shared
the door's loop with that writing. Clients that leave mid-step: tests/test_serve_departures.py.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from agentkv import SessionPool
from agentkv._engines._system import free_port
from agentkv.engines import StepRequest
from agentkv.serve import FrontDoor
from agentkv.testing import HonestPairEngine

LONG = ("-" * 63 + "\n") * 80_000
"""The slow client's answer: 5 MB in 160,000 tokens, more than the kernel's buffers hold (a send buffer: 4 MiB)."""
OTHERS = 3
WITHIN_S = 30.0
WARM_UP_S = 300.0


FLOOD_TOKENS = 250_000
"""The slow client's ``max_tokens``: its step answers `LONG`, every other step a short text."""


def respond(request: StepRequest) -> str:
    return LONG if request.sampling.max_tokens == FLOOD_TOKENS else "A short answer."


def wait_for(condition: Callable[[], bool], *, within_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        time.sleep(0.01)


def converse(url: str, number: int, within_s: float = WITHIN_S) -> None:
    """One conversation's request: even numbers streamed, odd ones plain; both must end in a full answer."""
    payload = {"model": "m", "messages": [{"role": "user", "content": f"Other {number}?"}], "stream": number % 2 == 0}
    if payload["stream"]:
        with httpx.stream("POST", url + "/v1/chat/completions", json=payload, timeout=within_s) as answer:
            assert answer.status_code == 200
            lines = list(answer.iter_lines())
        assert "data: [DONE]" in lines, lines[-3:]
    else:
        answer = httpx.post(url + "/v1/chat/completions", json=payload, timeout=within_s)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == "A short answer."


def round_of_others(url: str) -> float:
    """`OTHERS` conversations at once; the seconds until the last one has its whole answer."""
    failures: list[BaseException] = []

    def run(number: int) -> None:
        try:
            converse(url, number)
        except BaseException as error:  # noqa: BLE001 - reported below
            failures.append(error)

    started = time.monotonic()
    threads = [threading.Thread(target=run, args=(number,)) for number in range(OTHERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=WITHIN_S)
    took = time.monotonic() - started
    assert not any(thread.is_alive() for thread in threads), "a conversation waited on the slow reader"
    assert not failures, failures
    return took


def in_flight(url: str) -> int:
    metrics = httpx.get(url + "/metrics", timeout=WITHIN_S).text
    return int(
        float(next(line.split()[1] for line in metrics.splitlines() if line.startswith("agentkv_steps_in_flight ")))
    )


def flood(door: FrontDoor, engine: HonestPairEngine, stack: contextlib.ExitStack) -> socket.socket:
    """A client that asks for `LONG`, streamed, and never reads: its socket, once the engine has answered it."""
    steps = len(engine.steps)
    slow = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))  # closed on a failure too
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    slow.connect(("127.0.0.1", int(door.url.rsplit(":", 1)[1])))
    data = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "Flood?"}],
            "stream": True,
            "max_tokens": FLOOD_TOKENS,
        }
    )
    slow.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: agentkv\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(data)}\r\n\r\n{data}".encode()
    )  # and never reads
    wait_for(lambda: len(engine.steps) > steps, what="the slow client's step reached the engine")
    slow_step = engine.steps[steps]
    wait_for(lambda: slow_step.outcome == "done", within_s=2 * WITHIN_S, what="the slow client's step answered")
    return slow


def test_a_client_that_stops_reading_its_stream_stalls_no_other_conversation() -> None:
    with (
        HonestPairEngine(respond, max_model_len=300_000) as engine,
        SessionPool(engine=engine, max_tokens=32) as pool,
        FrontDoor(pool, model_name="m", port=free_port()) as door,
        contextlib.ExitStack() as stack,
    ):
        converse(door.url, 0, within_s=WARM_UP_S)  # the door's first step imports transformers: slow under load
        round_of_others(door.url)
        assert in_flight(door.url) == 0
        slow = flood(door, engine, stack)
        assert in_flight(door.url) == 1  # the slow client's stream is not sent: its place is held

        round_of_others(door.url)  # each completes (within WITHIN_S), none waiting on the slow reader
        assert in_flight(door.url) == 1  # the slow client is still stuck
        sessions = len(pool.sessions)  # the others' and the slow client's (its step had answered)

        slow.close()
        wait_for(lambda: in_flight(door.url) == 0, what="the in-flight gauge back to 0")
        assert len(pool.sessions) == sessions
        assert all(step.outcome == "done" for step in engine.steps)
    engine.assert_honest()


def test_a_client_that_neither_reads_nor_closes_is_dropped_by_the_write_timeout(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """With a write time-out of 1 s the slow client's place is given back while it still holds its socket open:
    its connection is dropped by the task that writes to it (quietly: no error is logged), and the door serves
    on."""
    with (
        HonestPairEngine(respond, max_model_len=300_000) as engine,
        SessionPool(engine=engine, max_tokens=32) as pool,
        FrontDoor(pool, model_name="m", port=free_port(), write_timeout_s=1.0, max_in_flight=1) as door,
        contextlib.ExitStack() as stack,
    ):
        converse(door.url, 0, within_s=WARM_UP_S)
        slow = flood(door, engine, stack)
        wait_for(lambda: in_flight(door.url) == 0, within_s=WITHIN_S, what="the slow reader's place given back")
        converse(door.url, 0)  # the one place is free again
        converse(door.url, 1)
        slow.setblocking(False)
        received = b""
        with contextlib.suppress(BlockingIOError, ConnectionResetError):
            while part := slow.recv(1 << 20):
                received += part
        assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received  # what the buffers held: cut
    said = capfd.readouterr().err  # uvicorn logs to stderr (its loggers do not reach the root logger)
    assert "without completing response" not in said and "Exception in ASGI" not in said, said
    engine.assert_honest()
