"""Engines: one small async contract and its implementations (embedded, launched and remote pairs, colocated)."""

from ._base import Engine, EngineInfo, EngineState, Sampling, StepDone, StepEvent, StepRequest, StepTimings, TokenDelta
from ._colocated import Colocated
from ._group import EngineGroup
from ._handle import KVHandle
from ._http_capabilities import ServerCapabilities
from ._launched import LaunchedPair
from ._pair import EmbeddedPair
from ._pair_config import CorePolicy, PairConfig, PairSettings
from ._placement import Placement, PrefillEngine
from ._remote import RemotePair

__all__ = [
    "Colocated",
    "CorePolicy",
    "EmbeddedPair",
    "Engine",
    "EngineGroup",
    "EngineInfo",
    "EngineState",
    "KVHandle",
    "LaunchedPair",
    "PairConfig",
    "PairSettings",
    "Placement",
    "PrefillEngine",
    "RemotePair",
    "Sampling",
    "ServerCapabilities",
    "StepDone",
    "StepEvent",
    "StepRequest",
    "StepTimings",
    "TokenDelta",
]
