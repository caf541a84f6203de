"""A `SessionPool`'s tenants: what keeps one tenant's conversations from meeting another's.

A tenant is a name a step carries (``agentkv serve`` gives each API key's): the pool's members are each one
tenant's, and

* **names** are a tenant's own: a named conversation is found by its name and tenant, so two tenants' ``"c1"`` are
  two conversations; an unnamed one is matched by its history only among its tenant's sessions; its store key is
  its tenant's (src/agentkv/_store_table.py);
* **the prefix cache** is a tenant's own: its steps run under a cache salt of its own (`tenant_salt`, derived from
  the pool's and the tenant's name), so that P's and D's caches never give one tenant's blocks to another's
  prompt (``cached_tokens`` would otherwise tell one tenant what another sent); a request's own ``cache_salt``
  goes over it, as vLLM salts a request's;
* **room** is shared fairly (`Quotas`): beyond ``max_sessions`` the pool closes an idle session of the tenant
  that holds the most (the least recently used of its), so that one tenant flooding the pool with fresh
  conversations closes its own; a tenant may also be held to ``tenant_max_sessions`` sessions and
  ``tenant_max_pinned_tokens`` tokens pinned on D (its least recently used idle sessions' pins are dropped past
  it, never another tenant's).

A step that names no tenant is the default tenant's (a pool used from Python): its salt is the pool's own, and
its keys `DEFAULT_TENANT`'s.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .._errors import UserError
from ._pool_members import Member

__all__ = ["Quotas", "check_quota", "evictable", "over_pinned", "tenant_salt"]


def tenant_salt(pool_salt: str | None, tenant: str | None, request_salt: str | None = None) -> str | None:
    """The cache salt of ``tenant``'s steps (and of a request's own ``request_salt`` over it): the pool's salt when
    neither is given, else a digest of all three (hex: a salt vLLM takes, 32 characters)."""
    if tenant is None and request_salt is None:
        return pool_salt
    parts = json.dumps([pool_salt, tenant, request_salt], separators=(",", ":"))
    return hashlib.sha256(parts.encode()).hexdigest()[:32]


def check_quota(name: str, value: int | None) -> int | None:
    """``value``, checked to be None or a positive int (a `UserError` naming ``name`` otherwise)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UserError(f"{name} must be None or a positive int, not {value!r}")
    return value


@dataclass(frozen=True)
class Quotas:
    """What one tenant may hold in a pool (None: no bound of its own)."""

    max_sessions: int | None = None
    """The most sessions one tenant keeps; past it its least recently used idle one is closed."""
    max_pinned_tokens: int | None = None
    """The most tokens of one tenant's conversations pinned on D between its steps; past it the pins of its least
    recently used idle sessions are dropped (their next steps recompute)."""

    def __post_init__(self) -> None:
        check_quota("tenant_max_sessions", self.max_sessions)
        check_quota("tenant_max_pinned_tokens", self.max_pinned_tokens)


def evictable(members: Sequence[Member], *, max_sessions: int, quotas: Quotas, tenant: str | None) -> Member | None:
    """The idle member to close now, or None: one of ``tenant``'s (who just added one) past its own quota, else, past
    ``max_sessions`` in all, one of the tenant holding the most sessions (the least recently used of its idle
    ones; a tie goes to ``tenant``'s, then to the least recently used)."""
    own = [m for m in members if m.tenant == tenant]
    if quotas.max_sessions is not None and len(own) > quotas.max_sessions:
        idle = [m for m in own if not m.busy]
        if idle:
            return min(idle, key=lambda m: m.used)
    if len(members) <= max_sessions:
        return None
    held = Counter(m.tenant for m in members)
    idle = [m for m in members if not m.busy]
    if not idle:
        return None
    return min(idle, key=lambda m: (-held[m.tenant], m.tenant != tenant, m.used))


def over_pinned(members: Sequence[Member], *, quotas: Quotas, tenant: str | None) -> list[Member]:
    """``tenant``'s members whose pins go for it to hold at most ``quotas.max_pinned_tokens`` on D: its idle ones,
    the least recently used first (the one that just stepped last: a conversation alone over the quota pins
    nothing); a busy one's pin is its step's, never dropped."""
    limit = quotas.max_pinned_tokens
    if limit is None:
        return []
    own = sorted((m for m in members if m.tenant == tenant), key=lambda m: (m.busy, m.used))
    pinned = sum(m.session.pinned_tokens for m in own)
    dropped: list[Member] = []
    for member in own:
        if pinned <= limit:
            break
        tokens = member.session.pinned_tokens
        if tokens and not member.busy:
            dropped.append(member)
            pinned -= tokens
    return dropped
