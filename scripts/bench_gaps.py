"""Where a load sweep's token-gap tail and lost turns come from, read from `agentkv bench --json` records.

    .venv/bin/python scripts/bench_gaps.py RUN.json [--mode auto] [--against bidirectional] [--turns 4]

Per load, for the two pair modes: the p99 of their gaps (turns 2+), how many of ``--mode``'s gaps pass
``--against``'s p99 and how many of those spanned a prefill on D (a step placed on D alone, from its first
token back by its prefill time) or were hand-overs (the first gap of a step prefilled on P), and the stretches in
which ``--against`` had nothing decoding on D (each turn decodes on D from its first token to its last). With
``--turns N``, the turns of load N: each one's TTFT against its own objective (``--slo-ttft`` x the turn's floor,
as the bench counts goodput), its worst gap, where it was prefilled and why. Used in docs/benchmarks.md ("Results
under load").
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from agentkv._bench._goodput import meets, ttft_target_s
from agentkv._bench._records import FloorFit, Slo, TurnRecord, percentile


def _gaps(records: list[TurnRecord]) -> list[float]:
    return [gap for r in records if r.turn >= 2 for gap in r.itl_s]


def _idle_stretches(records: list[TurnRecord]) -> list[float]:
    """The lengths of the stretches between two of D's decodes (their union), longest first."""
    spans = sorted((r.start_s + r.ttft_s, r.start_s + r.wall_s) for r in records)
    merged: list[list[float]] = []
    for begin, end in spans:
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    return sorted((b[0] - a[1] for a, b in zip(merged, merged[1:], strict=False)), reverse=True)


def tail(records: dict[tuple[str, int], list[TurnRecord]], loads: list[int], mode: str, against: str) -> None:
    for load in loads:
        ours, theirs = records.get((mode, load), []), records.get((against, load), [])
        if not ours or not theirs:
            continue
        bar = percentile(_gaps(theirs), 99)
        on_d = [
            (r.start_s + r.ttft_s - (r.prefill_s or 0.0), r.start_s + r.ttft_s)
            for r in ours
            if r.prefill_engine == "decode"
        ]
        over = spanning = handovers = 0
        for r in ours:
            if r.turn < 2:
                continue
            at = r.start_s + r.ttft_s
            for index, gap in enumerate(r.itl_s):
                if gap > bar:
                    over += 1
                    spanning += any(begin < at + gap and end > at for begin, end in on_d)
                    handovers += index == 0 and r.prefill_engine == "prefill"
                at += gap
        idle = _idle_stretches(theirs)
        sys.stdout.write(
            f"load {load:2d}: ITL p99 {mode} {percentile(_gaps(ours), 99):.3f} s, {against} {bar:.3f} s; {mode}'s gaps "
            f"over it {over}, {spanning} spanning a prefill on D, {handovers} hand-overs; {mode}'s steps on D "
            f"{len(on_d)}; {against}: D decoded nothing for {sum(idle):.1f} s in {len(idle)} stretches "
            f"({', '.join(f'{s:.2f}' for s in idle[:12])})\n"
        )


def turns(records: list[TurnRecord], floor: FloorFit, slo: Slo) -> None:
    """Each turn 2+ of ``records`` against the objective the bench counts goodput with (src/agentkv/_bench/_goodput.py)."""
    for r in sorted(records, key=lambda r: r.start_s):
        if r.turn < 2:
            continue
        objective = ttft_target_s(slo, floor, r)
        verdict = "kept" if meets(slo, floor, r) else "lost on TTFT" if r.ttft_s > objective else "lost on a gap"
        sys.stdout.write(
            f"{r.mode:13s} session {r.session} turn {r.turn} at {r.start_s:7.1f} s: TTFT {r.ttft_s:.2f} of "
            f"{objective:.2f} s, worst gap {r.worst_gap_s or 0.0:.3f} s, {verdict}; on {r.prefill_engine}: "
            f"{(r.placement_reason or '').rsplit(': ', 1)[-1]}\n"
        )


def report(run: dict[str, Any], *, mode: str, against: str, load: int | None) -> None:
    """`tail`, then with ``load`` `turns` of both modes at that load, for a bench JSON read as ``run``."""
    records: dict[tuple[str, int], list[TurnRecord]] = {}
    for raw in run["records"]:
        record = TurnRecord.model_validate(raw)
        records.setdefault((record.mode, record.load), []).append(record)
    tail(records, run["loads"], mode, against)
    if load is not None:
        floor, slo = FloorFit.model_validate(run["floor"]), Slo.model_validate(run["slo"])
        for name in (mode, against):
            turns(records.get((name, load), []), floor, slo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json")
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--against", default="bidirectional")
    parser.add_argument("--turns", type=int, default=None, metavar="LOAD")
    args = parser.parse_args()
    with open(args.json) as file:
        run = json.load(file)
    report(run, mode=args.mode, against=args.against, load=args.turns)


if __name__ == "__main__":
    main()
