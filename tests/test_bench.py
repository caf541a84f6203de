"""The benchmark's workloads, figures and outputs, on records made by hand (no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentkv import UserError
from agentkv._bench import BenchReport, load_replay, make_workload, plot, run_bench_sync, table
from agentkv._bench._records import FloorFit, StepRecord, summarize
from agentkv._cli import _BenchProgress, main


def _record(mode: str, turn: int, ttft: float, *, session: int = 0, pulled: int = 0, tokens: int = 100) -> StepRecord:
    return StepRecord(
        mode=mode,
        session=session,
        turn=turn,
        ttft_s=ttft,
        engine_ttft_s=ttft - 0.01,
        itl_s=[0.1, 0.2],
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
        output_token_ids=[1, 2],
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
    floor = FloorFit(a_s=0.1, b_s_per_token=0.01, points=[(16, 0.26)])
    by_mode = {s.mode: s for s in summarize(records, {"bidirectional": 10, "disaggregated": 20, "raw": 5}, floor)}
    bidi, plain = by_mode["bidirectional"], by_mode["disaggregated"]
    assert bidi.steps == 2 and bidi.ttft_mean_s == pytest.approx(1.5)
    assert plain.ttft_vs_bidirectional == pytest.approx(3.0)
    assert bidi.reuse_ratio == pytest.approx(0.8) and plain.reuse_ratio == 0
    assert bidi.kv_bytes == 2000 and plain.kv_bytes is None
    assert bidi.output_tokens_per_s == pytest.approx(6 / 10)  # turn 1 counts for throughput
    assert bidi.floor_mean_s == pytest.approx(0.1 + 0.2 + 0.01)
    assert bidi.overhead_vs_raw_s == pytest.approx(0.25) and plain.overhead_vs_raw_s is None
    assert bidi.itl_p50_s == pytest.approx(0.15)


def test_the_report_prints_writes_json_and_draws(tmp_path: Path) -> None:
    records = [_record("bidirectional", t, 1.0 / t, pulled=50 if t > 1 else 0) for t in (1, 2, 3)]
    report = BenchReport(
        workload="agentic",
        workload_description="test",
        modes=["bidirectional"],
        sessions=1,
        turns=3,
        machine={"cores": 2},
        floor=None,
        records=records,
        round_wall_s={"bidirectional": 3.0},
        summaries=summarize(records, {"bidirectional": 3.0}, None),
        answers_agree={},
    )
    header, rule, row = table(report.summaries).splitlines()
    assert header.split()[:3] == ["mode", "ttft", "mean"] and set(rule) == {"-"}
    assert row.split()[0] == "bidirectional" and len(header) == len(rule) >= len(row)
    assert row.split()[1] == "0.417"  # mean TTFT of turns 2 and 3: (1/2 + 1/3) / 2
    assert BenchReport.model_validate_json(report.model_dump_json()) == report
    assert plot(report, tmp_path / "b.png").read_bytes().startswith(b"\x89PNG")


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


def test_the_progress_bar_counts_steps_and_shows_what_runs(capsys: pytest.CaptureFixture[str]) -> None:
    progress = _BenchProgress()
    progress("turn 1/2 bidirectional", 0, 4)
    progress.log("a start-up stage")
    progress("turn 2/2 raw", 2, 4)
    progress("done", 4, 4)
    err = capsys.readouterr().err
    last = err.rsplit("\r", 1)[-1]  # tqdm redraws in place; intermediate frames are throttled
    assert "\ra start-up stage\n" in err
    assert last.startswith("done:") and "4/4" in last and last.endswith("\n")  # closed at the end
