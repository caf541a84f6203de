"""What agentkv does where the installed vLLM lacks the targets of one of its features (docs/vllm-patches.md):
it refuses a setting that asks for the feature explicitly, by name, or turns the feature off with one warning.

The probes are the plugin's (tests/test_vllm_patches.py moves real targets in fresh interpreters); here a probe is
made to fail in this process (`missing`). No engine starts: the pair's engines are recorded, not built.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from _agentkv_vllm._patches import (
    AUTO_PLACEMENT,
    CORE_TABLE_ENV,
    ELASTIC_CORES,
    FEATURES,
    IDLE_SLEEP,
    PUSH_BACK,
    WARNED_ENV,
    engine_env,
)
from agentkv import EmbeddedPair, UserError
from agentkv._engines import _vllm_features
from agentkv._engines._base import Sampling, StepRequest
from agentkv._engines._pair_config import PUSH_CONNECTOR, PairConfig, connector_choice
from agentkv._engines._platforms import Platform
from agentkv._engines._vllm import AsyncLLMRunner
from agentkv._engines._vllm_features import warn_engine_features
from agentkv._session._modes import modes_of
from agentkv._session._session import Session

MOVED = "Thing.method (vllm.somewhere): missing"


@pytest.fixture
def missing(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[str], None]]:
    """``missing(feature)``: the installed vLLM lacks a target of ``feature`` (as the plugin's probe would say)."""
    off: dict[str, str] = {}
    _vllm_features.feature_problem.cache_clear()
    monkeypatch.setattr(_vllm_features, "probe", lambda feature: off.get(feature))
    monkeypatch.setenv(WARNED_ENV, "")  # nothing said yet in this process
    caplog.set_level(logging.WARNING, logger="agentkv")

    def make_missing(feature: str) -> None:
        off[feature] = MOVED
        _vllm_features.feature_problem.cache_clear()

    yield make_missing
    _vllm_features.feature_problem.cache_clear()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


def test_push_with_push_back_is_refused_by_name_and_the_stock_connectors_run(missing: Callable[[str], None]) -> None:
    assert connector_choice(PairConfig(transfer="push")) == PUSH_CONNECTOR  # the installed vLLM has it all
    missing(PUSH_BACK)
    with pytest.raises(UserError, match="push with push-back") as refused:
        connector_choice(PairConfig(transfer="push"))
    assert MOVED in str(refused.value) and 'transfer="push"' in str(refused.value)
    assert connector_choice(PairConfig(transfer="push", push_back=False)) == {"kv_connector": "NixlPushConnector"}
    assert connector_choice(PairConfig()) == {"kv_connector": "NixlConnector"}


def test_without_auto_placement_a_pair_serves_no_auto_mode_and_says_why(missing: Callable[[str], None]) -> None:
    def opened() -> EmbeddedPair:
        pair = EmbeddedPair(warmup=False)
        pair._d = SimpleNamespace(num_blocks=100)  # type: ignore[assignment]  # what _know_started reads of D
        pair._know_started(Path("/model"), {})
        return pair

    assert "auto" in modes_of(opened().info)
    missing(AUTO_PLACEMENT)
    pair = opened()
    assert modes_of(pair.info) == {"bidirectional", "disaggregated"} and not pair.info.places_steps
    assert "auto placement" in pair.info.off_reasons["places_steps"]
    session = SimpleNamespace(_config=SimpleNamespace(mode="auto"))
    with pytest.raises(UserError, match="auto placement is off") as refused:
        Session._resolve_mode(session, pair)  # type: ignore[arg-type]
    assert MOVED in str(refused.value)
    assert Session._resolve_mode(SimpleNamespace(_config=SimpleNamespace(mode=None)), pair) == "bidirectional"  # type: ignore[arg-type]

    def step(placement: Any) -> StepRequest:
        return StepRequest(request_id="r", prompt_token_ids=[1, 2], sampling=Sampling(), placement=placement)

    with pytest.raises(UserError, match="auto placement"):
        pair._place(step("decode"))
    assert pair._place(step("auto")).engine == "prefill"


@pytest.mark.anyio
async def test_without_elastic_cores_a_pair_runs_split(
    missing: Callable[[str], None], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[Any] = []

    async def model(*args: Any, **kwargs: Any) -> Path:
        return Path("/model")

    async def start_async(self: AsyncLLMRunner, progress: Any) -> None:  # the engine, not started: recorded
        started.append(self.launch)
        cache = SimpleNamespace(block_size=16, num_gpu_blocks=100)
        self._llm = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache))  # type: ignore[assignment]

    class Table:  # a core table of this test's own (the host's is shared with real engines)
        def claim(self, cores: list[int]) -> Any:
            return SimpleNamespace(path="/nonexistent-core-table", index=len(started))

    monkeypatch.setattr("agentkv._engines._pair.prepare_model_off_loop", model)
    monkeypatch.setattr("agentkv._engines._pair.current_platform", lambda: Platform("cpu"))
    monkeypatch.setattr("agentkv._engines._pair.CoreTable", Table)
    monkeypatch.setattr(AsyncLLMRunner, "start_async", start_async)
    missing(ELASTIC_CORES)
    pair = EmbeddedPair(warmup=False, cores=([0], [1]))  # core_policy="elastic", the default
    await pair._start()
    assert pair.info.details["core_policy"] == "split"
    assert [launch.env.get("VLLM_CPU_OMP_THREADS_BIND") for launch in started] == ["0", "1"]  # each its own core
    assert not [launch for launch in started if CORE_TABLE_ENV in launch.env]
    [warning] = _warnings(caplog)
    assert "agentkv: elastic cores is off" in warning and MOVED in warning and "split" in warning


def test_an_engine_start_warns_once_per_feature_it_would_patch(
    missing: Callable[[str], None], caplog: pytest.LogCaptureFixture
) -> None:
    missing(IDLE_SLEEP)
    warn_engine_features(engine_env(None))  # no idle polling asked: nothing to say
    assert _warnings(caplog) == []
    warn_engine_features(engine_env(50))
    warn_engine_features(engine_env(50))  # a second engine: said already (its processes inherit that too)
    [warning] = _warnings(caplog)
    assert warning.startswith("agentkv: idle sleep is off") and MOVED in warning
    assert FEATURES[IDLE_SLEEP].when_off in warning
