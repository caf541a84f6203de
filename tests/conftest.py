"""Shared fixtures: one real P/D pair for the whole test session, the bundled model's tokenizer."""

from __future__ import annotations

import collections
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentkv import EmbeddedPair, prepare_model
from agentkv._engines._start_log import ENGINE_LOG_VARIABLE
from agentkv.testing import block_real_engines
from scripted import close_leftover_event_loop

# D pins blocks for 30 s in tests (480 s by default), so expiry paths run in seconds.
PIN_TTL_S = 30.0
# bf16 KV from a cache, a pull or a recompute differs in its last bits: float32 keeps greedy outputs equal across modes.
EXACT_DTYPE = "float32"


@pytest.fixture(autouse=True)
def _no_real_engines_in_unit_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests not marked `pair` must not start a real engine (they test logic, on doubles)."""
    if request.node.get_closest_marker("pair") is not None:
        yield
        return
    with block_real_engines():
        yield


@pytest.fixture(autouse=True)
def _close_the_loop_frameworks_leave() -> Iterator[None]:
    """openai-agents' and pydantic-ai's ``run_sync`` leave an event loop set on the thread for their next
    call; a later ``asyncio.run`` (in any test) would drop it unclosed, a ResourceWarning: close it."""
    yield
    close_leftover_event_loop()


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"  # vLLM's AsyncLLM runs on asyncio


@pytest.fixture(scope="session")
def model_path() -> Path:
    return prepare_model()


@pytest.fixture(scope="session")
def tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.fixture(scope="session")
def pair() -> Iterator[EmbeddedPair]:
    """The real pair: P on one half of the cores, D on the other, NIXL, push-back on."""
    with EmbeddedPair(max_model_len=2048, pin_ttl_s=PIN_TTL_S, dtype=EXACT_DTYPE) as engine:
        yield engine


# ----------------------------------------------------------------- engine starts, counted per test file
# Every vLLM engine agentkv starts, in this process or a child, appends a line to AGENTKV_ENGINE_LOG
# (src/agentkv/_engines/_start_log.py); the summary counts them per test file. A pair counts once
# (its P; its D is the second engine of the same start), a colocated engine once, stock vLLM servers
# (tests/test_stock_vllm.py logs them itself) once per pair of servers.


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get(ENGINE_LOG_VARIABLE):
        handle, path = tempfile.mkstemp(prefix="agentkv-engines-", suffix=".jsonl")
        os.close(handle)
        os.environ[ENGINE_LOG_VARIABLE] = path
        config.stash[_OWN_ENGINE_LOG] = path


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    path = os.environ.get(ENGINE_LOG_VARIABLE, "")
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()] if path else []
    per_file: collections.Counter[str] = collections.Counter()
    engines: collections.Counter[str] = collections.Counter()
    for line in lines:
        where = (line.get("test") or "outside a test").split("::")[0]
        engines[where] += 1
        if line["role"] != "decode":
            per_file[where] += 1
    terminalreporter.section("engine starts (a pair counts once)")
    for where, count in sorted(per_file.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{count:4d}  {where}  ({engines[where]} vLLM engines)")
    terminalreporter.write_line(f"engine starts: {sum(per_file.values())} ({len(lines)} vLLM engines) [{path}]")
    if own := config.stash.get(_OWN_ENGINE_LOG, None):
        Path(own).unlink(missing_ok=True)


_OWN_ENGINE_LOG = pytest.StashKey[str]()
