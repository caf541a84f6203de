"""The HTTP client's logic against scripted servers (no model runs): the probe, retries, handle rules, stock servers.

``ScriptedServer`` answers ``/v1/completions`` like a vLLM P or D server would, from a
script; it proves nothing about KV (the real launched pair's tests do), only about what
agentkv sends, when it retries, and what it tells the user.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentkv import EngineError, EngineUnavailableError, RemotePair, Session, UserError
from agentkv._engines._http_transport import PairTransport
from agentkv._model import prepare_model

ANSWER_IDS = [12095, 30, 2]  # any ids: the session only needs them back exactly


def _prefill_result() -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1]],
        "remote_engine_id": "p",
        "remote_request_id": "r",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_num_tokens": 10,
        "tp_size": 1,
    }


def _handle(tokens: int) -> dict[str, Any]:
    return {
        **_prefill_result(),
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_engine_id": "d",
        "remote_num_tokens": tokens,
        "remote_blocks_expiry_time": time.perf_counter() + 300,
    }


class ScriptedServer:
    """A scripted vLLM P or D server on a free local port: agentkv's server, or stock vLLM (``agentkv=False``).

    Requests without ``kv_transfer_params`` are the pair's probes (kept in `probes`); P's
    streamed requests are pin releases (in `releases`); the rest are steps (in `bodies`).
    """

    def __init__(
        self,
        role: str,
        *,
        agentkv: bool = True,
        token_ids: bool = True,
        handle: bool = True,
        vllm: str = "0.32.0",
        served: str | None = None,
        root: str | None = None,
        versions: dict[str, Any] | None = None,
    ) -> None:
        self.role = role
        self.agentkv = agentkv
        self.vllm = vllm
        """What ``/version`` says; a stock server from 0.33 on streams the handle on its last chunk with choices."""
        self.root = root or str(prepare_model())
        """What the server loaded (``/v1/models``' root): by default the bundled model's folder, as the tests'."""
        self.served = served or ("agentkv" if agentkv else self.root)
        """The name it serves under: agentkv's servers' ``agentkv``, a stock server's ``--model`` by default."""
        self.versions = versions
        """What agentkv's server says it runs (its extras' ``versions``; None: nothing)."""
        self.token_ids = token_ids
        self.handle = handle
        """D returns a handle (off: a decode server without ``bidirectional_kv_xfer``)."""
        self.failures: list[int] = []
        """Status codes to answer the next step requests with, before answering normally."""
        self.bodies: list[dict[str, Any]] = []
        self.probes: list[dict[str, Any]] = []
        self.releases: list[dict[str, Any]] = []
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        app = Starlette(
            routes=[
                Route("/v1/models", self._models),
                Route("/version", self._version),
                Route("/v1/completions", self._completions, methods=["POST"]),
            ]
        )
        self._server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join()

    async def _models(self, request: Request) -> Response:
        card = {"id": self.served, "object": "model", "root": self.root, "max_model_len": 2048}
        return JSONResponse({"object": "list", "data": [card]})

    async def _version(self, request: Request) -> Response:
        return JSONResponse({"version": self.vllm})

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        params = body.get("kv_transfer_params")
        if params is None:
            self.probes.append(body)
        elif self.role == "prefill" and body.get("stream"):
            self.releases.append(body)
            return StreamingResponse(self._stream(None), media_type="text/event-stream")
        else:
            self.bodies.append(body)
            if self.failures:
                return JSONResponse({"error": {"message": "scripted failure"}}, status_code=self.failures.pop(0))
        if self.role == "prefill":
            choice = {"index": 0, "text": "x", "finish_reason": "length", "token_ids": [7]}
            result = _prefill_result() if params is not None else None
            return JSONResponse(self._completion([choice], kv_transfer_params=result))
        handle = _handle(len(body["prompt"]) + len(ANSWER_IDS) - 1) if params is not None and self.handle else None
        if not body.get("stream"):
            choice = {"index": 0, "text": "Paris.", "finish_reason": "stop", "token_ids": ANSWER_IDS}
            return JSONResponse(self._completion([choice], kv_transfer_params=handle))
        return StreamingResponse(self._stream(handle), media_type="text/event-stream")

    async def _stream(self, handle: dict[str, Any] | None) -> AsyncIterator[str]:
        for index, (token, text) in enumerate(zip(ANSWER_IDS, ("Par", "is", "."), strict=True)):
            finish = "stop" if index == len(ANSWER_IDS) - 1 else None
            choice = {
                "index": 0,
                "text": text,
                "finish_reason": finish,
                "token_ids": [token] if self.token_ids else None,
            }
            on_last = handle if finish and not self.agentkv and self.vllm >= "0.33" else None
            yield f"data: {json.dumps(self._completion([choice], kv_transfer_params=on_last))}\n\n"
        if self.agentkv:  # agentkv's server ends a stream with the handle and its extras
            yield f"data: {json.dumps(self._completion([], kv_transfer_params=handle))}\n\n"
        yield "data: [DONE]\n\n"

    def _completion(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        extras = {"agentkv": {"prefill": None, "seconds": {}, "versions": self.versions}} if self.agentkv else {}
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": "scripted",
            "choices": choices,
            **extra,
            **extras,
        }


@pytest.fixture
def servers() -> Iterator[tuple[ScriptedServer, ScriptedServer]]:
    with ScriptedServer("prefill") as p, ScriptedServer("decode") as d:
        yield p, d


def _sent_handle(body: dict[str, Any]) -> bool:
    return body["kv_transfer_params"].get("remote_engine_id") == "d"


def test_the_handle_from_the_stream_is_pushed_back(servers: tuple[ScriptedServer, ScriptedServer]) -> None:
    p, d = servers
    with RemotePair(p.url, d.url, warmup=False) as pair, Session(engine=pair, max_tokens=8) as session:
        assert session.run_sync("Capital of France?").text == "Paris."
        session.run_sync("And of Italy?")
    assert [_sent_handle(body) for body in p.bodies] == [False, True]
    assert all(body["prompt"] and body["return_token_ids"] for body in p.bodies + d.bodies)
    assert d.bodies[1]["prompt"][: len(d.bodies[0]["prompt"])] == d.bodies[0]["prompt"]  # token-exact history
    assert [_sent_handle(body) for body in p.releases] == [True]  # the pin the closed session gave up
    assert p.releases[0]["kv_transfer_params"]["remote_num_tokens"] == 0  # P reads none of it, D frees it
    assert p.releases[0]["priority"] == -1 and all("priority" not in body for body in p.bodies)  # releases first


def test_the_servers_are_probed_once_at_open_without_kv(servers: tuple[ScriptedServer, ScriptedServer]) -> None:
    p, d = servers
    pair = RemotePair(p.url, d.url, warmup=False)
    assert pair.server_kind is None and pair.handle_in_stream is None and pair.capabilities is None
    with pair, Session(engine=pair, max_tokens=8) as session:
        assert pair.server_kind == "agentkv" and pair.handle_in_stream is True
        assert not p.bodies and not d.bodies  # decided before any step
        session.run_sync("Capital of France?")
        session.run_sync("And of Italy?")
    assert len(p.probes) == len(d.probes) == 1  # once, not per step
    assert not p.probes[0].get("stream") and d.probes[0]["stream"]  # D's stream is what is checked
    assert p.probes[0]["max_tokens"] == d.probes[0]["max_tokens"] == 1


def test_a_stock_decode_server_is_refused_for_streaming_at_open() -> None:
    """A stock D streams no handle, and with bidirectional transfer pins KV nobody can free: refused, plainly."""
    with ScriptedServer("prefill", agentkv=False) as p, ScriptedServer("decode", agentkv=False) as d:
        pair = RemotePair(p.url, d.url)
        with pytest.raises(UserError, match="stock vLLM") as refused:
            pair.__enter__()
        assert "agentkv engine --role decode" in str(refused.value) and "decode_streaming=False" in str(refused.value)
        assert not pair.is_open
        assert not p.bodies and not d.bodies  # no step ran, so nothing was pinned


def test_a_stock_server_keeps_push_back_without_token_streaming(caplog: pytest.LogCaptureFixture) -> None:
    with ScriptedServer("prefill", agentkv=False) as p, ScriptedServer("decode", agentkv=False) as d:
        with caplog.at_level(logging.WARNING, logger="agentkv"):
            with RemotePair(p.url, d.url, decode_streaming=False, warmup=False) as pair:
                assert pair.server_kind == "vllm" and pair.handle_in_stream is False and pair.info.pins
                with Session(engine=pair, max_tokens=8) as session:
                    session.run_sync("Capital of France?")
                    second = session.run_sync("And of Italy?")
                assert pair.info.pins
        assert [_sent_handle(body) for body in p.bodies] == [False, True]
        assert second.steps[0].stats.handle_forwarded
        assert not any(body.get("stream") for body in d.bodies)
        assert "reported as local_hit_tokens" in caplog.text  # a stock P gives no split: said once, at open


def test_agentkvs_own_servers_without_the_streamed_handle_take_each_answer_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A LaunchedPair's D streams no handle only where the installed vLLM lacks agentkv's streamed handle
    (docs/vllm-patches.md): the pair then takes D's answers whole, with one warning, and still pushes back."""

    class OwnServers(RemotePair):
        _agentkv_servers = True  # as LaunchedPair's: servers agentkv started with its own entry point

    with ScriptedServer("prefill") as p, ScriptedServer("decode", agentkv=False, served="agentkv") as d:
        with caplog.at_level(logging.WARNING, logger="agentkv"):
            with OwnServers(p.url, d.url, warmup=False) as pair, Session(engine=pair, max_tokens=8) as session:
                assert not pair.decode_streaming and pair.info.pins
                session.run_sync("Capital of France?")
                second = session.run_sync("And of Italy?")
        assert second.steps[0].stats.handle_forwarded
        assert not any(body.get("stream") for body in d.bodies)
        assert "streamed handle is off" in caplog.text


def test_what_the_pair_decided_at_open_never_changes(servers: tuple[ScriptedServer, ScriptedServer]) -> None:
    """A step whose D returns no handle costs the next step its push-back, not the pair's capabilities."""
    p, d = servers
    d.handle = False
    with RemotePair(p.url, d.url, warmup=False) as pair, Session(engine=pair, max_tokens=8) as session:
        before = pair.capabilities
        session.run_sync("Capital of France?")
        second = session.run_sync("And of Italy?")
        assert pair.capabilities == before and pair.info.pins and pair.handle_in_stream is True
    assert second.steps[0].stats.miss_reason == "no_handle"
    d.handle = True


def test_transient_errors_are_retried(servers: tuple[ScriptedServer, ScriptedServer]) -> None:
    p, d = servers
    with RemotePair(p.url, d.url, warmup=False) as pair, Session(engine=pair, max_tokens=8) as session:
        p.failures = [503, 502]
        assert session.run_sync("Capital of France?").text == "Paris."
    assert len(p.bodies) == 3


def test_a_handle_that_may_have_been_read_is_never_sent_again(servers: tuple[ScriptedServer, ScriptedServer]) -> None:
    p, d = servers
    with RemotePair(p.url, d.url, warmup=False) as pair, Session(engine=pair, max_tokens=8) as session:
        session.run_sync("Capital of France?")
        p.failures = [500]  # P failed after the handle reached it: its blocks may be gone
        second = session.run_sync("And of Italy?")
    assert [_sent_handle(body) for body in p.bodies] == [False, True, False]
    assert second.steps[0].stats.miss_reason == "declined"


def test_client_errors_are_not_retried_and_leave_the_session_usable(
    servers: tuple[ScriptedServer, ScriptedServer],
) -> None:
    p, d = servers
    with RemotePair(p.url, d.url, warmup=False) as pair, Session(engine=pair, max_tokens=8) as session:
        before = session.messages
        d.failures = [400]  # vLLM refused a field: the caller's to fix, with vLLM's message
        with pytest.raises(UserError, match="decode server refused the request: scripted failure"):
            session.run_sync("Capital of France?")
        assert session.messages == before
        assert session.run_sync("Capital of France?").text == "Paris."
    assert len(d.bodies) == 2


def test_an_unreachable_server_is_a_clear_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{sock.getsockname()[1]}"
    pair = RemotePair(nobody, nobody, attempts=2)
    with pytest.raises(EngineUnavailableError, match="prefill server could not be reached"):
        pair.__enter__()


def test_a_server_that_returns_no_token_ids_is_refused() -> None:
    """Text alone cannot extend the token history exactly (docs/concepts.md, "The token-exact rule"): the pair refuses at open."""
    with ScriptedServer("prefill") as p, ScriptedServer("decode", token_ids=False) as d:
        pair = RemotePair(p.url, d.url, warmup=False)
        with pytest.raises(EngineError, match="no token ids"):
            pair.__enter__()
        assert not pair.is_open and not d.bodies


def _suspended_http_generators() -> list[str]:
    return [
        obj.__qualname__
        for obj in gc.get_objects()
        if inspect.isasyncgen(obj)
        and obj.ag_frame is not None
        and any(part in obj.ag_code.co_filename for part in ("openai", "httpx", "httpcore"))
    ]


@pytest.mark.anyio
async def test_a_stream_left_early_leaves_no_generator_for_the_garbage_collector(
    servers: tuple[ScriptedServer, ScriptedServer],
) -> None:
    """A pin release reads one chunk and closes the stream. Every generator under it must end on the loop:
    one left in a reference cycle is finalized by the cyclic collector in whatever thread runs it, and from
    another thread that raced with the loop ("async generator already executing", seen in CI)."""
    _, d = servers
    transport = PairTransport(attempts=1, step_timeout_s=30.0)
    await transport.connect((d.url, d.url))
    body = {"model": "scripted", "prompt": [1, 2], "max_tokens": 3, "extra_body": {"kv_transfer_params": {}}}
    gc.collect()
    before = _suspended_http_generators()
    try:
        async with contextlib.aclosing(transport.stream("decode", body)) as chunks:
            async for _ in chunks:
                break
        for _ in range(50):  # each closed generator's finalizer closes the next one down on a later iteration
            await anyio.lowlevel.checkpoint()
        assert _suspended_http_generators() == before
    finally:
        await transport.close()
