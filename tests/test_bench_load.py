"""The bench under load (issue #30, point 1): the load list, the seeded population, goodput against its SLO, the
load tables and the goodput plot, on records made by hand and on scripted engines (no real engine)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentkv import UserError
from agentkv._bench import (
    AGENTIC_THINK_S,
    BenchReport,
    goodput_lines,
    header,
    load_tables,
    make_workload,
    parse_loads,
    plot,
    run_bench,
)
from agentkv._bench._goodput import busy_s, load_rows, measure_slo, meets
from agentkv._bench._population import Plan
from agentkv._bench._records import FloorFit, TurnRecord
from agentkv._surfaces._cli import main
from agentkv.testing import HonestPairEngine

_FLOOR = FloorFit(a_s=0.1, b_s_per_token=0.01, c_s_per_attended=0.0, points=[])
"""20 new tokens: a floor of 0.3 s, so a TTFT target of 0.9 s at 3x."""


def _turn(
    mode: str,
    load: int,
    turn: int,
    ttft: float,
    gaps: tuple[float, ...] = (0.1,),
    *,
    session: int = 0,
    transfer: float | None = None,
    start: float = 0.0,
    wall: float = 1.0,
) -> TurnRecord:
    """A turn of 20 new tokens over 80 of history, two output tokens."""
    return TurnRecord.model_validate(
        {"mode": mode, "load": load, "session": session, "turn": turn, "ttft_s": ttft, "engine_ttft_s": ttft}
        | {"itl_s": list(gaps), "wall_s": wall, "start_s": start, "prompt_tokens": 100, "new_tokens": 20}
        | {"local_hit_tokens": 80, "pulled_tokens": 0, "computed_tokens": 20, "output_tokens": 2}
        | {"kv_bytes": None, "kv_transfer_s": transfer, "miss_reason": None, "prefill_engine": None}
        | {"placement_reason": None, "output_token_ids": [1, 2], "prompt_digest": f"turn {turn}"}
    )


def _solo() -> list[TurnRecord]:
    """Colocated at load 1: token gaps 0.05, 0.1, 0.1, 0.3 (median 0.1: a gap target of 0.5 s at 5x)."""
    return [_turn("colocated", 1, 2, 0.4, (0.05, 0.1)), _turn("colocated", 1, 3, 0.4, (0.1, 0.3))]


def test_the_load_list_is_parsed_and_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_loads("1,2,4,8,16") == [1, 2, 4, 8, 16]
    assert parse_loads(" 8, 1 ,2") == [1, 2, 8]  # the lightest first: load 1 sizes the arrivals and the SLO
    assert parse_loads("3") == [3]
    for text, message in (
        ("1,two,4", "not 'two'"),
        ("1,,4", "not ''"),
        ("1.5", "not '1.5'"),
        ("1,0,2", r"sessions must be at least 1 \(a load of 0\)"),
        ("1,-2", r"a load of -2"),
        ("1,4,2,4", "load 4 given twice"),
    ):
        with pytest.raises(UserError, match=message):
            parse_loads(text)
    assert main(["bench", "--sessions", "1,x"]) == 2  # before any engine starts
    err = capsys.readouterr().err.strip()
    assert err == "agentkv bench: error: --sessions takes whole numbers of sessions, comma-separated; not 'x'"


def test_the_population_is_seeded_per_load() -> None:
    plan = Plan.make([1, 4, 16], turns=4, workload="agentic", arrival_s=2.0, seed=7)
    again = Plan.make([4, 16], turns=4, workload="agentic", arrival_s=2.0, seed=7)
    other = Plan.make([1, 4, 16], turns=4, workload="agentic", arrival_s=2.0, seed=8)
    assert (plan.arrivals, plan.think_mean_s) == ("staggered", AGENTIC_THINK_S)  # the defaults of a sweep
    assert plan.report() == Plan.make([1, 4, 16], turns=4, workload="agentic", arrival_s=2.0, seed=7).report()
    for load in (4, 16):  # the same seed, the same draws, whatever other loads run
        assert [plan.start_s(load, s) for s in range(load)] == [again.start_s(load, s) for s in range(load)]
        assert plan.thinks(load) == again.thinks(load) != other.thinks(load)
        assert plan.starts(load) != other.starts(load)
    starts = [plan.start_s(16, s) for s in range(16)]
    assert starts[0] == 0 and starts == sorted(starts) and starts[-1] > 0
    assert plan.think_s(16, 3, 1) == 0 and plan.think_s(16, 3, 2) == plan.thinks(16)[3][0] * AGENTIC_THINK_S
    assert len(plan.thinks(16)) == 16 and {len(row) for row in plan.thinks(16)} == {3}  # turns 2-4
    many = Plan.make([1, 2000], turns=2, workload="agentic", arrival_s=1.0)  # the draws' means are the unit
    assert statistics.fmean(row[0] for row in many.thinks(2000)) == pytest.approx(1, abs=0.15)
    assert statistics.fmean(
        b - a for a, b in zip(many.starts(2000), many.starts(2000)[1:], strict=False)
    ) == pytest.approx(1, abs=0.1)
    drawn = plan.report()
    assert drawn.starts_s[16] == starts and drawn.think_s[16][3][0] == plan.think_s(16, 3, 2)
    gaps = [b - a for load in (4, 16) for a, b in zip(drawn.starts_s[load], drawn.starts_s[load][1:], strict=False)]
    assert drawn.arrival_gap_drawn_mean_s == pytest.approx(statistics.fmean(gaps))
    assert drawn.think_drawn_mean_s is not None and drawn.think_drawn_p90_s is not None
    assert drawn.think_drawn_p90_s > drawn.think_drawn_mean_s


def test_the_population_defaults_and_its_mistakes() -> None:
    one = Plan.make(8, turns=3, workload="agentic")  # one load: the barrier run, as before load sweeps
    assert (one.loads, one.arrivals, one.think_mean_s) == ([8], "barrier", 0.0)
    assert one.start_s(8, 5) == 0 and one.think_s(8, 5, 2) == 0
    assert Plan.make([1, 2], turns=3, workload="chat").think_mean_s == 0  # think time by default: tool latency
    assert Plan.make([1, 2], turns=3, workload="chat", think_s=0.5).think_mean_s == 0.5
    assert Plan.make([1, 2], turns=3, workload="agentic", think_s=0).think_s(2, 1, 2) == 0
    for options, message in (
        ({"loads": [1, 2], "think_s": -1.0}, "think time must be 0 s or more"),
        ({"loads": 2, "think_s": 1.0}, "think time needs staggered arrivals"),
        ({"loads": [2, 4]}, "put 1 in the sessions or give the mean arrival gap"),
        ({"loads": [1, 2], "arrival_s": -0.5}, "mean arrival gap must be 0 s or more"),
        ({"loads": [1, 2], "arrivals": "poisson"}, "arrivals are staggered or barrier, not 'poisson'"),
    ):
        loads = options.pop("loads")
        with pytest.raises(UserError, match=message):
            Plan.make(loads, turns=3, workload="agentic", **options)
    assert Plan.make([2, 4], turns=3, workload="agentic", arrival_s=1.0).arrival_mean_s == 1.0
    measured = Plan.make([1, 2], turns=3, workload="agentic").measured(
        [_turn("bidirectional", 1, 1, 0.1, wall=9.0), *_solo(), _turn("colocated", 2, 2, 0.1, wall=50.0)]
    )
    assert measured.arrival_mean_s == pytest.approx(0.5)  # half colocated's solo turn (1 s), not the others'


def test_goodput_counts_turns_within_both_objectives() -> None:
    slo, note = measure_slo(_solo(), _FLOOR, ttft_factor=3.0, itl_factor=5.0)
    assert note is None and slo is not None
    assert (slo.itl_reference_s, slo.itl_reference_gaps, slo.itl_target_s) == pytest.approx((0.1, 4, 0.5))
    assert (slo.ttft_target_min_s, slo.ttft_target_max_s) == pytest.approx((0.9, 0.9))
    loaded = [
        _turn("auto", 4, 1, 5.0, (9.0,)),  # turn 1: left out, as from every figure
        _turn("auto", 4, 2, 0.8, (0.1, 0.45), session=0),  # both met
        _turn("auto", 4, 2, 0.9, (0.5,), session=1),  # both met, at the bounds
        _turn("auto", 4, 2, 0.95, (0.1,), session=2),  # TTFT over 3x its floor
        _turn("auto", 4, 2, 0.5, (0.1, 0.6, 0.1), session=3),  # one gap over 5x the solo median
        _turn("auto", 4, 3, 0.92, (0.1,), transfer=0.05),  # the transfer does not raise the target: missed
        _turn("auto", 4, 3, 0.2, (), session=1),  # one token: no gap to miss
    ]
    assert [meets(slo, _FLOOR, r) for r in loaded[1:]] == [True, True, False, False, False, True]
    walls = {1: {"colocated": 2.0}, 4: {"auto": 4.0}}
    rows = {(row.mode, row.load): row for row in load_rows(_solo() + loaded, walls, slo, _FLOOR)}
    auto = rows[("auto", 4)]
    assert (auto.steps, auto.good_steps, auto.goodput) == (6, 3, pytest.approx(0.5))
    assert auto.gap_lost_steps == 1  # session 3's turn: its TTFT met, one gap over
    assert auto.output_tokens_per_s == pytest.approx(7 * 2 / 4.0)  # every turn's tokens over the busy time
    assert auto.itl_p99_s is not None and auto.itl_p99_s >= 0.45 and auto.ttft_p50_s == pytest.approx(0.85)
    assert rows[("colocated", 1)].goodput == 1.0
    without = load_rows(loaded, walls, None, None)
    assert [(row.good_steps, row.goodput, row.gap_lost_steps) for row in without] == [(None, None, None)]
    # the objective needs the colocated engine's floor and a solo colocated session
    assert measure_slo(_solo(), None, ttft_factor=3, itl_factor=5)[1] == (
        "the SLO is measured on the colocated engine (its floor): add colocated to the modes"
    )
    assert "add 1 to the sessions" in (measure_slo(loaded, _FLOOR, ttft_factor=3, itl_factor=5)[1] or "")
    one_token = [_turn("colocated", 1, 2, 0.4, ())]
    assert "no token gap" in (measure_slo(one_token, _FLOOR, ttft_factor=3, itl_factor=5)[1] or "")


def test_busy_time_is_the_union_of_the_turns_spans() -> None:
    spans = [(0.0, 2.0), (1.0, 2.0), (5.0, 1.0), (5.5, 0.2), (10.0, 0.5)]  # (start, wall)
    assert busy_s([_turn("auto", 3, 2, 0.1, start=s, wall=w) for s, w in spans]) == pytest.approx(3.0 + 1.0 + 0.5)
    assert busy_s([]) == 0


def _sweep_report(records: list[TurnRecord], loads: list[int]) -> BenchReport:
    slo, note = measure_slo(records, _FLOOR, ttft_factor=3.0, itl_factor=5.0)
    walls = {load: dict.fromkeys({r.mode for r in records}, 2.0) for load in loads}
    plan = Plan.make(loads, turns=3, workload="agentic", arrival_s=0.5)
    return BenchReport.model_validate(
        {"workload": "agentic", "workload_description": "test", "modes": list(dict.fromkeys(r.mode for r in records))}
        | {"sessions": loads[-1], "turns": 3, "machine": {"cores": 2}, "dtype": "float32", "floor": _FLOOR}
        | {"records": records, "round_wall_s": walls[loads[0]], "summaries": [], "answers_agree": {}}
        | {"loads": loads, "population": plan.report(), "slo": slo, "slo_note": note}
        | {"load_rows": load_rows(records, walls, slo, _FLOOR)}
    )


def test_the_load_tables_the_slo_and_the_population_print(tmp_path: Path) -> None:
    records = [*_solo(), _turn("auto", 1, 2, 0.5)]
    records += [
        _turn(mode, 4, 2, ttft, session=s) for mode, ttft in (("auto", 0.6), ("colocated", 1.2)) for s in (0, 1)
    ]
    report = _sweep_report(records, [1, 4])
    assert header(report).splitlines()[0].startswith("workload: agentic (test); 3 turns, 1, 4 sessions per mode")
    tables = load_tables(report.load_rows).split("\n\n")
    assert [table.splitlines()[0] for table in tables] == ["colocated:", "auto:"]
    head, rule, *rows = tables[1].splitlines()[1:]
    assert head.split() == ["load", "steps", "ttft", "p50", "ttft", "p90", "itl", "p50", "itl", "p90"] + [
        *("itl", "p99", "tok/s", "goodput", "gap-lost")
    ]
    assert [row.split()[:3] + row.split()[-2:] for row in rows] == [
        ["1", "1", "0.500", "100%", "0"],
        ["4", "2", "0.600", "100%", "0"],
    ]
    assert tables[0].splitlines()[-1].split()[-2:] == ["0%", "0"]  # colocated at 4: 1.2 s against a 0.9 s target
    *slo, population = goodput_lines(report)
    assert slo == [
        "goodput: the share of a mode's turns 2+ within both objectives, measured in this run:",
        "  TTFT <= 3x the turn's floor (the floor's fit without the transfer, for the turn's new tokens over its "
        "history: 0.900-0.900 s over these turns)",
        "  worst token gap <= 5x the median gap of a solo colocated session (0.100 s over 4 gaps: 0.500 s)",
        "gap-lost: of those turns, the ones whose TTFT met its objective and a token gap did not",
    ]
    assert population.startswith("population: staggered arrivals, exponential gaps of mean 0.50 s; drawn: mean ")
    assert "think time before each turn after the first: lognormal (sigma 1) of mean 2.00 s; drawn: mean" in population
    assert population.endswith("; seed 0")
    assert plot(report, tmp_path / "goodput.png").read_bytes().startswith(b"\x89PNG")
    assert BenchReport.model_validate_json(report.model_dump_json()) == report
    unmeasured = _sweep_report([r for r in records if r.mode == "auto"], [1, 4])
    assert goodput_lines(unmeasured)[0] == (
        "goodput: not measured: the SLO's token gap is a solo colocated session's: add 1 to the sessions"
    )
    assert plot(unmeasured, tmp_path / "none.png").stat().st_size > 0


def test_one_load_adds_a_goodput_line_and_keeps_the_turn_plot(tmp_path: Path) -> None:
    records = [*_solo(), _turn("auto", 1, 2, 0.5), _turn("auto", 1, 3, 1.5)]
    report = _sweep_report(records, [1])
    *slo, shares = goodput_lines(report)  # no population line: one load runs under a barrier
    assert slo[1].startswith("  TTFT <= 3x the turn's floor") and len(slo) == 3
    assert shares == "  colocated 100% (2/2), auto 50% (1/2)"
    assert "1 session(s) per mode" in header(report)
    assert plot(report, tmp_path / "turns.png").read_bytes().startswith(b"\x89PNG")


def _honest(**options: Any) -> HonestPairEngine:
    return HonestPairEngine(max_model_len=options["max_model_len"])


@pytest.mark.anyio
async def test_a_sweep_runs_every_mode_at_every_load_without_a_barrier() -> None:
    workload = make_workload("chat", turns=3, scale=0.25)
    modes = ["bidirectional", "colocated"]
    async with HonestPairEngine() as engine:
        report = await run_bench(
            workload, modes=modes, engines=dict.fromkeys(modes, engine), sessions=[3, 1], think_s=0.02, seed=3
        )
    assert report.loads == [1, 3] and report.sessions == 3
    assert [(r.mode, r.load, r.session, r.turn) for r in report.records] == [
        (m, load, s, t) for m in modes for load in (1, 3) for s in range(load) for t in (1, 2, 3)
    ]
    assert report.answers_agree == {"colocated": True}
    population = report.population
    assert population is not None and population.arrivals == "staggered" and population.arrival_mean_measured
    solo = [r.wall_s for r in report.records if r.mode == "colocated" and r.load == 1]
    assert population.arrival_mean_s == pytest.approx(statistics.fmean(solo) / 2)
    plan = Plan.make([1, 3], turns=3, workload="chat", think_s=0.02, seed=3, arrival_s=population.arrival_mean_s)
    assert population == plan.report().model_copy(update={"arrival_mean_measured": True})
    for mode in modes:  # each session starts at its drawn time and runs its own turns, pausing its drawn time
        at = {(r.session, r.turn): r for r in report.records if r.mode == mode and r.load == 3}
        for session in range(3):
            first = at[(session, 1)].start_s - at[(0, 1)].start_s
            assert first >= population.starts_s[3][session] - 0.005
            for turn in (2, 3):
                before, this = at[(session, turn - 1)], at[(session, turn)]
                assert this.think_s == population.think_s[3][session][turn - 2] > 0
                assert this.start_s >= before.start_s + before.wall_s + this.think_s - 0.005
    rows = {(row.mode, row.load): row for row in report.load_rows}
    assert list(rows) == [(m, load) for m in modes for load in (1, 3)]
    assert rows[("bidirectional", 3)].steps == 6 and all(row.goodput is not None for row in rows.values())
    assert report.slo is not None and report.slo_note is None
    assert {s.mode: s.steps for s in report.summaries} == {"bidirectional": 2, "colocated": 2}  # the lightest load


def test_the_command_runs_a_sweep_and_prints_per_load(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    starts: Callable[..., HonestPairEngine] = _honest
    for name in ("EmbeddedPair", "Colocated"):
        monkeypatch.setattr(f"agentkv._bench._modes.{name}", starts)
    argv = ["bench", "--workload", "chat", "--scale", "0.25", "--turns", "2", "--modes", "auto,colocated"]
    argv += ["--sessions", "2,1", "--think-s", "0.01", "--slo-ttft", "4", "--slo-itl", "6"]
    argv += ["--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "1, 2 sessions per mode" in out and "at 1 session(s) per mode, the lightest load:" in out
    assert "\nauto:\nload  steps  ttft p50" in out and "\ncolocated:\nload" in out
    assert "\n  TTFT <= 4x the turn's floor" in out and "\n  worst token gap <= 6x the median gap" in out
    assert "population: staggered arrivals, exponential gaps of mean" in out and "(half a solo turn at load 1)" in out
    assert "think time before each turn after the first: lognormal (sigma 1) of mean 0.01 s" in out
    written = json.loads((tmp_path / "b.json").read_text())
    assert written["loads"] == [1, 2] and len(written["load_rows"]) == 4 and written["slo"]["ttft_factor"] == 4
    assert (tmp_path / "b.png").read_bytes().startswith(b"\x89PNG")


def test_the_objective_measured_at_one_session_becomes_the_auto_pairs() -> None:
    from agentkv import EmbeddedPair
    from agentkv._bench._goodput import pair_slo
    from agentkv._bench._runner import _aim_auto
    from agentkv.engines import Slo

    slo, how = pair_slo(_solo() + [_turn("auto", 2, 2, 9.0)], _FLOOR, ttft_factor=3.0, itl_factor=5.0)
    assert slo is not None and isinstance(slo, Slo)
    assert (slo.ttft_s, slo.itl_s) == pytest.approx((0.9, 0.5))  # 3x a 0.3 s floor; 5x a 0.1 s gap
    assert "median of the solo turns' TTFT targets (3x their floors)" in how
    pair, lines = EmbeddedPair(), []
    _aim_auto({"auto": pair, "colocated": HonestPairEngine()}, _solo(), _FLOOR, (3.0, 5.0), lines.append)
    assert pair.slo == slo and lines == [
        f"agentkv bench: auto now places its steps for the SLO measured at 1 session: {slo} ({how})"
    ]
    unmeasured = EmbeddedPair()
    _aim_auto({"auto": unmeasured}, _solo(), None, (3.0, 5.0), lines.append)  # no colocated floor
    assert unmeasured.slo == EmbeddedPair().slo and "auto keeps its pair's objective (TTFT 2 s" in lines[-1]


@pytest.mark.anyio
async def test_the_sweep_aims_auto_once_after_its_solo_load(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[set[int], tuple[float, float]]] = []

    def aim(by_mode: Any, records: list[TurnRecord], floor: Any, factors: tuple[float, float], log: Any) -> None:
        calls.append(({r.load for r in records}, factors))

    monkeypatch.setattr("agentkv._bench._runner._aim_auto", aim)
    workload = make_workload("chat", turns=2, scale=0.25)
    modes = ["auto", "colocated"]
    async with HonestPairEngine() as engine:
        engines = dict.fromkeys(modes, engine)
        await run_bench(workload, modes=modes, engines=engines, sessions=[1, 2], think_s=0.01, slo_ttft=4, slo_itl=6)
        assert calls == [({1}, (4, 6))]  # after the solo load, before the next
        await run_bench(
            workload, modes=modes, engines=engines, sessions=[2], arrivals="staggered", arrival_s=0.01, think_s=0.01
        )
        await run_bench(workload, modes=modes, engines=engines, sessions=[1], arrivals="staggered", think_s=0.01)
    assert len(calls) == 1  # without a solo load, or with nothing after it: the pair's own objective
