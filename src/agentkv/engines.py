"""The engine contract, for those who implement an engine or drive one step by step.

Agent code does not need this module: `agentkv.Session` and the engines in `agentkv` are enough.
An engine is anything that implements `Engine`: it is opened and closed, reports `EngineInfo` (the
model, and flags saying what it can do), and runs each `StepRequest` as an async stream of `TokenDelta`
events ended by one `StepDone`; an engine that keeps KV between steps returns a `Pin`, opaque but for
how many tokens it keeps and until when, which the next step gives back (the contract and its rules:
src/agentkv/_engines/_base.py).

    from agentkv.engines import Engine, StepDone, StepRequest
"""

from __future__ import annotations

from ._engines import (
    Engine,
    EngineDetails,
    EngineInfo,
    PairSettings,
    Pin,
    Placement,
    PrefillEngine,
    ReleaseGuard,
    Sampling,
    SavedPin,
    ServerCapabilities,
    ServerVersions,
    Slo,
    StepDone,
    StepEvent,
    StepRequest,
    StepTimings,
    TokenDelta,
)
from ._home import EventLoopHome
from ._public import present_as as _present_as

__all__ = [
    "Engine",
    "EngineDetails",
    "EngineInfo",
    "EventLoopHome",
    "PairSettings",
    "Pin",
    "Placement",
    "PrefillEngine",
    "ReleaseGuard",
    "Sampling",
    "SavedPin",
    "ServerCapabilities",
    "ServerVersions",
    "Slo",
    "StepDone",
    "StepEvent",
    "StepRequest",
    "StepTimings",
    "TokenDelta",
]

_present_as(__name__, globals(), __all__)
