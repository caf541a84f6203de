"""`PinUpkeep`: the one-token steps that keep a session's conversation pinned on D while the session waits for its
caller (docs/reliability.md, "Pins that outlive a pause"). Three kinds of wake, one machinery:

* **renew**: a pin lives ``pin_ttl_s`` on D (src/agentkv/_engines/_pair_config.py), and a session gives it back only
  while it is more than ``expiry_margin_s`` from its expiry (`agentkv._engines._pinning.choose_pin`). An agent that
  pauses longer (a build, a test suite, a human) would find its pin expired and recompute its whole conversation.
  So a task on the session's home wakes `RENEW_LEAD_S` (plus the last renewal's time to first token) before the pin
  would fail that test and renews it: given the pin back, placed on D alone where the engine can (D's own cache
  holds the pin's whole blocks: it recomputes at most one block and pins again, no transfer), else the ordinary
  step (``renew_pins``).
* **repin**: vLLM ends a step at a stop string in its front end and aborts the request, so D pins nothing
  (`StepDone.stopped_by_string`); D's prefix cache still holds the blocks (freed, not yet evicted). Right after such
  a turn is kept, a step with no pin, placed on D alone where the engine can, prefills from that cache and pins
  (``renew_pins``).
* **prefetch** (early transfer): the step after a pause gives D's pin back and P pulls D's new blocks on the
  critical path. Right after a turn is kept, a step given the pin and placed on P pulls them into P's prefix cache
  now; D pins again. The next step finds them in P's cache and pulls at most the partial last block
  (``early_transfer``).

Each is one step of one token whose prompt is the conversation's tokens (they extend a pin's tokens by the last
output token, so the token-exact rule holds); its output token is thrown away: the conversation does not change,
and the new pin is held for the conversation's tokens alone, which the next step's prompt extends exactly. After a
repin or a prefetch the renewal is scheduled from the new pin's expiry.

A session whose pin a pool offers to other doors (a store several doors share: src/agentkv/_session/_pool.py) has
`PinOffers`: an upkeep step that gives the pin back takes it off offer first (if another door took it meanwhile,
the step is not made and the pin is not this session's any more), and the new pin is offered after.

A turn that starts while one runs waits for it (one token) and takes its pin; one that starts while one waits
cancels it. An edit that drops the pin cancels it (a pin it brings back is released), and closing the session
cancels it and waits for its end. One that fails drops the pin quietly (logged at debug): the next step recomputes
(``miss_reason="no_handle"``). Renewals stop once the session has been idle ``renew_pins_for_s`` (an abandoned
session does not hold D forever), when D's budget evicted the pin (an idle conversation does not take D back from
active ones), and when the pin lives too briefly for a renewal to help.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
import weakref
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol

import anyio

from .._conversation._conversation import Conversation
from .._engines import Engine, Pin, Sampling, StepDone, StepRequest
from .._engines._pinning import HeldPin, choose_pin
from .._home import EventLoopHome
from ._modes import Mode, pushes_back
from ._session_config import SessionConfig

__all__ = ["RENEW_LEAD_S", "PinOffers", "PinUpkeep", "UpkeepKind"]

logger = logging.getLogger("agentkv")

RENEW_LEAD_S = 2.0
"""How long before a pin would fail `choose_pin`'s expiry test its renewal starts, besides the last renewal's time
to first token: room for the event loop's wake-up and for the renewal to wait behind other requests on a busy pair
(a one-token step on D alone takes tens of milliseconds on an idle pair). It is also the shortest time between two
renewals of a pin: one that would be due sooner is not renewed (its TTL is too short for renewals to help)."""

_CLOSE_GRACE_S = 5.0
"""How long closing waits for a cancelled upkeep step to unwind (it is one token; the engine aborts it)."""


UpkeepKind = Literal["renew", "repin", "prefetch"]
"""What a wake does (see the module's docstring)."""


class PinOffers(Protocol):
    """Where a session's pin is offered to other processes (a pool's store several doors share)."""

    async def take_back(self, pin: Pin) -> bool:
        """Take ``pin`` off offer before an upkeep step gives it back: True when no other process can have it (it
        was not on offer, or is off it now); False when another took it (it is not the session's any more)."""
        ...

    async def offer(self) -> None:
        """Offer the session's pin after an upkeep step left a new one (or drop it where it cannot be offered)."""
        ...


class Upkept(Protocol):
    """What an upkeep step reads and changes of its session (`agentkv._session._session_core.SessionCore`)."""

    _pin: HeldPin | None
    _pin_offers: PinOffers | None

    @property
    def _lock(self) -> AbstractContextManager[Any]: ...
    @property
    def _active(self) -> object | None: ...
    @property
    def _conversation(self) -> Conversation | None: ...
    @property
    def _engine(self) -> Engine | None: ...
    @property
    def _config(self) -> SessionConfig: ...
    @property
    def mode(self) -> Mode: ...
    @property
    def home(self) -> EventLoopHome | None: ...
    @property
    def is_open(self) -> bool: ...
    def _discard_pin(self, held: HeldPin) -> None: ...


@dataclasses.dataclass(eq=False)
class _Wake:
    """One scheduled upkeep step: what it gives back (``held``; None: a repin), its task's cancel scope, and whether
    it has ended."""

    kind: UpkeepKind
    held: HeldPin | None
    at: float
    """When it starts (``time.perf_counter``)."""
    scope: anyio.CancelScope = dataclasses.field(default_factory=anyio.CancelScope)
    ended: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    running: bool = False
    """Its step has begun (it holds the session's pin, if any: a turn that starts waits for it)."""


class PinUpkeep:
    """The upkeep of one session's pin (see the module's docstring). Every method but `settled` and `close` is
    called with the session's lock held, from any thread."""

    def __init__(self, session: Upkept) -> None:
        self._session = weakref.ref(session)
        """Weak: a renewal waiting for hours keeps no forgotten session alive (its engine pin simply expires)."""
        self._wake: _Wake | None = None
        self.count = 0
        """Renewals since the last turn was kept (`TurnStats.pin_renewals`)."""
        self.repins = 0
        """Repins since the last turn was kept (`TurnStats.repins`)."""
        self.early_transfers = 0
        """Prefetches since the last turn was kept (`TurnStats.early_transfers`)."""
        self.idle_since = time.perf_counter()
        """When the session last kept a turn (or took a pin up): renewals stop ``renew_pins_for_s`` after it."""
        self._last_ttft_s = 0.0

    def counts(self) -> tuple[int, int, int]:
        """(renewals, repins, prefetches) since the last turn was kept: the next turn's `TurnStats` counts."""
        return self.count, self.repins, self.early_transfers

    @property
    def renewing(self) -> HeldPin | None:
        """The pin a running upkeep step took from the session (None: none runs, or a repin, which took none)."""
        wake = self._wake
        return wake.held if wake is not None and wake.running else None

    # ----------------------------------------------------------------- the session's calls (its lock held)

    def kept(self, session: Upkept, *, turn: bool, repin: bool = False) -> None:
        """The session is idle (``turn``: it just kept a turn, which resets the counts and the bound; ``repin``: its
        last step ended at a stop string, D pinned nothing): repin, prefetch, or schedule the pin's renewal."""
        if turn:
            self.count = self.repins = self.early_transfers = 0
            self.idle_since = time.perf_counter()
        self.cancel()
        engine, home = session._engine, session.home
        if engine is None or home is None or not self._pins(session, engine):
            return
        wake = self._after_turn(session, turn=turn, repin=repin)
        if wake is not None:
            self._start(home, wake)
        else:
            self.schedule(session)

    @staticmethod
    def _after_turn(session: Upkept, *, turn: bool, repin: bool) -> _Wake | None:
        """The step due at once when the session is idle again: a repin, a prefetch, or None (a renewal later)."""
        config = session._config
        if repin and session._pin is None and config.renew_pins:
            return _Wake("repin", None, time.perf_counter())
        if turn and session._pin is not None and config.early_transfer:
            return _Wake("prefetch", session._pin, time.perf_counter())
        return None

    def schedule(self, session: Upkept) -> None:
        """Schedule the renewal of the session's pin, replacing a waiting upkeep step; nothing when it needs none."""
        self.cancel()
        held, home, engine = session._pin, session.home, session._engine
        if held is None or home is None or engine is None:
            return
        config = session._config
        if not config.renew_pins or not self._pins(session, engine):
            return
        at = held.pin.expires_at - config.expiry_margin_s - RENEW_LEAD_S - self._last_ttft_s
        now = time.perf_counter()
        if at < now + RENEW_LEAD_S:
            logger.debug("agentkv: a pin expires too soon for a renewal to help; it is not renewed")
            return
        if at > self.idle_since + config.renew_pins_for_s:
            logger.debug("agentkv: the session has been idle too long; its pin is left to expire")
            return
        self._start(home, _Wake("renew", held, at))

    def pause(self) -> None:
        """A turn starts: a waiting upkeep step is cancelled; a running one finishes (the turn waits, `settled`)."""
        if self._wake is not None and not self._wake.running:
            self.cancel()

    def cancel(self) -> None:
        """Cancel the upkeep step, waiting or running (an edit, a close): a pin it brings back is released."""
        wake, self._wake = self._wake, None
        session = self._session()
        home = session.home if session is not None else None
        if wake is None or home is None:
            return
        if home.is_current():
            wake.scope.cancel()
        else:
            home.spawn(_cancel, wake.scope)

    # ----------------------------------------------------------------- waiting (on the session's home)

    async def settled(self) -> None:
        """Wait until no upkeep step runs (a turn starting calls it after `pause`)."""
        wake = self._wake
        if wake is not None and wake.running:
            await wake.ended.wait()

    async def close(self) -> None:
        """Cancel the upkeep step and wait until its task has ended (the session closes)."""
        session = self._session()
        home = session.home if session is not None else None
        if home is not None and not home.is_current():
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await home.call_async(self.close)
            return
        if session is None:
            return
        with session._lock:
            wake = self._wake
            self.cancel()
        if wake is not None:
            with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_GRACE_S):
                await wake.ended.wait()

    # ----------------------------------------------------------------- the step

    @staticmethod
    def _pins(session: Upkept, engine: Engine) -> bool:
        """The session gives pins back on an engine that pins (a pair in a push-back mode)."""
        return pushes_back(session.mode) and engine.is_open and engine.info.pins

    def _start(self, home: EventLoopHome, wake: _Wake) -> None:
        self._wake = wake
        home.spawn(self._run, wake)

    async def _run(self, wake: _Wake) -> None:
        try:
            with wake.scope:
                delay = wake.at - time.perf_counter()
                if delay > 0:  # one due now (a repin, a prefetch) takes the pin at once: a turn then waits for it
                    await anyio.sleep(delay)
                await self._upkeep(wake)
        finally:
            wake.ended.set()

    async def _upkeep(self, wake: _Wake) -> None:
        session = self._session()
        if session is None:
            return
        with session._lock:
            conversation, engine = session._conversation, session._engine
            if (
                self._wake is not wake
                or session._pin is not wake.held
                or session._active is not None
                or not session.is_open
                or conversation is None
                or engine is None
                or engine.is_dead
            ):
                return
            tokens = list(conversation.tokens)
            config = session._config
            if len(tokens) >= engine.info.max_model_len:
                return  # no room for one more token: left as it is
            pin = None
            if wake.held is not None:
                pin, _ = choose_pin(wake.held, tokens, push_back=True, expiry_margin_s=config.expiry_margin_s)
                if pin is None and not _refreshable(wake, tokens, config.expiry_margin_s):
                    return  # the conversation's tokens do not strictly extend the pin's: left as it is
            session._pin, wake.running = None, True
        replaced = wake.held if pin is None else None
        """A pin that holds the conversation's tokens exactly (an upkeep step's): released once the step has run."""
        on_decode = wake.kind != "prefetch" and engine.info.places_steps
        offers = session._pin_offers
        new: HeldPin | None = None
        kept = False
        try:
            if offers is not None and wake.held is not None and not await offers.take_back(wake.held.pin):
                logger.debug("agentkv: another door took the pin off offer; its %s step is not made", wake.kind)
                return  # not this session's: forgotten, or released where the guard lets it (it does not)
            request = StepRequest(
                request_id=f"agentkv-{wake.kind}-{uuid.uuid4().hex}",
                prompt_token_ids=tokens,
                sampling=Sampling(max_tokens=1),
                pin=pin,
                cache_salt=config.cache_salt,
                placement="decode" if on_decode else "prefill",
            )
            new = await self._step(engine, request, tokens, wake.kind)
        finally:
            with session._lock:
                current = self._wake is wake
                if current:
                    self._wake = None
                if current and new is not None and session._pin is None:
                    session._pin, kept = new, True
                    self._count(wake.kind)
                    if session._active is None:
                        self.schedule(session)
                elif new is not None:  # cancelled by an edit or a close meanwhile
                    session._discard_pin(new)
                if replaced is not None:
                    session._discard_pin(replaced)
        if offers is not None and kept:
            with anyio.CancelScope(shield=True):  # offered, or dropped: never left half-way
                await offers.offer()

    def _count(self, kind: UpkeepKind) -> None:
        if kind == "renew":
            self.count += 1
        elif kind == "repin":
            self.repins += 1
        else:
            self.early_transfers += 1

    async def _step(self, engine: Engine, request: StepRequest, tokens: list[int], kind: UpkeepKind) -> HeldPin | None:
        """The upkeep's step: the new pin, held for the conversation's ``tokens`` (None: it failed)."""
        done: StepDone | None = None
        try:
            events = engine.step(request)
            try:
                async for event in events:
                    if isinstance(event, StepDone):
                        done = event
            finally:
                aclose = getattr(events, "aclose", None)
                if aclose is not None:
                    await aclose()
        except Exception as exc:  # never the user's error: the next step recomputes
            logger.debug("agentkv: a pin's %s step failed; the next step recomputes: %s", kind, exc)
            return None
        if done is None or done.pin is None:
            logger.debug("agentkv: a pin's %s step left no pin; the next step recomputes", kind)
            return None
        if kind == "renew":
            self._last_ttft_s = done.timings.ttft_s
        new = HeldPin(done.pin, tokens)
        if done.timings.pin_evicted or done.pin.tokens > len(tokens):
            # evicted: D's budget gave this idle conversation's blocks to others; it does not take them back
            logger.debug(
                "agentkv: a pin's %s step's pin is not kept (evicted, or holding more than the conversation)", kind
            )
            session = self._session()
            if session is not None:
                session._discard_pin(new)
            return None
        return new


def _refreshable(wake: _Wake, tokens: list[int], expiry_margin_s: float) -> bool:
    """Whether ``wake`` renews a pin that holds the conversation's ``tokens`` exactly (the pin of an upkeep step: D
    keeps its prompt, the output token is thrown away). No prompt strictly extends it, so it cannot be given back;
    but D's prefix cache holds its blocks, and a step with no pin on D alone prefills from them and pins anew (where
    the pair cannot place a step on D, on P: from P's prefix cache, which the prefetch filled, and D pulls it all)."""
    held = wake.held
    return (
        wake.kind == "renew"
        and held is not None
        and held.pin.tokens == len(tokens)
        and held.token_ids[: len(tokens)] == tokens
        and time.perf_counter() + expiry_margin_s < held.pin.expires_at
    )


async def _cancel(scope: anyio.CancelScope) -> None:
    scope.cancel()
