"""The suite's own tools: the engine-start count (tests/conftest.py) and lending shared engines (tests/lending.py)."""

from __future__ import annotations

import json
import unittest.mock
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import agentkv
from agentkv import Colocated, EmbeddedPair, LaunchedPair, Session, SessionPool
from agentkv._engines._start_log import ENGINE_LOG_VARIABLE, record_engine_start
from agentkv.engines import EngineInfo
from conftest import count_engine_starts
from lending import lending


def _line(role: str, *, at: float, pid: int = 1, test: str = "tests/test_a.py::t (call)") -> dict[str, Any]:
    return {"time": at, "pid": pid, "role": role, "test": test, "kind": "in-process"}


def test_a_pair_counts_once_a_colocated_engine_once_a_lone_server_as_a_restart() -> None:
    lines = [
        _line("prefill", at=0.0),
        _line("decode", at=25.0),  # the same pair's D
        _line("colocated", at=60.0),
        _line("decode", at=400.0),  # a D server restarted on its own
        _line("prefill", at=500.0, test="tests/test_b.py::u (setup)"),
        _line("prefill", at=500.5, pid=2, test="tests/test_b.py::u (call)"),  # another process: another pair
        _line("decode", at=501.0, test="tests/test_b.py::u (setup)"),
        _line("decode", at=501.2, pid=2, test="tests/test_b.py::u (call)"),
    ]
    opened, restarted = count_engine_starts(lines)
    assert opened == {"tests/test_a.py": 2, "tests/test_b.py": 2}
    assert restarted == {"tests/test_a.py": 1}
    lone_p = [_line("prefill", at=0.0), _line("prefill", at=1000.0), _line("decode", at=1001.0)]
    assert count_engine_starts(lone_p) == ({"tests/test_a.py": 1}, {"tests/test_a.py": 1})
    d_first = [_line("decode", at=0.0), _line("prefill", at=0.01)]  # a pair's halves start at once, in either order
    assert count_engine_starts(d_first) == ({"tests/test_a.py": 1}, {})


def test_engine_starts_are_logged_only_where_asked(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "engines.jsonl"
    monkeypatch.setenv(ENGINE_LOG_VARIABLE, str(log))
    record_engine_start(kind="server", role="prefill")
    record_engine_start(kind="server", role="decode")
    assert [json.loads(line)["role"] for line in log.read_text().splitlines()] == ["prefill", "decode"]
    monkeypatch.delenv(ENGINE_LOG_VARIABLE)
    record_engine_start(kind="server", role="prefill")
    assert len(log.read_text().splitlines()) == 2


@pytest.fixture
def shared() -> Iterator[dict[str, Any]]:
    """Unopened engines standing in for the suite's running ones (lending never opens or starts them)."""
    info = EngineInfo(model_path=Path("/nowhere"), max_model_len=2048, pins=True, disaggregated=True)
    engines = {"pair": EmbeddedPair(), "colocated": Colocated(), "launched": LaunchedPair()}
    with (
        unittest.mock.patch.object(EmbeddedPair, "info", info),
        unittest.mock.patch.object(Colocated, "info", info),
        unittest.mock.patch.object(LaunchedPair, "info", info),
    ):
        yield engines


def test_code_run_while_lending_gets_the_shared_engine_where_its_arguments_allow(shared: dict[str, Any]) -> None:
    pair, colocated, launched = shared["pair"], shared["colocated"], shared["launched"]
    with lending(**shared) as lender:
        assert agentkv.EmbeddedPair() is pair and agentkv.EmbeddedPair(max_model_len=1024, warmup=False) is pair
        assert agentkv.Colocated(max_model_len=2048) is colocated
        assert agentkv.LaunchedPair(max_model_len=2048) is launched
        for asks_more in ({"max_model_len": 4096}, {"transfer": "push"}, {"prefill_prefix_cache": False}):
            real = agentkv.EmbeddedPair(**asks_more)
            assert real is not pair and type(real) is EmbeddedPair  # a real pair of its own (unopened here)
        assert agentkv.Session()._given_engine is pair
        assert agentkv.Session(mode="colocated")._given_engine is colocated
        assert agentkv.Session(engine_options={"max_model_len": 512})._given_engine is pair
        assert agentkv.Session(engine_options={"kv_cache_gib": 4})._given_engine is None  # starts its own
        assert agentkv.SessionPool()._given_engine is pair
        with pair as entered, agentkv.EmbeddedPair() as borrowed:  # lifecycle calls are the owner's: no-ops
            assert entered is pair and borrowed is pair and pair.start() is pair
        pair.close()
        assert pair.state.value == "unopened"
    assert lender.lent.count("EmbeddedPair") == 6 and lender.refused[0] == "EmbeddedPair(max_model_len=4096)"
    assert agentkv.EmbeddedPair is EmbeddedPair and agentkv.Session is Session and agentkv.SessionPool is SessionPool
    assert type(pair) is EmbeddedPair and type(colocated) is Colocated


def test_the_soak_script_hooks_what_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/soak.py runs only nightly: on a landing, at least what it patches in agentkv must still exist."""
    import importlib.util

    from agentkv._engines import _vllm

    path = Path(__file__).parent.parent / "scripts" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    assert spec is not None and spec.loader is not None
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    monkeypatch.setattr(_vllm.AsyncLLMRunner, "_stat_logger_factory", _vllm.AsyncLLMRunner._stat_logger_factory)
    original = _vllm.AsyncLLMRunner._stat_logger_factory
    soak.record_kv_usage()  # wraps the runner's stat-logger factory (monkeypatch restores it)
    wrapped = _vllm.AsyncLLMRunner._stat_logger_factory
    assert wrapped is not original and "record_kv_usage" in wrapped.__qualname__


def test_the_nixl_read_script_times_one_block_from_every_layer_s_caches() -> None:
    """scripts/nixl_read.py (the fixed cost under a pull, docs/benchmarks.md): two processes, real NIXL reads."""
    import subprocess
    import sys

    path = Path(__file__).parent.parent / "scripts" / "nixl_read.py"
    run = subprocess.run(
        [sys.executable, str(path), "--block-size", "32", "--blocks", "2", "--reads", "4", "--pause-s", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["descriptors"] == 60 and result["bytes"] == 60 * 32 * 3 * 64 * 4  # K and V of 30 layers
    assert result["reads"] == 4 and 0 < result["min_ms"] <= result["p50_ms"] <= result["p90_ms"]


def _turn(mode: str, engine: str, *, start: float, ttft: float, gaps: list[float], prefill: float = 0.5) -> Any:
    """A bench record (`TurnRecord`, as `agentkv bench --json` writes it) of a turn 2 at load 2."""
    return {
        "mode": mode,
        "session": 0,
        "turn": 2,
        "load": 2,
        "start_s": start,
        "ttft_s": ttft,
        "engine_ttft_s": ttft,
        "wall_s": ttft + sum(gaps),
        "itl_s": gaps,
        "prefill_s": prefill,
        "prefill_engine": engine,
        "placement_reason": "SLO TTFT 2 s, ITL 0.5 s: D 1.000 s (...): D is no slower",
        "prompt_tokens": 600,
        "new_tokens": 100,
        "local_hit_tokens": 500,
        "pulled_tokens": 0,
        "computed_tokens": 100,
        "output_tokens": len(gaps) + 1,
        "kv_bytes": None,
        "kv_transfer_s": None,
        "miss_reason": None,
        "output_token_ids": [7] * (len(gaps) + 1),
        "prompt_digest": "d",
    }


def test_the_bench_gaps_script_places_each_gap_against_the_prefills_on_d(capsys: pytest.CaptureFixture[str]) -> None:
    """scripts/bench_gaps.py (docs/benchmarks.md, "Results under load") on a made-up load of two turns per mode."""
    import importlib.util

    path = Path(__file__).parent.parent / "scripts" / "bench_gaps.py"
    spec = importlib.util.spec_from_file_location("bench_gaps", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    steady = [0.1] * 10
    run = {
        "loads": [2],
        "floor": {"a_s": 1.0, "b_s_per_token": 0.0, "c_s_per_attended": 0.0, "points": []},  # every turn's: 1 s
        "slo": {  # a turn's objective: TTFT 2 s, worst gap 0.5 s
            "ttft_factor": 2.0,
            "itl_factor": 5.0,
            "itl_reference_s": 0.1,
            "itl_reference_gaps": 10,
            "ttft_target_min_s": 2.0,
            "ttft_target_max_s": 2.0,
        },
        "records": [
            _turn("bidirectional", "prefill", start=0.0, ttft=1.0, gaps=steady),  # decodes on D from 1 s to 2 s
            _turn("bidirectional", "prefill", start=0.0, ttft=3.0, gaps=steady),  # D idle from 2 s to 3 s
            _turn("auto", "decode", start=0.0, ttft=1.0, gaps=steady, prefill=1.0),  # prefilled on D from 0 to 1 s
            _turn("auto", "prefill", start=0.0, ttft=0.5, gaps=[0.6, *steady[1:]]),  # its hand-over waits on it
        ],
    }
    script.report(run, mode="auto", against="bidirectional", load=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("load  2: ITL p99 auto ") and "bidirectional 0.100 s" in lines[0]
    assert "auto's gaps over it 1, 1 spanning a prefill on D, 1 hand-overs; auto's steps on D 1" in lines[0]
    assert lines[0].endswith("D decoded nothing for 1.0 s in 1 stretches (1.00)")
    verdicts = [line.split(", ")[2].split(";")[0] for line in lines[1:]]
    assert verdicts == ["kept", "lost on a gap", "kept", "lost on TTFT"]
