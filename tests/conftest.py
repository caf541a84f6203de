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

from agentkv import Colocated, EmbeddedPair, LaunchedPair, prepare_model
from agentkv._engines._start_log import ENGINE_LOG_VARIABLE
from agentkv._engines._system import alive, available_cores
from agentkv._session._pin_upkeep import PinUpkeep
from agentkv.testing import block_real_engines
from freed import assert_ports_freed, running_pids
from postgres_server import PostgresServer, postgres_server
from scripted import close_leftover_event_loop

# D pins blocks for 30 s in tests (480 s by default), so expiry paths run in seconds.
PIN_TTL_S = 30.0
# The launched pair's pins live longer: doors that share a store do not renew pins (src/agentkv/_session/_pool.py), so
# a conversation's next turn must come within the TTL less the 10 s margin, and a round of 8 conversations across a
# door's death (tests/test_scale_out_pair.py) took 11.6 s here, near the 20 s that 30 s leaves on a slower machine.
LAUNCHED_PIN_TTL_S = 120.0
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
def _no_upkeep_after_turns(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Right after each turn a session on an engine that pins starts a one-token step of its own: the repin after a
    stop string, the early transfer into P (src/agentkv/_session/_pin_upkeep.py). Tests not marked `upkeep` count
    their doubles' steps and script one output per step of a turn, so there it does not happen (the renewals, due
    later, still do): tests/test_pin_upkeep.py and the tests marked `upkeep` test it."""
    if request.node.get_closest_marker("upkeep") is None:
        monkeypatch.setattr(PinUpkeep, "_after_turn", staticmethod(lambda session, *, turn, repin: None))


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


@pytest.fixture(scope="session")
def colocated() -> Iterator[Colocated]:
    """One engine with prefix caching on all the cores, as the pair is sized: every test's colocated engine. (By
    default a `Colocated` leaves a core to its scheduler, as vLLM binds; on this 2-core host it would compute on core
    0 alone, spinning beside the launched pair's P, which the suite starts while it is open.)"""
    with Colocated(max_model_len=2048, dtype=EXACT_DTYPE, cores=available_cores()) as engine:
        yield engine


@pytest.fixture(scope="session")
def launched() -> Iterator[LaunchedPair]:
    """Two vLLM API servers that agentkv started, as the pair is sized; closing it leaves no process, no port and no
    IPC socket file."""
    running_before = running_pids()
    with LaunchedPair(max_model_len=2048, pin_ttl_s=LAUNCHED_PIN_TTL_S, dtype=EXACT_DTYPE) as engine:
        yield engine
        pids, ports = engine.pids, engine.ports
        sockets = [server.ipc_folder for server in engine._servers.values()]
        assert pids and ports and all(sockets)
    assert alive(pids) == set()
    assert_ports_freed(ports, running_before=running_before)
    assert not [folder for folder in sockets if folder and os.path.exists(folder)]  # vLLM's IPC socket files went


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of the module's own (tests/postgres_server.py; skipped where PostgreSQL is not installed)."""
    with postgres_server() as running:
        yield running


@pytest.fixture
def postgres_url(postgres: PostgresServer) -> str:
    """The module's server, running (started again if a test stopped it), its database emptied."""
    if not postgres.running:
        postgres.start()
    postgres.reset()
    return postgres.url


# ----------------------------------------------------------------- the order of the real-engine tiers
# A shared engine stays open from its first user to the session's end. An engine on the bundled model
# holds about 3.3 GiB here (its worker 2.6, with 1 GiB of KV; its core 0.7); the launched pair's two
# API servers add about 1 GiB each. With the pair, the colocated engine and the launched pair open,
# a test's own pair pushed a 24-GiB machine out of memory (page cache thrashing; the tier ran 2.5
# times slower). So test files run in three groups, each file whole and in its order otherwise:
# those on no shared engine (they start their own), those on the shared pair or colocated engine,
# then those on the shared launched pair too; the peak is the three shared engines alone.

SHARED_ENGINES = ("pair", "colocated", "launched")


def _group(item: pytest.Item) -> int:
    """0: no shared engine, 1: the pair or colocated engine, 2: the launched pair (by fixture or `uses_shared`)."""
    names = set(getattr(item, "fixturenames", ()))
    for mark in item.iter_markers("uses_shared"):
        names.update(mark.args)
    return 2 if "launched" in names else 1 if names & set(SHARED_ENGINES) else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        groups[path] = max(groups.get(path, 0), _group(item))
    items.sort(key=lambda item: groups[item.nodeid.split("::")[0]])  # stable: each group in collection order


# ----------------------------------------------------------------- engine starts, counted per test file
# Every vLLM engine agentkv starts, in this process or a child, appends a line to AGENTKV_ENGINE_LOG
# (src/agentkv/_engines/_start_log.py); tests/test_stock_vllm.py logs the stock servers it starts.
# The summary counts, per test file, the engines opened (a pair once: its P and D start from the same
# process within a pair's start-up, at once, in either order; a colocated engine once; a pair of stock
# servers once) and, apart, the servers a launched pair restarted on its own (a lone P or D).

PAIR_START_S = 180.0
"""A pair's P and D start within this much of each other (at once in-process: src/agentkv/_engines/_spawn.py)."""

_OTHER_HALF = {"prefill": "decode", "decode": "prefill"}


def count_engine_starts(lines: list[dict[str, Any]]) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Engines opened and servers restarted, per test file, from the engine log's lines (in the order written)."""
    opened: collections.Counter[str] = collections.Counter()
    restarted: collections.Counter[str] = collections.Counter()
    halves: dict[tuple[int, str], list[tuple[float, str, str]]] = collections.defaultdict(list)

    def where(line: dict[str, Any]) -> str:
        return str(line.get("test") or "outside a test").split("::")[0]

    for line in lines:
        role = line["role"]
        if role not in _OTHER_HALF:
            opened[where(line)] += 1
            continue
        pending = halves[(line["pid"], str(line.get("test")))]
        while pending and line["time"] - pending[0][0] > PAIR_START_S:  # a half no other half followed: a restart
            restarted[pending.pop(0)[2]] += 1
        match = next((half for half in pending if half[1] == _OTHER_HALF[role]), None)
        if match is not None:
            pending.remove(match)
            opened[match[2]] += 1  # the other half of a pair's start
        else:
            pending.append((line["time"], role, where(line)))
    for pending in halves.values():
        for _, _, test_file in pending:
            restarted[test_file] += 1
    return opened, restarted


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get(ENGINE_LOG_VARIABLE):
        handle, path = tempfile.mkstemp(prefix="agentkv-engines-", suffix=".jsonl")
        os.close(handle)
        os.environ[ENGINE_LOG_VARIABLE] = path
        config.stash[_OWN_ENGINE_LOG] = path


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    path = os.environ.get(ENGINE_LOG_VARIABLE, "")
    log = Path(path) if path else None
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log and log.exists() else []
    opened, restarted = count_engine_starts(lines)
    engines = collections.Counter(str(line.get("test") or "outside a test").split("::")[0] for line in lines)
    terminalreporter.section("engine starts (a pair counts once)")
    for where in sorted(engines, key=lambda name: (-opened[name], name)):
        again = f", {restarted[where]} server restarts" if restarted[where] else ""
        terminalreporter.write_line(f"{opened[where]:4d}  {where}  ({engines[where]} vLLM engines{again})")
    terminalreporter.write_line(
        f"engine starts: {sum(opened.values())} engines opened, {sum(restarted.values())} servers restarted, "
        f"{len(lines)} vLLM engines in all"
    )
    if own := config.stash.get(_OWN_ENGINE_LOG, None):
        Path(own).unlink(missing_ok=True)


_OWN_ENGINE_LOG = pytest.StashKey[str]()
