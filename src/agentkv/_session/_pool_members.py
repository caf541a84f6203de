"""A `SessionPool`'s members (`Member`: a session and what the pool knows of it), and the pins a pool offers to other
doors through a store several doors share (src/agentkv/_postgres.py, "Pins"): `offered_id`, what taking a lease took
off offer; `Offers`, a member's upkeep steps taking its pin back before they give it to D and offering the new one
after (`agentkv._session._pin_upkeep.PinOffers`).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
from pydantic import ValidationError

from .._engines import Pin
from .._engines._base import SavedPin
from .._postgres import StoreLease
from ._session import Session
from ._session_store import SessionStore

__all__ = ["Member", "Offers", "offered_id"]

logger = logging.getLogger("agentkv")


@dataclass(eq=False)
class Member:
    """A pool's session and what the pool knows of it."""

    session: Session
    conversation_id: str | None
    busy: bool = False
    tenant: str | None = None
    """Whose conversation it is (src/agentkv/_session/_tenancy.py; None: the default tenant)."""
    used: float = field(default_factory=time.monotonic)
    saved_key: str | None = None
    """Where its last snapshot is in the pool's store."""
    written: int | None = None
    """The store's number of that save, where it numbers them (a store several doors share)."""
    offered: str | None = None
    """The id of the pin that save offered to the door that steps the conversation next."""
    raw: bool = False
    """Its conversation is raw-token completions (`SessionPool.complete`), apart from a chat's of the same name."""
    offering: anyio.Lock = field(default_factory=anyio.Lock)
    """Held while the pool offers the session's pin or takes it back (its save, `Offers`): one at a time."""


def offered_id(lease: StoreLease) -> str | None:
    """The id of the pin the lease took off offer (None: none, or one too damaged to read)."""
    if lease.pin is None:
        return None
    try:
        return SavedPin.model_validate_json(lease.pin).id
    except ValidationError:
        return None


class Offers:
    """A named conversation's pin as its member's upkeep steps offer it (`PinOffers`; src/agentkv/_postgres.py,
    "Pins"): taken back off offer before one gives it to D, the new one offered after on the row as the member's
    last save left it. Where the row moved on (another door stepped the conversation, or holds its lease now), the
    new pin is this door's alone: the session drops it (released: no other door can have it).

    ``offered`` is the pool's record of the pins its saves offered (id -> key), which its release guard reads;
    ``members`` its live members."""

    def __init__(
        self, member: Member, store: SessionStore, key: str, *, offered: dict[str, str], members: list[Member]
    ) -> None:
        self._member, self._store, self._key = member, store, key
        self._offered, self._members = offered, members

    async def take_back(self, pin: Pin) -> bool:
        member, engine = self._member, self._member.session._engine
        saved = engine.saved_pin(pin) if engine is not None else None
        async with member.offering:
            if saved is None or member.offered != saved.id:  # not on offer (the lease took it, or never): this door's
                return True
            try:
                taken = await anyio.to_thread.run_sync(self._store.take_pin_back, self._key, saved.id)
            except Exception as exc:  # not known to be off offer: not given back (the guard asks again to release)
                logger.debug("agentkv: an offered pin could not be taken back (%s); it is not renewed", exc)
                return False
            if taken:  # this door's alone again; if not, the guard's entry stays: its release asks the store
                self._offered.pop(saved.id, None)
                member.offered = None
            return taken

    async def offer(self) -> None:
        member = self._member
        async with member.offering:
            saved = member.session._saved_pin()
            if saved is None or saved.id == member.offered or member not in self._members or member.written is None:
                return  # nothing new, the member closed, or never saved here (nothing to offer it beside: ours alone)
            self._offered[saved.id] = self._key  # from before the offer on: a release asks the store first
            try:
                offered = await anyio.to_thread.run_sync(
                    functools.partial(self._store.offer_pin, self._key, saved, written=member.written)
                )
            except Exception as exc:  # perhaps offered: the guard's entry stays, so a release asks the store first
                logger.debug("agentkv: a renewed pin could not be offered (%s); it is dropped", exc)
                offered = False
            else:
                if not offered:
                    self._offered.pop(saved.id, None)
            if offered:
                member.offered = saved.id
                return
        logger.debug("agentkv: a renewed pin was not offered (the conversation moved on); it is dropped")
        with member.session._lock:
            held = member.session._pin
            if held is not None and member.session._engine is not None:
                now = member.session._engine.saved_pin(held.pin)
                if now is not None and now.id == saved.id:  # (a turn may have taken it meanwhile)
                    member.session._drop_pin()
