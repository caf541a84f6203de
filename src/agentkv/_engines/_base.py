"""The engine contract: token ids and a handle in; token deltas, then tokens, a handle and timings out.

Engines know nothing of sessions, tools or chat messages. An engine is an async context
manager with the lifecycle of `agentkv._lifecycle` (unopened -> open -> closed); an
implementation provides `Engine.info` and `Engine.step`, and `_start`/`_stop` for its processes.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict

from .._errors import EngineDeadError, SessionClosedError
from .._lifecycle import Lifecycle, LifecycleState
from ._handle import KVHandle
from ._placement import Placement, PrefillEngine
from ._sampling import Sampling, SamplingOptions, TokenLogprob

__all__ = [
    "Engine",
    "EngineInfo",
    "EngineState",
    "Mode",
    "Placement",
    "PrefillEngine",
    "Sampling",
    "SamplingOptions",
    "StepDone",
    "StepEvent",
    "StepRequest",
    "StepTimings",
    "TokenDelta",
    "TokenLogprob",
    "pair_modes",
    "prompt_split",
]

Mode = Literal["auto", "bidirectional", "disaggregated", "colocated"]
"""How a session runs on its engine: on a pair with KV pushed back to P, on a pair without, or on one engine.

``"auto"`` is push-back where the pair places each step: on P with push-back, or on D alone
from D's own cache of the pinned conversation, whichever its measured costs say is faster.
"""

_MODE_PREFERENCE: tuple[Mode, ...] = ("bidirectional", "auto", "disaggregated", "colocated")


@dataclass(frozen=True, kw_only=True)
class StepRequest:
    """One model call: the whole prompt as token ids, and D's handle to push back (or None)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: Sampling
    handle: KVHandle | None = None
    cache_salt: str | None = None
    """Prefix-cache namespace: blocks cached under one salt never serve another (vLLM ``cache_salt``)."""
    placement: Placement = "prefill"
    """Where a pair prefills (see `Placement`); engines without a choice ignore it."""


@dataclass(frozen=True, kw_only=True)
class TokenDelta:
    """New output tokens, streamed as the decoding engine produces them."""

    token_ids: Sequence[int]
    text: str
    logprobs: Sequence[TokenLogprob] | None = None
    """One per token of `token_ids` when the step asked for them (`SamplingOptions.logprobs`), else None."""


@dataclass(kw_only=True)
class StepTimings:
    """Where one step's time went and where its prompt KV came from, as the engine measured.

    Token counts are those of the engine that prefilled the prompt (P in a pair).
    Every field documents its source; `None` means the source did not report it. The user sees
    these numbers in `StepStats`, built with `stats_fields` (every field but `pullback_declined` and
    `pin_evicted`, which become the step's ``miss_reason``).
    """

    ttft_s: float
    """Client clock (``time.perf_counter``): submitted, to the first output token streamed (P's or D's)."""
    prefill_s: float | None = None
    """Prefilling engine: ``first_token_ts - scheduled_ts`` (vLLM ``RequestStateStats``)."""
    kv_wait_s: float = 0.0
    """Both engines: ``scheduled_ts - queued_ts``: time requests waited, mostly for KV to arrive."""
    decode_s: float | None = None
    """Decoding engine: ``last_token_ts - first_token_ts``."""
    local_hit_tokens: int = 0
    """Prefilling engine's own prefix cache (vLLM ``PrefillStats.num_local_cached_tokens``)."""
    pulled_tokens: int = 0
    """Pulled back from D over NIXL (``PrefillStats.num_external_cached_tokens`` on P)."""
    computed_tokens: int = 0
    """Computed by the prefilling engine (``PrefillStats.num_computed_tokens``)."""
    handoff_tokens: int = 0
    """Tokens D pulled from P to start decoding (``PrefillStats.num_external_cached_tokens`` on D)."""
    kv_bytes: int | None = None
    """NIXL bytes read by either engine while this step was the only one in flight on it."""
    kv_transfer_s: float | None = None
    """NIXL transfer time, same attribution as `kv_bytes`."""
    prefill_engine: PrefillEngine | None = None
    """The engine of a pair that computed the new prompt tokens: ``"prefill"`` (P, the protocol of
    docs/concepts.md, "Turns, steps, P and D") or ``"decode"`` (D alone, from its own cache of the pinned conversation);
    None for a single engine."""
    placement_reason: str | None = None
    """Why the step was prefilled where it was (``auto`` placement: the estimates compared)."""
    pullback_declined: bool = False
    """P declined to read D's blocks (NIXL ``num_kv_expired_reqs`` or a failed read)."""
    pin_evicted: bool = False
    """The handle was not used: the pair had released its pin to make room in D's cache."""

    def stats_fields(self) -> dict[str, Any]:
        """The measurements a `StepStats` reports under the same names: ``StepStats(..., **timings.stats_fields())``."""
        fields = dataclasses.asdict(self)
        del fields["pullback_declined"], fields["pin_evicted"]
        return fields


class PromptSplit(TypedDict):
    """The `StepTimings` token fields: where a prompt's KV came from."""

    local_hit_tokens: int
    pulled_tokens: int
    computed_tokens: int


def prompt_split(prompt_tokens: int, *, split: tuple[int, int] | None, cached_tokens: int | None) -> PromptSplit:
    """Where a prompt's KV came from, as the `StepTimings` token fields.

    ``split`` is (local, pulled) as the prefilling engine reported them (vLLM ``PrefillStats``:
    ``num_local_cached_tokens``, ``num_external_cached_tokens``); without it, the engine's one
    cached count (``cached_tokens``) is taken as local hits: local and pulled cannot be told apart.
    """
    local, pulled = split if split is not None else (min(cached_tokens or 0, prompt_tokens), 0)
    return PromptSplit(local_hit_tokens=local, pulled_tokens=pulled, computed_tokens=prompt_tokens - local - pulled)


@dataclass(frozen=True, kw_only=True)
class StepDone:
    """The end of a step: the output exactly as generated, D's new handle, and timings."""

    token_ids: Sequence[int]
    text: str
    finish_reason: str
    handle: KVHandle | None
    timings: StepTimings
    handle_deadline: float | None = None
    """The handle's expiry in this process's ``time.perf_counter()`` clock, when D's clock is another
    host's (None: D shares this host's monotonic clock, and ``remote_blocks_expiry_time`` is it)."""
    handle_error: str | None = None
    """Why D's handle was dropped (it was malformed; `handle` is then None): the step's answer stands,
    the next step cannot push back."""
    logprobs: Sequence[TokenLogprob] | None = None
    """One per token of `token_ids` when the step asked for them (`SamplingOptions.logprobs`), else None."""


StepEvent = TokenDelta | StepDone


@dataclass(frozen=True, kw_only=True)
class EngineInfo:
    """What a session needs to know of the model an engine serves, and the session modes it can serve."""

    model_path: Path
    max_model_len: int
    modes: frozenset[Mode]
    """The session modes the engine serves: a pair serves "disaggregated", and "bidirectional" when D
    pins KV after each step and P can pull it back (`pair_modes`); a single engine serves "colocated"."""
    extra: dict[str, Any] = field(default_factory=dict[str, Any])

    @property
    def push_back(self) -> bool:
        """Whether D pins KV after each step and P can pull it back (the engine serves "bidirectional")."""
        return "bidirectional" in self.modes

    @property
    def natural_mode(self) -> Mode:
        """The mode of a session that asks for none: the first served of bidirectional, disaggregated, colocated."""
        return next(mode for mode in _MODE_PREFERENCE if mode in self.modes)


def pair_modes(*, push_back: bool, placement: bool = False) -> frozenset[Mode]:
    """The modes a P/D pair serves: "disaggregated"; "bidirectional" with push-back; "auto" too when it
    can also place steps on D alone (``placement``)."""
    if not push_back:
        return frozenset({"disaggregated"})
    return frozenset({"disaggregated", "bidirectional", "auto"} if placement else {"disaggregated", "bidirectional"})


EngineState = LifecycleState
"""Lifecycle of an engine (the same states as a session's: unopened, open, closed)."""


class Engine(Lifecycle, ABC):
    """An inference backend for sessions. Subclasses implement `info`, `step`, `_start` and `_stop`.

    The lifecycle (``open(home=...)``, ``aclose``, ``async with``, ``with``, ``start()``,
    ``close()``) comes from `Lifecycle`: an engine opens once, on the event loop given to
    ``open`` (a session passes its own), and "not open" raises `SessionClosedError`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._dead: BaseException | None = None

    @property
    @abstractmethod
    def info(self) -> EngineInfo:
        """The model and capabilities (valid once open)."""

    def _info_once_started(self, info: EngineInfo | None) -> EngineInfo:
        """`info` of an engine that learns it as it starts: ``info`` once known, else `SessionClosedError`."""
        if info is None:
            self._require_open()
            raise SessionClosedError(f"the {type(self).__name__} is not open")
        return info

    @abstractmethod
    def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        """Run one model call, yielding `TokenDelta`s and then exactly one `StepDone`."""

    async def release(self, handle: KVHandle) -> None:
        """Let D drop the blocks ``handle`` pins: the session will never forward it.

        Called by sessions for a pin they give up (closed, rewound, edited, not forwarded, or
        from a turn that did not finish), so D's cache does not fill with pins that wait for
        their expiry. Best effort and optional: the default does nothing (the pin expires).
        Must not raise; an engine that is closed or dead ignores it.
        """

    async def _start(self) -> None:
        """Start the engine's processes. Called once, by `open`."""

    async def _warm_up(self) -> None:
        """Serve first requests before users do (called once by `open`, the engine already open)."""

    async def _stop(self) -> None:
        """Stop every process the engine started. Called once, by `aclose` (or a failed `open`); must not raise."""

    async def _open_resources(self) -> None:
        await self._start()

    async def _when_open(self) -> None:
        await self._warm_up()

    async def _close_resources(self) -> None:
        await self._stop()

    def check_open(self) -> None:
        """Raise the right error when the engine cannot serve a step."""
        if self._dead is not None:
            raise EngineDeadError(f"{type(self).__name__} died: {self._dead}") from self._dead
        self._require_open()

    @property
    def is_dead(self) -> bool:
        """Whether an engine process died; a dead engine serves no more steps."""
        return self._dead is not None
