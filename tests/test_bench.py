"""The benchmark's workloads, figures and outputs, on records made by hand (no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentkv._bench import BenchReport, load_replay, make_workload, plot, table
from agentkv._bench._records import FloorFit, StepRecord, summarize
from agentkv._cli import main


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
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope", turns=3)
    with pytest.raises(ValueError, match="at least 2 turns"):
        make_workload("chat", turns=1)


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
    with pytest.raises(ValueError, match="at least 2 user messages"):
        load_replay(path)


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
    assert table(report.summaries).splitlines()[2].startswith("bidirectional")
    assert BenchReport.model_validate_json(report.model_dump_json()) == report
    assert plot(report, tmp_path / "b.png").read_bytes().startswith(b"\x89PNG")


def test_the_command_rejects_unknown_modes_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--modes", "bidirectional,warp", "--turns", "2"]) == 2
    assert "unknown mode" in capsys.readouterr().err
