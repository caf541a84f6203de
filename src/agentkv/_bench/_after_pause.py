"""The steps that follow a pause (issue 30): how long each waited for its KV, per mode, and ``bidirectional-early``'s
TTFT (the same session with the KV moved into P during the pause) over bidirectional's on those steps.

A step follows a pause when its turn is not the first and its session paused before it (`TurnRecord.think_s` above
0: staggered arrivals with a think time, src/agentkv/_bench/_population.py). Its KV wait is what `StepStats` records
(src/agentkv/_stats/_stats.py): `kv_wait_s`, the time its requests waited to be scheduled, mostly for KV, split at
the step's first token (`handoff_wait_s`: D's wait for P's KV after P's first token was streamed), with the transfer
time and the tokens pulled beside it. The target is on the wait before the first token: what the pause could move.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ._modes import EARLY_MODE, PAIR_MODES
from ._records import TurnRecord
from ._target_records import EARLY_RATIO_TARGET, KV_WAIT_TARGET_S, AfterPause

__all__ = ["after_pause", "after_pause_lines", "after_pause_records", "early_ratio_line"]


def after_pause_records(records: Sequence[TurnRecord], mode: str) -> list[TurnRecord]:
    """``mode``'s steps after a pause: turns after the first with a think time above 0."""
    return [r for r in records if r.mode == mode and r.turn > 1 and r.think_s > 0]


def after_pause(records: Sequence[TurnRecord]) -> list[AfterPause]:
    """Per pair mode (the modes' order) that had steps after a pause: their KV wait, transfer, pulls and TTFT."""
    summaries = []
    for mode in dict.fromkeys(r.mode for r in records):
        rows = after_pause_records(records, mode)
        if mode not in PAIR_MODES or not rows:
            continue
        transfers = [r.kv_transfer_s for r in rows]
        before_first = [r.kv_wait_s - r.handoff_wait_s for r in rows]
        summaries.append(
            AfterPause(
                mode=mode,
                steps=len(rows),
                think_mean_s=statistics.fmean(r.think_s for r in rows),
                ttft_mean_s=statistics.fmean(r.ttft_s for r in rows),
                kv_wait_mean_s=statistics.fmean(r.kv_wait_s for r in rows),
                kv_wait_max_s=max(r.kv_wait_s for r in rows),
                first_token_wait_mean_s=statistics.fmean(before_first),
                first_token_wait_max_s=max(before_first),
                handoff_wait_mean_s=statistics.fmean(r.handoff_wait_s for r in rows),
                kv_transfer_mean_s=None if None in transfers else statistics.fmean(t or 0.0 for t in transfers),
                pulled_tokens_mean=statistics.fmean(r.pulled_tokens for r in rows),
            )
        )
    return summaries


def after_pause_lines(summaries: Sequence[AfterPause], *, pair_modes_ran: bool) -> list[str]:
    """The KV wait of the steps after a pause, one line per mode, against `KV_WAIT_TARGET_S`; when pair modes ran
    but no step followed a pause, one line saying how to get such steps."""
    if not summaries:
        if not pair_modes_ran:
            return []
        return ["steps after a pause: none (a pause needs --arrivals staggered and a --think-s above 0)"]
    lines = [
        "steps after a pause (turns 2+ with a think time; KV wait before the first token, target <= "
        f"{KV_WAIT_TARGET_S * 1000:g} ms; then D's hand-over wait after it):"
    ]
    width = max(len(s.mode) for s in summaries)
    for s in summaries:
        transfer = "-" if s.kv_transfer_mean_s is None else f"{s.kv_transfer_mean_s * 1000:.1f} ms"
        verdict = "met" if s.first_token_wait_mean_s <= KV_WAIT_TARGET_S else "NOT met"
        lines.append(
            f"  {s.mode:<{width}}  {s.steps} steps after {s.think_mean_s:.2f} s mean pause: KV wait mean "
            f"{s.first_token_wait_mean_s * 1000:.1f} ms ({verdict}), max {s.first_token_wait_max_s * 1000:.1f} ms, "
            f"hand-over {s.handoff_wait_mean_s * 1000:.1f} ms; transfer {transfer}; pulled {s.pulled_tokens_mean:.0f} "
            f"tokens; TTFT {s.ttft_mean_s:.3f} s"
        )
    return lines


def early_ratio_line(summaries: Sequence[AfterPause]) -> str | None:
    """``bidirectional-early``'s mean TTFT over bidirectional's, steps after a pause only, against
    `EARLY_RATIO_TARGET`; None unless both had such steps."""
    by_mode = {s.mode: s for s in summaries}
    early, late = by_mode.get(EARLY_MODE), by_mode.get("bidirectional")
    if early is None or late is None or late.ttft_mean_s <= 0:
        return None
    ratio = early.ttft_mean_s / late.ttft_mean_s
    verdict = "met" if ratio <= EARLY_RATIO_TARGET else "NOT met"
    return (
        f"{EARLY_MODE} over bidirectional, steps after a pause: TTFT {ratio:.2f}x ({early.ttft_mean_s:.3f} vs "
        f"{late.ttft_mean_s:.3f} s over {early.steps} and {late.steps} steps; target <= {EARLY_RATIO_TARGET:g}x on "
        f"coding: {verdict}); KV wait before the first token {early.first_token_wait_mean_s * 1000:.1f} vs "
        f"{late.first_token_wait_mean_s * 1000:.1f} ms"
    )
