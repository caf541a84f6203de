"""The benchmark's outputs: a table for the terminal, the JSON report, a PNG plot."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from .._plots import plot_turns
from .._stats import text_table
from ._records import BenchReport, ModeSummary, StepRecord

__all__ = ["per_turn", "plot", "table"]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _megabytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}"


_COLUMNS = (
    "mode",
    "ttft mean",
    "p50",
    "p90",
    "vs bidi",
    "itl p50",
    "itl p90",
    "reuse",
    "pulled",
    "computed",
    "MB moved",
    "xfer s",
    "tok/s",
    "floor",
    "/floor",
    "sdk ovh",
)


def table(summaries: Sequence[ModeSummary]) -> str:
    """One row per mode: turns 2+ of every session."""
    rows = (
        (
            s.mode,
            _seconds(s.ttft_mean_s),
            _seconds(s.ttft_p50_s),
            _seconds(s.ttft_p90_s),
            _ratio(s.ttft_vs_bidirectional),
            _seconds(s.itl_p50_s),
            _seconds(s.itl_p90_s),
            f"{s.reuse_ratio:.0%}",
            str(s.pulled_tokens),
            str(s.computed_tokens),
            _megabytes(s.kv_bytes),
            _seconds(s.kv_transfer_s),
            f"{s.output_tokens_per_s:.1f}",
            _seconds(s.floor_mean_s),
            _ratio(s.ttft_over_floor),
            _seconds(s.overhead_vs_raw_s),
        )
        for s in summaries
    )
    return text_table(_COLUMNS, rows, left_columns=1)


def per_turn(records: Sequence[StepRecord]) -> dict[str, list[tuple[int, float, float]]]:
    """Per mode: (turn, mean TTFT over sessions, reuse ratio over sessions) for each turn."""
    series: dict[str, list[tuple[int, float, float]]] = {}
    for mode in dict.fromkeys(r.mode for r in records):
        rows = [r for r in records if r.mode == mode]
        points = []
        for turn in sorted({r.turn for r in rows}):
            at = [r for r in rows if r.turn == turn]
            reused = sum(r.local_hit_tokens + r.pulled_tokens for r in at) / sum(r.prompt_tokens for r in at)
            points.append((turn, statistics.fmean(r.ttft_s for r in at), reused))
        series[mode] = points
    return series


def plot(report: BenchReport, path: str | Path) -> Path:
    """Draw TTFT per turn per mode and reuse per turn per mode, side by side, as a PNG."""
    title = f"agentkv bench: {report.workload}, {report.sessions} session(s) per mode, {report.turns} turns"
    plot_turns(per_turn(report.records), title=title, path=path)
    return Path(path)
