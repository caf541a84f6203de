"""TTFT and reuse per turn, one line per mode (matplotlib, from the ``plot`` extra).

Plots read stats, never the reverse: this module imports `._stats`; `._stats` imports no
agentkv module at import time (`SessionStats.plot` loads this one when it is called).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import UserError
from ._stats import SessionStats

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["TurnPoint", "plot_stats", "plot_turns"]

TurnPoint = tuple[int, float, float]
"""(turn, TTFT in seconds, share of the prompt whose KV was reused)."""


def plot_turns(series: Mapping[str, Sequence[TurnPoint]], *, title: str, path: str | Path | None = None) -> Figure:
    """Two panels: TTFT per turn and reuse per turn, one line per series; saved as PNG if ``path``."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'agentkv[plot]'") from exc

    class NotebookFigure(Figure):
        """A Figure that a notebook shows as PNG, with or without pyplot's inline backend."""

        def _repr_png_(self) -> bytes:
            buffer = io.BytesIO()
            self.savefig(buffer, format="png", dpi=90)
            return buffer.getvalue()

    figure = NotebookFigure(figsize=(11, 4.2))  # not pyplot: no global state, no display backend needed
    left, right = figure.subplots(1, 2)
    for label, points in series.items():
        turns = [turn for turn, _, _ in points]
        left.plot(turns, [ttft for _, ttft, _ in points], marker="o", label=label)
        right.plot(turns, [100 * reuse for _, _, reuse in points], marker="o", label=label)
    left.set(xlabel="turn", ylabel="TTFT (s)", title="Time to first token")
    right.set(xlabel="turn", ylabel="prompt KV reused (%)", title="Reuse: (local + pulled) / prompt", ylim=(0, 105))
    for axes in (left, right):
        axes.grid(alpha=0.3)
        axes.xaxis.get_major_locator().set_params(integer=True)
    left.legend(fontsize="small")
    figure.suptitle(title, fontsize="medium")
    figure.tight_layout()
    if path is not None:
        figure.savefig(Path(path), dpi=110)
    return figure


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
    series = {name: [(t.turn, t.ttft_s, t.reuse_ratio) for t in s.turns] for name, s in zip(names, stats, strict=True)}
    return plot_turns(series, title="agentkv: " + ", ".join(names), path=path)
