"""The benchmark's outputs: a table for the terminal, the JSON report, a PNG plot."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from .._stats._plots import plot_turns
from .._stats._stats import text_table
from ._records import SERVED_TTFT_TARGET, BenchReport, ModeSummary, TurnRecord

__all__ = ["header", "per_turn", "plot", "push_against_pull", "served_overhead", "table"]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _megabytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}"


def _on_decode(summary: ModeSummary) -> str:
    return "-" if summary.steps_on_decode is None else f"{summary.steps_on_decode}/{summary.steps}"


_LATENCY_COLUMNS = (
    "mode",
    "on D",
    "ttft mean",
    "vs bidi",
    "vs coloc",
    "ttft p50",
    "ttft p90",
    "itl p50",
    "vs coloc",
    "itl p90",
    "itl p99",
)
_COST_COLUMNS = (
    "mode",
    "tok/s",
    "reuse",
    "pulled",
    "computed",
    "MB moved",
    "xfer s",
    "floor",
    "/floor",
    "sdk ovh",
)


def table(summaries: Sequence[ModeSummary]) -> str:
    """Two tables, one row per mode over turns 2+ of every session: latency, then throughput and reuse.

    Each "vs" column is the ratio of the column before it (TTFT mean, ITL p50) to that of bidirectional
    or colocated; "on D" counts the steps prefilled on D alone.
    """
    latency = (
        (
            s.mode,
            _on_decode(s),
            _seconds(s.ttft_mean_s),
            _ratio(s.ttft_vs_bidirectional),
            _ratio(s.ttft_vs_colocated),
            _seconds(s.ttft_p50_s),
            _seconds(s.ttft_p90_s),
            _seconds(s.itl_p50_s),
            _ratio(s.itl_p50_vs_colocated),
            _seconds(s.itl_p90_s),
            _seconds(s.itl_p99_s),
        )
        for s in summaries
    )
    cost = (
        (
            s.mode,
            f"{s.output_tokens_per_s:.1f}",
            f"{s.reuse_ratio:.0%}",
            str(s.pulled_tokens),
            str(s.computed_tokens),
            _megabytes(s.kv_bytes),
            _seconds(s.kv_transfer_s),
            _seconds(s.floor_mean_s),
            _ratio(s.ttft_over_floor),
            _seconds(s.overhead_vs_raw_s),
        )
        for s in summaries
    )
    return "\n\n".join(
        (text_table(_LATENCY_COLUMNS, latency, left_columns=1), text_table(_COST_COLUMNS, cost, left_columns=1))
    )


def header(report: BenchReport) -> str:
    """The lines above the tables: what ran, in which dtype, and how to read the columns."""
    dtype = f"dtype {report.dtype}" if report.dtype is not None else "the given engines' dtype"
    return "\n".join(
        (
            f"workload: {report.workload} ({report.workload_description}); {report.turns} turns, "
            f"{report.sessions} session(s) per mode, {dtype}",
            "figures over turns 2+; TTFT on the client clock (call -> first token; served: HTTP request sent -> "
            "first chunk); seconds",
            "on D: steps prefilled on D alone; vs bidi / vs coloc: the column before, over bidirectional's / "
            "colocated's",
        )
    )


def served_overhead(summaries: Sequence[ModeSummary]) -> str | None:
    """The front door's cost next to its target: served's mean TTFT over bidirectional's (ratio, and ms per
    step), and the door's own share of it: served's client-over-engine TTFT minus bidirectional's (the rest
    is the engine's TTFT varying between rounds). None unless both modes ran."""
    by_mode = {s.mode: s for s in summaries}
    served, bidirectional = by_mode.get("served"), by_mode.get("bidirectional")
    if served is None or bidirectional is None:
        return None
    ratio, extra = served.ttft_vs_bidirectional, served.overhead_vs_bidirectional_s
    if ratio is None or extra is None:
        return None
    verdict = "met" if ratio <= SERVED_TTFT_TARGET else "NOT met"
    door = served.client_over_engine_s - bidirectional.client_over_engine_s
    return (
        f"served over bidirectional: {ratio:.3f}x mean TTFT, {extra * 1000:+.1f} ms per step "
        f"(target <= {SERVED_TTFT_TARGET:.2f}x: {verdict}); the door's own share: {door * 1000:+.1f} ms per step "
        f"({door / bidirectional.ttft_mean_s:.1%} of bidirectional's TTFT; client TTFT over the engine's: served "
        f"{served.client_over_engine_s * 1000:.1f} ms, bidirectional {bidirectional.client_over_engine_s * 1000:.1f} ms)"
    )


def push_against_pull(summaries: Sequence[ModeSummary]) -> str | None:
    """Push transfer next to pull, each with and without push-back: mean TTFT and mean time to the second
    token (the first token D sends in a pull pair, which streams P's first). None unless a pair ran."""
    by_mode = {s.mode: s for s in summaries}
    parts = []
    for push, pull in (("push", "bidirectional"), ("push-disaggregated", "disaggregated")):
        a, b = by_mode.get(push), by_mode.get(pull)
        if a is None or b is None:
            continue
        second = (
            f", second token {a.second_token_mean_s / b.second_token_mean_s:.2f}x"
            f" ({a.second_token_mean_s:.3f} vs {b.second_token_mean_s:.3f} s)"
            if a.second_token_mean_s and b.second_token_mean_s
            else ""
        )
        parts.append(
            f"{push} over {pull}: TTFT {a.ttft_mean_s / b.ttft_mean_s:.2f}x ({a.ttft_mean_s:.3f} vs "
            f"{b.ttft_mean_s:.3f} s){second}, reuse {a.reuse_ratio:.0%} vs {b.reuse_ratio:.0%}"
        )
    return "; ".join(parts) or None


def per_turn(records: Sequence[TurnRecord]) -> dict[str, list[tuple[int, float, float]]]:
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
