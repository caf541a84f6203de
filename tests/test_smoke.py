"""``agentkv smoke``: the pair's check on a host, on the suite's real pair, and its report and command on doubles.

The real-pair test runs `run_smoke` on the session's shared pair (it starts no engine of its own); the others
run it on `agentkv.testing`'s doubles (an honest pair that pulls back, a scripted engine without push-back)
and check the report's checks, its text, the command's wiring and its exit status.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agentkv import EmbeddedPair, StepStats
from agentkv._engines import _pair_config
from agentkv._engines._base import EngineInfo
from agentkv._surfaces import _smoke
from agentkv._surfaces._cli import main
from agentkv._surfaces._engine_placement import engine_placement
from agentkv._surfaces._smoke import SmokeStep, run_smoke, smoke_question
from agentkv.engines import StepRequest
from agentkv.testing import HonestPairEngine, ScriptedEngine

# ----------------------------------------------------------------- on the real pair


@pytest.mark.pair
def test_the_smoke_run_on_the_real_pair_passes_and_pulls_back_from_turn_two(pair: EmbeddedPair) -> None:
    report = run_smoke(pair)
    text = report.text()
    assert report.passed and report.exit_code == 0, text
    assert {step.stats.turn for step in report.steps} == {1, 2, 3}

    first = report.steps[0]
    assert first.stats.pulled_tokens == 0 and first.stats.miss_reason == "no_handle"
    assert first.tool_calls and first.tool_calls[0].name == "add"  # tool_choice="required": the first step calls
    for turn in (2, 3):
        steps = [step.stats for step in report.steps if step.stats.turn == turn]
        assert all(stats.handle_forwarded for stats in steps), steps
        assert any(stats.pulled_tokens > 0 for stats in steps), steps
        # a step pulls, or P's own cache left less than the recompute threshold to pull (the report notes it)
        assert all(stats.pulled_tokens > 0 or stats.miss_reason == "below_threshold" for stats in steps), steps

    # where the engines ran: the suite's pair reports its cores (on a GPU host, its GPUs)
    assert report.platform in ("cpu", "cuda") and {"prefill", "decode"} <= set(report.placement)
    unit = "cores " if report.platform == "cpu" else "GPUs "
    assert report.placement["prefill"].startswith(unit) and report.placement["decode"].startswith(unit)
    for label in ("prefill (P)", "decode (D)", "ttft_s", "pulled", "computed", "agentkv smoke: passed"):
        assert label in text
    assert pair.is_open and not pair.is_dead  # a shared engine stays open


@pytest.mark.pair
def test_the_smoke_run_in_auto_mode_reuses_from_turn_two(pair: EmbeddedPair) -> None:
    report = run_smoke(pair, turns=2, mode="auto")
    assert report.passed, report.text()
    assert all(step.stats.prefill_engine in ("prefill", "decode") for step in report.steps)


# ----------------------------------------------------------------- on doubles


def _answers() -> Any:
    """An honest pair's outputs: each turn calls add once, then answers (as a model forced to call would)."""
    state = {"step": 0}

    def respond(request: StepRequest) -> str:
        state["step"] += 1
        if state["step"] % 2:
            return json.dumps({"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]})
        return json.dumps({"answer": "5"})

    return respond


def test_a_pair_that_pulls_back_passes_every_check() -> None:
    with HonestPairEngine(_answers()) as engine:
        report = run_smoke(engine, turns=3)
    text = report.text()
    assert report.passed and report.exit_code == 0, text
    assert [check.name for check in report.checks] == ["push-back", "tool", "pull-back"]
    assert [(s.stats.turn, s.stats.step) for s in report.steps] == [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)]
    assert all(step.stats.pulled_tokens > 0 for step in report.steps[1:])
    assert report.steps[0].tool_calls[0].name == "add" and report.steps[1].text
    lines = text.splitlines()
    assert lines[0].startswith("agentkv smoke: HonestPairEngine, model ")
    assert "engines: where they compute was not reported by this engine" in lines
    header = next(line for line in lines if line.startswith("turn"))
    assert header.split() == [
        "turn", "step", "ttft_s", "prompt", "local", "pulled", "computed", "on", "out", "kv_MB", "miss", "tool", "calls",
    ]  # fmt: skip
    assert "add(a=2, b=3)" in text and "  ok    pull-back: " in text
    assert lines[-1] == "agentkv smoke: passed (3 turns, 6 steps)"


def test_an_engine_without_push_back_fails_the_push_back_check() -> None:
    with ScriptedEngine([]) as engine:
        report = run_smoke(engine)
    assert not report.passed and report.exit_code == 1 and not report.steps
    assert [(check.name, check.passed) for check in report.checks] == [("push-back", False)]
    assert "FAIL  push-back: the engine does not push back" in report.text()
    assert report.text().splitlines()[-1] == "agentkv smoke: FAILED (push-back; 0 turns, 0 steps)"


def test_a_turn_that_raises_fails_the_run_and_names_the_turn() -> None:
    with HonestPairEngine(_answers()) as engine:
        engine.inject("error")  # the first step fails
        report = run_smoke(engine)
    failed = {check.name: check.detail for check in report.failures}
    assert report.exit_code == 1 and set(failed) == {"turns", "tool", "pull-back"}
    assert failed["turns"].startswith("turn 1 raised EngineError: injected")
    assert "FAILED (turns, tool, pull-back; 0 turns, 0 steps)" in report.text()


def _stats(
    turn: int, step: int, *, pulled: int, forwarded: bool = True, miss: Any = None, on: Any = "prefill"
) -> SmokeStep:
    stats = StepStats(
        turn=turn,
        step=step,
        ttft_s=0.1,
        prompt_tokens=300,
        local_hit_tokens=128,
        pulled_tokens=pulled,
        computed_tokens=172 - pulled,
        output_tokens=8,
        handle_forwarded=forwarded,
        miss_reason=miss,
        prefill_engine=on,
    )
    return SmokeStep(stats=stats, tool_calls=())


def test_a_step_on_d_alone_counts_as_reuse_in_auto_mode() -> None:
    """Placed on D, a step pulls nothing: D's own cache of the pin served it (its local hits)."""
    first = _stats(1, 1, pulled=0, forwarded=False, miss="no_handle")
    steps = [first, _stats(1, 2, pulled=40), _stats(2, 1, pulled=0, on="decode"), _stats(2, 2, pulled=0, on="decode")]
    check = {c.name: c for c in _smoke._check_steps(steps, turns=2, notes=[])}["pull-back"]
    assert check.passed and "2 step(s) ran on D alone" in check.detail, check.detail


class _PlacesOnP(HonestPairEngine):
    """An honest pair double that serves no mode auto (as a pair on a vLLM without auto placement's targets)."""

    @property
    def info(self) -> EngineInfo:
        info = super().info
        return dataclasses.replace(info, places_steps=False, off_reasons={"places_steps": "targets moved"})


def test_auto_on_an_engine_that_places_every_step_on_p_fails_by_name() -> None:
    with _PlacesOnP(_answers()) as engine:
        report = run_smoke(engine, mode="auto")
    assert report.exit_code == 1 and not report.steps
    assert report.failures[0].name == "push-back"
    assert report.failures[0].detail == "the engine serves no auto: targets moved"


def test_the_pull_back_check_allows_below_threshold_and_names_every_other_miss() -> None:
    first = _stats(1, 1, pulled=0, forwarded=False, miss="no_handle")
    notes: list[str] = []
    below = [first, _stats(1, 2, pulled=40), _stats(2, 1, pulled=0, miss="below_threshold"), _stats(2, 2, pulled=30)]
    checks = {check.name: check for check in _smoke._check_steps(below, turns=2, notes=notes)}
    assert checks["pull-back"].passed, checks["pull-back"].detail
    assert "1 step(s) pulled nothing for an expected reason" in checks["pull-back"].detail
    assert notes and notes[0].startswith("turn 2 step 1 pulled nothing (below_threshold): P's own prefix cache")
    assert not checks["tool"].passed and "turn 1 did not call add" in checks["tool"].detail

    notes = []
    missed = [first, _stats(1, 2, pulled=40), _stats(2, 1, pulled=0, miss="declined")]
    detail = {c.name: c for c in _smoke._check_steps(missed, turns=3, notes=notes)}["pull-back"].detail
    assert "turn 2 step 1: the handle was forwarded but nothing was pulled (miss_reason declined)" in detail
    assert "turn 2 pulled nothing from D in any of its steps" in detail and "2 of 3 turns ran" in detail

    expired = [first, _stats(2, 1, pulled=0, forwarded=False, miss="expired")]
    detail = {c.name: c for c in _smoke._check_steps(expired, turns=2, notes=[])}["pull-back"].detail
    assert "turn 2 step 1: D's handle was not forwarded (miss_reason expired)" in detail


def _info(**details: Any) -> EngineInfo:
    return EngineInfo(model_path=Path("/m"), max_model_len=2048, pins=True, disaggregated=True, details=details)


def test_the_report_says_where_each_engine_computes() -> None:
    cpu = _info(prefill_cores=[0, 1], decode_cores=[2, 3], core_policy="elastic")
    assert engine_placement(cpu) == (
        "cpu",
        {
            "prefill": "cores 0-1",
            "decode": "cores 2-3",
            "core policy": "elastic (each engine also computes on the other's cores while that one is idle)",
        },
    )
    gpu = _info(platform="cuda", prefill_devices=["0", "1"], decode_devices=["2", "3"])
    assert engine_placement(gpu) == (
        "cuda",
        {"prefill": "GPUs 0,1 (tensor-parallel 2)", "decode": "GPUs 2,3 (tensor-parallel 2)"},
    )
    config = SimpleNamespace(  # a pair's config: its engine arguments set the tensor-parallel sizes
        engine_args={"tensor_parallel_size": 4}, prefill_engine_args={"tensor_parallel_size": 1}, decode_engine_args={}
    )
    wider: Any = SimpleNamespace(config=config)
    assert engine_placement(gpu, wider)[1]["prefill"] == "GPUs 0,1 (tensor-parallel 1)"
    assert engine_placement(gpu, wider)[1]["decode"] == "GPUs 2,3 (tensor-parallel 4)"
    assert engine_placement(_info(platform="cuda", devices=["0"])) == ("cuda", {"engine": "GPUs 0 (tensor-parallel 1)"})
    assert engine_placement(_info(cores=[0, 1, 2])) == ("cpu", {"engine": "cores 0-2"})
    remote = _info(prefill_url="http://10.0.0.1:8100", decode_url="http://10.0.0.2:8100", engines=2)
    assert engine_placement(remote) == (
        "not reported (remote servers)",
        {
            "prefill": "server at http://10.0.0.1:8100",
            "decode": "server at http://10.0.0.2:8100",
            "pairs": "2 (the lines above are the first pair's)",
        },
    )
    assert smoke_question(1) == "What is 1234 + 4321?" and smoke_question(4) == "And 80 + 5?"


# ----------------------------------------------------------------- the command


class _Pair(HonestPairEngine):
    """What ``agentkv smoke`` opens instead of an `EmbeddedPair` here: an honest pair double, its settings kept."""

    made: list[tuple[Any, dict[str, Any]]] = []
    fault: str | None = None

    def __init__(self, model: Any = None, **settings: Any) -> None:
        super().__init__(_answers())
        _Pair.made.append((model, settings))
        if _Pair.fault is not None:
            self.inject(_Pair.fault)  # type: ignore[arg-type]


@pytest.fixture
def pairs(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_Pair]]:
    monkeypatch.setattr(_smoke, "EmbeddedPair", _Pair)
    _Pair.made, _Pair.fault = [], None
    yield _Pair


def test_agentkv_smoke_opens_a_pair_and_exits_0_when_every_check_passed(
    pairs: type[_Pair], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["smoke", "--model", "org/name", "--max-model-len", "2048", "--turns", "2"]) == 0
    assert pairs.made == [("org/name", {"max_model_len": 2048})]
    out = capsys.readouterr().out
    assert out.startswith("agentkv smoke: opening _Pair (model org/name)")
    assert "opened in " in out and out.rstrip().endswith("agentkv smoke: passed (2 turns, 4 steps)")


def test_agentkv_smoke_exits_1_and_says_what_failed(pairs: type[_Pair], capsys: pytest.CaptureFixture[str]) -> None:
    pairs.fault = "error"
    assert main(["smoke"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  turns: turn 1 raised EngineError" in out
    assert out.rstrip().endswith("agentkv smoke: FAILED (turns, tool, pull-back; 0 turns, 0 steps)")


def test_agentkv_smoke_gives_the_words_after_dashes_to_both_engines(
    pairs: type[_Pair], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_pair_config, "vllm_engine_arg_names", lambda: None)
    monkeypatch.setattr("agentkv._engines._server_process.parse_vllm_flags", lambda words: {"max_num_seqs": 8})
    assert main(["smoke", "--turns", "2", "--", "--max-num-seqs", "8"]) == 0
    assert pairs.made == [(None, {"max_model_len": 4096, "engine_args": {"max_num_seqs": 8}})]


def test_agentkv_smoke_needs_two_turns(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["smoke", "--turns", "1"])
    assert exited.value.code == 2 and "must be at least 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least 2 turns"):
        run_smoke(ScriptedEngine([]), turns=1)


def test_agentkv_smoke_passes_the_devices_given(pairs: type[_Pair]) -> None:
    assert main(["smoke", "--turns", "2", "--prefill-devices", "0", "--decode-devices", "GPU-1f2e,1"]) == 0
    assert pairs.made == [(None, {"max_model_len": 4096, "prefill_devices": [0], "decode_devices": ["GPU-1f2e", 1]})]


def test_agentkv_smoke_runs_auto_when_asked(pairs: type[_Pair], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["smoke", "--turns", "2", "--mode", "auto"]) == 0
    assert "ok    push-back: the engine serves auto; the session runs it" in capsys.readouterr().out
