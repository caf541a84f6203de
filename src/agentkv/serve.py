"""The front door's parts, for those who embed `agentkv serve` in their own server or store its data elsewhere.

`agentkv serve` (the command) needs none of this; `FrontDoor` is the ASGI application behind it,
`ResponseStore` the contract of the Responses API's stored replies (in memory or in SQLite), and
`SavedTranscript` / `SavedSegment` what a session snapshot keeps so that a door can match a
client's resent history to its pinned conversation (docs/serve.md).

    from agentkv.serve import FrontDoor
"""

from __future__ import annotations

from ._public import present_as as _present_as
from ._session._snapshot import SavedSegment, SavedTranscript
from ._surfaces._response_store import (
    MemoryResponseStore,
    PostgresResponseStore,
    ResponseStore,
    SqliteResponseStore,
    StoredResponse,
)
from ._surfaces._serve import FrontDoor

__all__ = [
    "FrontDoor",
    "MemoryResponseStore",
    "PostgresResponseStore",
    "ResponseStore",
    "SavedSegment",
    "SavedTranscript",
    "SqliteResponseStore",
    "StoredResponse",
]

_present_as(__name__, globals(), __all__)
