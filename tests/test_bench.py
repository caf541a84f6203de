"""The benchmark's workloads, figures and outputs, on records made by hand (no engine)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from _agentkv_vllm._cores import CoreSlot
from agentkv import AgentKVError, Colocated, UserError
from agentkv._bench import (
    DEFAULT_DTYPE,
    DEFAULT_MODES,
    SERVED_TTFT_TARGET,
    BenchReport,
    header,
    load_replay,
    make_workload,
    plot,
    push_against_pull,
    run_bench,
    run_bench_sync,
    served_overhead,
    table,
)
from agentkv._bench._fits import check_fits, prompt_bounds
from agentkv._bench._records import FloorFit, FloorPoint, TurnRecord, first_prompt_divergence, summarize
from agentkv._bench._runner import FloorSampler
from agentkv._conversation._conversation import ChatRenderer, Message
from agentkv._engines import Engine, PrefillEngine, StepRequest
from agentkv._engines._base import StepDone, StepEvent, StepTimings, TokenDelta
from agentkv._engines._engine_launch import EngineLaunch
from agentkv._engines._platform_settings import resolve_dtype
from agentkv._model import prepare_model
from agentkv._session._session import load_tokenizer
from agentkv._stats._stats import StepStats
from agentkv._surfaces._cli import main
from agentkv._surfaces._cli_bench import BenchProgress
from agentkv.testing import HonestPairEngine, ScriptedEngine


def _record(
    mode: str,
    turn: int,
    ttft: float,
    *,
    session: int = 0,
    pulled: int = 0,
    tokens: int = 100,
    on: PrefillEngine | None = None,
    itl: tuple[float, ...] = (0.1, 0.2),
    output: tuple[int, ...] = (1, 2),
    prompt: str = "",
) -> TurnRecord:
    return TurnRecord(
        mode=mode,
        session=session,
        turn=turn,
        ttft_s=ttft,
        engine_ttft_s=ttft - 0.01,
        itl_s=list(itl),
        wall_s=ttft + 0.3,
        prompt_tokens=tokens,
        new_tokens=20,
        local_hit_tokens=0,
        pulled_tokens=pulled,
        computed_tokens=tokens - pulled,
        output_tokens=2,
        kv_bytes=1000 if pulled else None,  # None: overlapped another step (not attributable)
        kv_transfer_s=0.01 if pulled else None,
        miss_reason=None if pulled else "push_back_off",
        prefill_engine=on,
        placement_reason=None if on is None else f"placed on {on}",
        output_token_ids=list(output),
        prompt_digest=prompt or f"prompt of turn {turn}",
    )


def test_workloads_are_deterministic_and_scale() -> None:
    a = make_workload("agentic", turns=3, seed=1)
    assert a == make_workload("agentic", turns=3, seed=1)
    assert a != make_workload("agentic", turns=3, seed=2)
    assert len(a.turns) == 3 and "run_tests" in a.system
    assert len(make_workload("agentic", turns=3, scale=2).turns[1]) > len(a.turns[1])
    assert make_workload("coding", turns=2, scale=2).max_tokens == 2 * make_workload("coding", turns=2).max_tokens
    with pytest.raises(UserError, match="unknown workload"):
        make_workload("nope", turns=3)
    with pytest.raises(UserError, match="at least 2 turns"):
        make_workload("chat", turns=1)
    with pytest.raises(UserError, match="scale must be a positive number"):
        make_workload("chat", turns=2, scale=float("nan"))


def test_a_replay_takes_the_system_and_user_messages(tmp_path: Path) -> None:
    path = tmp_path / "conversation.json"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "ignored"},
        {"role": "user", "content": "two"},
    ]
    path.write_text(json.dumps({"messages": messages}))
    workload = load_replay(path, max_tokens=8)
    assert workload.system == "Be brief." and workload.turns == ("one", "two") and workload.max_tokens == 8
    path.write_text(json.dumps(messages[:2]))
    with pytest.raises(UserError, match="at least 2 user messages"):
        load_replay(path)
    for content in ("not json", json.dumps({"turns": []}), json.dumps(["hello"])):
        path.write_text(content)
        with pytest.raises(UserError, match=str(path)):
            load_replay(path)
    with pytest.raises(UserError, match="cannot read"):
        load_replay(tmp_path / "missing.json")


def test_summaries_compare_modes_over_turns_two_and_later() -> None:
    records = [
        _record("bidirectional", 1, 5.0),
        _record("bidirectional", 2, 1.0, pulled=80),
        _record("bidirectional", 3, 2.0, pulled=80),
        _record("disaggregated", 1, 5.0),
        _record("disaggregated", 2, 4.0),
        _record("disaggregated", 3, 5.0),
        _record("raw", 2, 1.25, pulled=80),
        _record("raw", 3, 1.25, pulled=80),
    ]
    floor = FloorFit(a_s=0.1, b_s_per_token=0.01, c_s_per_attended=1e-5, points=[])
    by_mode = {s.mode: s for s in summarize(records, {"bidirectional": 10, "disaggregated": 20, "raw": 5}, floor)}
    bidi, plain = by_mode["bidirectional"], by_mode["disaggregated"]
    assert bidi.steps == 2 and bidi.ttft_mean_s == pytest.approx(1.5)
    assert plain.ttft_vs_bidirectional == pytest.approx(3.0)
    assert bidi.reuse_ratio == pytest.approx(0.8) and plain.reuse_ratio == 0
    assert bidi.kv_bytes == 2000 and plain.kv_bytes is None
    assert bidi.output_tokens_per_s == pytest.approx(6 / 10)  # turn 1 counts for throughput
    # 20 new tokens after 80 of history attend to 20 * (80 + 10) tokens; plus the step's transfer
    assert bidi.floor_mean_s == pytest.approx(0.1 + 0.2 + 1e-5 * 20 * 90 + 0.01)
    assert bidi.overhead_vs_raw_s == pytest.approx(0.25) and plain.overhead_vs_raw_s is None
    assert bidi.itl_p50_s == pytest.approx(0.15)


def test_the_floor_fit_recovers_a_cost_per_token_and_one_per_token_attended() -> None:
    def ttft(context: int, computed: int) -> float:
        return 0.06 + 0.002 * computed + 1.5e-6 * FloorFit.attended(computed, context)

    shapes = [(0, 16), (0, 64), (0, 512), (0, 2048), (1024, 64), (1024, 512), (2048, 64), (2048, 512)]
    fit = FloorFit.fit([FloorPoint(context=c, computed=n, ttft_s=ttft(c, n)) for c, n in shapes])
    assert (fit.a_s, fit.b_s_per_token, fit.c_s_per_attended) == pytest.approx((0.06, 0.002, 1.5e-6))
    assert fit.floor_s(500, 2500, 0.01) == pytest.approx(ttft(2500, 500) + 0.01)
    # 500 tokens over a 2,500-token history cost more than twice the same tokens fresh: the old floor's omission
    assert fit.floor_s(500, 2500, None) > 2 * fit.floor_s(500, 0, None)
    # times that fall with size: every term but the fixed one fits below 0; the fixed one is then their mean
    falling = [FloorPoint(context=0, computed=n, ttft_s=0.5 - 0.0001 * n) for n in (16, 256, 512)]
    noisy = FloorFit.fit(falling)
    assert (noisy.b_s_per_token, noisy.c_s_per_attended) == (0.0, 0.0)
    assert noisy.a_s == pytest.approx(sum(p.ttft_s for p in falling) / 3)


class _BlockCacheEngine:
    """Stands in for the colocated engine under the floor: whole 128-token blocks of earlier prompts are cached."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        prompt = list(request.prompt_token_ids)
        cached = max((self._common_blocks(prompt, seen) for seen in self.prompts), default=0)
        self.prompts.append(prompt)
        yield TokenDelta(token_ids=[7], text="x")
        timings = StepTimings(ttft_s=0.0, local_hit_tokens=cached, computed_tokens=len(prompt) - cached)
        yield StepDone(token_ids=[7], text="x", finish_reason="length", timings=timings)

    @staticmethod
    def _common_blocks(prompt: list[int], seen: list[int]) -> int:
        same = next(
            (i for i, (a, b) in enumerate(zip(prompt, seen, strict=False)) if a != b), min(len(prompt), len(seen))
        )
        return min(same, len(prompt) - 1) // 128 * 128


@pytest.mark.anyio
async def test_the_floor_is_sampled_in_rounds_and_each_point_says_what_the_engine_computed() -> None:
    engine = _BlockCacheEngine()
    sampler = FloorSampler(cast(Engine, engine), max_model_len=4096)
    await sampler.sample()
    await sampler.sample()  # after a turn: the history is not prefilled again
    shapes = [(p.context, p.computed) for p in sampler.points]
    fresh = [(0, 16), (0, 64), (0, 256), (0, 512)]
    appended = [(1024, 64), (1024, 512), (2048, 64), (2048, 512)]
    assert shapes == [*fresh, (0, 2048), *appended, *fresh, *appended]
    short = FloorSampler(cast(Engine, _BlockCacheEngine()), max_model_len=1024)  # no history fits
    await short.sample()
    assert [(p.context, p.computed) for p in short.points] == fresh


def test_summaries_count_steps_on_d_and_compare_with_colocated() -> None:
    records = [
        _record("auto", 1, 4.0, on="prefill"),  # turn 1 is left out of every figure
        _record("auto", 2, 0.5, on="decode", itl=(0.05, 0.05)),
        _record("auto", 3, 1.5, on="prefill", itl=(0.05, 0.05)),
        _record("bidirectional", 2, 1.0, on="prefill", itl=(0.1, 0.1)),
        _record("colocated", 2, 2.0, itl=(0.2, 0.2)),
        _record("colocated", 3, 2.0, itl=(0.2, 0.2)),
    ]
    walls = {"auto": 1.0, "bidirectional": 1.0, "colocated": 1.0}
    by_mode = {s.mode: s for s in summarize(records, walls, None)}
    auto, bidi, colocated = by_mode["auto"], by_mode["bidirectional"], by_mode["colocated"]
    assert (auto.steps_on_decode, auto.steps) == (1, 2)
    assert bidi.steps_on_decode == 0 and colocated.steps_on_decode is None  # one engine places nothing
    assert auto.ttft_vs_colocated == pytest.approx(0.5) and auto.ttft_vs_bidirectional == pytest.approx(1.0)
    assert auto.itl_p50_vs_colocated == pytest.approx(0.25) and colocated.itl_p50_vs_colocated == pytest.approx(1)
    assert bidi.itl_p99_s == pytest.approx(0.1)
    without = {s.mode: s for s in summarize(records[:4], walls, None)}
    assert without["auto"].ttft_vs_colocated is None and without["auto"].itl_p50_vs_colocated is None


def test_itl_percentiles_come_from_every_gap_of_turns_two_and_later() -> None:
    gaps = tuple(float(n) for n in range(1, 101))  # 1..100 s
    records = [_record("raw", 1, 1.0, itl=(1000.0,)), _record("raw", 2, 1.0, itl=gaps)]
    (raw,) = summarize(records, {"raw": 1.0}, None)
    assert raw.itl_p50_s is not None and raw.itl_p90_s is not None and raw.itl_p99_s is not None
    assert raw.itl_p50_s < raw.itl_p90_s < raw.itl_p99_s <= 100
    assert raw.itl_p99_s == pytest.approx(99, abs=1)


def test_a_step_record_carries_where_the_step_was_prefilled() -> None:
    stats = StepStats.model_validate(
        {"turn": 2, "step": 1, "ttft_s": 0.2, "prompt_tokens": 300, "local_hit_tokens": 256, "pulled_tokens": 0}
        | {"computed_tokens": 44, "output_tokens": 3, "prefill_engine": "decode", "placement_reason": "D cheaper"}
    )
    client: dict[str, Any] = {"session": 0, "turn": 2, "ttft_s": 0.25, "itl_s": [0.01, 0.01], "wall_s": 0.3}
    record = TurnRecord.from_stats(
        stats, mode="auto", new_tokens=30, output_token_ids=[5, 6, 7], prompt_digest="d", **client
    )
    assert (record.prefill_engine, record.placement_reason) == ("decode", "D cheaper")
    assert (record.ttft_s, record.engine_ttft_s, record.computed_tokens) == (0.25, 0.2, 44)
    dumped = json.loads(record.model_dump_json())
    assert dumped["prefill_engine"] == "decode" and dumped["placement_reason"] == "D cheaper"


def _report(records: list[TurnRecord], *, dtype: str | None = "float32") -> BenchReport:
    walls = dict.fromkeys((r.mode for r in records), 3.0)
    return BenchReport(
        workload="agentic",
        workload_description="test",
        modes=list(walls),
        sessions=1,
        turns=max(r.turn for r in records),
        machine={"cores": 2},
        dtype=dtype,
        floor=None,
        records=records,
        round_wall_s=walls,
        summaries=summarize(records, walls, None),
        answers_agree={},
    )


def test_the_report_prints_writes_json_and_draws(tmp_path: Path) -> None:
    records = [_record("bidirectional", t, 1.0 / t, pulled=50 if t > 1 else 0, on="prefill") for t in (1, 2, 3)]
    records += [_record("auto", t, 0.2, on="decode" if t > 1 else "prefill") for t in (1, 2, 3)]
    records += [_record("colocated", t, 0.5) for t in (1, 2, 3)]
    report = _report(records)
    latency, cost = table(report.summaries).split("\n\n")
    header, rule, *rows = latency.splitlines()
    assert header.split() == [
        *("mode", "on", "D", "ttft", "mean", "vs", "bidi", "vs", "coloc", "ttft", "p50", "ttft", "p90"),
        *("itl", "p50", "vs", "coloc", "itl", "p90", "itl", "p99"),
    ]
    assert set(rule) == {"-"} and all(len(header) == len(rule) >= len(row) for row in rows)
    cells = {row.split()[0]: row.split()[1:] for row in rows}
    assert cells["bidirectional"][:4] == ["0/2", "0.417", "1.00x", "0.83x"]  # (1/2 + 1/3) / 2 against 0.5
    assert cells["auto"][:2] == ["2/2", "0.200"] and cells["colocated"][:2] == ["-", "0.500"]
    header, rule, *rows = cost.splitlines()
    assert header.split()[:3] == ["mode", "tok/s", "reuse"] and [row.split()[0] for row in rows] == list(cells)
    assert max(len(line) for line in (latency + "\n" + cost).splitlines()) <= 120  # fits a terminal
    assert BenchReport.model_validate_json(report.model_dump_json()) == report
    steps = json.loads(report.model_dump_json())["records"]
    assert {(r["mode"], r["prefill_engine"]) for r in steps if r["turn"] > 1} == {
        ("bidirectional", "prefill"),
        ("auto", "decode"),
        ("colocated", None),
    }
    assert plot(report, tmp_path / "b.png").read_bytes().startswith(b"\x89PNG")


def test_the_header_says_which_dtype_ran() -> None:
    records = [_record("bidirectional", t, 1.0) for t in (1, 2)]
    first = header(_report(records)).splitlines()[0]
    assert first.startswith("workload: agentic (test); 2 turns, 1 session(s) per mode") and "dtype float32" in first
    assert "dtype" in header(_report(records, dtype=None)).splitlines()[0]


def test_the_command_rejects_unknown_modes_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--modes", "bidirectional,warp", "--turns", "2"])
    assert exited.value.code == 2
    assert "unknown mode(s) warp" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--turns", "1"], "at least 2 turns"),
        (["bench", "--sessions", "0"], "sessions must be at least 1"),
        (["bench", "--replay", "/nonexistent/conversation.json"], "cannot read"),
        (["bench", "--workload", "agentic", "--turns", "8"], "run 7 turns or fewer, or a longer context"),
    ],
)
def test_a_usage_mistake_is_one_line_and_exit_code_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("agentkv bench: error: ") and message in err and "\n" not in err


def test_mistakes_in_bench_arguments_raise_user_error() -> None:
    workload = make_workload("chat", turns=2)
    with pytest.raises(UserError, match="unknown mode"):
        run_bench_sync(workload, modes=["bidirectional", "warp"])
    with pytest.raises(UserError, match="sessions must be at least 1"):
        run_bench_sync(workload, sessions=0)
    with pytest.raises(UserError, match="dtype is one of auto, float32, bfloat16, not 'float8'"):
        run_bench_sync(workload, dtype="float8")
    with pytest.raises(UserError, match="dtype applies to the engines the bench starts"):
        run_bench_sync(workload, modes=["colocated"], dtype="float32", engines={"colocated": ScriptedEngine([])})


def test_colocated_starts_its_engine_in_its_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    launches: list[EngineLaunch] = []

    def runner(launch: EngineLaunch, *, core_slot: CoreSlot | None = None) -> None:
        if core_slot is not None:
            core_slot.release()
        launches.append(launch)
        raise UserError("not started")  # the launch is all this test needs

    monkeypatch.setattr("agentkv._engines._colocated.AsyncLLMRunner", runner)
    for dtype in ("float32", "bfloat16"):
        with pytest.raises(UserError, match="not started"), Colocated(dtype=dtype, warmup=False):
            pass
    assert [launch.engine_args["dtype"] for launch in launches] == ["float32", "bfloat16"]
    with pytest.raises(UserError, match="dtype is one of 'auto', 'float32', 'bfloat16', 'float16', not 'fp8'"):
        Colocated(dtype="fp8")


def test_the_command_takes_the_new_modes_and_refuses_an_unknown_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--modes", "auto,bidirectional-split", "--dtype", "bfloat16", "--turns", "1"]) == 2
    assert "at least 2 turns" in capsys.readouterr().err  # the options parsed; the workload refused
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--dtype", "float16"])
    assert exited.value.code == 2
    assert "invalid choice: 'float16'" in capsys.readouterr().err


class _Engines:
    """Stand-ins for the engine classes the bench starts: each records its keywords and is an honest pair double
    whose answers depend only on the prompt; every request is logged with its cache salt (which names the mode)."""

    def __init__(self) -> None:
        self.started: list[tuple[str, dict[str, Any]]] = []
        self.requests: list[tuple[str, str]] = []
        """(bench mode, placement) of every session step."""

    def kind(self, name: str) -> Callable[..., HonestPairEngine]:
        def start(**options: Any) -> HonestPairEngine:
            self.started.append((name, {k: v for k, v in options.items() if k != "progress"}))
            return HonestPairEngine(self._respond, max_model_len=options["max_model_len"])

        return start

    def _respond(self, request: StepRequest) -> str:
        # the floor's requests have no salt; a session's one-token steps between turns (pin upkeep) are its own
        if request.cache_salt is not None and request.sampling.max_tokens > 1:
            mode = request.cache_salt.split("-", 3)[3].rsplit("-", 1)[0]  # agentkv-bench-<run>-<mode>-<session>
            self.requests.append((mode, request.placement))
        return f"answer {sum(request.prompt_token_ids) % 997}"


@pytest.mark.anyio
async def test_every_engine_the_bench_starts_gets_its_dtype_and_each_mode_its_placement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engines = _Engines()
    for name in ("EmbeddedPair", "Colocated", "LaunchedPair"):
        monkeypatch.setattr(f"agentkv._bench._modes.{name}", engines.kind(name))
    modes = [*DEFAULT_MODES, "bidirectional-split", "launched", "served", "push", "push-disaggregated"]
    workload = make_workload("chat", turns=2, scale=0.25)
    report = await run_bench(workload, modes=modes, dtype="bfloat16", max_model_len=1024)
    assert report.dtype == "bfloat16" and "dtype bfloat16" in header(report)
    assert engines.started == [
        ("EmbeddedPair", {"max_model_len": 1024, "dtype": "bfloat16"}),
        ("EmbeddedPair", {"max_model_len": 1024, "core_policy": "split", "dtype": "bfloat16"}),
        (
            "EmbeddedPair",
            {"max_model_len": 1024, "push_back": False, "prefill_prefix_cache": False, "dtype": "bfloat16"},
        ),
        ("EmbeddedPair", {"max_model_len": 1024, "dtype": "bfloat16", "transfer": "push"}),  # both push rows
        ("Colocated", {"max_model_len": 1024, "dtype": "bfloat16"}),
        ("LaunchedPair", {"max_model_len": 1024, "dtype": "bfloat16"}),
    ]
    placements = {mode: {p for m, p in engines.requests if m == mode} for mode in modes}
    assert placements["auto"] == {"auto"}  # the session asks the pair to place each step
    assert placements["raw"] == placements["bidirectional"] == placements["bidirectional-split"] == {"prefill"}
    assert placements["served"] == {"prefill"}  # the front door's sessions, on the bidirectional pair
    assert placements["push"] == placements["push-disaggregated"] == {"prefill"}
    assert sorted({m for m, _ in engines.requests}) == sorted(modes)
    assert [(r.mode, r.turn) for r in report.records] == [(m, t) for m in modes for t in (1, 2)]
    assert report.answers_agree == dict.fromkeys([m for m in modes if m != "bidirectional"], True)
    by_mode = {s.mode: s for s in report.summaries}
    assert by_mode["auto"].ttft_vs_colocated is not None and by_mode["colocated"].steps_on_decode is None


@pytest.mark.anyio
async def test_a_workload_whose_last_turn_overflows_the_context_is_refused_before_any_engine_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engines = _Engines()
    monkeypatch.setattr("agentkv._bench._modes.Colocated", engines.kind("Colocated"))
    workload = make_workload("agentic", turns=8)  # turn 8: 7 tool results and 7 answers of up to 24 tokens
    with pytest.raises(UserError, match=r"turn 8 may send \d+ prompt tokens .* the context is 4096: run 7 turns"):
        await run_bench(workload, modes=["colocated"])
    assert engines.started == []
    with pytest.raises(UserError, match="the context is 2048: run 3 turns or fewer"):
        await run_bench(workload, modes=["colocated"], max_model_len=2048)
    given = ScriptedEngine([], max_model_len=3000)  # given engines: their own context, not the bench's default
    with pytest.raises(UserError, match="the context is 3000: run 5 turns or fewer"):
        await run_bench(workload, modes=["colocated"], engines={"colocated": given})
    assert given.requests == [] and engines.started == []


def test_a_turn_s_bound_is_its_conversation_and_the_longest_earlier_answers() -> None:
    tokenizer = load_tokenizer(str(prepare_model()))
    workload = make_workload("agentic", turns=3)
    bounds = prompt_bounds(workload, tokenizer)
    answered = ChatRenderer(tokenizer, system=None)
    system = Message(role="system", content=workload.system)
    first = answered.initial([system, Message(role="user", content=workload.turns[0])])
    assert bounds[0] == len(first)
    shorter = dataclasses.replace(workload, max_tokens=0)
    assert [b - s for b, s in zip(bounds, prompt_bounds(shorter, tokenizer), strict=True)] == [0, 24, 48]
    check_fits(workload, tokenizer, max_model_len=bounds[-1] + 1)  # room for the answer's first token: fits
    with pytest.raises(UserError, match=f"turn 3 may send {bounds[-1]} prompt tokens"):
        check_fits(workload, tokenizer, max_model_len=bounds[-1])


@pytest.mark.anyio
async def test_the_bench_defaults_to_float32_and_resolves_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    engines = _Engines()
    monkeypatch.setattr("agentkv._bench._modes.Colocated", engines.kind("Colocated"))
    workload = make_workload("chat", turns=2, scale=0.25)
    assert (await run_bench(workload, modes=["colocated"])).dtype == DEFAULT_DTYPE == "float32"
    assert (await run_bench(workload, modes=["colocated"], dtype="auto")).dtype == resolve_dtype("auto") != "auto"
    assert [options["dtype"] for _, options in engines.started] == ["float32", resolve_dtype("auto")]
    async with HonestPairEngine() as engine:
        given = await run_bench(workload, modes=["colocated"], engines={"colocated": engine})
    assert given.dtype is None  # the caller's engines: the bench does not know their dtype


def test_the_progress_bar_counts_steps_and_shows_what_runs(capsys: pytest.CaptureFixture[str]) -> None:
    progress = BenchProgress()
    progress("turn 1/2 bidirectional", 0, 4)
    progress.log("a start-up stage")
    progress("turn 2/2 raw", 2, 4)
    progress("done", 4, 4)
    err = capsys.readouterr().err
    last = err.rsplit("\r", 1)[-1]  # tqdm redraws in place; intermediate frames are throttled
    assert "\ra start-up stage\n" in err
    assert last.startswith("done:") and "4/4" in last and last.endswith("\n")  # closed at the end


def test_a_prompt_that_differs_on_the_same_history_is_found() -> None:
    bidi = [_record("bidirectional", t, 1.0, prompt=f"p{t}", output=(t,)) for t in (1, 2, 3)]
    same = [_record("served", t, 1.0, prompt=f"p{t}", output=(t,)) for t in (1, 2, 3)]
    assert first_prompt_divergence(bidi + same) is None
    rebuilt = [*same[:1], _record("served", 2, 1.0, prompt="other", tokens=120), same[2]]
    assert first_prompt_divergence(bidi + rebuilt) == (
        "served, session 0, turn 2: a prompt of 120 tokens, miss_reason push_back_off, against bidirectional's of 100"
    )
    answered_otherwise = [_record("raw", 1, 1.0, prompt="p1", output=(9,))]  # bf16: the answer differed on turn 1
    answered_otherwise += [_record("raw", t, 1.0, prompt="later", output=(t,)) for t in (2, 3)]
    assert first_prompt_divergence(bidi + answered_otherwise) is None  # so later prompts may differ


def test_the_push_line_compares_each_transfer_with_its_pull_twin() -> None:
    records = [
        _record(mode, t, ttft, itl=(gap, 0.1))
        for mode, ttft, gap in (
            ("bidirectional", 1.0, 0.3),
            ("push", 1.2, 0.1),
            ("disaggregated", 2.0, 0.3),
            ("push-disaggregated", 1.8, 0.1),
        )
        for t in (1, 2, 3)
    ]
    walls = dict.fromkeys(("bidirectional", "push", "disaggregated", "push-disaggregated"), 1.0)
    line = push_against_pull(summarize(records, walls, None))
    assert line is not None
    assert line.startswith(
        "push over bidirectional: TTFT 1.20x (1.200 vs 1.000 s), second token 1.00x (1.300 vs 1.300 s)"
    )
    assert "push-disaggregated over disaggregated: TTFT 0.90x" in line
    assert push_against_pull(summarize(records[:3], {"bidirectional": 1.0}, None)) is None


def test_the_served_line_gives_the_overhead_next_to_the_target() -> None:
    records = [_record("bidirectional", t, 1.0) for t in (1, 2, 3)]
    records += [_record("served", t, 1.02) for t in (1, 2, 3)]
    line = served_overhead(summarize(records, {"bidirectional": 1.0, "served": 1.0}, None))
    assert line is not None and line.startswith("served over bidirectional: 1.020x mean TTFT, +20.0 ms per step")
    assert f"target <= {SERVED_TTFT_TARGET:.2f}x: met" in line
    assert "the door's own share: +0.0 ms per step (0.0% of bidirectional's TTFT" in line  # the engine was slower
    assert "client TTFT over the engine's: served 10.0 ms, bidirectional 10.0 ms)" in line
    door = [r.model_copy(update={"engine_ttft_s": r.ttft_s - 0.015}) for r in records[3:]]
    line = served_overhead(summarize(records[:3] + door, {"bidirectional": 1.0, "served": 1.0}, None))
    assert line is not None and "the door's own share: +5.0 ms per step (0.5% of bidirectional's TTFT" in line
    slower = records[:3] + [_record("served", t, 1.2) for t in (1, 2, 3)]
    assert "NOT met" in (served_overhead(summarize(slower, {"bidirectional": 1.0, "served": 1.0}, None)) or "")
    assert served_overhead(summarize(records[:3], {"bidirectional": 1.0}, None)) is None


@pytest.mark.parametrize("name", ["agentic", "coding"])
def test_the_served_row_replays_the_conversation_through_the_front_door(name: str) -> None:
    """The `openai` client through `FrontDoor` gives the model bidirectional's prompts, pushes back from turn 2,
    and its record carries the step's stats from the server."""
    workload = make_workload(name, turns=3, scale=0.1)
    modes = ["bidirectional", "served"]
    with HonestPairEngine() as engine:
        report = run_bench_sync(workload, modes=modes, engines=dict.fromkeys(modes, engine), sessions=2)
        assert engine.violations == []
    assert [(r.mode, r.session, r.turn) for r in report.records] == [
        (m, s, t) for m in modes for s in (0, 1) for t in (1, 2, 3)
    ]
    assert report.answers_agree == {"served": True}
    reference = {(r.session, r.turn): r for r in report.records if r.mode == "bidirectional"}
    for record in (r for r in report.records if r.mode == "served"):
        same = reference[(record.session, record.turn)]
        assert (record.prompt_digest, record.prompt_tokens) == (same.prompt_digest, same.prompt_tokens)
        assert record.pulled_tokens == same.pulled_tokens == (0 if record.turn == 1 else same.pulled_tokens)
        assert record.turn == 1 or (record.pulled_tokens > 0 and record.miss_reason is None)
        assert record.ttft_s >= record.engine_ttft_s > 0 and record.itl_s
    (served,) = [s for s in report.summaries if s.mode == "served"]
    assert served.overhead_vs_bidirectional_s is not None and served.reuse_ratio > 0
    assert served_overhead(report.summaries) is not None


@pytest.mark.anyio
async def test_served_refuses_an_engine_the_front_door_cannot_call() -> None:
    async with HonestPairEngine() as engine:  # opened on this loop: no thread can call into it
        with pytest.raises(UserError, match="mode served needs its engine opened with `with`"):
            await run_bench(make_workload("chat", turns=2), modes=["served"], engines={"served": engine})


def test_a_diverging_mode_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mode that gives the model another prompt on the same history fails the bench, naming where."""

    digests = itertools.count()
    monkeypatch.setattr("agentkv._bench._runner._digest", lambda tokens: str(next(digests)))  # every prompt differs
    modes = ["bidirectional", "raw"]
    with HonestPairEngine() as engine, pytest.raises(AgentKVError, match="did not replay the same conversation"):
        run_bench_sync(make_workload("chat", turns=2), modes=modes, engines=dict.fromkeys(modes, engine))
