"""Stats models: the invariant and the exports."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from agentkv import SessionStats, StepStats, TurnStats


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
