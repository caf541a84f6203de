"""`SessionPool`: whole conversations in, each routed to the session that holds its KV.

Agent frameworks and HTTP clients send the whole conversation with every model call and
rarely say which conversation it is. The pool keeps one `Session` per conversation on one
engine and sends each `step` to the session named by ``conversation_id``, else to an idle
session whose history the messages extend exactly (`Session.extends`), else to a new one.
Idle sessions past ``idle_ttl_s`` or beyond ``max_sessions`` (least recently used first)
are closed, and D's blocks for them released. A step may name its tenant: tenants' conversations never meet
(names, history matching, store keys, the prefix cache, room: src/agentkv/_session/_tenancy.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, Unpack, overload

import anyio
import anyio.to_thread
from pydantic import ValidationError

from .._conversation._conversation import Message
from .._engines import Engine
from .._engines._base import SavedPin
from .._engines._sampling import SamplingOptions
from .._errors import SessionBusyError, UserError
from .._home import Background, start_background
from .._postgres import StoreLease
from ._engine_user import EngineUser
from ._message_step import MessageRequest, StepOptions
from ._pool_completions import CompletionOptions, pooled_completion
from ._pool_members import Member, Offers, offered_id
from ._pool_stream import streamed_step
from ._results import ReasoningDelta, Step, StepReply, TextDelta, ToolCallDelta
from ._session import Session
from ._session_config import SessionConfig
from ._session_core import make_engine
from ._session_store import SessionStore, check_session_store, conversation_key, history_key, leased
from ._tenancy import Quotas, evictable, over_pinned, tenant_salt
from ._tool_sources import ToolSources

__all__ = ["SessionPool"]

logger = logging.getLogger("agentkv")


class SessionPool(EngineUser):
    """Sessions on one engine, one per conversation, for callers that send whole conversations.

    Open it like a session (``with SessionPool() as pool`` or ``async with``); closing it closes
    its sessions and, when the pool opened it, its engine.

    Args:
        engine: the engine for every session. An open engine is shared (its owner closes it);
            an unopened one is opened by the pool and closes with it. Default: the pool starts
            the embedded pair (or the engine ``mode`` asks for).
        max_sessions: the most sessions kept; beyond it the least recently used idle one is closed.
        idle_ttl_s: a session unused this long is closed (its pin released).
        store: where each session's snapshot is saved after every step (e.g. `SqliteSessionStore`): a
            conversation not live in the pool (closed when idle, or before a restart) resumes from it,
            token for token. Default: none (such a conversation is rebuilt from its messages).
            The caller closes a store it passes; a ``postgresql://`` URL opens a `PostgresSessionStore`
            that the pool closes. A step that cannot be saved (`StoreUnavailableError`:
            the store's file locked, full, read-only) raises instead of answering, and its session is
            closed: the conversation's next step resumes from its last saved step. A named conversation's
            step holds its lease in the store (`SessionStore.lease`: a PostgreSQL store several doors
            share); one another door holds is a `SessionBusyError`, as a busy session is. With a store that
            offers pins (PostgreSQL), a named conversation's pin renewed or moved early between steps
            (`Session`'s ``renew_pins``, ``early_transfer``) is taken off offer first and the new one offered
            after (src/agentkv/_session/_pool_members.py), so the door that steps the conversation next pulls
            the live one.
        tenant_max_sessions: the most sessions one tenant keeps (a step's ``tenant``); past it, its own least
            recently used idle session is closed. Beyond ``max_sessions`` in all, the idle session closed is the
            least recently used of the tenant holding the most, so that one tenant's new conversations close its
            own before another's.
        tenant_max_pinned_tokens: the most tokens of one tenant's conversations pinned on D between its steps;
            past it, the pins of its least recently used idle sessions are dropped (their next steps recompute).
        session_options: keyword arguments of each `Session` (``system``, ``mode``, ``tool_format``,
            ``tool_call_parser`` and ``reasoning_parser`` (vLLM's parsers, by name), ``max_tokens``, ``temperature``, ``seed``, ``sampling`` (`SamplingOptions`: every session's
            defaults, which a step's ``sampling=`` overrides field by field), ``cache_salt``; ``model`` and
            ``engine_options`` for the pool's own engine).
    """

    def __init__(
        self,
        *,
        engine: Engine | None = None,
        max_sessions: int = 64,
        idle_ttl_s: float = 600.0,
        store: SessionStore | str | None = None,
        tenant_max_sessions: int | None = None,
        tenant_max_pinned_tokens: int | None = None,
        **session_options: Any,
    ) -> None:
        super().__init__()
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise UserError(f"max_sessions must be a positive int, not {max_sessions!r}")
        if not idle_ttl_s > 0:
            raise UserError(f"idle_ttl_s must be positive, not {idle_ttl_s!r}")
        if engine is not None and ("model" in session_options or "engine_options" in session_options):
            raise UserError("model= and engine_options= configure the pool's own engine; not with engine=")
        self._config = SessionConfig.of_options(session_options, owner=type(self).__name__)
        """Every session's configuration (each step's request is read once, with it), and the pool's own engine's."""
        self._use_engine(engine)
        self.store = check_session_store(store)
        self._owns_store = self.store is not store
        """Whether the pool opened its store (from a URL), and so closes it."""
        self._members: list[Member] = []
        self._offered: dict[str, str] = {}
        """The pins this pool's saves offered (`SessionStore.offers_pins`) and not yet taken back: id -> key."""
        self._reaper: Background | None = None
        self._sources = ToolSources()
        """The MCP servers among the tools: those the pool opened close with it; its sessions share them."""
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self.quotas = Quotas(max_sessions=tenant_max_sessions, max_pinned_tokens=tenant_max_pinned_tokens)
        """What one tenant may hold (src/agentkv/_session/_tenancy.py)."""

    # ----------------------------------------------------------------- lifecycle

    def _make_engine(self) -> Engine:
        return make_engine(self._config)

    async def _open_resources(self) -> None:
        await self._open_engine()
        if self.store is not None and self.store.offers_pins:
            self.engine.guard_releases(self._may_release)
        assert self.home is not None  # set by open, before the resources are
        self._config = await self._sources.open(self._config, self.home)
        self._reaper = start_background(self.home, self._reap)

    async def _reap(self) -> None:
        """Close idle sessions as they pass ``idle_ttl_s``, whether or not requests come."""
        while True:
            await anyio.sleep(min(self.idle_ttl_s / 2, 30.0))
            await self._close_idle()

    async def _close_resources(self) -> None:
        if self._reaper is not None:
            await self._reaper.stop()
        members, self._members = self._members, []
        for member in members:
            await member.session.aclose()
        await self._sources.close()
        if self.store is not None and self.store.offers_pins and self._engine is not None:
            self._engine.guard_releases(None)
        await self._close_engine()
        if self._owns_store and self.store is not None:
            await anyio.to_thread.run_sync(self.store.close)

    # ----------------------------------------------------------------- reading

    @property
    def sessions(self) -> list[Session]:
        """The live sessions, least recently used first."""
        return [m.session for m in sorted(self._members, key=lambda m: m.used)]

    @property
    def conversations(self) -> list[str]:
        """The named conversations live in the pool, of every tenant, least recently used first."""
        return [m.conversation_id for m in sorted(self._members, key=lambda m: m.used) if m.conversation_id is not None]

    def conversations_of(self, tenant: str | None) -> list[str]:
        """``tenant``'s named conversations live in the pool, least recently used first."""
        members = sorted((m for m in self._members if m.tenant == tenant), key=lambda m: m.used)
        return [m.conversation_id for m in members if m.conversation_id is not None]

    def session_for(self, conversation_id: str, *, tenant: str | None = None) -> Session | None:
        """The session of ``tenant``'s named conversation, if it is live."""
        member = self._named(conversation_id, tenant)
        return member.session if member is not None else None

    def _named(self, conversation_id: str, tenant: str | None, *, raw: bool = False) -> Member | None:
        """The member of ``tenant``'s named conversation: a chat's, or with ``raw`` a completions' one."""
        return next(
            (m for m in self._members if m.conversation_id == conversation_id and m.tenant == tenant and m.raw == raw),
            None,
        )

    async def forget(self, conversation_id: str, *, tenant: str | None = None) -> bool:
        """Forget ``tenant``'s named conversation: its live session closed (its pin released) and its saved
        snapshot deleted. False when there was neither; a conversation running a step raises `SessionBusyError`."""
        self._require_open()
        assert self._home is not None
        if not self._home.is_current():
            return await self._home.call_async(functools.partial(self._forget, conversation_id, tenant))
        return await self._forget(conversation_id, tenant)

    async def _forget(self, conversation_id: str, tenant: str | None) -> bool:
        key = conversation_key(conversation_id, tenant)
        async with leased(self.store, key):  # a store several doors share: not while another door steps it
            member = self._named(conversation_id, tenant)
            if member is not None and member.busy:
                raise SessionBusyError(f"conversation {conversation_id!r} is running a step")
            if member is not None:
                member.busy = True
                await self._close(member, "forgotten")
            completions = self._named(conversation_id, tenant, raw=True)
            if completions is not None and not completions.busy:  # its completions' session too (never stored)
                completions.busy = True
                await self._close(completions, "forgotten")
                member = member or completions
            store = self.store
            if store is None:
                return member is not None

            def delete() -> bool:
                saved = store.get(key) is not None
                store.delete(key)
                return saved

            saved = await anyio.to_thread.run_sync(delete)
            return member is not None or saved

    # ----------------------------------------------------------------- stepping

    async def step(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        conversation_id: str | None = None,
        tenant: str | None = None,
        cache_salt: str | None = None,
        **options: Unpack[StepOptions],
    ) -> StepReply:
        """`Session.step` (the same arguments) on the conversation's session (see the class for how it is found).

        ``tenant``: whose conversation it is (None: the default tenant's); its name, its history matching, its
        store key and its prefix cache are that tenant's alone (src/agentkv/_session/_tenancy.py).
        ``cache_salt``: the step's own prefix-cache salt, over the tenant's (as vLLM's request ``cache_salt``).
        A named conversation whose session is running a step raises `SessionBusyError`.
        """
        self._require_open()
        assert self._home is not None
        step = functools.partial(self._step, messages, conversation_id, options, tenant, cache_salt)
        if not self._home.is_current():
            return await self._home.call_async(step)
        return await step()

    async def complete(
        self,
        prompt_token_ids: Sequence[int],
        *,
        conversation_id: str | None = None,
        tenant: str | None = None,
        cache_salt: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        sampling: SamplingOptions | None = None,
        on_delta: Callable[[TextDelta], None] | None = None,
    ) -> Step:
        """`Session.complete` (a raw-token prompt, the same sampling arguments) on ``tenant``'s completions session named ``conversation_id``
        (src/agentkv/_session/_pool_completions.py; `streamed_completion` streams it); None: a one-shot session,
        closed after the step."""
        self._require_open()
        assert self._home is not None
        options = CompletionOptions(
            max_tokens=max_tokens, temperature=temperature, seed=seed, stop=stop, sampling=sampling, on_delta=on_delta
        )
        step = functools.partial(
            pooled_completion, self, prompt_token_ids, conversation_id, tenant, cache_salt, options
        )
        if not self._home.is_current():
            return await self._home.call_async(step)
        return await step()

    def step_sync(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        conversation_id: str | None = None,
        tenant: str | None = None,
        cache_salt: str | None = None,
        **options: Unpack[StepOptions],
    ) -> StepReply:
        """Blocking `step`, for a pool opened with ``with``."""
        self._require_open()
        assert self._home is not None
        return self._home.call(functools.partial(self._step, messages, conversation_id, options, tenant, cache_salt))

    @overload
    def stream(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        conversation_id: str | None = None,
        tenant: str | None = None,
        cache_salt: str | None = None,
        first_token: bool = False,
        deltas: Literal[False] = False,
        **options: Unpack[StepOptions],
    ) -> AsyncGenerator[str | StepReply]: ...
    @overload
    def stream(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        conversation_id: str | None = None,
        tenant: str | None = None,
        cache_salt: str | None = None,
        first_token: bool = False,
        deltas: Literal[True],
        **options: Unpack[StepOptions],
    ) -> AsyncGenerator[str | ToolCallDelta | ReasoningDelta | StepReply]: ...
    def stream(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        conversation_id: str | None = None,
        tenant: str | None = None,
        cache_salt: str | None = None,
        first_token: bool = False,
        deltas: bool = False,
        **options: Unpack[StepOptions],
    ) -> AsyncGenerator[str | ToolCallDelta | ReasoningDelta | StepReply]:
        """`step`, as the answer's text pieces while they are generated, then the `StepReply`.

        With ``deltas``, the `ToolCallDelta` and `ReasoningDelta` pieces come too, in order with the text (a
        front door streams tool-call arguments and reasoning as they are written).

        With ``first_token``, an empty string comes first, when the model's first token arrives
        (for a client's TTFT when the step calls tools and streams no text). Works from any
        asyncio loop (the pool may run on another). A consumer that stops early cancels the
        step, which then changes nothing in the session. When the step asks for ``logprobs`` (``sampling=``),
        each text piece is a `TextPiece` carrying the log probabilities of the tokens since the last piece
        (all of them are in the reply's ``step.logprobs``).
        """

        def step(streamed: StepOptions) -> Awaitable[StepReply]:
            return self.step(
                messages, conversation_id=conversation_id, tenant=tenant, cache_salt=cache_salt, **streamed
            )

        return streamed_step(step, options, first_token=first_token, deltas=deltas)

    async def _step(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        conversation_id: str | None,
        options: StepOptions,
        tenant: str | None = None,
        cache_salt: str | None = None,
    ) -> StepReply:
        await self._close_idle()
        self._config = self._sources.newer(self._config) or self._config  # a changed MCP list, taken now
        request = MessageRequest.build(self._tenant_config(tenant, cache_salt), messages, options)
        key = conversation_key(conversation_id, tenant) if conversation_id is not None else None
        async with leased(self.store, key) as lease:  # a store several doors share: one door at a time
            return await self._step_member(request, conversation_id, tenant, options, lease)

    def _tenant_config(self, tenant: str | None, cache_salt: str | None = None) -> SessionConfig:
        """The pool's session configuration with ``tenant``'s cache salt (and a request's own over it)."""
        salt = tenant_salt(self._config.cache_salt, tenant, cache_salt)
        return self._config if salt == self._config.cache_salt else self._config.model_copy(update={"cache_salt": salt})

    async def _step_member(
        self,
        request: MessageRequest,
        conversation_id: str | None,
        tenant: str | None,
        options: StepOptions,
        lease: StoreLease | None,
    ) -> StepReply:
        member = await self._member_for(request, conversation_id, tenant, lease)
        try:
            reply = await member.session._step_request(
                request,
                on_text=options.get("on_text"),
                on_first_token=options.get("on_first_token"),
                on_tool_call=options.get("on_tool_call"),
                on_reasoning=options.get("on_reasoning"),
            )
            if self.store is not None:
                try:
                    await self._save(member, history=[*request.messages, reply.message])
                except Exception:  # not answered: the live session goes, the next step resumes from the last saved one
                    with anyio.CancelScope(shield=True):
                        await self._close(member, "its step could not be saved")
                    raise
            return reply
        except BaseException:
            if not member.session.stats.turns and member.saved_key is None and member in self._members:
                with anyio.CancelScope(shield=True):  # a session whose first step failed or was cancelled holds
                    await self._close(member, "its first step did not complete")  # nothing: not kept
            raise
        finally:
            member.busy = False
            member.used = time.monotonic()
            self._trim_pins(tenant)

    def _trim_pins(self, tenant: str | None) -> None:
        """Drop the pins that take ``tenant`` past its quota of pinned tokens (`Quotas`)."""
        for member in over_pinned(self._members, quotas=self.quotas, tenant=tenant):
            logger.debug("agentkv: dropping a pooled session's pin (its tenant is over its pinned tokens)")
            with member.session._lock:
                member.session._drop_pin()

    async def _member_for(
        self, request: MessageRequest, conversation_id: str | None, tenant: str | None, lease: StoreLease | None
    ) -> Member:
        """The conversation's member, marked busy (no await between the choice and the mark).

        With a store several doors share, ``lease`` says what taking the conversation's lease found: a member
        saved under another number than the store's last is stale (another door stepped the conversation
        since: it is closed, its pin left alone, and the conversation resumes from the store); the pin the store
        offered is this door's now (the member's own, or one another door left, adopted on resuming). A member
        whose offered pin the lease did not take off offer keeps its conversation but not its pin: another door
        took the pin and saved no step (its step failed or was cancelled, or it died, perhaps after pushing the
        pin back), so it is dropped, never pushed back (its release is refused by the guard: not on offer)."""
        saved_key: str | None
        if conversation_id is not None:
            named = self._named(conversation_id, tenant)
            if named is not None and named.busy:
                raise SessionBusyError(f"conversation {conversation_id!r} is already running a step")
            if named is not None and lease is not None and lease.written not in (None, named.written):
                named.busy = True  # until closed: no other step takes it meanwhile
                await self._close(named, "another door stepped its conversation since")
                named = None
            if named is not None:
                if lease is not None and named.offered is not None:  # the lease took it off offer: ours again
                    if offered_id(lease) != named.offered:  # or another door did: the guard refuses its release
                        logger.debug("agentkv: another door took a pooled session's pin; the step recomputes")
                        with named.session._lock:
                            named.session._drop_pin()
                    else:
                        self._offered.pop(named.offered, None)
                    named.offered = None
                named.busy = True
                return named
            saved_key = conversation_key(conversation_id, tenant)
        else:
            for member in sorted(self._members, key=lambda m: m.used, reverse=True):
                if (
                    not member.busy
                    and member.conversation_id is None
                    and member.tenant == tenant  # a tenant's history matches its own sessions only
                    and member.session._extends_request(request)
                ):
                    member.busy = True
                    return member
            answered = [i for i, m in enumerate(request.messages) if m.role == "assistant"]
            saved = self.store is not None and answered  # the digest only when there is a store to look in
            saved_key = history_key(request.messages[: answered[-1] + 1], tenant) if saved else None
        session = Session._of_config(self._tenant_config(tenant), self.engine, conversation_id=conversation_id)
        member = Member(session, conversation_id, busy=True, tenant=tenant)
        if self.store is not None and self.store.offers_pins and conversation_id is not None:
            key = conversation_key(conversation_id, tenant)
            member.session._pin_offers = Offers(member, self.store, key, offered=self._offered, members=self._members)
        self._members.append(member)  # before opening: a second step of this conversation sees it busy
        try:
            await member.session.open(home=self.home)
            if self.store is not None and saved_key is not None:
                await self._resume(member, saved_key, lease)
        except BaseException:
            self._members.remove(member)
            with anyio.CancelScope(shield=True):
                await member.session.aclose()
            raise
        await self._close_beyond_limit(tenant)
        return member

    async def _resume(self, member: Member, key: str, lease: StoreLease | None) -> None:
        """Restore the member's session from the store's snapshot under ``key``, if there is one that fits, with
        the pin the lease took off offer (unless the lease was taken over from a door that died: it may have
        used that pin in a step it never saved)."""
        assert self.store is not None
        snapshot = await anyio.to_thread.run_sync(self.store.get, key)
        if snapshot is None:
            return
        try:
            member.session.restore(snapshot)
        except UserError as exc:  # another model, or damaged: the conversation is rebuilt from the messages
            logger.info("agentkv: a saved session could not be restored (%s); rebuilding it", exc)
            return
        member.saved_key = key
        if lease is not None:
            member.written = lease.written
            if lease.pin is not None and not lease.took_over:
                with contextlib.suppress(ValidationError):  # damaged: the prompt is computed, as without a pin
                    member.session._adopt_pin(SavedPin.model_validate_json(lease.pin))
        logger.debug("agentkv: resumed a pooled session from the store")

    async def _may_release(self, pin_id: str) -> bool:
        """The engine's release guard: a pin this pool offered is released only once taken back off offer."""
        key = self._offered.pop(pin_id, None)
        if key is None or self.store is None:
            return True
        try:
            return await anyio.to_thread.run_sync(self.store.take_pin_back, key, pin_id)
        except Exception as exc:  # not known to be off offer: left to expire on D
            logger.debug("agentkv: an offered pin could not be taken back (%s); it expires", exc)
            return False

    async def _save(self, member: Member, *, history: Sequence[Message]) -> None:
        """Save the member's session after a step (an unnamed one under its new history, the old key dropped).

        A save that fails raises (`SqliteSessionStore`: `StoreUnavailableError`): `_step` then drops the
        member and does not answer, so every answered step is saved and the store keeps the last saved one."""
        assert self.store is not None
        store, snapshot = self.store, member.session.snapshot()
        if member.conversation_id is not None:
            key = conversation_key(member.conversation_id, member.tenant)
        else:
            key = history_key(history, member.tenant)
        previous, member.saved_key = member.saved_key, key

        def save(pin: SavedPin | None) -> None:
            member.written = store.put(key, snapshot, pin=pin) if store.offers_pins else store.put(key, snapshot)
            if previous is not None and previous != key:
                try:
                    store.delete(previous)
                except Exception as exc:  # the step is saved; the old snapshot stays (the old history's own)
                    logger.warning("agentkv: a superseded session snapshot could not be dropped: %s", exc)

        with anyio.CancelScope(shield=True):  # the step is done: its snapshot is saved even if the caller left
            async with member.offering:  # not beside an upkeep step's offer or take-back (`Offers`)
                pin = member.session._saved_pin() if store.offers_pins and member.conversation_id else None
                if pin is not None:  # offered from before the save on: a release from now on asks the store first
                    self._offered[pin.id] = key
                    member.offered = pin.id
                await anyio.to_thread.run_sync(save, pin)

    async def _close_idle(self) -> None:
        for member in list(self._members):
            if not member.busy and time.monotonic() - member.used > self.idle_ttl_s:  # rechecked: closing awaits
                await self._close(member, "idle")

    async def _close_beyond_limit(self, tenant: str | None) -> None:
        """Close idle sessions while ``tenant`` (which just added one) is over its quota or the pool over
        ``max_sessions`` (`evictable`: the tenant holding the most loses one first)."""
        while member := evictable(self._members, max_sessions=self.max_sessions, quotas=self.quotas, tenant=tenant):
            await self._close(member, "over max_sessions")

    async def _close(self, member: Member, why: str) -> None:
        logger.debug("agentkv: closing a pooled session (%s)", why)
        self._members.remove(member)
        await member.session.aclose()  # its pin released (the guard asked) or skipped (it was about to expire)
        if member.offered is not None:  # either way no one asks again: the entry goes (idle closes outlive pins)
            self._offered.pop(member.offered, None)
