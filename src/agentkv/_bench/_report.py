"""The benchmark's outputs: a table for the terminal, the JSON report, a PNG plot."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from .._plots import plot_turns
from ._records import BenchReport, ModeSummary, StepRecord

__all__ = ["per_turn", "plot", "table"]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(summaries: Sequence[ModeSummary]) -> str:
    """One row per mode: turns 2+ of every session."""
    header = (
        f"{'mode':<22} {'ttft mean':>9} {'p50':>7} {'p90':>7} {'vs bidi':>7} {'itl p50':>7} {'itl p90':>7} "
        f"{'reuse':>6} {'pulled':>7} {'computed':>8} {'MB moved':>8} {'xfer s':>7} {'tok/s':>6} "
        f"{'floor':>6} {'/floor':>6} {'sdk ovh':>7}"
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        lines.append(
            f"{s.mode:<22} {_seconds(s.ttft_mean_s):>9} {_seconds(s.ttft_p50_s):>7} {_seconds(s.ttft_p90_s):>7} "
            f"{_ratio(s.ttft_vs_bidirectional):>7} {_seconds(s.itl_p50_s):>7} {_seconds(s.itl_p90_s):>7} "
            f"{s.reuse_ratio:>6.0%} {s.pulled_tokens:>7} {s.computed_tokens:>8} "
            f"{'-' if s.kv_bytes is None else f'{s.kv_bytes / 1e6:.2f}':>8} "
            f"{_seconds(s.kv_transfer_s):>7} {s.output_tokens_per_s:>6.1f} {_seconds(s.floor_mean_s):>6} "
            f"{_ratio(s.ttft_over_floor):>6} {_seconds(s.overhead_vs_raw_s):>7}"
        )
    return "\n".join(lines)


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
