"""`agentkv bench` on the real pair: the modes that share one pair (served through the front door), two turns."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentkv import EmbeddedPair
from agentkv._bench import make_workload, plot, run_bench

pytestmark = [pytest.mark.pair, pytest.mark.nightly, pytest.mark.anyio]


async def test_the_bench_measures_each_mode_on_the_same_conversation(pair: EmbeddedPair, tmp_path: Path) -> None:
    workload = make_workload("chat", turns=2, scale=0.25)  # 8-token answers
    modes = ["bidirectional", "disaggregated", "raw", "served"]
    report = await run_bench(workload, modes=modes, engines=dict.fromkeys(modes, pair))
    assert [(r.mode, r.turn) for r in report.records] == [(m, t) for m in modes for t in (1, 2)]
    second = {r.mode: r for r in report.records if r.turn == 2}
    assert second["bidirectional"].pulled_tokens > 0 and second["raw"].pulled_tokens > 0
    assert second["served"].pulled_tokens == second["bidirectional"].pulled_tokens  # the same prompts (checked)
    assert second["disaggregated"].pulled_tokens == 0
    for record in report.records:  # each session has its own cache salt: no help from another mode
        assert record.turn > 1 or record.local_hit_tokens + record.pulled_tokens == 0
        assert record.ttft_s >= record.engine_ttft_s > 0
    assert report.answers_agree == {"disaggregated": True, "raw": True, "served": True}
    summaries = {s.mode: s for s in report.summaries}
    assert summaries["bidirectional"].overhead_vs_raw_s is not None
    assert summaries["disaggregated"].ttft_vs_bidirectional is not None
    assert summaries["served"].overhead_vs_bidirectional_s is not None
    assert plot(report, tmp_path / "bench.png").stat().st_size > 0
