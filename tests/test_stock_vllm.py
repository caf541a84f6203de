"""`RemotePair` against stock vLLM 0.32 servers: each row of docs/engines.md's table for stock servers.

The servers are started exactly as the docs say a user would (``python -m
vllm.entrypoints.openai.api_server`` with NIXL and ``bidirectional_kv_xfer``), not with
agentkv's entry point; agentkv's vLLM plugin is in this venv but does nothing in them
(none of its variables is set). Once up, each server's threads are put back on its own
cores (what the docs tell a user running both on one host to do with ``taskset -a``):
vLLM's NIXL worker moves every server's model thread to the host's last core, and on this
2-core machine an unpinned stock P did not finish a 301-token prefill in vLLM's 300 s
``execute_model`` timeout. One pair of servers serves the module; its fixture checks
on the way out that no process and no port is left. Each turn has a generous bound: the
tests check behaviour (a turn ends), not speed. ``pytest -s`` prints what each turn took.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from agentkv import ModelPreparationError, RemotePair, Session, TurnResult, UserError
from agentkv._bench._stock import vllm_server_command
from agentkv._engines._start_log import record_engine_start
from agentkv._engines._system import descendants, free_port, repin_threads, split_cores
from agentkv._model import prepare_model
from freed import running_pids
from stock_server import healthy, stock_vllm_server, stop_servers

pytestmark = [pytest.mark.pair, pytest.mark.nightly]

SYSTEM = "You are a terse assistant for a Python project. " + " ".join(
    f"Fact {i}: module m{i} exports function f{i}." for i in range(60)
)  # ~700 tokens, as in the issue that found the hang
QUESTIONS = ("Which module exports f3?", "And f7?", "Name one more module.")
TURN_BOUND_S = 120.0
OPEN_BOUND_S = 300.0
KV_TRANSFER_CONFIG = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
    "kv_connector_extra_config": {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 16},
}
"""vLLM's default threshold (64) has P recompute rather than pull any tail under 64 tokens; with P's own
prefix cache that is most short turns, so nothing would come back. agentkv's pairs use 16."""


def stock_server_command(model: Path, port: int) -> list[str]:
    """The command of docs/engines.md's "stock vLLM 0.32" rows (each server's environment adds its cores and port)."""
    return vllm_server_command(
        model,
        port,
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--kv-transfer-config",
        json.dumps(KV_TRANSFER_CONFIG),
    )


@pytest.fixture(scope="module")
def model() -> Path:
    return prepare_model()


@pytest.fixture(scope="module")
def stock_servers(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A stock vLLM prefill server and decode server on disjoint cores; gone, with their ports, at the end."""
    running_before = running_pids()
    logs = tmp_path_factory.mktemp("stock-vllm")
    cores = split_cores()
    ports = {role: (free_port(), free_port()) for role in ("prefill", "decode")}
    processes: dict[str, subprocess.Popen[bytes]] = {}
    env = {key: value for key, value in os.environ.items() if not key.startswith("AGENTKV_")}
    for (role, (port, side_channel)), role_cores in zip(ports.items(), cores, strict=True):
        record_engine_start(kind="stock-server", role=role)  # counted in the suite's engine summary (conftest)
        with open(logs / f"{role}.log", "wb") as log:
            processes[role] = subprocess.Popen(
                stock_server_command(model, port),
                env={
                    **env,
                    "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, role_cores)),
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel),
                    "VLLM_CPU_KVCACHE_SPACE": "1",
                },
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    urls = tuple(f"http://127.0.0.1:{port}" for port, _ in ports.values())
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 600
        while not all(healthy(url) for url in urls):
            dead = [role for role, process in processes.items() if process.poll() is not None]
            if dead or time.monotonic() > deadline:
                tails = {role: (logs / f"{role}.log").read_text()[-2000:] for role in processes}
                pytest.fail(f"stock vLLM servers did not start (exited: {dead}): {tails}")
            time.sleep(2)
        for process, role_cores in zip(processes.values(), cores, strict=True):
            repin_threads({process.pid, *descendants(process.pid)}, role_cores)  # `taskset -a -p -c CORES PID`
        pids = {pid for process in processes.values() for pid in {process.pid, *descendants(process.pid)}}
        yield urls[0], urls[1]
    finally:
        pids |= {pid for process in processes.values() for pid in descendants(process.pid)}
        ports_used = {port for pair in ports.values() for port in pair}
        stop_servers(list(processes.values()), pids, ports_used, running_before)


def nixl_totals(url: str) -> tuple[float, float]:
    """A server's NIXL reads so far, from its Prometheus metrics: (transfers, bytes)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((f"{name} ", f"{name}{{")))

    return total("vllm:nixl_xfer_time_seconds_count"), total("vllm:nixl_bytes_transferred_sum")


async def _three_turns(pair: RemotePair) -> list[TurnResult]:
    results = []
    async with Session(engine=pair, system=SYSTEM, max_tokens=12) as session:
        for question in QUESTIONS:
            started = time.perf_counter()
            with anyio.fail_after(TURN_BOUND_S):
                results.append(await session.run(question))
            stats = results[-1].steps[0].stats
            print(f"stock turn {len(results)}: {time.perf_counter() - started:.1f} s, TTFT {stats.ttft_s:.2f} s")
    return results


def test_stock_servers_keep_push_back_without_token_streaming(stock_servers: tuple[str, str], model: Path) -> None:
    """The ``decode_streaming=False`` row: three turns, each step's handle pushed back to P."""

    async def run() -> list[TurnResult]:
        started = time.perf_counter()
        with anyio.fail_after(OPEN_BOUND_S):
            pair = RemotePair(*stock_servers, model=model, decode_streaming=False)
            await pair.open()
        print(f"stock open (probe and warm-up): {time.perf_counter() - started:.1f} s")
        try:
            assert pair.server_kind == "vllm" and pair.handle_in_stream is False and pair.info.pins
            before = await anyio.to_thread.run_sync(nixl_totals, stock_servers[0])
            results = await _three_turns(pair)
        finally:
            await pair.aclose()
        after = await anyio.to_thread.run_sync(nixl_totals, stock_servers[0])
        assert (await anyio.to_thread.run_sync(nixl_totals, stock_servers[1]))[0] > 0  # D read P's prefills
        # P reads over NIXL only when it pulls a conversation back from D (turn 3 has 40+ new tokens to pull)
        assert after[0] > before[0] and after[1] > before[1], (before, after)
        return results

    results = anyio.run(run)
    steps = [result.steps[0].stats for result in results]
    assert all(result.text for result in results)
    assert steps[0].miss_reason == "no_handle"
    for step in steps[1:]:  # the handle went back and P took it (a stock P reports no pulled count)
        assert step.handle_forwarded and step.miss_reason not in ("declined", "expired", "prefix_mismatch")
        assert step.pulled_tokens == 0 and step.kv_bytes is None


def test_stock_decode_server_is_refused_for_streaming(stock_servers: tuple[str, str], model: Path) -> None:
    """The default row (``decode_streaming=True``): refused at open, with what to run instead; no step runs."""

    async def run() -> None:
        pair = RemotePair(*stock_servers, model=model)
        with anyio.fail_after(OPEN_BOUND_S), pytest.raises(UserError) as refused:
            await pair.open()
        assert "agentkv engine --role decode" in str(refused.value)
        assert "decode_streaming=False" in str(refused.value)
        assert not pair.is_open

    anyio.run(run)


def test_without_a_model_the_pair_tokenizes_with_the_servers(stock_servers: tuple[str, str], model: Path) -> None:
    """The servers serve the bundled model's folder: a pair given no model reads it from them and uses it."""

    async def run() -> None:
        pair = RemotePair(*stock_servers, decode_streaming=False, warmup=False)
        with anyio.fail_after(OPEN_BOUND_S):
            await pair.open()
        try:
            assert pair.info.model_path == model
            assert pair.info.details["versions"]["decode"]["vllm"] == pair.info.details["versions"]["prefill"]["vllm"]
        finally:
            await pair.aclose()

    anyio.run(run)


def test_a_server_serving_under_another_models_name_is_refused_at_open(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stock server started with the bundled weights under a Qwen's name (``--served-model-name``): a session that
    names the bundled model is refused at open, by name, before any request; one that names none takes the
    servers' word (a Qwen), which this host's HF cache lacks, and says so. Before, both sent SmolLM2's ids."""
    qwen = "Qwen/Qwen3-0.6B"
    args = ["--enforce-eager", "--max-model-len", "2048", "--served-model-name", qwen]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with stock_vllm_server(model, free_port(), args, tmp_path / "alias.log") as url:

        async def run() -> None:
            named = RemotePair(url, url, model="smollm2-135m-instruct", decode_streaming=False, warmup=False)
            with (
                anyio.fail_after(OPEN_BOUND_S),
                pytest.raises(UserError, match=f"is not the one the servers serve: '{qwen}'"),
            ):
                await named.open()
            theirs = RemotePair(url, url, decode_streaming=False, warmup=False)
            with (
                anyio.fail_after(OPEN_BOUND_S),
                pytest.raises(ModelPreparationError, match=f"the servers serve '{qwen}'"),
            ):
                await theirs.open()
            assert not named.is_open and not theirs.is_open

        anyio.run(run)
