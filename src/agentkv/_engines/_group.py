"""`EngineGroup`: several pairs behind one engine, each conversation kept on the pair that holds its pin.

A step that gives a pin back goes to the pair whose D issued it (the pin's handle names D's
engine); a step without one (a new conversation) goes to the live pair with the fewest steps in
flight, then the fewest conversations pinned. When a pair dies, the group keeps serving on the
others: a step whose pin names the dead pair is re-placed on a live one and recomputes its
prompt (its stats say ``declined``), and the dead pair is replaced in the background when the
group was told how (``replace``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import anyio

from .._errors import EngineDeadError, UserError
from .._home import Background, start_background
from ._base import Engine, EngineInfo, EngineState, Pin, StepDone, StepEvent, StepRequest
from ._handle import KVHandle, handle_of

__all__ = ["EngineGroup"]

logger = logging.getLogger("agentkv")


@dataclass(eq=False)
class _Member:
    engine: Engine
    in_flight: int = 0
    pins: set[str] = field(default_factory=set[str])
    """The pins it issued (D's request ids) that were neither given back nor released yet (its conversations)."""
    replacing: bool = False
    given_up: bool = False
    """Its replacement failed: it stays out."""

    @property
    def serves(self) -> bool:
        return self.engine.state is EngineState.OPEN and not self.engine.is_dead and not self.replacing


class EngineGroup(Engine):
    """Several engines of one model serving as one: conversations spread over them, each kept on its pair.

    The group opens the engines it is given (unopened) and closes them with it. Sessions,
    pools and the front door take it like any engine.

    Args:
        engines: the engines, unopened, all of the same model (e.g. ``EmbeddedPair(cores=...)`` each).
        replace: makes a new engine to take a dead one's place (given the dead one); the group opens
            it in the background while the others serve. Default: a dead engine stays out.
    """

    def __init__(self, engines: Sequence[Engine], *, replace: Callable[[Engine], Engine] | None = None) -> None:
        super().__init__()
        engines = list(engines)
        if not engines or not all(isinstance(e, Engine) for e in engines):
            raise UserError("EngineGroup takes a non-empty list of agentkv engines")
        if any(e.state is not EngineState.UNOPENED for e in engines) or len({id(e) for e in engines}) < len(engines):
            raise UserError("EngineGroup opens its engines itself: give each one once, unopened")
        self._members = [_Member(engine) for engine in engines]
        self._replace = replace
        self._owners: dict[str, _Member] = {}
        """D's engine id (named in every pin's handle it issues) -> the member it belongs to."""
        self._info: EngineInfo | None = None
        self._replacements: list[Background] = []

    # ----------------------------------------------------------------- reading

    @property
    def engines(self) -> list[Engine]:
        """The group's engines now (a replaced engine's successor in its place)."""
        return [m.engine for m in self._members]

    @property
    def live(self) -> int:
        """How many of the engines serve steps now."""
        return sum(1 for m in self._members if m.serves)

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise UserError("the group's info is known once it is open")
        return self._info

    @property
    def is_dead(self) -> bool:
        """Whether no engine of the group can serve (each died, none is being replaced)."""
        return self.is_open and not any(m.serves or m.replacing for m in self._members)

    def check_open(self) -> None:
        self._require_open()
        if self.is_dead:
            raise EngineDeadError("every engine of the group died")

    # ----------------------------------------------------------------- lifecycle

    async def _start(self) -> None:
        for member in self._members:  # one at a time: engines starting together fight for the cores
            await member.engine.open(home=self.home)
        infos = [m.engine.info for m in self._members]
        if len({info.model_path for info in infos}) > 1:
            raise UserError("the engines of a group must serve one model")
        self._info = dataclasses.replace(
            infos[0],
            max_model_len=min(info.max_model_len for info in infos),
            pins=all(info.pins for info in infos),
            places_steps=all(info.places_steps for info in infos),
            off_reasons={key: why for info in reversed(infos) for key, why in info.off_reasons.items()},
            details={**infos[0].details, "engines": len(infos)},
        )

    async def _stop(self) -> None:
        for replacement in self._replacements:
            await replacement.stop()
        for member in self._members:
            await member.engine.aclose()

    # ----------------------------------------------------------------- steps

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        """The step on its pair; a pair that dies before its first token gets the step re-placed once."""
        self.check_open()
        member, placed = self._place(request)
        started = False
        try:
            async for event in self._step_on(member, placed, forwarded=request.pin is not None):
                started = True
                yield event
        except EngineDeadError:
            if started or not member.engine.is_dead or not any(m.serves for m in self._members):
                raise
            logger.warning("agentkv: a pair died before the step's first token; re-placing the step")
            member, placed = self._place(dataclasses.replace(request, pin=None))
            async for event in self._step_on(member, placed, forwarded=request.pin is not None):
                yield event

    async def _step_on(self, member: _Member, request: StepRequest, *, forwarded: bool) -> AsyncIterator[StepEvent]:
        lost = forwarded and request.pin is None  # forwarded, but its pair is gone: the step says declined
        member.in_flight += 1
        try:
            async for event in member.engine.step(request):
                if isinstance(event, StepDone):
                    if event.pin is not None:
                        handle = handle_of(event.pin)
                        self._owners[handle.remote_engine_id] = member
                        member.pins.add(handle.remote_request_id)
                    if lost:
                        timings = event.timings.model_copy(update={"pin_declined": True})
                        event = dataclasses.replace(event, timings=timings)
                yield event
        finally:
            member.in_flight -= 1
            if member.engine.is_dead:
                self._lost(member)

    def _place(self, request: StepRequest) -> tuple[_Member, StepRequest]:
        """The member for ``request`` and the request as it goes there (without a pin its pair cannot read)."""
        for member in self._members:
            if member.engine.is_dead and not member.replacing:
                self._lost(member)
        handle = handle_of(request.pin)
        if handle is not None:
            owner = self._owners.get(handle.remote_engine_id)
            if owner is not None and owner.serves:
                owner.pins.discard(handle.remote_request_id)
                return owner, request
            logger.info("agentkv: a conversation's pair is gone; its step recomputes on another")
            request = dataclasses.replace(request, pin=None)
        serving = [m for m in self._members if m.serves]
        if not serving:
            raise EngineDeadError("every engine of the group died")
        return min(serving, key=lambda m: (m.in_flight, len(m.pins))), request

    def cut_pin(self, pin: Pin, tokens: int) -> Pin | None:
        """The pin cut by the member whose pair made it (None: its pair is gone)."""
        handle = pin.ref
        owner = self._owners.get(handle.remote_engine_id) if isinstance(handle, KVHandle) else None
        return owner.engine.cut_pin(pin, tokens) if owner is not None and owner.serves else None

    async def release(self, pin: Pin) -> None:
        handle = pin.ref
        if not isinstance(handle, KVHandle):  # no member's pin: nothing to release (a release never raises)
            return
        owner = self._owners.get(handle.remote_engine_id)
        if owner is not None and owner.serves:
            owner.pins.discard(handle.remote_request_id)
            await owner.engine.release(pin)

    # ----------------------------------------------------------------- dead engines

    def _lost(self, member: _Member) -> None:
        """A member died: forget its pins; start its replacement if the group knows how (once)."""
        for engine_id in [k for k, m in self._owners.items() if m is member]:
            del self._owners[engine_id]
        member.pins.clear()
        if self._replace is None or member.replacing or member.given_up or not self.is_open:
            return
        assert self.home is not None  # an open group has its home
        member.replacing = True
        self._replacements = [r for r in self._replacements if not r.ended]
        self._replacements.append(
            start_background(self.home, self._replace_member, member)
        )  # the group's close stops it

    async def _replace_member(self, member: _Member) -> None:
        assert self._replace is not None
        dead = member.engine
        logger.warning("agentkv: an engine of the group died; starting its replacement while the others serve")
        successor: Engine | None = None
        try:
            await dead.aclose()
            successor = self._replace(dead)
            await successor.open(home=self.home)
        except BaseException as exc:
            member.given_up = not isinstance(exc, anyio.get_cancelled_exc_class())
            if member.given_up:
                logger.warning("agentkv: replacing a dead engine of the group failed; it stays out", exc_info=True)
            if successor is not None:
                with anyio.CancelScope(shield=True):
                    await successor.aclose()
            if not member.given_up:
                raise
            return
        finally:
            member.replacing = False
        member.engine = successor
