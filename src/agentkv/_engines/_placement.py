"""Per-step placement: prefill a step on P with push-back, or on D alone from D's own cache.

D holds every pinned conversation in its prefix cache, but a cache keeps whole blocks
only: a step prefilled on D recomputes the pin's last partial block (up to 127 tokens on
CPU) and the new tokens, with no P hop and no transfers. A step on P computes only the new
tokens but pays the hop: P's scheduling, P's pull from D, D's pull from P. Which is faster
depends on the step and the machine, so `PlacementCosts` learns both from the pair's own
steps (calibrated by the warm-up, updated by every step) and compares the estimates: the
compute of each (src/agentkv/_engines/_compute.py: the recomputed block sits at the end of the
history, where a token costs the most) and each placement's overhead.

Without an objective (a pair's ``slo=None``), D takes a step only while it has nothing else in
flight: prefilling on D stalls the decodes of other conversations, which is what disaggregation
exists to prevent. With one (every pair's default), what is in flight on each engine is weighed
against it instead: `choose_within_slo` in src/agentkv/_engines/_slo.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ._compute import ComputeModel, ComputePoint

__all__ = ["Placement", "PlacementChoice", "PlacementCosts", "PrefillEngine"]

Placement = Literal["prefill", "decode", "auto"]
"""Where a pair prefills a step: on P (``"prefill"``, the protocol), on D alone from its own cache
(``"decode"``), or where its measured costs say is faster (``"auto"``)."""

PrefillEngine = Literal["prefill", "decode"]
"""The engine of a pair that computed a step's new prompt tokens."""

_SMOOTHING = 0.3
"""Weight of the newest observation in each running estimate."""
_MIN_TOKENS_FOR_GAP = 8
"""A step teaches D's token gap only when its answer has at least this many tokens."""


@dataclass(frozen=True)
class PlacementChoice:
    """Where a step is prefilled, and why (the step's ``placement_reason``)."""

    engine: PrefillEngine
    reason: str


@dataclass
class PlacementCosts:
    """Running estimates of time to first token on each placement: the step's compute (`ComputeModel`, shared by
    both engines) plus the placement's own overhead (P: scheduling and the pulls; D: little).

    The priors (0.1 s of overhead on P, 2 ms per token) only matter until the warm-up's steps replace them.
    """

    overhead_s: dict[PrefillEngine, float] = field(default_factory=lambda: {"prefill": 0.1, "decode": 0.02})
    """What a step's time to first token takes beyond its compute, by engine: the running mean of what steps took
    beyond the compute model's estimate (their queue left out)."""
    compute: ComputeModel = field(default_factory=ComputeModel)
    gap_s: float = 0.0
    """D's gap between two tokens of an answer (its forward pass over the decodes in flight): the running mean
    of steps' mean gaps. A prefill on D lengthens the pass its decodes wait for by its own compute, so a decode's
    gap then is this plus the prefill's (`agentkv._engines._slo.choose_within_slo`)."""
    _seen: set[tuple[str, PrefillEngine]] = field(default_factory=set[tuple[str, PrefillEngine]])

    def compute_s(self, computed_tokens: int, context_tokens: int) -> float:
        """Estimated compute of a prefill of ``computed_tokens`` after ``context_tokens`` cached ones (either engine)."""
        return self.compute.seconds(computed_tokens, context_tokens)

    def added_s(self, computed_tokens: int, context_tokens: int) -> float:
        """What such a prefill adds to a forward pass that runs anyway: on D, the pass over its decodes."""
        return self.compute.cost.added_s(computed_tokens, context_tokens)

    def estimate(self, engine: PrefillEngine, computed_tokens: int, context_tokens: int) -> float:
        """Estimated time to first token for a step that computes ``computed_tokens`` after ``context_tokens`` on
        ``engine``."""
        return self.overhead_s[engine] + self.compute_s(computed_tokens, context_tokens)

    def observe(
        self,
        engine: PrefillEngine,
        *,
        computed_tokens: int,
        context_tokens: int,
        ttft_s: float,
        prefill_s: float | None,
        alone: bool = True,
        decode_s: float | None = None,
        output_tokens: int = 0,
    ) -> None:
        """Learn from a finished step: its compute (when its prefill ran ``alone`` on its engine), the rest of its
        time to first token, and (from an answer of `_MIN_TOKENS_FOR_GAP` tokens or more) D's gap between tokens."""
        if decode_s is not None and output_tokens >= _MIN_TOKENS_FOR_GAP:
            self.gap_s = self._blend("gap", "decode", self.gap_s, decode_s / (output_tokens - 1))
        if prefill_s is not None and alone:
            self.compute.observe(ComputePoint(computed_tokens, context_tokens, prefill_s))
        overhead = max(0.0, ttft_s - self.compute_s(computed_tokens, context_tokens))
        self.overhead_s[engine] = self._blend("overhead", engine, self.overhead_s[engine], overhead)

    def _blend(self, what: str, engine: PrefillEngine, current: float, new: float) -> float:
        """The first observation replaces the prior; later ones move the estimate by `_SMOOTHING`."""
        if (what, engine) not in self._seen:
            self._seen.add((what, engine))
            return new
        return (1 - _SMOOTHING) * current + _SMOOTHING * new

    def choose(
        self, *, prompt_tokens: int, held_tokens: int, block_size: int, decode_in_flight: int, prefill_in_flight: int
    ) -> PlacementChoice:
        """P or D for a step whose prompt extends the ``held_tokens`` that D pins."""
        if decode_in_flight:
            return PlacementChoice("prefill", f"D busy ({decode_in_flight} in flight)")
        on_decode_context = held_tokens // block_size * block_size
        on_prefill = prompt_tokens - held_tokens
        on_decode = prompt_tokens - on_decode_context
        if prefill_in_flight:
            return PlacementChoice("decode", f"P busy ({prefill_in_flight} in flight), D idle: {on_decode} tokens on D")
        via_prefill = self.estimate("prefill", on_prefill, held_tokens)
        via_decode = self.estimate("decode", on_decode, on_decode_context)
        engine: PrefillEngine = "decode" if via_decode <= via_prefill else "prefill"
        return PlacementChoice(
            engine, f"estimated D {via_decode:.3f} s ({on_decode} tokens), P {via_prefill:.3f} s ({on_prefill} tokens)"
        )
