"""Stock vLLM API servers for tests: started as a user starts them, stopped with their process group, ports checked."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from agentkv._bench._stock import vllm_server_command
from agentkv._engines._spawn import ipc_folder, remove_ipc_folder
from agentkv._engines._start_log import record_engine_start
from agentkv._engines._system import alive, descendants
from freed import assert_ports_freed, running_pids


def healthy(url: str) -> bool:
    """Whether a vLLM server answers ``/health`` with 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def with_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``process`` leads (its engine core included)."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def stop_servers(
    processes: Sequence[subprocess.Popen[bytes]], pids: set[int], ports: set[int], running_before: set[int]
) -> None:
    """SIGTERM each server's group (SIGKILL after 60 s); then no process and no port of theirs is left."""
    for process in processes:
        with_group(process, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with_group(process, signal.SIGKILL)
            process.wait()
    stop = time.monotonic() + 30
    while alive(pids) and time.monotonic() < stop:
        time.sleep(0.5)
    assert alive(pids) == set()
    assert_ports_freed(ports, running_before=running_before)


@contextlib.contextmanager
def stock_vllm_starting(model: Path, port: int, args: Sequence[str], log: Path) -> Iterator[Callable[[], str]]:
    """``python -m vllm.entrypoints.openai.api_server --model MODEL --port PORT ARGS`` with vLLM's own defaults
    otherwise (no agentkv variable set; 1 GiB of KV cache on CPU), started at once; yields the function that
    waits until it is healthy and returns its URL. Stopped when the block ends."""
    running_before = running_pids()
    env = {key: value for key, value in os.environ.items() if not key.startswith("AGENTKV_")}
    sockets = ipc_folder("vllm-serve")  # where its ZMQ IPC socket files go: removed when it stops
    record_engine_start(kind="stock-server", role="colocated")  # counted in the suite's engine summary (conftest)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            vllm_server_command(model, port, *args),
            env={**env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_RPC_BASE_PATH": sockets},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    pids = {process.pid}

    def ready() -> str:
        deadline = time.monotonic() + 600
        while not healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"stock vLLM server did not start (rc {process.poll()}): {log.read_text()[-3000:]}")
            time.sleep(1)
        pids.update(descendants(process.pid))
        return url

    try:
        yield ready
    finally:
        pids.update(descendants(process.pid))
        try:
            stop_servers([process], pids, {port}, running_before)
        finally:
            remove_ipc_folder(sockets)


@contextlib.contextmanager
def stock_vllm_server(model: Path, port: int, args: Sequence[str], log: Path) -> Iterator[str]:
    """`stock_vllm_starting`, once healthy: its URL."""
    with stock_vllm_starting(model, port, args, log) as ready:
        yield ready()
