"""The benchmark's outputs: tables for the terminal (with several loads, one per mode across loads, and the
goodput's objective), the JSON report, a PNG plot (TTFT and reuse per turn; goodput against load for several)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from .._stats._plots import plot_turns
from .._stats._stats import text_table
from ._records import SERVED_TTFT_TARGET, BenchReport, FloorFit, LoadRow, ModeSummary, Population, Slo, TurnRecord

__all__ = [
    "floor_line",
    "goodput_lines",
    "header",
    "load_tables",
    "per_turn",
    "plot",
    "plot_goodput",
    "push_against_pull",
    "served_overhead",
    "table",
]


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
    if report.compiled:
        dtype += ", agentkv's engines compiled (--compiled)"
    if report.block_size is not None:
        dtype += f", KV blocks of {report.block_size} tokens in every engine (--block-size)"
    sessions = (
        f"{', '.join(map(str, report.loads))} sessions per mode (one load after another)"
        if len(report.loads) > 1
        else f"{report.sessions} session(s) per mode"
    )
    return "\n".join(
        (
            f"workload: {report.workload} ({report.workload_description}); {report.turns} turns, {sessions}, {dtype}",
            "figures over turns 2+; TTFT on the client clock (call -> first token; served: HTTP request sent -> "
            "first chunk); seconds",
            "on D: steps prefilled on D alone; vs bidi / vs coloc: the column before, over bidirectional's / "
            "colocated's",
        )
    )


def floor_line(floor: FloorFit) -> str:
    """The floor's terms, and where its fixed cost came from: measured (one-token steps) or fitted."""
    source = (
        f"measured: median of {len(floor.fixed_s)} one-token steps less that token's cost"
        if floor.a_measured
        else "fitted"
    )
    return (
        f"floor: {floor.a_s:.3f} s ({source}) + {floor.b_s_per_token * 1000:.2f} ms/token"
        f" + {floor.c_s_per_attended * 1e6:.2f} us per (new token x token it attends to) (+ the step's transfer)"
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
    """Draw TTFT per turn per mode and reuse per turn per mode, side by side, as a PNG; with several loads,
    goodput against load instead (`plot_goodput`)."""
    if len(report.loads) > 1:
        return plot_goodput(report, path)
    title = f"agentkv bench: {report.workload}, {report.sessions} session(s) per mode, {report.turns} turns"
    plot_turns(per_turn(report.records), title=title, path=path)
    return Path(path)


_LOAD_COLUMNS = (
    "load",
    "steps",
    "ttft p50",
    "ttft p90",
    "itl p50",
    "itl p90",
    "itl p99",
    "tok/s",
    "goodput",
    "gap-lost",
)


def load_tables(rows: Sequence[LoadRow]) -> str:
    """One table per mode, a row per load, over turns 2+: TTFT and ITL percentiles, tokens/s, goodput, and the turns
    lost on a token gap alone (their TTFT met)."""
    tables = []
    for mode in dict.fromkeys(row.mode for row in rows):
        cells = (
            (
                str(row.load),
                str(row.steps),
                _seconds(row.ttft_p50_s),
                _seconds(row.ttft_p90_s),
                _seconds(row.itl_p50_s),
                _seconds(row.itl_p90_s),
                _seconds(row.itl_p99_s),
                f"{row.output_tokens_per_s:.1f}",
                "-" if row.goodput is None else f"{row.goodput:.0%}",
                "-" if row.gap_lost_steps is None else str(row.gap_lost_steps),
            )
            for row in rows
            if row.mode == mode
        )
        tables.append(f"{mode}:\n{text_table(_LOAD_COLUMNS, cells, left_columns=0)}")
    return "\n\n".join(tables)


def _slo_lines(slo: Slo) -> list[str]:
    return [
        "goodput: the share of a mode's turns 2+ within both objectives, measured in this run:",
        f"  TTFT <= {slo.ttft_factor:g}x the turn's floor (the floor's fit without the transfer, for the turn's new "
        f"tokens over its history: {slo.ttft_target_min_s:.3f}-{slo.ttft_target_max_s:.3f} s over these turns)",
        f"  worst token gap <= {slo.itl_factor:g}x the median gap of a solo colocated session "
        f"({slo.itl_reference_s:.3f} s over {slo.itl_reference_gaps} gaps: {slo.itl_target_s:.3f} s)",
    ]


def _population_line(population: Population) -> str:
    gap = population.arrival_mean_s or 0.0
    measured = " (half a solo turn at load 1)" if population.arrival_mean_measured else ""
    drawn = (
        f"; drawn: mean {population.arrival_gap_drawn_mean_s:.2f} s, p90 {population.arrival_gap_drawn_p90_s:.2f} s"
        if population.arrival_gap_drawn_mean_s is not None and population.arrival_gap_drawn_p90_s is not None
        else ""
    )
    think = (
        f"lognormal (sigma 1) of mean {population.think_mean_s:.2f} s; drawn: mean "
        f"{population.think_drawn_mean_s:.2f} s, p90 {population.think_drawn_p90_s:.2f} s"
        if population.think_drawn_mean_s is not None and population.think_drawn_p90_s is not None
        else "none"
    )
    return (
        f"population: staggered arrivals, exponential gaps of mean {gap:.2f} s{measured}{drawn}; think time before "
        f"each turn after the first: {think}; seed {population.seed}"
    )


def goodput_lines(report: BenchReport) -> list[str]:
    """The lines under the tables on goodput: the SLO (with one load, each mode's goodput under it; with several,
    what the tables' ``gap-lost`` counts; none where the run did not measure one), or with several loads why there
    is none; and the population, when staggered."""
    lines = []
    if report.slo is not None:
        lines.extend(_slo_lines(report.slo))
        if len(report.loads) > 1:
            lines.append("gap-lost: of those turns, the ones whose TTFT met its objective and a token gap did not")
        else:
            lines.append(
                "  "
                + ", ".join(
                    f"{row.mode} {row.goodput:.0%} ({row.good_steps}/{row.steps})"
                    for row in report.load_rows
                    if row.goodput is not None
                )
            )
    elif len(report.loads) > 1:
        lines.append(f"goodput: not measured: {report.slo_note}")
    if report.population is not None and report.population.arrivals == "staggered":
        lines.append(_population_line(report.population))
    return lines


def plot_goodput(report: BenchReport, path: str | Path) -> Path:
    """Goodput against load, one line per mode, beside TTFT p90 against load, as a PNG (matplotlib)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'agentkv-vllm[plot]'") from exc

    figure = Figure(figsize=(11, 4.2))  # not pyplot: no global state, no display backend needed
    left, right = figure.subplots(1, 2)
    for mode in dict.fromkeys(row.mode for row in report.load_rows):
        rows = [row for row in report.load_rows if row.mode == mode]
        loads = [row.load for row in rows]
        if report.slo is not None:
            left.plot(loads, [100 * (row.goodput or 0.0) for row in rows], marker="o", label=mode)
        right.plot(loads, [row.ttft_p90_s for row in rows], marker="o", label=mode)
    slo = report.slo
    goodput_title = (
        f"Goodput: TTFT <= {slo.ttft_factor:g}x floor, worst gap <= {slo.itl_factor:g}x solo median"
        if slo is not None
        else "Goodput: not measured"
    )
    if slo is None:
        left.text(0.5, 0.5, report.slo_note or "", ha="center", va="center", wrap=True, transform=left.transAxes)
    left.set(xlabel="sessions at once", ylabel="turns within the SLO (%)", title=goodput_title, ylim=(0, 105))
    right.set(xlabel="sessions at once", ylabel="TTFT p90 (s)", title="Time to first token, p90")
    for axes in (left, right):
        axes.set_xscale("log", base=2)
        axes.set_xticks(report.loads, [str(load) for load in report.loads])
        axes.grid(alpha=0.3)
    right.legend(fontsize="small")
    figure.suptitle(
        f"agentkv bench: {report.workload}, {report.turns} turns, turns 2+ per mode and load", fontsize="medium"
    )
    figure.tight_layout()
    figure.savefig(Path(path), dpi=110)
    return Path(path)
