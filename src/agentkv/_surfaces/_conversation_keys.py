"""Which conversation a request continues: its key, read the same way by every route of the door.

A client names its conversation (the pool keeps one session per named conversation, whose KV is pushed back at its
next request) in one of these, the first given winning:

1. the ``x-session-id`` header;
2. the body's ``session_id`` (vLLM's field for a stable session identity);
3. the body's ``conversation_id`` (what vLLM's own multi-turn benchmark sends);
4. the body's ``prompt_cache_key`` (OpenAI's field for requests that share a prefix).

``user`` is never a key: it names an end user, who may hold several conversations at once (it is metadata,
echoed by the Responses API). A request with none of them is matched by its history among its tenant's sessions.

Each key is an id (src/agentkv/_surfaces/_bounds.py: 1 to 256 visible ASCII characters), refused with a 400 naming
its field otherwise, before anything runs: it is echoed in the answer's ``x-session-id`` header and names stored
rows. A key is its tenant's alone: two tenants' ``"c1"`` are two conversations.

`conversation_key` is the one place this is decided: every route that steps a conversation calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from ._bounds import body_field, check_id

__all__ = ["KEY_FIELDS", "SESSION_HEADER", "conversation_key"]

SESSION_HEADER = "x-session-id"
"""The header that names a conversation (first of all)."""

KEY_FIELDS = ("session_id", "conversation_id", "prompt_cache_key")
"""The body fields that name a conversation, in the order they are read (after `SESSION_HEADER`)."""


def conversation_key(headers: Mapping[str, str], body: BaseModel | Mapping[str, Any]) -> str | None:
    """The conversation ``headers`` and ``body`` (a parsed request, or its JSON object) name, in the module's
    order (None: none named); a key that is not an id is a `BoundError` naming its field."""
    header = headers.get(SESSION_HEADER)
    if header is not None:
        return check_id(SESSION_HEADER, header)
    for name in KEY_FIELDS:
        value = body_field(body, name)
        if value is not None:
            return check_id(name, value)
    return None
