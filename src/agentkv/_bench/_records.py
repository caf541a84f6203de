"""What the benchmark measures per step, and the summary per mode (pydantic, written as JSON)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from .._engines import PrefillEngine
from .._engines._compute import ComputePoint, attended, fit_compute
from .._stats._stats import StepStats
from ._target_records import AfterPause, ModeProbes

__all__ = [
    "SERVED_TTFT_TARGET",
    "BenchReport",
    "FloorFit",
    "FloorPoint",
    "LoadRow",
    "ModeSummary",
    "Population",
    "Slo",
    "TurnRecord",
    "first_prompt_divergence",
    "percentile",
    "summarize",
]

SERVED_TTFT_TARGET = 1.05
"""The most served's mean TTFT may be over bidirectional's (issue 15: the front door costs at most 5%)."""


class TurnRecord(BaseModel):
    """One turn of one session in one mode (each turn is one model call: no tools in the workloads)."""

    model_config = ConfigDict(frozen=True)

    mode: str
    session: int
    turn: int
    ttft_s: float
    """Client clock: the call (``Session.run``, or ``Engine.step`` for raw; served: the HTTP request sent) to the
    first output token (served: the first chunk, which the front door sends at the first token)."""
    engine_ttft_s: float
    """The engine's own TTFT: request submitted to the first token (`StepStats.ttft_s`)."""
    prefill_s: float | None = None
    """The prefilling engine's compute time of the step (`StepStats.prefill_s`)."""
    kv_wait_s: float = 0.0
    """Time the step's requests waited for KV or in a queue before being scheduled (`StepStats.kv_wait_s`)."""
    handoff_wait_s: float = 0.0
    """Of `kv_wait_s`, D's wait after P's first token was streamed (`StepStats.handoff_wait_s`)."""
    itl_s: list[float]
    """Gaps between output tokens as the client received them (served: between the text chunks)."""
    wall_s: float
    """Client clock: the call to the step's end."""
    request_s: float = 0.0
    """Served: the `openai` client's own time from the call to its HTTP request sent (not in `ttft_s`)."""
    prompt_tokens: int
    new_tokens: int
    """Tokens this turn appended to the conversation (the user message and chat template)."""
    local_hit_tokens: int
    pulled_tokens: int
    computed_tokens: int
    output_tokens: int
    kv_bytes: int | None
    kv_transfer_s: float | None
    miss_reason: str | None
    prefill_engine: PrefillEngine | None
    """Where the new prompt tokens were computed (`StepStats.prefill_engine`): P, D alone, or None (one engine)."""
    placement_reason: str | None
    """Why there (`StepStats.placement_reason`)."""
    output_token_ids: list[int]
    prompt_digest: str
    """A digest of the prompt's token ids: on the same history every mode must give the model the same prompt."""
    load: int = 1
    """How many sessions of the mode ran in the turn's round (the load; src/agentkv/_bench/_population.py)."""
    start_s: float = 0.0
    """Client clock: from the run's first round to the call (turns overlap where their spans do)."""
    think_s: float = 0.0
    """The pause the session took before this turn (a tool's latency, a user's think time): drawn, then slept."""

    @property
    def worst_gap_s(self) -> float | None:
        """The turn's longest gap between output tokens (`itl_s`); None for an answer of one token."""
        return max(self.itl_s, default=None)

    @classmethod
    def from_stats(cls, stats: StepStats, **client_side: Any) -> TurnRecord:
        """The record of a turn's step: what the engine reported (``stats``) plus what the client measured.

        Fields named as in `StepStats` come from ``stats``, except ``ttft_s`` (here the client's,
        ``stats.ttft_s`` becomes `engine_ttft_s`) and any given in ``client_side``.
        """
        shared = (cls.model_fields.keys() & StepStats.model_fields.keys()) - client_side.keys() - {"ttft_s"}
        return cls(engine_ttft_s=stats.ttft_s, **stats.model_dump(include=shared), **client_side)


class FloorPoint(BaseModel):
    """One prefill measured for the floor: ``computed`` new tokens after ``context`` cached ones."""

    context: int
    computed: int
    ttft_s: float


class FloorFit(BaseModel):
    """Least time to compute a step's new tokens on one engine, measured over the run.

    ``a_s + b_s_per_token * n + c_s_per_attended * attended(n, context)``: a fixed cost per pass, a
    cost per token (the weights' work), and a cost per pair of (new token, token it attends to): new
    tokens attend to the whole history before them (docs/performance.md, "TTFT against the floor").
    With one-token steps measured (`fixed_s`), the fixed cost is theirs, not fitted (`a_measured`).
    """

    a_s: float
    b_s_per_token: float
    c_s_per_attended: float
    points: list[FloorPoint]
    a_measured: bool = False
    """``a_s`` is measured: the median TTFT of the one-token steps (`fixed_s`) less that one token's own cost; the
    fit gave only the costs per token. False: a least-squares intercept."""
    fixed_s: list[float] = Field(default_factory=list[float])
    """TTFTs of one-token steps (a one-token prompt, one token out) on the same engine: one forward pass."""

    @staticmethod
    def attended(new_tokens: int, context_tokens: int) -> float:
        """(new token, token it attends to) pairs: each new token sees the context and the new tokens before it."""
        return attended(new_tokens, context_tokens)

    @classmethod
    def fit(cls, points: Sequence[FloorPoint], fixed_s: Sequence[float] = ()) -> FloorFit:
        """`fit_compute` over the points (least squares, no coefficient below 0), with the fixed cost measured from
        ``fixed_s`` (one-token steps' TTFTs) when given."""
        cost = fit_compute((ComputePoint(p.computed, p.context, p.ttft_s) for p in points), fixed_s)
        return cls(
            a_s=cost.pass_s,
            b_s_per_token=cost.per_token_s,
            c_s_per_attended=cost.per_attended_s,
            points=list(points),
            a_measured=bool(fixed_s),
            fixed_s=list(fixed_s),
        )

    def floor_s(self, new_tokens: int, context_tokens: int, transfer_s: float | None) -> float:
        """Least TTFT of a step: compute only its new tokens over its history, plus the KV transfer it needed."""
        return (
            self.a_s
            + self.b_s_per_token * new_tokens
            + self.c_s_per_attended * self.attended(new_tokens, context_tokens)
            + (transfer_s or 0.0)
        )


class ModeSummary(BaseModel):
    """One mode over turns 2+ of every session."""

    mode: str
    steps: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    engine_ttft_mean_s: float
    client_over_engine_s: float
    """Mean of TTFT on the client clock minus the engine's own: what lies between the caller and the engine
    (the Session; for served also HTTP, the front door and the pool)."""
    second_token_mean_s: float | None
    """Mean time from the call to the answer's second token (TTFT plus the first gap): a pull pair streams
    P's token first and D's token comes second; a push pair's first two both come from D."""
    itl_p50_s: float | None
    itl_p90_s: float | None
    itl_p99_s: float | None
    steps_on_decode: int | None
    """Of `steps`, how many were prefilled on D alone; None when no step says where (one engine)."""
    ttft_vs_bidirectional: float | None
    """Mean TTFT of this mode / mean TTFT of bidirectional (>1: slower than push-back)."""
    ttft_vs_colocated: float | None
    """Mean TTFT of this mode / mean TTFT of colocated (>1: slower than one engine)."""
    itl_p50_vs_colocated: float | None
    """ITL p50 of this mode / ITL p50 of colocated."""
    reuse_ratio: float
    pulled_tokens: int
    computed_tokens: int
    kv_bytes: int | None
    """NIXL bytes of the mode's steps; None when some step's transfers overlapped another's
    (concurrent sessions): the engines' counters cannot be split between them."""
    kv_transfer_s: float | None
    output_tokens_per_s: float
    """Output tokens of all sessions / wall time of the rounds (sessions run concurrently)."""
    floor_mean_s: float | None
    ttft_over_floor: float | None
    overhead_vs_raw_s: float | None
    """Bidirectional only: its mean TTFT minus raw's (same pair, same push-back, no Session)."""
    overhead_vs_bidirectional_s: float | None = None
    """Served only: its mean TTFT minus bidirectional's (same pair, same prompts, through the front door)."""


class Population(BaseModel):
    """The bench's user population as drawn (src/agentkv/_bench/_population.py): when each session started and how
    long it paused before each later turn, in seconds, per load."""

    arrivals: str
    """``staggered`` (seeded starts, no barrier) or ``barrier`` (every session sends turn t together)."""
    arrival_mean_s: float | None
    """The mean gap between sessions' starts (staggered only)."""
    arrival_mean_measured: bool
    """The gap was half a solo turn measured at load 1 in this run (else given)."""
    think_mean_s: float
    """The think time's mean (lognormal, sigma 1); 0: none."""
    seed: int
    starts_s: dict[int, list[float]]
    """Per load: each session's start, from the round's start."""
    think_s: dict[int, list[list[float]]]
    """Per load, per session: the pause before each turn from the second."""
    arrival_gap_drawn_mean_s: float | None
    arrival_gap_drawn_p90_s: float | None
    think_drawn_mean_s: float | None
    think_drawn_p90_s: float | None


class Slo(BaseModel):
    """The objective a turn meets for goodput (src/agentkv/_bench/_goodput.py), from figures measured in the run:
    TTFT at most `ttft_factor` x the turn's floor (`FloorFit.floor_s` of its new tokens over its history, no
    transfer: the same for every mode) and its worst token gap at most `itl_factor` x the median token gap of a
    solo colocated session (turns 2+ at load 1)."""

    ttft_factor: float
    itl_factor: float
    itl_reference_s: float
    """The median gap between tokens of colocated's solo session."""
    itl_reference_gaps: int
    """How many gaps that median is over."""
    ttft_target_min_s: float
    ttft_target_max_s: float
    """The range of the TTFT targets over the turns judged (each turn's own floor times the factor)."""

    @property
    def itl_target_s(self) -> float:
        return self.itl_factor * self.itl_reference_s


class LoadRow(BaseModel):
    """One mode at one load, over turns 2+ of its sessions."""

    mode: str
    load: int
    steps: int
    ttft_p50_s: float
    ttft_p90_s: float
    itl_p50_s: float | None
    itl_p90_s: float | None
    itl_p99_s: float | None
    output_tokens_per_s: float
    """Output tokens of every turn (1+) over the time any of the mode's turns was in flight at that load."""
    good_steps: int | None
    """Of `steps`, how many met the SLO (`Slo`); None without one."""
    goodput: float | None
    """``good_steps / steps``."""
    gap_lost_steps: int | None = None
    """Of `steps`, how many met the TTFT objective and lost the turn on a token gap alone (what stalls cost, as
    against what queues cost); None without an objective."""


class BenchReport(BaseModel):
    """Everything one ``agentkv bench`` run measured.

    With several loads, `summaries` and `round_wall_s` are those of the lightest load; `load_rows` has every
    load's figures."""

    workload: str
    workload_description: str
    modes: list[str]
    sessions: int
    """The most sessions a mode ran at once (the only load, or the largest of `loads`)."""
    turns: int
    machine: dict[str, str | int]
    dtype: str | None
    """The dtype the bench started its engines with, as resolved (``"auto"`` becomes what it chose);
    None when the caller gave the engines."""
    floor: FloorFit | None
    records: list[TurnRecord]
    round_wall_s: dict[str, float]
    summaries: list[ModeSummary]
    answers_agree: dict[str, bool]
    """Per mode: its greedy answers equal bidirectional's, token for token, on every turn."""
    loads: list[int] = Field(default_factory=list)
    """Each load the modes ran at (sessions at once), ascending."""
    population: Population | None = None
    slo: Slo | None = None
    slo_note: str | None = None
    """Why there is no `slo` (what the run lacked to measure it)."""
    load_rows: list[LoadRow] = Field(default_factory=list)
    """Per mode, per load (the modes' order, then ascending loads)."""
    after_pause: list[AfterPause] = Field(default_factory=list)
    """Per pair mode, its steps after a pause at the lightest load: their KV wait (src/agentkv/_bench/_after_pause.py)."""
    probes: list[ModeProbes] = Field(default_factory=list)
    """Per pair mode that pushes back, the probes run after its workload (``probes=True``)."""
    pin_ttl_s: float | None = None
    """The pin TTL the bench gave every pair it started; None: the pairs' default (or the given engines')."""
    compiled: bool = False
    """Every engine the bench started compiled its model (``--compiled``) instead of running eager on a CPU."""
    block_size: int | None = None
    """The KV block size every engine the bench started kept (``--block-size``); None: vLLM's own."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (1-99) of ``values``, inclusive method; the value itself when there is one."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


_Number = TypeVar("_Number", int, float)


def _total(values: Sequence[_Number | None]) -> _Number | None:
    """The sum, or None if any value is unknown."""
    known = [value for value in values if value is not None]
    return sum(known[1:], known[0]) if known and len(known) == len(values) else None


def summarize(
    records: Sequence[TurnRecord], round_wall_s: dict[str, float], floor: FloorFit | None
) -> list[ModeSummary]:
    """Per-mode figures over turns 2+ (turn 1 has nothing to reuse in any mode)."""
    modes = list(dict.fromkeys(r.mode for r in records))
    later = {mode: [r for r in records if r.mode == mode and r.turn > 1] for mode in modes}
    means = {mode: statistics.fmean(r.ttft_s for r in rows) for mode, rows in later.items() if rows}
    itls = {mode: [gap for r in rows for gap in r.itl_s] for mode, rows in later.items()}
    itl_p50 = {mode: percentile(gaps, 50) for mode, gaps in itls.items() if gaps}
    summaries = []
    for mode, rows in later.items():
        if not rows:
            continue
        ttfts = [r.ttft_s for r in rows]
        floors = (
            [floor.floor_s(r.new_tokens, r.prompt_tokens - r.new_tokens, r.kv_transfer_s) for r in rows]
            if floor
            else None
        )
        every = [r for r in records if r.mode == mode]
        gaps = itls[mode]
        placed = [r.prefill_engine for r in rows if r.prefill_engine is not None]
        summaries.append(
            ModeSummary(
                mode=mode,
                steps=len(rows),
                ttft_mean_s=means[mode],
                ttft_p50_s=percentile(ttfts, 50),
                ttft_p90_s=percentile(ttfts, 90),
                engine_ttft_mean_s=statistics.fmean(r.engine_ttft_s for r in rows),
                client_over_engine_s=statistics.fmean(r.ttft_s - r.engine_ttft_s for r in rows),
                second_token_mean_s=statistics.fmean(seconds) if (seconds := _second_tokens(rows)) else None,
                itl_p50_s=itl_p50.get(mode),
                itl_p90_s=percentile(gaps, 90) if gaps else None,
                itl_p99_s=percentile(gaps, 99) if gaps else None,
                steps_on_decode=placed.count("decode") if placed else None,
                ttft_vs_bidirectional=_ratio(means, mode, "bidirectional"),
                ttft_vs_colocated=_ratio(means, mode, "colocated"),
                itl_p50_vs_colocated=_ratio(itl_p50, mode, "colocated"),
                reuse_ratio=sum(r.local_hit_tokens + r.pulled_tokens for r in rows)
                / sum(r.prompt_tokens for r in rows),
                pulled_tokens=sum(r.pulled_tokens for r in rows),
                computed_tokens=sum(r.computed_tokens for r in rows),
                kv_bytes=_total([r.kv_bytes for r in rows]),
                kv_transfer_s=_total([r.kv_transfer_s for r in rows]),
                output_tokens_per_s=sum(r.output_tokens for r in every) / round_wall_s[mode],
                floor_mean_s=statistics.fmean(floors) if floors else None,
                ttft_over_floor=statistics.fmean(t / f for t, f in zip(ttfts, floors, strict=True)) if floors else None,
                overhead_vs_raw_s=means[mode] - means["raw"] if "raw" in means and mode == "bidirectional" else None,
                overhead_vs_bidirectional_s=(
                    means[mode] - means["bidirectional"] if "bidirectional" in means and mode == "served" else None
                ),
            )
        )
    return summaries


def _second_tokens(rows: Sequence[TurnRecord]) -> list[float]:
    return [r.ttft_s + r.itl_s[0] for r in rows if r.itl_s]


def _ratio(values: dict[str, float], mode: str, reference: str) -> float | None:
    """``values[mode] / values[reference]``, or None when either is missing (or the reference is 0)."""
    if mode not in values or not values.get(reference):
        return None
    return values[mode] / values[reference]


def first_prompt_divergence(records: Sequence[TurnRecord]) -> str | None:
    """Where a mode first gave the model another prompt than bidirectional on the same history, or None.

    A session's turns are compared until its answer differs from bidirectional's (possible outside
    float32: the next prompts then differ rightly).
    """
    reference = {(r.load, r.session, r.turn): r for r in records if r.mode == "bidirectional"}
    ordered = sorted(
        (r for r in records if r.mode != "bidirectional"), key=lambda r: (r.mode, r.load, r.session, r.turn)
    )
    several = len({r.load for r in records}) > 1
    diverged: set[tuple[str, int, int]] = set()
    for record in ordered:
        same = reference.get((record.load, record.session, record.turn))
        if same is None or (record.mode, record.load, record.session) in diverged:
            continue
        if record.prompt_digest != same.prompt_digest:
            why = f", miss_reason {record.miss_reason}" if record.miss_reason else ""
            load = f" at load {record.load}" if several else ""
            return (
                f"{record.mode}, session {record.session}{load}, turn {record.turn}: a prompt of "
                f"{record.prompt_tokens} tokens{why}, against bidirectional's of {same.prompt_tokens}"
            )
        if record.output_token_ids != same.output_token_ids:
            diverged.add((record.mode, record.load, record.session))
    return None
