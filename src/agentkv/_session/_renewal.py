"""`PinRenewal`: a session's pin renewed while the session waits for its caller (docs/reliability.md, "Pins that
outlive a pause").

A pin lives ``pin_ttl_s`` on D (src/agentkv/_engines/_pair_config.py), and a session gives it back only while it is
more than ``expiry_margin_s`` from its expiry (`agentkv._engines._pinning.choose_pin`). An agent that pauses longer
(a build, a test suite, a human) would find its pin expired and recompute its whole conversation. So, while the
session is open, idle and holds a pin, a task on the session's home wakes `RENEW_LEAD_S` (plus the last renewal's
time to first token) before the pin would fail that test and renews it: one step of one token whose prompt is the
conversation's tokens (they extend the pin's tokens by the last output token, so the token-exact rule holds), given
the pin back, placed on D alone where the engine can (D's own cache holds the pin's whole blocks: it recomputes at
most one block and pins again, no transfer), else the ordinary step. The output token is thrown away: the
conversation does not change, and the new pin is held for the conversation's tokens alone, which the next step's
prompt extends exactly.

A turn that starts while a renewal runs waits for it (one token) and takes the renewed pin; one that starts while a
renewal waits cancels it. An edit that drops the pin cancels the renewal (a pin it brings back is released), and
closing the session cancels it and waits for its end. A renewal that fails drops the pin quietly (logged at debug):
the next step recomputes (``miss_reason="no_handle"``). Renewals stop once the session has been idle
``renew_pins_for_s`` (an abandoned session does not hold D forever), when D's budget evicted the pin (an idle
conversation does not take D back from active ones), and when the pin lives too briefly for a renewal to help.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
import weakref
from contextlib import AbstractContextManager
from typing import Any, Protocol

import anyio

from .._conversation._conversation import Conversation
from .._engines import Engine, Sampling, StepDone, StepRequest
from .._engines._pinning import HeldPin, choose_pin
from .._home import EventLoopHome
from ._modes import Mode, pushes_back
from ._session_config import SessionConfig

__all__ = ["RENEW_LEAD_S", "PinRenewal"]

logger = logging.getLogger("agentkv")

RENEW_LEAD_S = 2.0
"""How long before a pin would fail `choose_pin`'s expiry test its renewal starts, besides the last renewal's time
to first token: room for the event loop's wake-up and for the renewal to wait behind other requests on a busy pair
(a one-token step on D alone takes tens of milliseconds on an idle pair). It is also the shortest time between two
renewals of a pin: one that would be due sooner is not renewed (its TTL is too short for renewals to help)."""

_CLOSE_GRACE_S = 5.0
"""How long closing waits for a cancelled renewal to unwind (it is one token; the engine aborts it)."""


class Renewable(Protocol):
    """What a renewal reads and changes of its session (`agentkv._session._session_core.SessionCore`)."""

    _pin: HeldPin | None

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
    """One scheduled renewal of ``held``: its task's cancel scope, and whether it has ended."""

    held: HeldPin
    at: float
    """When it starts (``time.perf_counter``)."""
    scope: anyio.CancelScope = dataclasses.field(default_factory=anyio.CancelScope)
    ended: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    running: bool = False
    """Its step has begun (it holds the session's pin)."""


class PinRenewal:
    """The renewals of one session's pin (see the module's docstring). Every method but `settled` and `close` is
    called with the session's lock held, from any thread."""

    def __init__(self, session: Renewable) -> None:
        self._session = weakref.ref(session)
        """Weak: a renewal waiting for hours keeps no forgotten session alive (its engine pin simply expires)."""
        self._wake: _Wake | None = None
        self.count = 0
        """Renewals since the last turn was kept (`TurnStats.pin_renewals`)."""
        self.idle_since = time.perf_counter()
        """When the session last kept a turn (or took a pin up): renewals stop ``renew_pins_for_s`` after it."""
        self._last_ttft_s = 0.0

    @property
    def renewing(self) -> HeldPin | None:
        """The pin a running renewal took from the session (None: none runs)."""
        wake = self._wake
        return wake.held if wake is not None and wake.running else None

    # ----------------------------------------------------------------- the session's calls (its lock held)

    def kept(self, session: Renewable, *, turn: bool) -> None:
        """The session is idle with its pin (``turn``: it just kept a turn, which resets the count and the bound):
        schedule the pin's renewal."""
        if turn:
            self.count = 0
            self.idle_since = time.perf_counter()
        self.schedule(session)

    def schedule(self, session: Renewable) -> None:
        """Schedule the renewal of the session's pin, replacing a waiting one; nothing when it needs none."""
        self.cancel()
        held, home, engine = session._pin, session.home, session._engine
        if held is None or home is None or engine is None or not self._renews(session, engine):
            return
        config = session._config
        at = held.pin.expires_at - config.expiry_margin_s - RENEW_LEAD_S - self._last_ttft_s
        now = time.perf_counter()
        if at < now + RENEW_LEAD_S:
            logger.debug("agentkv: a pin expires too soon for a renewal to help; it is not renewed")
            return
        if at > self.idle_since + config.renew_pins_for_s:
            logger.debug("agentkv: the session has been idle too long; its pin is left to expire")
            return
        self._wake = _Wake(held, at)
        home.spawn(self._run, self._wake)

    def pause(self) -> None:
        """A turn starts: a waiting renewal is cancelled; a running one finishes (the turn waits, `settled`)."""
        if self._wake is not None and not self._wake.running:
            self.cancel()

    def cancel(self) -> None:
        """Cancel the renewal, waiting or running (an edit, a close): a pin it brings back is released."""
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
        """Wait until no renewal runs (a turn starting calls it after `pause`)."""
        wake = self._wake
        if wake is not None and wake.running:
            await wake.ended.wait()

    async def close(self) -> None:
        """Cancel the renewal and wait until its task has ended (the session closes)."""
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

    # ----------------------------------------------------------------- the renewal

    def _renews(self, session: Renewable, engine: Engine) -> bool:
        return session._config.renew_pins and pushes_back(session.mode) and engine.is_open and engine.info.pins

    async def _run(self, wake: _Wake) -> None:
        try:
            with wake.scope:
                await anyio.sleep(max(0.0, wake.at - time.perf_counter()))
                await self._renew(wake)
        finally:
            wake.ended.set()

    async def _renew(self, wake: _Wake) -> None:
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
            pin, _ = choose_pin(wake.held, tokens, push_back=True, expiry_margin_s=config.expiry_margin_s)
            if pin is None or len(tokens) >= engine.info.max_model_len:
                return  # the conversation's tokens do not strictly extend the pin's (or leave no room): not renewed
            session._pin, wake.running = None, True
        renewed: HeldPin | None = None
        try:
            request = StepRequest(
                request_id=f"agentkv-renew-{uuid.uuid4().hex}",
                prompt_token_ids=tokens,
                sampling=Sampling(max_tokens=1),
                pin=pin,
                cache_salt=config.cache_salt,
                placement="decode" if engine.info.places_steps else "prefill",
            )
            renewed = await self._step(engine, request, tokens)
        finally:
            with session._lock:
                current = self._wake is wake
                if current:
                    self._wake = None
                if current and renewed is not None and session._pin is None:
                    session._pin = renewed
                    self.count += 1
                    if session._active is None:
                        self.schedule(session)
                elif renewed is not None:  # cancelled by an edit or a close meanwhile
                    session._discard_pin(renewed)

    async def _step(self, engine: Engine, request: StepRequest, tokens: list[int]) -> HeldPin | None:
        """The renewal's step: the new pin, held for the conversation's ``tokens`` (None: it failed)."""
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
            logger.debug("agentkv: renewing a pin failed; the next step recomputes: %s", exc)
            return None
        if done is None or done.pin is None:
            logger.debug("agentkv: a pin's renewal left no pin; the next step recomputes")
            return None
        self._last_ttft_s = done.timings.ttft_s
        renewed = HeldPin(done.pin, tokens)
        if done.timings.pin_evicted or done.pin.tokens > len(tokens):
            # evicted: D's budget gave this idle conversation's blocks to others; it does not take them back
            logger.debug("agentkv: a renewed pin is not kept (evicted, or holding more than the conversation)")
            session = self._session()
            if session is not None:
                session._discard_pin(renewed)
            return None
        return renewed


async def _cancel(scope: anyio.CancelScope) -> None:
    scope.cancel()
