"""What the bench reports on issue 30's targets (pydantic, written in the JSON): the KV wait of the steps after a
pause per mode (`AfterPause`, src/agentkv/_bench/_after_pause.py) and the probes run after a pair mode's workload
(`ModeProbes`, src/agentkv/_bench/_probes.py). A leaf module: src/agentkv/_bench/_records.py's report holds them."""

from __future__ import annotations

from pydantic import BaseModel

__all__ = [
    "KV_WAIT_TARGET_S",
    "EARLY_RATIO_TARGET",
    "PIN_TTL_RATIO_TARGET",
    "AfterPause",
    "ModeProbes",
    "PinTtlProbe",
    "StopProbe",
]

KV_WAIT_TARGET_S = 0.005
"""The most KV wait before its first token a step after a pause may have on average once early transfer moves the
KV during the pause."""
EARLY_RATIO_TARGET = 0.75
"""The most ``bidirectional-early``'s mean TTFT of the steps after a pause may be over bidirectional's (coding)."""
PIN_TTL_RATIO_TARGET = 1.1
"""The most a turn after a pause longer than the pin TTL may take over the same turn after a short pause."""


class AfterPause(BaseModel):
    """One mode's steps that followed a pause (turns after the first whose think time was above 0), at the run's
    lightest load (under load, the wait includes the queue behind other sessions' steps)."""

    mode: str
    steps: int
    think_mean_s: float
    """The mean pause before these steps."""
    ttft_mean_s: float
    kv_wait_mean_s: float
    """Mean `TurnRecord.kv_wait_s`: the time the step's requests waited to be scheduled, mostly for KV
    (`StepStats.kv_wait_s`: P for D's blocks, D for P's, summed)."""
    kv_wait_max_s: float
    first_token_wait_mean_s: float
    """Mean of the part of `kv_wait_mean_s` before the step's first token (`TurnRecord.kv_wait_s` less
    `TurnRecord.handoff_wait_s`): P's wait for the pinned KV the pause left to move, and any queue. The target
    (`KV_WAIT_TARGET_S`) is on this: D's read of the KV P computes at the step comes after P's first token was
    streamed, and no move during the pause can make it (that KV does not exist before the step)."""
    first_token_wait_max_s: float
    handoff_wait_mean_s: float
    """Mean `TurnRecord.handoff_wait_s`: D's wait for P's KV after the first token (it delays the second)."""
    kv_transfer_mean_s: float | None
    """Mean NIXL transfer time of these steps (`StepStats.kv_transfer_s`); None when some step's was not
    attributable (another step in flight on the engine)."""
    pulled_tokens_mean: float
    """Mean tokens pulled back from D at the step (what the pause left to move on the step's critical path)."""


class StopProbe(BaseModel):
    """A turn ended by a stop string, then the next turn: does the next step still pull D's KV back?"""

    stop: str | None
    """The stop string (a word from the middle of the same prompt's answer without stop); None: none ended it."""
    note: str | None = None
    """Why there is no measurement (no word that ends the answer early), when there is none."""
    full_output_tokens: int
    """The answer's length without the stop string."""
    stopped_output_tokens: int | None = None
    next_pulled_tokens: int | None = None
    """The next step's tokens pulled back from D (target: above 0)."""
    next_miss_reason: str | None = None
    next_prefill_engine: str | None = None
    next_ttft_s: float | None = None
    repins: int | None = None
    """How many times the session pinned the conversation again before the next turn (`TurnStats.repins`);
    None where the session does not count them."""


class PinTtlProbe(BaseModel):
    """The same second turn of two fresh conversations, one after a short pause, one after a pause longer than
    the pin's TTL (the session renews its pin meanwhile)."""

    pin_ttl_s: float | None
    """The engine's pin TTL (None: the engine does not say; the long pause was given)."""
    short_pause_s: float
    long_pause_s: float
    short_ttft_s: float
    long_ttft_s: float
    short_pulled_tokens: int
    long_pulled_tokens: int
    short_miss_reason: str | None
    long_miss_reason: str | None
    short_renewals: int
    long_renewals: int
    """`TurnStats.pin_renewals` of each second turn: renewals made during its pause."""

    @property
    def ratio(self) -> float:
        """The long pause's TTFT over the short pause's (target: at most `PIN_TTL_RATIO_TARGET`)."""
        return self.long_ttft_s / self.short_ttft_s if self.short_ttft_s > 0 else float("inf")


class ModeProbes(BaseModel):
    """The probes of one pair mode that pushes back, run after its workload on its engine."""

    mode: str
    stop: StopProbe
    pin_ttl: PinTtlProbe | None
    """None when the engine does not say its pin TTL (`pin_ttl_note`)."""
    pin_ttl_note: str | None = None
