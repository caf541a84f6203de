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

from agentkv._engines._compute import attended


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    rank = (len(ordered) - 1) * 0.99
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _records(run: dict[str, Any], mode: str, load: int) -> list[dict[str, Any]]:
    return [r for r in run["records"] if r["mode"] == mode and r["load"] == load]


def _gaps(records: list[dict[str, Any]]) -> list[float]:
    return [gap for r in records if r["turn"] >= 2 for gap in r["itl_s"]]


def _idle_stretches(records: list[dict[str, Any]]) -> list[float]:
    """The lengths of the stretches between two of D's decodes (their union), longest first."""
    spans = sorted((r["start_s"] + r["ttft_s"], r["start_s"] + r["wall_s"]) for r in records)
    merged: list[list[float]] = []
    for begin, end in spans:
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    return sorted((b[0] - a[1] for a, b in zip(merged, merged[1:], strict=False)), reverse=True)


def tail(run: dict[str, Any], mode: str, against: str) -> None:
    for load in run["loads"]:
        ours, theirs = _records(run, mode, load), _records(run, against, load)
        if not ours or not theirs:
            continue
        bar = _p99(_gaps(theirs))
        on_d = [
            (r["start_s"] + r["ttft_s"] - (r["prefill_s"] or 0.0), r["start_s"] + r["ttft_s"])
            for r in ours
            if r["prefill_engine"] == "decode"
        ]
        over = spanning = handovers = 0
        for r in ours:
            if r["turn"] < 2:
                continue
            at = r["start_s"] + r["ttft_s"]
            for index, gap in enumerate(r["itl_s"]):
                if gap > bar:
                    over += 1
                    spanning += any(begin < at + gap and end > at for begin, end in on_d)
                    handovers += index == 0 and r["prefill_engine"] == "prefill"
                at += gap
        idle = _idle_stretches(theirs)
        sys.stdout.write(
            f"load {load:2d}: ITL p99 {mode} {_p99(_gaps(ours)):.3f} s, {against} {bar:.3f} s; {mode}'s gaps over it "
            f"{over}, {spanning} spanning a prefill on D, {handovers} hand-overs; {mode}'s steps on D {len(on_d)}; "
            f"{against}: D decoded nothing for {sum(idle):.1f} s in {len(idle)} stretches "
            f"({', '.join(f'{s:.2f}' for s in idle[:12])})\n"
        )


def turns(run: dict[str, Any], load: int, modes: tuple[str, ...]) -> None:
    floor, slo = run["floor"], run["slo"]
    for mode in modes:
        for r in sorted(_records(run, mode, load), key=lambda r: r["start_s"]):
            if r["turn"] < 2:
                continue
            new, context = r["new_tokens"], r["prompt_tokens"] - r["new_tokens"]
            fit = floor["a_s"] + floor["b_s_per_token"] * new + floor["c_s_per_attended"] * attended(new, context)
            objective = slo["ttft_factor"] * fit
            worst = max(r["itl_s"], default=0.0)
            gap_objective = slo["itl_factor"] * slo["itl_reference_s"]
            verdict = (
                "lost on TTFT" if r["ttft_s"] > objective else "lost on a gap" if worst > gap_objective else "kept"
            )
            sys.stdout.write(
                f"{mode:13s} session {r['session']} turn {r['turn']} at {r['start_s']:7.1f} s: TTFT {r['ttft_s']:.2f} "
                f"of {objective:.2f} s, worst gap {worst:.3f} s, {verdict}; on {r['prefill_engine']}: "
                f"{(r['placement_reason'] or '').rsplit(': ', 1)[-1]}\n"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json")
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--against", default="bidirectional")
    parser.add_argument("--turns", type=int, default=None, metavar="LOAD")
    args = parser.parse_args()
    with open(args.json) as file:
        run = json.load(file)
    tail(run, args.mode, args.against)
    if args.turns is not None:
        turns(run, args.turns, (args.mode, args.against))


if __name__ == "__main__":
    main()
