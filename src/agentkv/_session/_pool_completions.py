"""`SessionPool.complete`'s work: a raw-token prompt (``POST /v1/completions``) on a tenant's completions session.

A named completions conversation keeps its own session in the pool (`Member.raw`: apart from a chat conversation of
the same name, whose history is messages), with the same tenancy, quotas and idle closing as a chat's; it is not
saved in the pool's store (a raw prompt has no messages to rebuild from: after a restart its next step computes its
prompt once). A request that names no conversation runs on a one-shot session, closed (its pin released) after its
step: an editor's requests without a key share nothing but P's prefix cache.
`streamed_completion` turns a step's ``on_delta`` calls into an async generator (as `SessionPool.stream` does).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypedDict

import anyio

from .._engines._sampling import SamplingOptions
from .._errors import SessionBusyError
from ._pool_members import Member
from ._pool_stream import pumped
from ._results import Step, TextDelta
from ._session import Session
from ._tenancy import tenant_salt

if TYPE_CHECKING:
    from ._pool import SessionPool

__all__ = ["CompletionOptions", "pooled_completion", "streamed_completion"]


class CompletionOptions(TypedDict, total=False):
    """`Session.complete`'s keyword arguments (see there)."""

    max_tokens: int | None
    temperature: float | None
    seed: int | None
    stop: str | Sequence[str] | None
    sampling: SamplingOptions | None
    on_delta: Callable[[TextDelta], None] | None


async def pooled_completion(
    pool: SessionPool,
    prompt: Sequence[int],
    conversation_id: str | None,
    tenant: str | None,
    cache_salt: str | None,
    options: CompletionOptions,
) -> Step:
    """The step on the pool's loop: on the named conversation's completions session (made when new), else on a
    one-shot session. A named conversation running a step raises `SessionBusyError`."""
    await pool._close_idle()
    salt = tenant_salt(pool._config.cache_salt, tenant, cache_salt)
    if conversation_id is None:
        session = Session._of_config(pool._tenant_config(tenant), pool.engine)
        try:
            await session.open(home=pool.home)
            return await session.complete(prompt, cache_salt=salt, **options)
        finally:
            with anyio.CancelScope(shield=True):
                await session.aclose()  # its pin released: one-shot
    member = await _member(pool, conversation_id, tenant)
    try:
        return await member.session.complete(prompt, cache_salt=salt, **options)
    except BaseException:
        if not member.session.stats.turns and member in pool._members:
            with anyio.CancelScope(shield=True):  # a session whose first step failed holds nothing: not kept
                await pool._close(member, "its first step did not complete")
        raise
    finally:
        member.busy = False
        member.used = time.monotonic()
        pool._trim_pins(tenant)


async def _member(pool: SessionPool, conversation_id: str, tenant: str | None) -> Member:
    """The named completions conversation's member, marked busy (no await between the choice and the mark)."""
    named = pool._named(conversation_id, tenant, raw=True)
    if named is not None:
        if named.busy:
            raise SessionBusyError(f"conversation {conversation_id!r} is already running a step")
        named.busy = True
        return named
    session = Session._of_config(pool._tenant_config(tenant), pool.engine, conversation_id=conversation_id)
    member = Member(session, conversation_id, busy=True, tenant=tenant, raw=True)
    pool._members.append(member)  # before opening: a second step of this conversation sees it busy
    try:
        await session.open(home=pool.home)
    except BaseException:
        pool._members.remove(member)
        with anyio.CancelScope(shield=True):
            await session.aclose()
        raise
    await pool._close_beyond_limit(tenant)
    return member


def streamed_completion(
    step: Callable[[Callable[[TextDelta], None]], Awaitable[Step]],
) -> AsyncGenerator[TextDelta | Step]:
    """The `TextDelta`s ``step(on_delta)`` gives, then its `Step`; its error raised. From any loop (the pool's may be
    another thread's: src/agentkv/_session/_pool_stream.py); a consumer that stops early cancels the step."""
    return pumped(step, Step)
