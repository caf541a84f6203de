"""Engines: one small async contract and its implementations (embedded, launched and remote pairs, colocated).

The names below are re-exported for the package's own modules (``from .._engines import Engine``);
the public ones are listed once, in `agentkv` (the engines) and `agentkv.engines` (the contract).
"""

from ._base import Engine as Engine
from ._base import EngineDetails as EngineDetails
from ._base import EngineInfo as EngineInfo
from ._base import EngineState as EngineState
from ._base import Pin as Pin
from ._base import ReleaseGuard as ReleaseGuard
from ._base import Sampling as Sampling
from ._base import SavedPin as SavedPin
from ._base import StepDone as StepDone
from ._base import StepEvent as StepEvent
from ._base import StepRequest as StepRequest
from ._base import StepTimings as StepTimings
from ._base import TokenDelta as TokenDelta
from ._colocated import Colocated as Colocated
from ._group import EngineGroup as EngineGroup
from ._http_capabilities import ServerCapabilities as ServerCapabilities
from ._http_versions import ServerVersions as ServerVersions
from ._launched import LaunchedPair as LaunchedPair
from ._pair import EmbeddedPair as EmbeddedPair
from ._pair_config import CorePolicy as CorePolicy
from ._pair_config import PairConfig as PairConfig
from ._pair_config import PairSettings as PairSettings
from ._placement import Placement as Placement
from ._placement import PrefillEngine as PrefillEngine
from ._remote import RemotePair as RemotePair
from ._slo import Slo as Slo
