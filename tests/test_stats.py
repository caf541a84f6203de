"""Stats models: the invariant and the exports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agentkv import SessionStats, StepStats, TurnStats, plot_stats


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
    assert "no_handle" in stats.table()
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
    with pytest.raises(ValueError, match="one label per session"):
        plot_stats(bidirectional, labels=["a", "b"])
