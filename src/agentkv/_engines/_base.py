"""The engine contract: token ids and a pin in; token deltas, then tokens, a pin and timings out.

Engines know nothing of sessions, tools or chat messages. A `Pin` is opaque to its user: the
number of tokens whose KV the engine keeps and until when, plus the engine's own reference; an
engine says what it can do with typed flags (`EngineInfo.pins`, ``disaggregated``, ``places_steps``). An engine is an async context
manager with the lifecycle of `agentkv._lifecycle` (unopened -> open -> closed); an
implementation provides `Engine.info` and `Engine.step`, and `_start`/`_stop` for its processes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from pydantic import BaseModel, ConfigDict, Field

from .._errors import EngineDeadError, SessionClosedError
from .._lifecycle import Lifecycle, LifecycleState
from .._stats._stats import StepMeasurements
from ._placement import Placement, PrefillEngine
from ._sampling import Sampling, SamplingOptions, TokenLogprob

__all__ = [
    "Engine",
    "EngineDetails",
    "EngineInfo",
    "EngineState",
    "Pin",
    "Placement",
    "PrefillEngine",
    "Sampling",
    "SamplingOptions",
    "StepDone",
    "StepEvent",
    "StepRequest",
    "StepTimings",
    "ReleaseGuard",
    "SavedPin",
    "TokenDelta",
    "TokenLogprob",
    "prompt_split",
]


@dataclass(frozen=True, kw_only=True)
class Pin:
    """KV an engine keeps after a step, for a later step that extends it (`EngineInfo.pins`).

    Its user reads `tokens` and `expires_at` only and gives the pin back unchanged, once
    (`StepRequest.pin`) or lets it go (`Engine.release`); `ref` is the engine's own.
    """

    tokens: int
    """The engine keeps KV for the first ``tokens`` tokens of the step's prompt followed by its output."""
    expires_at: float
    """When the engine drops that KV, in this process's ``time.perf_counter()`` clock (the engine converts
    its own clock)."""
    ref: object
    """The engine's own reference to the KV, opaque to everyone else (a pair's: D's NIXL handle)."""


class SavedPin(BaseModel):
    """A `Pin` as another process can take it back (`Engine.saved_pin`, `Engine.adopt_pin`): kept with a
    conversation's snapshot in a store that several doors share, so that the door that steps it next on the same
    decode server pulls its KV instead of recomputing it."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    id: str
    """The pin's own id (unique per step): what a store offers and takes back."""
    server: str
    """Where the KV is, as the engine that made the pin names it (a pair: D's URL)."""
    tokens: int = Field(ge=1)
    """`Pin.tokens`."""
    expires_unix: float
    """`Pin.expires_at` in wall-clock time (``time.time()``), the one clock that doors on several hosts share."""
    ref: dict[str, Any]
    """The engine's reference as JSON (a pair's: D's handle)."""


ReleaseGuard = Callable[[str], Awaitable[bool]]
"""Asked with a pin's `SavedPin.id` before an engine releases a pin it saved: True when this process may release
it, False when the pin was offered to others and may be in another's hands now (it is then left to expire)."""


@dataclass(frozen=True, kw_only=True)
class StepRequest:
    """One model call: the whole prompt as token ids, and a pin of an earlier step to extend (or None)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: Sampling
    pin: Pin | None = None
    """A pin this engine returned (`StepDone.pin`) whose tokens the prompt extends: its KV is reused.
    An engine refuses a pin that is not its own (`UserError`)."""
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


class StepTimings(StepMeasurements):
    """Where one step's time went and where its prompt KV came from, as the engine measured (the fields of
    `StepMeasurements`), and what became of the pin it was given.

    The user sees the measurements in `StepStats`, under the same names (`stats_fields`); `pin_declined`
    and `pin_evicted` become the step's ``miss_reason``.
    """

    model_config = ConfigDict(extra="forbid")  # a misspelt measurement is an error, not dropped

    pin_declined: bool = False
    """The engine could not use the pin it was given and computed its tokens (a pair: P declined to read
    D's blocks, NIXL ``num_kv_expired_reqs`` or a failed read)."""
    pin_evicted: bool = False
    """The pin was not used: the engine had released it to make room in its cache."""

    def stats_fields(self) -> dict[str, Any]:
        """The measurements a `StepStats` reports under the same names: ``StepStats(..., **timings.stats_fields())``."""
        return self.model_dump(include=set(StepMeasurements.model_fields))


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
    """The end of a step: the output exactly as generated, the engine's new pin, and timings."""

    token_ids: Sequence[int]
    text: str
    finish_reason: str
    timings: StepTimings
    pin: Pin | None = None
    """The KV the engine keeps of this step's prompt and output, for the next step (None: it keeps none)."""
    pin_error: str | None = None
    """Why the engine has no pin to give although it keeps KV (a pair: D's handle was malformed): the step's
    answer stands, the next step computes its whole prompt."""
    logprobs: Sequence[TokenLogprob] | None = None
    """One per token of `token_ids` when the step asked for them (`SamplingOptions.logprobs`), else None."""
    stopped_by_string: bool = False
    """One of the step's stop strings ended it (vLLM's ``stop_reason`` is the string): vLLM's front end aborted the
    request, so a pair's D pinned nothing (`pin` None) although its prefix cache still holds the blocks."""


StepEvent = TokenDelta | StepDone


class EngineDetails(TypedDict, total=False):
    """What an engine reports of itself for people to read (``agentkv smoke``, logs): each key is optional."""

    platform: str
    """vLLM's platform the engines run on (``"cpu"``, ``"cuda"``)."""
    cores: list[int]
    """A single engine's CPU cores."""
    devices: list[str]
    """A single engine's GPUs."""
    prefill_cores: list[int]
    """P's CPU cores."""
    decode_cores: list[int]
    """D's CPU cores."""
    prefill_devices: list[str]
    """P's GPUs."""
    decode_devices: list[str]
    """D's GPUs."""
    core_policy: str
    """How P and D share the cores: ``"split"`` or ``"elastic"``."""
    transfer: str
    """How KV moves from P to D: ``"pull"`` or ``"push"``."""
    pin_ttl_s: float
    """How long D keeps a pin unless it is read or released."""
    prefill_prefix_cache: bool
    """Whether P keeps a prefix cache of its own."""
    decode_kv_blocks: int | None
    """D's KV cache in blocks (None: its server publishes no metrics)."""
    transport: str
    """How an HTTP pair reaches its servers: ``"launched"`` (agentkv started them) or ``"remote"``."""
    prefill_url: str
    """P's server."""
    decode_url: str
    """D's server."""
    server_kind: str
    """What the servers are: agentkv's (``agentkv engine``) or stock vLLM's."""
    served_model: str
    """The name an HTTP pair's servers serve their model under (what its requests name)."""
    versions: dict[str, dict[str, Any]]
    """What each server of an HTTP pair runs, by role: ``vllm``, ``nixl``, ``nixl_handshake`` (None: not said)."""
    log_dir: str
    """Where launched servers write their logs."""
    engines: int
    """How many engines an `EngineGroup` serves with (the other keys are its first engine's)."""


@dataclass(frozen=True, kw_only=True)
class EngineInfo:
    """What a session needs to know of the model an engine serves, and what the engine can do.

    The defaults describe a plain engine: one engine that prefills and decodes, and keeps no KV for
    later steps.
    """

    model_path: Path
    max_model_len: int
    pins: bool = False
    """The engine keeps KV after each step (`StepDone.pin`) and takes the pin back with a later step."""
    disaggregated: bool | None = False
    """Prefill and decode run on separate engines (a P/D pair). None: either; a test double that stands
    in for both (``agentkv.testing``)."""
    places_steps: bool = False
    """With a pin, the engine can run the step where the KV is (a pair: on D alone, from D's own cache of
    the pinned conversation) when its measured costs say so (`Placement` ``"auto"``)."""
    off_reasons: Mapping[str, str] = field(default_factory=dict[str, str])
    """Why a flag is off where the engine knows, by the flag's name (e.g. ``{"places_steps": "..."}``)."""
    details: EngineDetails = field(default_factory=lambda: EngineDetails())
    """What the engine reports of itself for people to read (where it computes, its servers)."""


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

    async def release(self, pin: Pin) -> None:
        """Let the engine drop the KV ``pin`` keeps: the session will never give it back.

        Called by sessions for a pin they give up (closed, rewound, edited, not forwarded, or
        from a turn that did not finish), so the engine's cache does not fill with pins that wait
        for their expiry. Best effort and optional: the default does nothing (the pin expires).
        Must not raise; an engine that is closed or dead ignores it.
        """

    def cut_pin(self, pin: Pin, tokens: int) -> Pin | None:
        """``pin`` keeping only the KV of its first whole blocks within ``tokens`` tokens, for a prompt that shares
        only those tokens with it (the rest of the pin is then of no use to that prompt); None when no whole block
        is shared or the engine cannot cut its pins (the default). The cut pin replaces ``pin``: its user gives
        back or releases one of the two, once, never both."""
        return None

    def saved_pin(self, pin: Pin) -> SavedPin | None:
        """``pin`` as another process on the same servers could take it back (`adopt_pin`), or None when its KV
        is only this process's to reach (the default: an engine this process runs, or one that does not say)."""
        return None

    def adopt_pin(self, saved: SavedPin) -> Pin | None:
        """A pin another process saved (`saved_pin`) as this engine's own, or None when this engine cannot reach
        its KV or it has expired (the default: None). The caller makes sure the pin was never used or released
        since it was saved (it is single use), and that the tokens it keeps are the conversation's."""
        return None

    def guard_releases(self, guard: ReleaseGuard | None) -> None:
        """Ask ``guard`` before releasing a pin that `saved_pin` saved (the default: an engine whose pins never
        leave this process needs no guard, and ignores it)."""

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
