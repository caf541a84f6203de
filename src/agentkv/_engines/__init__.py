"""Engines: one small async contract and its implementations (embedded pair, colocated)."""

from ._base import Engine, EngineInfo, EngineState, Sampling, StepDone, StepEvent, StepRequest, StepTimings, TokenDelta
from ._colocated import Colocated
from ._handle import KVHandle
from ._pair import EmbeddedPair

__all__ = [
    "Colocated",
    "EmbeddedPair",
    "Engine",
    "EngineInfo",
    "EngineState",
    "KVHandle",
    "Sampling",
    "StepDone",
    "StepEvent",
    "StepRequest",
    "StepTimings",
    "TokenDelta",
]
