"""The bench on issue 30's targets: the KV wait of the steps after a pause, ``bidirectional-early``, the probes (a
stop string, a pause past the pin's TTL), the floor's measured fixed cost, on records made by hand and on the honest
pair double (no real engine)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from agentkv import UserError
from agentkv._bench import (
    DEFAULT_MODES,
    EARLY_MODE,
    MODES,
    BenchReport,
    after_pause_lines,
    early_ratio_line,
    floor_line,
    make_workload,
    probe_lines,
    run_bench,
)
from agentkv._bench._after_pause import after_pause
from agentkv._bench._modes import PAIR_MODES, PROBE_MODES, session_options
from agentkv._bench._probes import pick_stop, pin_ttl_of, pin_ttl_probe, stop_probe
from agentkv._bench._records import FloorFit, FloorPoint, TurnRecord
from agentkv._bench._report import header as report_header
from agentkv._bench._runner import FloorSampler
from agentkv._engines import Engine, StepRequest
from agentkv._engines._base import StepDone, StepEvent, StepTimings, TokenDelta
from agentkv._session._session_config import SessionConfig
from agentkv._surfaces._cli import main
from agentkv.testing import HonestPairEngine

_ANSWER = "Sure: first read the failing test, then patch the parser and rerun every check."


def _record(
    mode: str, turn: int, *, think: float, wait: float, ttft: float = 0.5, pulled: int = 40, handoff: float = 0.0
) -> TurnRecord:
    return TurnRecord(
        mode=mode,
        session=0,
        turn=turn,
        ttft_s=ttft,
        engine_ttft_s=ttft - 0.001,
        kv_wait_s=wait + handoff,
        handoff_wait_s=handoff,
        itl_s=[0.05],
        wall_s=ttft + 0.1,
        prompt_tokens=100,
        new_tokens=20,
        local_hit_tokens=100 - pulled - 20,
        pulled_tokens=pulled,
        computed_tokens=20,
        output_tokens=2,
        kv_bytes=1000,
        kv_transfer_s=wait / 2,
        miss_reason=None,
        prefill_engine=None if mode == "colocated" else "prefill",
        placement_reason=None,
        output_token_ids=[1, 2],
        prompt_digest=f"turn {turn}",
        think_s=think,
    )


def test_the_steps_after_a_pause_give_each_pair_modes_kv_wait_and_the_late_ratio() -> None:
    records = [
        _record(EARLY_MODE, 1, think=0.0, wait=0.5),  # the first turn: no pause before it
        _record(EARLY_MODE, 2, think=2.0, wait=0.002, ttft=0.3, pulled=0, handoff=0.006),
        _record(EARLY_MODE, 3, think=1.0, wait=0.004, ttft=0.5, pulled=8, handoff=0.010),
        _record("bidirectional", 2, think=2.0, wait=0.030, ttft=0.6),
        _record("bidirectional", 3, think=1.0, wait=0.050, ttft=0.6),
        _record("bidirectional", 4, think=0.0, wait=9.0),  # no pause before it: not counted
        _record("colocated", 2, think=2.0, wait=0.0),  # one engine: no KV to wait for
    ]
    early, late = after_pause(records)
    assert (early.mode, early.steps, late.mode, late.steps) == (EARLY_MODE, 2, "bidirectional", 2)
    assert (early.kv_wait_mean_s, early.kv_wait_max_s) == pytest.approx((0.011, 0.014))  # both engines' waits
    # the target is on the wait before the first token: D's after P's first token was streamed is the hand-over's
    assert (early.first_token_wait_mean_s, early.first_token_wait_max_s) == pytest.approx((0.003, 0.004))
    assert early.handoff_wait_mean_s == pytest.approx(0.008) and late.handoff_wait_mean_s == 0.0
    assert (early.ttft_mean_s, early.pulled_tokens_mean, early.think_mean_s) == pytest.approx((0.4, 4.0, 1.5))
    assert early.kv_transfer_mean_s == pytest.approx(0.0015) and late.kv_wait_mean_s == pytest.approx(0.04)
    header, first, second = after_pause_lines([early, late], pair_modes_ran=True)
    assert "KV wait before the first token, target <= 5 ms" in header
    assert "2 steps after 1.50 s mean pause: KV wait mean 3.0 ms (met), max 4.0 ms, hand-over 8.0 ms" in first
    assert "KV wait mean 40.0 ms (NOT met)" in second and "pulled 40 tokens" in second
    line = early_ratio_line([early, late])
    assert line is not None and line.startswith(f"{EARLY_MODE} over bidirectional, steps after a pause: TTFT 0.67x")
    assert "(0.400 vs 0.600 s over 2 and 2 steps; target <= 0.75x on coding: met)" in line
    assert early_ratio_line([early]) is None
    shared = [r.model_copy(update={"kv_transfer_s": None}) if r.turn == 3 else r for r in records]
    assert after_pause(shared)[0].kv_transfer_mean_s is None  # a transfer not attributable: no mean
    assert after_pause_lines([], pair_modes_ran=True) == [
        "steps after a pause: none (a pause needs --arrivals staggered and a --think-s above 0)"
    ]
    assert after_pause_lines([], pair_modes_ran=False) == []


def test_bidirectional_early_is_bidirectional_with_early_transfer_and_not_a_default() -> None:
    assert EARLY_MODE in MODES and EARLY_MODE not in DEFAULT_MODES and EARLY_MODE in PAIR_MODES
    assert session_options(EARLY_MODE) == {"mode": "bidirectional", "early_transfer": True}
    assert session_options("bidirectional") == {"mode": "bidirectional"}  # no early transfer: the session's default
    assert not SessionConfig().early_transfer
    assert PROBE_MODES == {
        "auto",
        "bidirectional",
        "bidirectional-split",
        "launched",
        "netns",
        "push",
        EARLY_MODE,
    }


@pytest.mark.anyio
async def test_a_run_with_pauses_reports_the_steps_after_them_per_mode() -> None:
    workload = make_workload("coding", turns=3, scale=0.1)
    modes = ["bidirectional", EARLY_MODE, "disaggregated"]
    async with HonestPairEngine() as engine:
        report = await run_bench(
            workload, modes=modes, engines=dict.fromkeys(modes, engine), arrivals="staggered", think_s=0.01
        )
        sweep = await run_bench(
            workload, modes=modes, engines=dict.fromkeys(modes, engine), sessions=[1, 2], arrival_s=0.0, think_s=0.01
        )
        assert engine.violations == []
    assert {s.steps for s in sweep.after_pause} == {2}  # the lightest load's: under load a step also queues
    assert [s.mode for s in report.after_pause] == modes and {s.steps for s in report.after_pause} == {2}
    by_mode = {s.mode: s for s in report.after_pause}
    assert by_mode["bidirectional"].pulled_tokens_mean > 0 and by_mode["disaggregated"].pulled_tokens_mean == 0
    assert report.answers_agree == {EARLY_MODE: True, "disaggregated": True}
    assert BenchReport.model_validate_json(report.model_dump_json()) == report
    assert early_ratio_line(report.after_pause) is not None


def test_the_floors_fixed_cost_is_measured_on_one_token_steps() -> None:
    def ttft(context: int, computed: int) -> float:
        return 0.04 + 0.002 * computed + 1e-6 * FloorFit.attended(computed, context)

    shapes = [(0, 16), (0, 64), (0, 512), (1024, 64), (1024, 512), (2048, 64), (2048, 512)]
    points = [FloorPoint(context=c, computed=n, ttft_s=ttft(c, n)) for c, n in shapes]
    one = ttft(0, 1)
    fit = FloorFit.fit(points, [one + 0.001, one, one - 0.001])  # the median is the one-token step's TTFT
    assert fit.a_measured and len(fit.fixed_s) == 3
    assert (fit.a_s, fit.b_s_per_token, fit.c_s_per_attended) == pytest.approx((0.04, 0.002, 1e-6))
    assert fit.floor_s(1, 0, None) == pytest.approx(one)
    assert "floor: 0.040 s (measured: median of 3 one-token steps less that token's cost) + 2.00 ms/token" in (
        floor_line(fit)
    )
    slow = FloorFit.fit(points, [0.1])  # a fixed cost above what the points say: the slopes are fitted below it
    assert slow.a_measured and slow.a_s == pytest.approx(0.1 - slow.b_s_per_token - slow.c_s_per_attended / 2)
    fitted = FloorFit.fit(points)
    assert not fitted.a_measured and "(fitted)" in floor_line(fitted)
    assert FloorFit.model_validate({"a_s": 0.1, "b_s_per_token": 0, "c_s_per_attended": 0, "points": []}).fixed_s == []


class _OneBlockEngine:
    """Stands in for the colocated engine under the floor: every prompt is computed, nothing cached."""

    def __init__(self) -> None:
        self.prompts: list[int] = []

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.prompts.append(len(request.prompt_token_ids))
        yield TokenDelta(token_ids=[7], text="x")
        timings = StepTimings(ttft_s=0.0, computed_tokens=len(request.prompt_token_ids))
        yield StepDone(token_ids=[7], text="x", finish_reason="length", timings=timings)


@pytest.mark.anyio
async def test_the_floor_sampler_runs_one_token_steps_each_round() -> None:
    engine = _OneBlockEngine()
    sampler = FloorSampler(cast(Engine, engine), max_model_len=512, sizes=(16, 64))
    await sampler.sample()
    await sampler.sample()
    assert engine.prompts == [1, 1, 1, 16, 64] * 2 and len(sampler.fixed_s) == 6
    assert [(p.context, p.computed) for p in sampler.points] == [(0, 16), (0, 64)] * 2
    assert sampler.fit().a_measured


def test_a_stop_string_is_a_word_from_the_middle_of_the_answer() -> None:
    assert pick_stop(_ANSWER) == "patch"  # where it first occurs is nearest the middle
    assert pick_stop("Done.") is None  # only at the start: it would end the answer before anything
    assert pick_stop("1 2 3 ok") is None
    assert pick_stop("a word, a word") == "word"


def _answers(request: StepRequest) -> str:
    return _ANSWER


@pytest.mark.anyio
@pytest.mark.upkeep  # the session's repin after the stop string runs (tests/conftest.py)
async def test_the_stop_probe_ends_a_turn_early_and_reports_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agentkv._bench._probes.SHORT_PAUSE_S", 0.2)
    workload = make_workload("agentic", turns=2, scale=0.1)
    async with HonestPairEngine(_answers) as engine:
        probe = await stop_probe(cast(Engine, engine), "bidirectional", workload, "salt")
        assert engine.violations == []
    assert probe.stop == "patch" and probe.note is None
    assert probe.stopped_output_tokens is not None and probe.stopped_output_tokens < probe.full_output_tokens
    if probe.repins is None:  # the session pins nothing again after a stop string: the next step recomputes
        assert (probe.next_pulled_tokens, probe.next_miss_reason) == (0, "no_handle")
    else:
        assert probe.next_pulled_tokens and probe.next_pulled_tokens > 0
    (line, _) = probe_lines([_probes(probe)])
    assert line.startswith("probe bidirectional: stop 'patch' ended the answer at ")
    async with HonestPairEngine(lambda request: "Done.") as engine:
        none = await stop_probe(cast(Engine, engine), "bidirectional", workload, "salt")
    assert none.stop is None and none.note is not None and "no word of the answer" in none.note


def _probes(stop: Any) -> Any:
    from agentkv._bench._target_records import ModeProbes, PinTtlProbe

    pause = PinTtlProbe(
        pin_ttl_s=30.0,
        short_pause_s=1.0,
        long_pause_s=40.0,
        short_ttft_s=0.2,
        long_ttft_s=0.21,
        short_pulled_tokens=50,
        long_pulled_tokens=50,
        short_miss_reason=None,
        long_miss_reason=None,
        short_renewals=0,
        long_renewals=2,
    )
    return ModeProbes(mode="bidirectional", stop=stop, pin_ttl=pause)


def test_the_pause_probe_line_gives_both_ttfts_their_ratio_pulls_and_renewals() -> None:
    from agentkv._bench._target_records import ModeProbes, StopProbe

    probes = _probes(StopProbe(stop=None, note="no word", full_output_tokens=3))
    stop, pause = probe_lines([probes])
    assert stop == "probe bidirectional: no stop string: no word"
    assert pause == (
        "probe bidirectional: after 40 s (pin TTL 30 s) TTFT 0.210 s against 0.200 s after 1 s: 1.05x (target <= "
        "1.1x: met); pulled 50 vs 50 tokens, miss - vs -; renewals 2 vs 0"
    )
    slower = probes.pin_ttl.model_copy(update={"long_ttft_s": 0.5, "long_miss_reason": "expired"})
    assert "2.50x (target <= 1.1x: NOT met)" in probe_lines([probes.model_copy(update={"pin_ttl": slower})])[1]
    unknown = ModeProbes(mode="push", stop=probes.stop, pin_ttl=None, pin_ttl_note="no TTL")
    assert probe_lines([unknown])[1] == "probe push: no TTL"


@pytest.mark.anyio
async def test_the_pause_probe_renews_the_pin_through_a_pause_past_its_ttl() -> None:
    """Pins of 15 s: the session renews them 12 s before expiry (its margin and lead), so a pause of 3.5 s sees
    one renewal and the next step still pulls."""
    workload = make_workload("coding", turns=2, scale=0.1)
    async with HonestPairEngine(pin_ttl_s=15.0) as engine:
        probe = await pin_ttl_probe(cast(Engine, engine), "bidirectional", workload, "salt", short_s=0.0, long_s=3.5)
        assert engine.violations == []
    assert (probe.short_renewals, probe.long_renewals) == (0, 1)
    assert probe.long_pulled_tokens > 0 and probe.short_pulled_tokens > 0
    assert (probe.short_miss_reason, probe.long_miss_reason) == (None, None)
    assert probe.pin_ttl_s == pin_ttl_of(cast(Engine, engine)) and probe.ratio > 0


@pytest.mark.anyio
async def test_probes_run_after_the_workload_once_per_mode_that_pushes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agentkv._bench._probes.SHORT_PAUSE_S", 0.0)
    monkeypatch.setattr("agentkv._bench._probes.long_pause_s", lambda ttl: 0.01)
    monkeypatch.setattr("agentkv._bench._probes.pin_ttl_of", lambda engine: 3600.0)
    workload = make_workload("chat", turns=2, scale=0.25)
    modes = ["bidirectional", "disaggregated", EARLY_MODE]
    async with HonestPairEngine(_answers) as engine:
        report = await run_bench(workload, modes=modes, engines=dict.fromkeys(modes, engine), probes=True)
        no_probes = await run_bench(workload, modes=modes, engines=dict.fromkeys(modes, engine))
    assert [p.mode for p in report.probes] == ["bidirectional", EARLY_MODE] and no_probes.probes == []
    assert [(r.mode, r.turn) for r in report.records] == [(m, t) for m in modes for t in (1, 2)]  # probes: apart
    for probe in report.probes:
        assert probe.stop.stop is not None and probe.pin_ttl is not None  # the answer cut at the chat's length
        assert (probe.pin_ttl.pin_ttl_s, probe.pin_ttl.long_pause_s) == (3600.0, 0.01)
    assert BenchReport.model_validate_json(report.model_dump_json()) == report
    assert len(probe_lines(report.probes)) == 4


@pytest.mark.anyio
async def test_the_pin_ttl_goes_to_every_pair_the_bench_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[str, dict[str, Any]]] = []

    def kind(name: str) -> Callable[..., HonestPairEngine]:
        def start(**options: Any) -> HonestPairEngine:
            started.append((name, {k: v for k, v in options.items() if k != "progress"}))
            return HonestPairEngine(max_model_len=options["max_model_len"])

        return start

    for name in ("EmbeddedPair", "Colocated"):
        monkeypatch.setattr(f"agentkv._bench._modes.{name}", kind(name))
    workload = make_workload("chat", turns=2, scale=0.25)
    report = await run_bench(workload, modes=[EARLY_MODE, "colocated"], max_model_len=1024, pin_ttl_s=30.0)
    assert started == [
        ("EmbeddedPair", {"max_model_len": 1024, "dtype": "float32", "pin_ttl_s": 30.0}),
        ("Colocated", {"max_model_len": 1024, "dtype": "float32"}),  # one engine: no pins
    ]
    assert report.pin_ttl_s == 30.0 and report.floor is not None and report.floor.a_measured
    for ttl in (10.0, float("nan")):
        with pytest.raises(UserError, match="pin TTL must be a number of seconds above 10"):
            await run_bench(workload, modes=["bidirectional"], pin_ttl_s=ttl)
    async with HonestPairEngine() as engine:
        with pytest.raises(UserError, match="pin_ttl_s applies to the pairs the bench starts"):
            await run_bench(workload, modes=["bidirectional"], engines={"bidirectional": engine}, pin_ttl_s=30.0)
        with pytest.raises(UserError, match="compiled applies to the engines the bench starts"):
            await run_bench(workload, modes=["bidirectional"], engines={"bidirectional": engine}, compiled=True)
    started.clear()  # --compiled: every engine compiles its model, as stock vLLM does (no enforce_eager)
    report = await run_bench(workload, modes=["bidirectional", "colocated"], max_model_len=1024, compiled=True)
    compiled = {"max_model_len": 1024, "dtype": "float32", "engine_args": {"enforce_eager": False}}
    assert started == [("EmbeddedPair", compiled), ("Colocated", compiled)] and report.compiled
    assert "compiled (--compiled)" in report_header(report)
    started.clear()  # --block-size: every engine keeps its KV in blocks of that many tokens
    report = await run_bench(workload, modes=["bidirectional", "colocated"], max_model_len=1024, block_size=32)
    sized = {"max_model_len": 1024, "dtype": "float32", "engine_args": {"block_size": 32}}
    assert started == [("EmbeddedPair", sized), ("Colocated", sized)] and report.block_size == 32
    assert "KV blocks of 32 tokens in every engine (--block-size)" in report_header(report)
    for size in (0, -16):
        with pytest.raises(UserError, match="KV block size is a number of tokens above 0"):
            await run_bench(workload, modes=["bidirectional"], block_size=size)
    async with HonestPairEngine() as engine:
        with pytest.raises(UserError, match="block_size applies to the engines the bench starts"):
            await run_bench(workload, modes=["bidirectional"], engines={"bidirectional": engine}, block_size=32)


def test_the_command_passes_the_probes_and_the_pin_ttl_and_prints_the_targets(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agentkv._bench._target_records import StopProbe

    records = [
        _record(mode, turn, think=1.0 if turn > 1 else 0.0, wait=0.002)
        for mode in ("bidirectional", EARLY_MODE)
        for turn in (1, 2)
    ]
    report = BenchReport(
        workload="coding",
        workload_description="test",
        modes=["bidirectional", EARLY_MODE],
        sessions=1,
        turns=2,
        machine={},
        dtype="float32",
        floor=None,
        records=records,
        round_wall_s={},
        summaries=[],
        answers_agree={},
        loads=[1],
        after_pause=after_pause(records),
        probes=[_probes(StopProbe(stop=None, note="none", full_output_tokens=1))],
        pin_ttl_s=30.0,
    )
    calls: list[dict[str, Any]] = []

    def bench(workload: Any, **options: Any) -> BenchReport:
        calls.append(options)
        return report

    monkeypatch.setattr("agentkv._bench.run_bench_sync", bench)
    path = tmp_path / "b.json"
    assert (
        main(["bench", "--workload", "coding", "--probes", "--pin-ttl-s", "30", "--json", str(path), "--plot", ""]) == 0
    )
    assert (calls[0]["probes"], calls[0]["pin_ttl_s"]) == (True, 30.0)
    out = capsys.readouterr().out
    assert "steps after a pause (turns 2+ with a think time; KV wait before the first token, target <= 5 ms;" in out
    assert f"{EARLY_MODE} over bidirectional, steps after a pause: TTFT 1.00x" in out
    assert "probe bidirectional: after 40 s (pin TTL 30 s)" in out
    written = json.loads(path.read_text())
    assert written["pin_ttl_s"] == 30.0 and written["after_pause"][0]["kv_wait_mean_s"] == pytest.approx(0.002)
    assert written["probes"][0]["pin_ttl"]["long_renewals"] == 2


def test_the_pin_ttl_is_read_from_the_engines_details_or_its_configuration() -> None:
    from types import SimpleNamespace

    from agentkv import PairConfig

    embedded = SimpleNamespace(info=SimpleNamespace(details={"pin_ttl_s": 30}))
    launched = SimpleNamespace(info=SimpleNamespace(details={}), config=PairConfig(pin_ttl_s=45.0))
    bare = SimpleNamespace(info=SimpleNamespace(details={}))
    assert [pin_ttl_of(cast(Engine, e)) for e in (embedded, launched, bare)] == [30.0, 45.0, None]
