"""TTFT and reuse per turn, one line per mode (matplotlib, from the ``plot`` extra).

Plots know points, not stats: `plot_stats` (in `._stats`) turns sessions into points and loads this
module when it is called, so matplotlib stays optional.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["TurnPoint", "plot_turns"]

TurnPoint = tuple[int, float, float]
"""(turn, TTFT in seconds, share of the prompt whose KV was reused)."""


def plot_turns(series: Mapping[str, Sequence[TurnPoint]], *, title: str, path: str | Path | None = None) -> Figure:
    """Two panels: TTFT per turn and reuse per turn, one line per series; saved as PNG if ``path``."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'agentkv-vllm[plot]'") from exc

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
