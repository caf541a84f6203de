"""The bench's ``vllm-serve`` mode without vLLM (src/agentkv/_bench/_stock.py): its command line and environment,
its server's start and stop (a scripted stand-in process), and how its conversation reads a vLLM chat stream
(a scripted server that streams as vLLM's does with ``return_token_ids`` and ``include_usage``). The real
server runs in ``agentkv bench --modes ...,vllm-serve`` (docs/benchmarks.md)."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import openai
import psutil
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentkv import EngineStartError
from agentkv._bench import _stock
from agentkv._bench._conversations import Clock
from agentkv._bench._stock import StockConversation, stock_command, stock_env, stock_server
from test_http_client import ScriptedServer

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def test_the_command_is_vllm_serve_with_only_the_runs_shared_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    words = stock_command(Path("/models/m"), 8123, max_model_len=4096, dtype="float32")
    assert words[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(words[3::2], words[4::2], strict=False))
    assert flags["--model"] == "/models/m"
    assert flags["--port"] == "8123" and flags["--max-model-len"] == "4096" and flags["--dtype"] == "float32"
    assert "--enforce-eager" not in words and "--block-size" not in words  # vLLM's own defaults stand
    sized = stock_command(Path("/models/m"), 8123, max_model_len=4096, dtype="float32", block_size=32)
    assert sized[sized.index("--block-size") + 1] == "32"  # the run's --block-size, as every engine's
    monkeypatch.setenv("AGENTKV_HOME", "/tmp/x")
    env = stock_env(2.0)
    assert not [key for key in env if key.startswith("AGENTKV_")]  # no agentkv plugin in the stock server
    assert env.get("VLLM_CPU_KVCACHE_SPACE") == "2"  # this machine is a CPU: agentkv's engines' KV size


def test_the_server_is_waited_for_and_leaves_no_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A stand-in (Python's HTTP server, which answers /health with a file) started and stopped as vllm serve is."""
    (tmp_path / "health").write_text("ok")

    def command(model: Path, port: int, **_: Any) -> list[str]:
        return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]

    monkeypatch.setattr(_stock, "stock_command", command)
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path))
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))  # the caller's: the server's folder goes inside it

    async def main() -> tuple[int, str]:
        async with stock_server(tmp_path, max_model_len=64, dtype="float32", kv_cache_gib=1.0) as server:
            assert server.process.poll() is None
            sockets = psutil.Process(server.process.pid).environ()["VLLM_RPC_BASE_PATH"]
            assert Path(sockets).parent == tmp_path and await anyio.Path(sockets).is_dir()
            return server.process.pid, sockets

    pid, sockets = anyio.run(main)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert list((tmp_path / "logs").glob("bench-vllm-serve-*.log"))
    assert not Path(sockets).exists()  # where vLLM's IPC socket files would be: removed with the server


def test_a_server_that_exits_at_start_is_an_engine_start_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_stock, "stock_command", lambda *_, **__: [sys.executable, "-c", "raise SystemExit(3)"])
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path))

    async def main() -> None:
        async with stock_server(tmp_path, max_model_len=64, dtype="float32", kv_cache_gib=1.0):
            pass

    with pytest.raises(EngineStartError, match="exited with 3"):
        anyio.run(main)


class _ChatServer(ScriptedServer):
    """Streams "Par", "is", "." (ids 10, 11, 12) as vLLM's chat server does with ``return_token_ids``: the prompt's
    ids on the first chunk, each choice's ``token_ids``, then a usage chunk whose cached tokens are 4."""

    def __init__(self) -> None:
        super().__init__("chat", agentkv=False)
        app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])])
        self._server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    async def _chat(self, request: Request) -> Response:
        self.bodies.append(await request.json())
        if self.failures:
            return JSONResponse({"error": {"message": "scripted failure"}}, status_code=self.failures.pop(0))
        return StreamingResponse(self._stream(), media_type="text/event-stream")

    async def _stream(self) -> AsyncIterator[str]:
        head = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": None}
        yield f"data: {json.dumps(head | {'choices': [role], 'prompt_token_ids': PROMPT})}\n\n"
        for token, text in zip((10, 11, 12), ("Par", "is", "."), strict=True):
            choice = {"index": 0, "delta": {"content": text}, "token_ids": [token]}
            yield f"data: {json.dumps(head | {'choices': [choice]})}\n\n"
        usage = {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11}
        usage |= {"prompt_tokens_details": {"cached_tokens": 4}}
        yield f"data: {json.dumps(head | {'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"


@pytest.fixture
def chat_server() -> Iterator[_ChatServer]:
    with _ChatServer() as server:
        yield server


def test_a_stock_turn_reads_the_ids_the_usage_and_the_first_token(chat_server: _ChatServer) -> None:
    async def main() -> tuple[Any, Any, Clock]:
        conversation = StockConversation(f"http://127.0.0.1:{chat_server.port}/v1", "Be terse.", 16, "salt-0")
        try:
            clock = Clock()
            first = await conversation.turn("Capital of France?", clock)
            second = await conversation.turn("And of Italy?", Clock())
            return first, second, clock
        finally:
            await conversation.aclose()

    first, second, clock = anyio.run(main)
    assert first.prompt == PROMPT and first.output == [10, 11, 12]
    stats = first.stats
    assert (stats.turn, stats.prompt_tokens, stats.output_tokens) == (1, 8, 3)
    assert (stats.local_hit_tokens, stats.computed_tokens) == (4, 4)
    assert len(clock.arrivals) == 3 and clock.first is not None and 0 < stats.ttft_s == clock.ttft_s
    assert second.stats.turn == 2
    body = chat_server.bodies[1]
    assert body["return_token_ids"] is True and body["stream_options"] == {"include_usage": True}
    assert body["cache_salt"] == "salt-0"  # the session's own blocks, as in every mode
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
    assert body["messages"][2]["content"] == "Paris."


def test_a_failed_turn_leaves_the_conversation_as_it_was(chat_server: _ChatServer) -> None:
    chat_server.failures.append(500)

    async def main() -> None:
        conversation = StockConversation(f"http://127.0.0.1:{chat_server.port}/v1", "Be terse.", 16, "salt-0")
        try:
            with pytest.raises(openai.InternalServerError):
                await conversation.turn("Capital of France?", Clock())
            await conversation.turn("And of Italy?", Clock())
        finally:
            await conversation.aclose()

    anyio.run(main)
    messages = chat_server.bodies[1]["messages"]
    assert [(m["role"], m["content"]) for m in messages] == [("system", "Be terse."), ("user", "And of Italy?")]
