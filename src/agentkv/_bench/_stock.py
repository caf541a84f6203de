"""The bench's ``vllm-serve`` mode: stock ``vllm serve`` on the same model, started as a user starts it, and the
conversation that drives it with the client that drives ``served`` (src/agentkv/_bench/_conversations.py).

The server gets vLLM's own defaults except what every mode of a run shares: the model, ``--max-model-len`` and
``--dtype`` (float32 by default, so that greedy answers stay token-exact across modes), and on a CPU the KV cache
size that agentkv's engines get (``VLLM_CPU_KVCACHE_SPACE``). ``--enable-prompt-tokens-details`` only adds the
cached-token count to each answer's usage. No agentkv code runs in it (no plugin: ``AGENTKV_*`` variables are
left out of its environment). Its own defaults stand: on a CPU, vLLM compiles the model (no ``enforce_eager``) and
binds its compute threads its own way. Its ZMQ IPC sockets go in a folder of the bench's (``VLLM_RPC_BASE_PATH``:
where the socket files are, nothing else), removed when it stops.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx

from .._engines._platform_settings import kv_cache_space
from .._engines._platforms import current_platform
from .._engines._server_process import vllm_flags
from .._engines._spawn import ipc_folder, remove_ipc_folder
from .._engines._system import descendants, free_port, kill_and_reap
from .._errors import AgentKVError, EngineStartError
from .._model import home_dir
from .._stats._stats import StepStats
from ._conversations import Answer, ClientConversation, Clock

__all__ = ["STOCK_MODE", "StockConversation", "StockServer", "stock_command", "stock_server", "vllm_server_command"]

STOCK_MODE = "vllm-serve"
_MODEL_NAME = "agentkv-bench-stock"
_START_TIMEOUT_S = 900.0
"""How long the server may take to answer ``/health`` (it compiles the model first: minutes on 2 cores)."""


class StockServer:
    """A running stock ``vllm serve``: its URL and its processes."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path


def vllm_server_command(model: Path, port: int, *flags: str) -> list[str]:
    """vLLM's OpenAI server on ``model`` at ``port`` with ``flags``: the module ``vllm serve`` runs, with this
    interpreter's vLLM (the ``vllm`` command itself looks up a distribution named ``vllm``, which the CPU build,
    ``vllm-cpu``, is not)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--port",
        str(port),
        *flags,
    ]


def stock_command(
    model: Path,
    port: int,
    *,
    max_model_len: int,
    dtype: str,
    block_size: int | None = None,
    engine_args: Mapping[str, Any] | None = None,
) -> list[str]:
    """``vllm serve`` with the run's shared settings only (`vllm_server_command`): the KV block size too when the
    run sets one for every engine (``--block-size``), and the caller's vLLM engine arguments (``agentkv bench --
    <vLLM args>``) as ``vllm serve`` flags."""
    shared = ["--max-model-len", str(max_model_len), "--dtype", dtype, "--served-model-name", _MODEL_NAME]
    if block_size is not None:
        shared += ["--block-size", str(block_size)]
    shared += vllm_flags(engine_args or {})
    return vllm_server_command(
        model, port, *shared, "--host", "127.0.0.1", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"
    )


def stock_env(kv_cache_gib: float) -> dict[str, str]:
    """The caller's environment without agentkv's variables; on a CPU, the KV cache size of agentkv's engines."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("AGENTKV_")}
    if current_platform().is_cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = kv_cache_space(kv_cache_gib)
    return env


@contextlib.asynccontextmanager
async def stock_server(
    model: Path,
    *,
    max_model_len: int,
    dtype: str,
    kv_cache_gib: float,
    block_size: int | None = None,
    engine_args: Mapping[str, Any] | None = None,
) -> AsyncIterator[StockServer]:
    """Start stock ``vllm serve`` and wait until it is healthy; on the way out stop it and every process it
    started. Its output goes to a log file under ``$AGENTKV_HOME/logs``. ``kv_cache_gib``: its KV cache on a CPU
    (as agentkv's CPU engines get it); elsewhere vLLM sizes it as it does."""
    port = free_port()
    log_dir = home_dir() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"bench-vllm-serve-{uuid.uuid4().hex[:8]}.log"
    command = stock_command(
        model, port, max_model_len=max_model_len, dtype=dtype, block_size=block_size, engine_args=engine_args
    )
    env = stock_env(kv_cache_gib)
    sockets = env["VLLM_RPC_BASE_PATH"] = ipc_folder("vllm-serve", inside=env.get("VLLM_RPC_BASE_PATH"))
    try:
        process = await anyio.to_thread.run_sync(_spawn, command, env, log_path)
        server = StockServer(process, f"http://127.0.0.1:{port}", log_path)
        pids = {process.pid}
        try:
            await _wait_healthy(server)
            pids |= descendants(process.pid)
            yield server
        finally:
            pids |= descendants(process.pid)
            await anyio.to_thread.run_sync(_stop, process, pids)
    finally:
        remove_ipc_folder(sockets)


def _spawn(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(process: subprocess.Popen[bytes], pids: set[int]) -> None:
    """SIGTERM (vllm serve then stops its engine), SIGKILL after 30 s; then whatever of its processes is left."""
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    kill_and_reap(pids - {process.pid})


async def _wait_healthy(server: StockServer) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            if server.process.poll() is not None:
                raise EngineStartError(
                    f"stock vllm serve exited with {server.process.returncode} before it was healthy "
                    f"(its output: {server.log_path})"
                )
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{server.url}/health")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"stock vllm serve was not healthy within {_START_TIMEOUT_S:.0f} s (its output: {server.log_path})"
                )
            await anyio.sleep(1.0)


class StockConversation(ClientConversation):
    """A conversation sent to stock ``vllm serve`` as `ServedConversation` sends one to the front door: the whole
    conversation each turn, streamed, by the `openai` client. The step's figures come from the stream itself:
    the prompt's and the answer's token ids (vLLM's ``return_token_ids``) and the usage (its cached tokens);
    TTFT is the client's, from the HTTP request sent to the first chunk that carries a token."""

    def __init__(self, url: str, system: str, max_tokens: int, cache_salt: str) -> None:
        super().__init__(url, _MODEL_NAME, system, max_tokens)
        self._cache_salt = cache_salt
        self._turns = 0

    async def turn(self, message: str, clock: Clock) -> Answer:
        # vLLM's cache_salt, as every other mode's session has its own: no blocks shared between the run's sessions
        body = {"return_token_ids": True, "cache_salt": self._cache_salt}
        stream = await self._send(message, clock, extra_body=body)
        text, prompt, output, usage = "", list[int](), list[int](), None
        async for chunk in stream:
            extra = chunk.model_extra or {}
            prompt = extra.get("prompt_token_ids") or prompt
            for choice in chunk.choices:
                ids = (choice.model_extra or {}).get("token_ids") or []
                if ids:
                    clock.first_token()
                    clock.tokens(1)  # one chunk per engine delta, as served counts them
                    output += ids
                text += choice.delta.content or ""
            usage = chunk.usage or usage
        if usage is None or not prompt:
            raise AgentKVError("agentkv bench: vllm serve's stream ended without its usage or prompt token ids")
        self._answered(text)
        self._turns += 1
        details = usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details is not None else 0
        stats = StepStats(
            turn=self._turns,
            step=1,
            ttft_s=clock.ttft_s,
            prompt_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            local_hit_tokens=cached,
            computed_tokens=usage.prompt_tokens - cached,
        )
        return Answer(stats, output, list(prompt))
