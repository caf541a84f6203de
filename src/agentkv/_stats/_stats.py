"""Per-step, per-turn and per-session statistics (pydantic models).

Near the bottom of the house: this module imports only the error tree; the layers above build these
models (the session) or read them (the benchmark). `plot_stats` loads the drawing module
(``._plots``), and matplotlib with it, only when it is called (both are optional).

Where each number comes from is documented on its field. Invariant on every step:
``local_hit_tokens + pulled_tokens + computed_tokens == prompt_tokens``.
"""

from __future__ import annotations

import csv
import html
import io
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, computed_field, model_validator

from .._errors import UserError

__all__ = ["MissReason", "SessionStats", "StepMeasurements", "StepStats", "TurnStats", "plot_stats", "text_table"]

MissReason = Literal[
    "no_handle", "push_back_off", "expired", "prefix_mismatch", "declined", "evicted", "below_threshold", "resumed"
]
"""Why a step reused no KV from D:

* ``no_handle``: there was no pin to push back (first step, after a rewind or fork, D returned none, or the pin's
  renewal failed);
* ``push_back_off``: the session's mode does not push handles back (disaggregated, colocated);
* ``expired``: the pin was expired or too close to expiry to be read safely;
* ``prefix_mismatch``: the new prompt does not extend the pinned tokens exactly (edited history);
* ``declined``: the handle was forwarded but P could not read D's blocks; P recomputed;
* ``evicted``: D's cache was full, and the pair had released this conversation's pin (the least recently
  pinned) to make room for others; P recomputed;
* ``below_threshold``: what was left to pull after P's own cache hit was under the engine's threshold;
* ``resumed``: the first step of a session restored from a `SessionSnapshot` (e.g. after a server restart):
  no KV was kept, the saved tokens were computed once.
"""


class StepMeasurements(BaseModel):
    """What an engine measured of one step: where its time went and where its prompt KV came from.

    Declared once for the engine's report (`agentkv.engines.StepTimings`) and the user's (`StepStats`,
    which adds the session's own fields). Token counts are those of the engine that prefilled the
    prompt (P in a pair). Every field documents its source; None means the source did not report it.
    """

    ttft_s: float
    """Client clock (``time.perf_counter``): step submitted -> its first output token (on a pair, P's sampled
    token when it can serve as the first, else D's)."""
    prefill_s: float | None = None
    """Prefilling engine's ``first_token_ts - scheduled_ts`` (vLLM ``RequestStateStats``): compute only."""
    kv_wait_s: float = 0.0
    """``scheduled_ts - queued_ts`` summed over the step's requests: waiting for KV (and any queue)."""
    handoff_wait_s: float = 0.0
    """Of `kv_wait_s`, the part after the step's first token: D's wait for the KV P computed, when P's sampled
    token was streamed as the answer's first (it delays the second token, not the first). 0 when the first token
    came after every wait (one engine, D alone, or D's own first token): `kv_wait_s` less this is the wait before
    the first token."""
    decode_s: float | None = None
    """Decoding engine's ``last_token_ts - first_token_ts``."""
    local_hit_tokens: int = 0
    """KV found in the prefilling engine's own prefix cache (vLLM ``PrefillStats.num_local_cached_tokens``)."""
    pulled_tokens: int = 0
    """KV pulled back from D over NIXL (vLLM ``PrefillStats.num_external_cached_tokens`` on P)."""
    computed_tokens: int = 0
    """KV computed by the prefilling engine (vLLM ``PrefillStats.num_computed_tokens``)."""
    handoff_tokens: int = 0
    """KV D pulled from P before decoding (vLLM ``PrefillStats`` on D); 0 for colocated engines."""
    kv_bytes: int | None = None
    """NIXL bytes moved for this step, both directions (stat loggers on P and D, while this step was the only
    one in flight on the engine); None if shared."""
    kv_transfer_s: float | None = None
    """NIXL transfer time for this step (same source and attribution as `kv_bytes`)."""
    prefill_engine: Literal["prefill", "decode"] | None = None
    """Where the new prompt tokens were computed: ``"prefill"`` (P, with push-back when a pin was
    forwarded) or ``"decode"`` (D alone, from its own cache of the pinned conversation: mode ``"auto"``);
    None on a single engine. On D, `local_hit_tokens` are D's cache hits."""
    placement_reason: str | None = None
    """Why the step ran where it did (mode ``"auto"``: the two estimates it compared)."""


class StepStats(StepMeasurements):
    """One model call: the engine's measurements (`StepMeasurements`) and the session's view of the step."""

    model_config = ConfigDict(frozen=True)

    turn: int
    """Turn number in the session, from 1."""
    step: int
    """Step number in the turn, from 1."""
    prompt_tokens: int
    """Tokens in the prompt of this model call (the whole conversation so far)."""
    output_tokens: int
    """Tokens generated."""
    handle_forwarded: bool = False
    """Whether D's handle was pushed back to the pair for this step."""
    miss_reason: MissReason | None = None
    """Why no KV was pulled back from D, when none was (see `MissReason`)."""
    tool_s: float = 0.0
    """Wall time of the tools this step called (client clock)."""
    duration_s: float | None = None
    """Client clock: step submitted -> its end (the engine's last output token); None where not measured."""

    @model_validator(mode="after")
    def _tokens_add_up(self) -> StepStats:
        total = self.local_hit_tokens + self.pulled_tokens + self.computed_tokens
        if total != self.prompt_tokens:
            raise ValueError(
                f"local {self.local_hit_tokens} + pulled {self.pulled_tokens} + computed "
                f"{self.computed_tokens} != prompt {self.prompt_tokens}"
            )
        return self

    @computed_field  # type: ignore[prop-decorator]
    @property
    def reuse_ratio(self) -> float:
        """Share of the prompt whose KV was not computed: (local + pulled) / prompt."""
        return (self.local_hit_tokens + self.pulled_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> str:
        """One line: TTFT, where each prompt token's KV came from, and why it was not reused if so."""
        return (
            f"ttft {self.ttft_s:.3f} s | prompt {self.prompt_tokens} = local {self.local_hit_tokens}"
            f" + pulled {self.pulled_tokens} + computed {self.computed_tokens} | {self.miss_reason or 'reused'}"
        )


class TurnStats(BaseModel):
    """One turn: a user message until the final answer."""

    model_config = ConfigDict(frozen=True)

    turn: int
    steps: list[StepStats]
    wall_s: float
    """Client clock: the whole turn, tools included."""
    pin_renewals: int = 0
    """How many times the session renewed its pin on D before the turn, while it waited for its caller (after the
    turn before, and between the turn's `Session.step` calls): each a one-token step that kept the conversation's
    KV pinned past the pin's TTL (``Session(renew_pins=...)``)."""
    repins: int = 0
    """How many times the session pinned its conversation again on D before the turn: the step before had ended at
    a stop string, so D pinned nothing, and a one-token step on D made a pin from D's prefix cache
    (``Session(renew_pins=...)``)."""
    early_transfers: int = 0
    """How many times the session moved its pin's KV into P's prefix cache before the turn, while it waited for its
    caller: a one-token step given the pin and placed on P, so that the turn's first step pulls almost nothing
    (``Session(early_transfer=...)``)."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ttft_s(self) -> float:
        """TTFT of the turn's first step: what a user waits for before anything appears."""
        return self.steps[0].ttft_s if self.steps else 0.0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def pulled_tokens(self) -> int:
        """Tokens pulled back from D over the turn's steps."""
        return sum(step.pulled_tokens for step in self.steps)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def computed_tokens(self) -> int:
        """Prompt tokens computed over the turn's steps."""
        return sum(step.computed_tokens for step in self.steps)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def reuse_ratio(self) -> float:
        """Share of all prompt tokens of the turn whose KV was reused."""
        prompt = sum(step.prompt_tokens for step in self.steps)
        return 1 - self.computed_tokens / prompt if prompt else 0.0


class SessionStats(BaseModel):
    """Every turn of a session, with aggregates."""

    model_config = ConfigDict(frozen=True)

    mode: str
    turns: list[TurnStats]

    @property
    def steps(self) -> list[StepStats]:
        """Every step of every turn, in order."""
        return [step for turn in self.turns for step in turn.steps]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def mean_ttft_s(self) -> float | None:
        """Mean TTFT over all steps."""
        return statistics.fmean(s.ttft_s for s in self.steps) if self.steps else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def mean_ttft_after_first_turn_s(self) -> float | None:
        """Mean TTFT over the steps of turns 2+: where reuse can happen."""
        later = [s.ttft_s for turn in self.turns[1:] for s in turn.steps]
        return statistics.fmean(later) if later else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def reuse_ratio(self) -> float:
        """Share of all prompt tokens whose KV was reused."""
        prompt = sum(s.prompt_tokens for s in self.steps)
        return 1 - sum(s.computed_tokens for s in self.steps) / prompt if prompt else 0.0

    def rows(self) -> list[dict[str, Any]]:
        """One flat dict per step (for CSV, pandas, plotting)."""
        return [{"mode": self.mode, "turn": step.turn, "step": step.step, **step.model_dump()} for step in self.steps]

    def to_json(self, *, indent: int | None = 2) -> str:
        """Every turn and step, with aggregates, as JSON."""
        return self.model_dump_json(indent=indent)

    def to_csv(self) -> str:
        """One CSV row per step."""
        rows = self.rows()
        buffer = io.StringIO()
        if rows:
            writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        return buffer.getvalue()

    def table(self) -> str:
        """A plain-text table, one line per step."""
        header = ("turn", "step", "prompt", "local", "pulled", "computed", "out", "ttft_s", "miss")
        rows = (
            (
                str(s.turn),
                str(s.step),
                str(s.prompt_tokens),
                str(s.local_hit_tokens),
                str(s.pulled_tokens),
                str(s.computed_tokens),
                str(s.output_tokens),
                f"{s.ttft_s:.3f}",
                s.miss_reason or "-",
            )
            for s in self.steps
        )
        return text_table(header, rows)

    def plot(self, *, path: str | Path | None = None) -> Any:
        """TTFT and reuse per turn as a matplotlib ``Figure`` (shown by a notebook; PNG if ``path``).

        The same as ``agentkv.plot_stats(self)``, which also compares sessions (say, one per mode)
        in one figure: ``agentkv.plot_stats(a.stats, b.stats)``.
        """
        return plot_stats(self, path=path)

    def _repr_html_(self) -> str:
        head = "".join(
            f"<th>{name}</th>"
            for name in ("turn", "step", "prompt", "local", "pulled", "computed", "out", "TTFT (s)", "reuse", "miss")
        )
        body = "".join(
            f"<tr><td>{s.turn}</td><td>{s.step}</td><td>{s.prompt_tokens}</td><td>{s.local_hit_tokens}</td>"
            f"<td>{s.pulled_tokens}</td><td>{s.computed_tokens}</td><td>{s.output_tokens}</td>"
            f"<td>{s.ttft_s:.3f}</td><td>{s.reuse_ratio:.0%}</td><td>{html.escape(s.miss_reason or '')}</td></tr>"
            for s in self.steps
        )
        return f"<table><caption>agentkv session ({html.escape(self.mode)})</caption><tr>{head}</tr>{body}</table>"


def text_table(header: Sequence[str], rows: Iterable[Sequence[str]], *, left_columns: int = 0) -> str:
    """Cells padded to their column's widest, a rule under the header; numbers align right.

    The first ``left_columns`` columns (labels) align left. A dozen lines of our own rather than
    a table library: agentkv's two tables (this one and the benchmark's) need nothing more.
    """
    lines = [tuple(header), *(tuple(row) for row in rows)]
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]

    def render(line: Sequence[str]) -> str:
        cells = [
            cell.ljust(width) if column < left_columns else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    rule = "-" * len(render(lines[0]))
    return "\n".join([render(lines[0]), rule, *(render(line) for line in lines[1:])])


def plot_stats(*stats: SessionStats, labels: Sequence[str] | None = None, path: str | Path | None = None) -> Any:
    """TTFT and reuse per turn of one or more sessions (e.g. the same conversation in each mode).

    Each session is labelled with its mode unless ``labels`` are given. Returns the
    matplotlib ``Figure`` (a notebook shows it); ``path`` also saves it as PNG.
    """
    if not stats:
        raise UserError("plot_stats needs at least one SessionStats")
    names = list(labels) if labels is not None else [s.mode for s in stats]
    if len(names) != len(stats):
        raise UserError(f"one label per session: {len(stats)} session(s), {len(names)} label(s)")
    if len(set(names)) != len(names):
        raise UserError(f"two sessions would share a label ({', '.join(names)}): pass labels=[...], one per session")
    from ._plots import plot_turns  # on call: matplotlib is optional

    series = {name: [(t.turn, t.ttft_s, t.reuse_ratio) for t in s.turns] for name, s in zip(names, stats, strict=True)}
    return plot_turns(series, title="agentkv: " + ", ".join(names), path=path)
