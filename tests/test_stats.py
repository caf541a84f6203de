"""Stats models: the invariant, the exports, the plots, and stats as the leaf the others read."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

import agentkv
from agentkv import SessionStats, StepStats, TurnStats, UserError, plot_stats
from agentkv._bench._records import TurnRecord
from agentkv._stats._stats import text_table
from agentkv.engines import StepTimings


def _step(turn: int, **changes: Any) -> StepStats:
    values: dict[str, Any] = {
        "turn": turn,
        "step": 1,
        "ttft_s": 0.5 / turn,
        "prompt_tokens": 100,
        "local_hit_tokens": 60,
        "pulled_tokens": 30,
        "computed_tokens": 10,
        "output_tokens": 5,
    }
    values.update(changes)
    return StepStats(**values)


def test_a_step_summarizes_itself_in_one_line() -> None:
    assert _step(2).summary() == "ttft 0.250 s | prompt 100 = local 60 + pulled 30 + computed 10 | reused"
    assert _step(1, miss_reason="expired").summary().endswith("| expired")


def test_token_sources_must_add_up_to_the_prompt() -> None:
    with pytest.raises(ValidationError, match="!= prompt"):
        _step(1, computed_tokens=11)


def test_aggregates_and_exports() -> None:
    first = _step(1, local_hit_tokens=0, pulled_tokens=0, computed_tokens=100, miss_reason="no_handle")
    stats = SessionStats(
        mode="bidirectional",
        turns=[TurnStats(turn=1, steps=[first], wall_s=1.0), TurnStats(turn=2, steps=[_step(2)], wall_s=1.0)],
    )
    assert stats.mean_ttft_after_first_turn_s == pytest.approx(0.25)
    assert stats.reuse_ratio == pytest.approx(90 / 200)
    assert _step(2).reuse_ratio == pytest.approx(0.9)
    data = json.loads(stats.to_json())
    assert data["turns"][1]["steps"][0]["pulled_tokens"] == 30
    assert stats.to_csv().splitlines()[0].startswith("mode,turn,step,ttft_s")
    header, rule, first_row, second_row = stats.table().splitlines()
    assert header.split() == ["turn", "step", "prompt", "local", "pulled", "computed", "out", "ttft_s", "miss"]
    assert first_row.split() == ["1", "1", "100", "0", "0", "100", "5", "0.500", "no_handle"]
    assert second_row.split()[-1] == "-" and set(rule) == {"-"}
    assert "<table>" in stats._repr_html_()


def test_one_call_plots_ttft_and_reuse_per_turn(tmp_path: Path) -> None:
    turns = [TurnStats(turn=t, steps=[_step(t)], wall_s=1.0) for t in (1, 2, 3)]
    bidirectional = SessionStats(mode="bidirectional", turns=turns)
    figure = bidirectional.plot(path=tmp_path / "session.png")
    ttft_axes, reuse_axes = figure.axes
    assert list(ttft_axes.lines[0].get_ydata()) == [0.5, 0.25, 0.5 / 3]
    assert list(reuse_axes.lines[0].get_ydata()) == [90.0, 90.0, 90.0]
    assert (tmp_path / "session.png").read_bytes().startswith(b"\x89PNG")
    both = plot_stats(bidirectional, SessionStats(mode="colocated", turns=turns[:2]))
    assert [line.get_label() for line in both.axes[0].lines] == ["bidirectional", "colocated"]
    with pytest.raises(UserError, match="one label per session"):
        plot_stats(bidirectional, labels=["a", "b"])
    with pytest.raises(UserError, match="share a label"):  # one line would hide the other
        plot_stats(bidirectional, bidirectional)
    with pytest.raises(UserError, match="at least one"):
        plot_stats()
    labelled = plot_stats(bidirectional, bidirectional, labels=["before", "after"])
    assert [line.get_label() for line in labelled.axes[0].lines] == ["before", "after"]


def test_a_text_table_aligns_labels_left_and_numbers_right() -> None:
    table = text_table(("mode", "ttft"), [("bidirectional", "0.5"), ("raw", "12.25")], left_columns=1)
    assert table.splitlines() == [
        "mode            ttft",
        "--------------------",
        "bidirectional    0.5",
        "raw            12.25",
    ]


def _module_level_imports(module: Any) -> set[str]:
    """What a module imports when it is imported (not inside functions), as absolute names."""
    tree = ast.parse(Path(module.__file__).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names.add(importlib.util.resolve_name("." * node.level + (node.module or ""), module.__package__))
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_stats_import_only_the_error_tree_and_plots_import_no_agentkv_module() -> None:
    assert {n for n in _module_level_imports(agentkv._stats._stats) if n.startswith("agentkv")} <= {"agentkv._errors"}
    assert not {n for n in _module_level_imports(agentkv._stats._plots) if n.startswith("agentkv")}


def test_the_user_sees_every_engine_measurement_under_its_name() -> None:
    timings = StepTimings(
        ttft_s=0.2,
        prefill_s=0.1,
        kv_wait_s=0.01,
        decode_s=0.5,
        local_hit_tokens=60,
        pulled_tokens=30,
        computed_tokens=10,
        handoff_tokens=10,
        kv_bytes=4096,
        kv_transfer_s=0.02,
        pin_declined=True,
    )
    stats = StepStats(turn=2, step=1, prompt_tokens=100, output_tokens=5, **timings.stats_fields())
    measured = set(StepTimings.model_fields) - {"pin_declined", "pin_evicted"}
    assert stats.model_dump(include=measured) == {name: getattr(timings, name) for name in measured}


def test_a_bench_record_is_the_steps_stats_plus_the_clients_clock() -> None:
    stats = _step(2, kv_bytes=4096, kv_transfer_s=0.02, miss_reason="below_threshold")
    record = TurnRecord.from_stats(
        stats,
        mode="bidirectional",
        session=0,
        turn=2,
        ttft_s=0.3,
        itl_s=[0.1],
        wall_s=0.4,
        new_tokens=20,
        output_token_ids=[1, 2, 3, 4, 5],
        prompt_digest="d1",
    )
    assert (record.ttft_s, record.engine_ttft_s) == (0.3, stats.ttft_s)  # the client's clock, and the engine's
    shared = (TurnRecord.model_fields.keys() & StepStats.model_fields.keys()) - {"ttft_s"}
    assert record.model_dump(include=shared) == stats.model_dump(include=shared)


def test_prefill_stats_are_handed_over_once_and_those_nobody_takes_age_out() -> None:
    from agentkv._engines import _server
    from agentkv._engines._vllm_readouts import PrefillStatsKeeper, Readouts

    kept = PrefillStatsKeeper()
    for index in range(PrefillStatsKeeper.LIMIT + 2):
        kept[f"request-{index}"] = index
    assert len(kept) == PrefillStatsKeeper.LIMIT and "request-0" not in kept  # the oldest went first
    assert kept.take(f"request-{PrefillStatsKeeper.LIMIT}") == PrefillStatsKeeper.LIMIT
    assert kept.take(f"request-{PrefillStatsKeeper.LIMIT}") is None  # once only
    assert isinstance(Readouts().prefill_stats, PrefillStatsKeeper)  # the in-process engines' keeper ...
    assert isinstance(_server._PREFILL_STATS, PrefillStatsKeeper)  # ... is the server's
