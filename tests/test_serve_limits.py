"""The front door's limits and its API key (docs/serve.md, "Limits"; docs/reliability.md, "The door under faults"),
on engine doubles: no model runs here."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agentkv import SessionPool, UserError
from agentkv._engines._system import free_port
from agentkv.engines import StepEvent, StepRequest
from agentkv.serve import FrontDoor
from agentkv.testing import HonestPairEngine
from serve_cli import serve_with_doubles

KEY = "sk-agentkv-" + secrets.token_hex(16)
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_BODY, MAX_HEADERS, MAX_MESSAGES = 64_000, 4096, 8


def ask(content: str = "Hi", **fields: Any) -> dict[str, Any]:
    return {"model": "smol", "messages": [{"role": "user", "content": content}], **fields}


@pytest.fixture(scope="module")
def door() -> Iterator[tuple[str, HonestPairEngine]]:
    """A door with small limits (and a key) on an engine whose context is 256 tokens."""
    with HonestPairEngine(lambda request: "Done.", max_model_len=256) as engine:
        with SessionPool(engine=engine, max_tokens=16) as pool:
            limits = {"max_request_bytes": MAX_BODY, "max_header_bytes": MAX_HEADERS, "max_messages": MAX_MESSAGES}
            with FrontDoor(pool, model_name="smol", api_key=KEY, port=free_port(), **limits) as opened:
                yield opened.url, engine
    engine.assert_honest()


WAIT_S = 300
"""A bound for waits that end in seconds: a door's first step imports transformers, which on a starved CPU is slow."""


def post(url: str, **options: Any) -> httpx.Response:
    return httpx.post(url, timeout=WAIT_S, **options)


def get(url: str, **options: Any) -> httpx.Response:
    return httpx.get(url, timeout=WAIT_S, **options)


def error_of(answer: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error object of a refusal, checked for its status and shape."""
    assert answer.status_code == status, answer.text
    error: dict[str, Any] = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def raw_exchange(url: str, head: bytes, *, timeout_s: float = WAIT_S) -> bytes:
    """Send ``head`` (and nothing after it) on a socket of its own; what the server answers before it closes
    or goes quiet (b"" when it reset the connection)."""
    host, port = url.removeprefix("http://").split(":")
    answer = b""
    with socket.create_connection((host, int(port)), timeout=timeout_s) as connection:
        try:
            connection.sendall(head)
            while b"\r\n\r\n" not in answer or len(answer) < answer.index(b"\r\n\r\n") + 4 + _length(answer):
                part = connection.recv(65536)
                if not part:
                    break
                answer += part
        except (ConnectionResetError, BrokenPipeError):
            pass
    return answer


def _length(answer: bytes) -> int:
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    return next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"content-length:")), 0)


# ------------------------------------------------------------------ the key


def test_the_key_from_the_environment_is_checked_in_any_length_and_never_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """``agentkv serve`` (verbose) with ``AGENTKV_API_KEY``: the key opens the door, a wrong key of its length or
    another does not, and the key is in no log line, start-up line, error body or header of the whole run."""
    from agentkv._surfaces._cli import main

    failing = [False]

    def respond(request: StepRequest) -> str:
        if failing[0]:
            raise RuntimeError("the engine double failed on purpose")
        return "Done."

    def pool_on_a_double(**options: Any) -> SessionPool:
        return SessionPool(engine=HonestPairEngine(respond), max_sessions=options["max_sessions"])

    answers: list[httpx.Response] = []

    def serve(door: FrontDoor, **options: Any) -> None:  # as FrontDoor.run, with requests while it serves
        door.start()
        try:
            url = door.url + "/v1/chat/completions"
            wrong = KEY[:-1] + ("x" if KEY[-1] != "x" else "y")
            for key, status in [
                (KEY, 200),
                (wrong, 401),  # the same length
                (KEY + "0", 401),
                (KEY[:-4], 401),
                ("k", 401),
            ]:
                answers.append(post(url, json=ask(), headers={"authorization": f"Bearer {key}"}))
                assert answers[-1].status_code == status, (key == KEY, answers[-1].text)
            answers.append(post(url, json=ask(), headers={"authorization": KEY}))  # no "Bearer "
            answers.append(post(url, json=ask()))
            assert [a.status_code for a in answers[-2:]] == [401, 401]
            assert error_of(answers[-1], 401)["type"] == "authentication_error"
            failing[0] = True  # an unexpected error: logged with its traceback
            answers.append(post(url, json=ask(), headers=AUTH))
            assert answers[-1].status_code == 500
            failing[0] = False
            answers.append(get(door.url + "/metrics", headers=AUTH))
            answers.append(post(url, json=ask(), headers=AUTH | {"x-pad": "a" * 20_000}))  # over 16 KiB: 431
            assert answers[-1].status_code == 431
            raw_exchange(door.url, b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 200_000)  # the parser's 400
        finally:
            door.stop()

    caplog.set_level("DEBUG")
    monkeypatch.setenv("AGENTKV_API_KEY", KEY)
    monkeypatch.setattr("agentkv._session._pool.SessionPool", pool_on_a_double)
    monkeypatch.setattr(FrontDoor, "run", serve)
    assert main(["-v", "serve", "--store", "memory", "--port", str(free_port())]) == 0

    out, err = capfd.readouterr()
    assert "agentkv serve: http://" in out and "an API key" in out  # the start-up line was captured
    assert "a request failed" in caplog.text and "RuntimeError" in caplog.text  # so was the traceback
    assert "Invalid HTTP request received" in err  # and uvicorn's own warnings
    exchanged = [a.text + json.dumps(dict(a.headers)) for a in answers]
    for where, text in [("stdout", out), ("stderr", err), ("log", caplog.text), *(("answers", t) for t in exchanged)]:
        assert KEY not in text and KEY[:16] not in text, where


def test_the_key_is_kept_out_of_the_settings_repr() -> None:
    with HonestPairEngine() as engine, SessionPool(engine=engine) as pool:
        door = FrontDoor(pool, api_key=KEY, port=free_port())
        assert door.settings.tenants.needs_key and KEY not in repr(door.settings) and KEY[:12] not in repr(door)


# ------------------------------------------------------------------ what one request may send


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(door: tuple[str, HonestPairEngine]) -> None:
    url = door[0] + "/v1/chat/completions"
    exact = json.dumps(ask()).encode()
    exact += b" " * (MAX_BODY - len(exact))  # JSON and trailing blanks, exactly at the limit
    assert len(exact) == MAX_BODY
    assert post(url, content=exact, headers=AUTH | {"content-type": "application/json"}).status_code == 200

    error = error_of(post(url, content=exact + b" ", headers=AUTH), 413)
    assert (
        error["code"] == "request_too_large"
        and "62.5 KiB" in error["message"]
        and "--max-request-mb" in error["message"]
    )

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 7_000
        yield b'"}]}'

    error = error_of(post(url, content=chunks(), headers=AUTH), 413)
    assert error["code"] == "request_too_large"

    # a declared body over the limit is refused at once: the server answers, though the body never comes
    answer = raw_exchange(
        door[0],
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {KEY}\r\ncontent-length: 1000000000\r\n\r\n".encode(),
    )
    assert answer.startswith(b"HTTP/1.1 413")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"


def test_headers_over_the_limit_are_a_431_and_a_huge_head_is_cut_off(door: tuple[str, HonestPairEngine]) -> None:
    url = door[0] + "/v1/chat/completions"
    assert post(url, json=ask(), headers=AUTH | {"x-pad": "a" * (MAX_HEADERS - 1000)}).status_code == 200
    error = error_of(post(url, json=ask(), headers=AUTH | {"x-pad": "a" * MAX_HEADERS}), 431)
    assert error["code"] == "request_header_fields_too_large" and "4 KiB" in error["message"]
    assert error_of(get(door[0] + "/health", headers={"x-pad": "a" * MAX_HEADERS}), 431)  # every route

    # past twice the limit the parser stops reading: a plain 400 (or a reset), never the app's 431
    answer = raw_exchange(door[0], b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 1_000_000)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer[:100]
    assert get(door[0] + "/health").status_code == 200  # and the door goes on


def test_more_messages_than_the_limit_are_a_400(door: tuple[str, HonestPairEngine]) -> None:
    url = door[0] + "/v1"
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(MAX_MESSAGES + 1)]
    error = error_of(post(url + "/chat/completions", json={"messages": messages}, headers=AUTH), 400)
    assert error["code"] == "array_above_max_length" and error["param"] == "messages"
    assert f"maximum length {MAX_MESSAGES}, but got an array with length {MAX_MESSAGES + 1}" in error["message"]
    within = {"messages": messages[: MAX_MESSAGES - 1]}  # 7: ends with the user's
    assert post(url + "/chat/completions", json=within, headers=AUTH).status_code == 200

    items = [{"role": "user", "content": f"m{i}"} for i in range(MAX_MESSAGES + 1)]
    error = error_of(post(url + "/responses", json={"input": items}, headers=AUTH), 400)
    assert error["code"] == "array_above_max_length" and error["param"] == "input"
    assert post(url + "/responses", json={"input": items[:MAX_MESSAGES]}, headers=AUTH).status_code == 200


def test_a_prompt_over_the_context_is_a_400_and_never_reaches_the_engine(door: tuple[str, HonestPairEngine]) -> None:
    url, engine = door[0] + "/v1", door[1]
    steps = len(engine.steps)
    long = "word " * 400  # one message, well under the body limit; over the double's 256 tokens
    for path, body in [("/chat/completions", ask(long)), ("/responses", {"input": long})]:
        error = error_of(post(url + path, json=body, headers=AUTH), 400)
        assert error["code"] == "context_length_exceeded" and "context is 256" in error["message"], error
    assert len(engine.steps) == steps


def test_the_limits_are_checked_settings() -> None:
    with HonestPairEngine() as engine, SessionPool(engine=engine, max_sessions=7) as pool:
        assert FrontDoor(pool, port=free_port()).settings.max_in_flight == 7  # by default, the pool's sessions
        for name in ("max_request_bytes", "max_header_bytes", "max_messages", "max_in_flight"):
            with pytest.raises(UserError, match=f"{name} must be a positive int, not 0"):
                FrontDoor(pool, port=free_port(), **{name: 0})


def test_agentkv_serve_passes_its_limits_to_the_door(monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, given = serve_with_doubles(monkeypatch, ["serve", "--store", "memory"])
    assert code == 0
    assert given["max_request_bytes"] == 4 * 1024 * 1024 and given["max_header_bytes"] == 16 * 1024
    assert given["max_messages"] == 2048 and given["max_in_flight"] is None  # the door's default: --max-sessions
    flags = ["--max-request-mb", "1", "--max-header-kb", "8", "--max-messages", "100", "--max-in-flight", "5"]
    code, _, given = serve_with_doubles(monkeypatch, ["serve", "--store", "memory", *flags])
    assert code == 0
    assert [given[k] for k in ("max_request_bytes", "max_header_bytes", "max_messages", "max_in_flight")] == [
        1024 * 1024,
        8 * 1024,
        100,
        5,
    ]


# ------------------------------------------------------------------ admission


class GatedEngine(HonestPairEngine):
    """Every step waits at a gate until the test opens it (an engine holding all it was given)."""

    def __init__(self) -> None:
        super().__init__(lambda request: "Done.")
        self.gate = threading.Event()
        self.held = 0
        """Steps waiting at the gate now."""

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.held += 1
        try:
            await anyio.to_thread.run_sync(self.gate.wait, abandon_on_cancel=True)
        finally:
            self.held -= 1
        async for event in super().step(request):
            yield event


async def until(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    """Wait until ``condition()`` holds (polled: it counts what other threads do)."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"not within {timeout_s} s")


def streamed_text(answer: httpx.Response) -> str:
    events = [line.removeprefix("data: ") for line in answer.text.splitlines() if line.startswith("data: {")]
    return "".join(c["delta"].get("content") or "" for e in events for c in json.loads(e).get("choices", []))


def in_flight(url: str) -> int:
    metrics = get(url + "/metrics").text
    return int(
        float(next(line for line in metrics.splitlines() if line.startswith("agentkv_steps_in_flight ")).split()[1])
    )


def test_a_burst_past_the_admission_limit_gets_429s_at_once_and_nothing_leaks() -> None:
    """200 requests (half streamed) at an engine that holds every step, 16 admitted: the other 184 get a 429 with
    Retry-After while the 16 are still held; the 16 complete once the engine lets them go; then clients that leave
    mid-step give their places back too, and the door's count of steps in flight is 0 again."""
    limit, burst = 16, 200
    engine = GatedEngine()
    with (
        SessionPool(engine=engine) as pool,
        FrontDoor(pool, model_name="smol", max_in_flight=limit, port=free_port()) as door,
    ):
        url = door.url + "/v1/chat/completions"
        engine.gate.set()
        assert post(url, json=ask("warm-up")).status_code == 200  # the tokenizer is loaded, as on a serving door
        engine.gate.clear()

        async def run() -> tuple[list[httpx.Response], float]:
            async with httpx.AsyncClient(timeout=WAIT_S, limits=httpx.Limits(max_connections=None)) as client:
                started = time.perf_counter()
                tasks = [
                    asyncio.ensure_future(client.post(url, json=ask(f"question {i}", stream=i % 2 == 1)))
                    for i in range(burst)
                ]
                await until(lambda: sum(t.done() for t in tasks) >= burst - limit)
                refused_after_s = time.perf_counter() - started
                await until(lambda: engine.held == limit)  # the admitted are at the engine, not queued in the door
                assert sum(t.done() for t in tasks) == burst - limit and in_flight(door.url) == limit
                engine.gate.set()
                return list(await asyncio.gather(*tasks)), refused_after_s

        answers, refused_after_s = asyncio.run(run())
        assert Counter(a.status_code for a in answers) == {429: burst - limit, 200: limit}
        assert refused_after_s < 60, refused_after_s  # (in ~1 s here) no engine step was over: none waited for one
        for answer in answers:
            if answer.status_code == 429:
                error = error_of(answer, 429)
                assert answer.headers["retry-after"] == "1" and error["code"] == "rate_limit_exceeded"
                assert "limit of 16 steps at once (agentkv serve --max-in-flight)" in error["message"]
            elif answer.headers["content-type"].startswith("text/event-stream"):
                assert answer.text.endswith("data: [DONE]\n\n") and streamed_text(answer) == "Done."
            else:
                assert answer.json()["choices"][0]["message"]["content"] == "Done."
        assert in_flight(door.url) == 0 and engine.held == 0
        assert (
            f'agentkv_errors_total{{kind="rate_limit_exceeded"}} {float(burst - limit)}'
            in get(door.url + "/metrics").text
        )

        engine.gate.clear()  # clients that leave while their steps are held, streamed or not

        async def leave() -> None:
            async with httpx.AsyncClient(timeout=WAIT_S) as client:
                tasks = [
                    asyncio.ensure_future(client.post(url, json=ask(f"leaving {i}", stream=i < 4))) for i in range(6)
                ]
                await until(lambda: engine.held == 6)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            engine.gate.set()
            await until(lambda: engine.held == 0 and in_flight(door.url) == 0)

        asyncio.run(leave())
        # at most one session per request admitted: the warm-up, the 16, the 6 that left (a refused one makes
        # none; one whose client left before its step began may be gone already)
        assert len(pool.sessions) <= 1 + limit + 6

        async def again() -> list[int]:  # every place came back: a full round is admitted
            async with httpx.AsyncClient(timeout=WAIT_S) as client:
                answers = await asyncio.gather(*(client.post(url, json=ask(f"again {i}")) for i in range(limit)))
                return [a.status_code for a in answers]

        assert asyncio.run(again()) == [200] * limit
        assert in_flight(door.url) == 0
    engine.assert_honest()


LOAD_AT_ONCE = """
import sys, threading
from agentkv._session._session import load_tokenizer
errors = []
def load():
    try:
        load_tokenizer(sys.argv[1])
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=load) for _ in range(16)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(errors)
"""


def test_sessions_opened_at_once_in_a_fresh_process_all_get_the_tokenizer(model_path: Path) -> None:
    """The first sessions of a door (a burst) load the tokenizer together, in threads; transformers' lazy imports
    fail when several threads import it at once, so the loads take turns (15 of 16 failed without)."""
    done = subprocess.run(
        [sys.executable, "-c", LOAD_AT_ONCE, str(model_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]
