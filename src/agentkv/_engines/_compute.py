"""What a prefill costs: the model a pair places steps by (`PlacementCosts`) and the bench's floor fits.

A prefill of ``n`` new tokens after ``context`` cached ones takes

    pass_s + per_token_s * n + per_attended_s * attended(n, context)

a fixed cost per forward pass, the weights' work per token, and attention: each new token attends
to the context and to the new tokens before it (docs/performance.md, "TTFT against the floor").
The last term is why the same number of tokens costs more late in a conversation than early,
and why the tokens a step on D alone recomputes (the pin's last partial block, at the end of the
history) cost more than an average token of the step.

`fit_compute` fits the three by least squares with none below 0; `ComputeModel` refits them from a
pair's own recent prefills as they finish.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["ComputeCost", "ComputeModel", "ComputePoint", "attended", "fit_compute"]


def attended(new_tokens: float, context_tokens: float) -> float:
    """(new token, token it attends to) pairs: each new token sees the context and the new tokens before it."""
    return new_tokens * (context_tokens + new_tokens / 2)


class ComputePoint(NamedTuple):
    """One prefill measured: ``computed`` new tokens after ``context`` cached ones took ``seconds``."""

    computed: int
    context: int
    seconds: float


@dataclass(frozen=True)
class ComputeCost:
    """The time a prefill computes, in seconds: see the module's docstring."""

    pass_s: float
    per_token_s: float
    per_attended_s: float

    def seconds(self, computed: int, context: int) -> float:
        """Time to compute ``computed`` new tokens after ``context`` cached ones."""
        if computed <= 0:
            return 0.0
        return self.pass_s + self.added_s(computed, context)

    def added_s(self, computed: int, context: int) -> float:
        """What the same tokens add to a forward pass that runs anyway (one over other requests' tokens)."""
        return self.per_token_s * max(0, computed) + self.per_attended_s * attended(max(0, computed), context)


def fit_compute(points: Iterable[ComputePoint], one_token_s: Sequence[float] = ()) -> ComputeCost:
    """Least squares over ``points`` with no coefficient below 0: a term that noise fits below 0 is dropped (taken
    as 0) and the others are fitted again without it. Only the terms the points tell apart are fitted, the cost per
    token first, then the pass's (two prefills of different sizes), then attention's. No point: a cost of 0.

    With ``one_token_s`` (one-token prefills' times: a forward pass each), the fixed cost is measured: a one-token
    prefill is pinned to their median ``m``, the costs per token are fitted on what each point took beyond it, and
    ``pass_s`` is ``m`` less that one token's share, at least 0."""
    import numpy as np  # vLLM's dependency

    rows = [(1.0, float(p.computed), attended(p.computed, p.context), p.seconds) for p in points]
    if not rows:
        return ComputeCost(0.0, 0.0, 0.0)
    table = np.array(rows)
    design, times = table[:, :3], table[:, 3]
    kept = [0, 1, 2]
    if one_token_s:
        one = statistics.median(one_token_s)
        design = design - np.array([1.0, 1.0, attended(1, 0)])  # beyond a one-token prefill
        times = times - one
        kept = [1, 2]
    kept = _separable(design, [term for term in (1, 0, 2) if term in kept])
    coefficients = np.zeros(3)
    while kept:
        scale = np.linalg.norm(design[:, kept], axis=0)  # columns of one size: no term wins a near-tie by its units
        scale[scale == 0] = 1.0
        solution, *_ = np.linalg.lstsq(design[:, kept] / scale, times, rcond=None)
        solution = solution / scale
        if (solution >= 0).all():
            coefficients[kept] = solution
            break
        del kept[int(np.argmin(solution))]
    a, b, c = (float(value) for value in coefficients)
    if one_token_s:
        a = max(0.0, one - b - c * attended(1, 0))
    return ComputeCost(pass_s=a, per_token_s=b, per_attended_s=c)


def _separable(design: Any, terms: list[int]) -> list[int]:
    """Of ``terms`` (columns of ``design``, in order of preference), those each of which the points tell apart from
    the ones before it: a column that adds no rank (within 1%, columns scaled alike) would be fitted on noise."""
    import numpy as np

    kept: list[int] = []
    for term in terms:
        columns = design[:, [*kept, term]]
        norms = np.linalg.norm(columns, axis=0)
        if (norms > 0).all() and np.linalg.matrix_rank(columns / norms, tol=1e-2) == len(kept) + 1:
            kept.append(term)
    return kept


_WINDOW = 24
"""Prefills a `ComputeModel` fits over: the most recent, so that the fit follows the engines' state."""


class ComputeModel:
    """A pair's cost of compute, refitted (`fit_compute`) over its latest prefills on either engine.

    P and D run the same model with the same engine arguments, so one fit serves both, and a step placed on
    one engine teaches the cost of the other: a pair that has placed every step on D still knows what P
    would take. Where P and D run on different kinds of device the fit is their blend; what differs by a
    constant (P's hop, D's cache lookups) is each placement's own overhead (`PlacementCosts.overhead_s`).
    Only prefills that ran alone on their engine teach it: one that shared its passes with other prefills
    reports their compute as its own. Answers decoding on D share a prefill's passes there too, but add one
    token each to a pass of hundreds: those still teach. The warm-up leaves two short prefills, whose sizes tell
    the pass from the tokens only as well as their noise allows; a conversation's first step (on P: no pin yet)
    adds a long one before any step of it can be placed.
    """

    def __init__(self, prior: ComputeCost | None = None) -> None:
        self.cost = prior or ComputeCost(pass_s=0.0, per_token_s=2e-3, per_attended_s=0.0)
        """The current fit; the prior until the first prefill is observed."""
        self._points: collections.deque[ComputePoint] = collections.deque(maxlen=_WINDOW)

    def observe(self, point: ComputePoint) -> None:
        """Add a prefill that ran alone on its engine and refit."""
        if point.computed <= 0 or point.seconds <= 0:
            return
        self._points.append(point)
        self.cost = fit_compute(self._points)

    def seconds(self, computed: int, context: int) -> float:
        return self.cost.seconds(computed, context)

    def __len__(self) -> int:
        return len(self._points)
