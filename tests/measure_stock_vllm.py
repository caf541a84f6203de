"""Stock vLLM servers against agentkv's, on this machine: what docs/engines.md's figures come from.

Starts the stock pair of ``test_stock_vllm.py`` (same command, threads put back on their
cores), then a `LaunchedPair` (agentkv's servers), and runs the same 3-turn session on each:
idle cores busy, open and turn times, the stats each one reports. Not a test (it asserts
nothing); run it alone, under the engines lock:

    flock /tmp/agentkv-engines.lock .venv/bin/python tests/measure_stock_vllm.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import anyio
import anyio.to_thread

from agentkv import LaunchedPair, RemotePair, Session
from agentkv._engines._system import descendants, free_port, repin_threads, split_cores
from agentkv._model import prepare_model
from agentkv.engines import Engine
from test_stock_vllm import QUESTIONS, SYSTEM, _healthy, stock_server_command  # this script's folder is on sys.path


def cores_busy(pids: Iterable[int], seconds: float = 10.0) -> float:
    """Cores the processes kept busy over ``seconds`` (user + system time from /proc)."""

    def ticks() -> int:
        total = 0
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except OSError:
                pass
        return total

    before = ticks()
    time.sleep(seconds)
    return (ticks() - before) / os.sysconf("SC_CLK_TCK") / seconds


async def three_turns(engine: Engine, label: str) -> None:
    async with Session(engine=engine, system=SYSTEM, max_tokens=12) as session:
        for question in QUESTIONS:
            started = time.perf_counter()
            step = (await session.run(question)).steps[0].stats
            print(
                f"{label} turn: {time.perf_counter() - started:.2f} s, TTFT {step.ttft_s:.2f} s; prompt "
                f"{step.prompt_tokens} = local {step.local_hit_tokens} + pulled {step.pulled_tokens} + computed "
                f"{step.computed_tokens}; forwarded {step.handle_forwarded}, miss {step.miss_reason}; "
                f"kv_bytes {step.kv_bytes}, prefill_s {step.prefill_s}, decode_s {step.decode_s}",
                flush=True,
            )


def stock(model: Path) -> None:
    cores = split_cores()
    servers: list[tuple[subprocess.Popen[bytes], str]] = []
    env = {key: value for key, value in os.environ.items() if not key.startswith("AGENTKV_")}
    for role_cores in cores:
        port = free_port()
        server_env = {
            **env,
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, role_cores)),
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            "VLLM_CPU_KVCACHE_SPACE": "1",
        }
        process = subprocess.Popen(
            stock_server_command(model, port),
            env=server_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        servers.append((process, f"http://127.0.0.1:{port}"))
    try:
        started = time.perf_counter()
        while not all(_healthy(url) for _, url in servers):
            time.sleep(2)
        print(f"stock servers up in {time.perf_counter() - started:.0f} s", flush=True)
        for (process, _), role_cores in zip(servers, cores, strict=True):
            repin_threads({process.pid, *descendants(process.pid)}, role_cores)
        pids = {pid for process, _ in servers for pid in {process.pid, *descendants(process.pid)}}
        print(f"stock idle: {cores_busy(pids):.2f} cores busy", flush=True)

        async def run() -> None:
            opened = time.perf_counter()
            async with RemotePair(servers[0][1], servers[1][1], model=model, decode_streaming=False) as pair:
                print(f"stock open (probe, warm-up): {time.perf_counter() - opened:.1f} s", flush=True)
                await three_turns(pair, "stock")
            print(f"stock idle after: {await anyio.to_thread.run_sync(cores_busy, pids):.2f} cores busy", flush=True)

        anyio.run(run)
    finally:
        for process, _ in servers:
            os.killpg(process.pid, signal.SIGTERM)
        for process, _ in servers:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def agentkv_servers(model: Path) -> None:
    async def run() -> None:
        opened = time.perf_counter()
        async with LaunchedPair(model, max_model_len=2048) as pair:
            print(f"agentkv open (start, warm-up): {time.perf_counter() - opened:.1f} s", flush=True)
            print(f"agentkv idle: {await anyio.to_thread.run_sync(cores_busy, pair.pids):.2f} cores busy", flush=True)
            await three_turns(pair, "agentkv")
            print(f"agentkv idle after: {await anyio.to_thread.run_sync(cores_busy, pair.pids):.2f} cores", flush=True)

    anyio.run(run)


if __name__ == "__main__":
    bundled = prepare_model()
    stock(bundled)
    agentkv_servers(bundled)
