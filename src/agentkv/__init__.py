"""agentkv: multi-turn agent sessions pinned to their KV on a disaggregated vLLM pair.

from agentkv import Session

with Session(system="You are terse.") as s:
    r = s.run_sync("What is the capital of France?")
    print(r.text, r.steps[-1].stats.ttft_s, r.steps[-1].stats.pulled_tokens)
"""

from ._conversation._conversation import Message
from ._conversation._tools import Tool, ToolCall, ToolChoice, ToolFormat, ToolResult, ToolSpec, tool
from ._engines import (
    Colocated,
    CorePolicy,
    EmbeddedPair,
    Engine,
    EngineGroup,
    EngineInfo,
    EngineState,
    KVHandle,
    LaunchedPair,
    PairConfig,
    PairSettings,
    Placement,
    PrefillEngine,
    RemotePair,
    Sampling,
    ServerCapabilities,
    StepDone,
    StepEvent,
    StepRequest,
    StepTimings,
    TokenDelta,
)
from ._engines._sampling import SamplingOptions, TokenLogprob
from ._errors import (
    AgentKVError,
    ContextLengthError,
    EngineDeadError,
    EngineError,
    EngineStartError,
    EngineUnavailableError,
    InvalidMessageError,
    ModelPreparationError,
    SessionBusyError,
    SessionClosedError,
    StoreUnavailableError,
    TemplateError,
    UserError,
)
from ._home import EventLoopHome
from ._lifecycle import LifecycleState
from ._model import DEFAULT_MODEL, prepare_model
from ._session._message_step import StepOptions
from ._session._pool import SessionPool
from ._session._results import (
    Event,
    ReasoningDelta,
    Step,
    StepEnd,
    StepReply,
    TextDelta,
    TextPiece,
    ToolCallDelta,
    ToolCallEvent,
    ToolResultEvent,
    TurnEnd,
    TurnResult,
)
from ._session._session import Mode, Session
from ._session._session_store import SessionStore, SqliteSessionStore
from ._session._snapshot import SavedSegment, SavedTranscript, SessionSnapshot
from ._stats._stats import MissReason, SessionStats, StepStats, TurnStats, plot_stats
from ._surfaces._response_store import MemoryResponseStore, ResponseStore, SqliteResponseStore, StoredResponse
from ._surfaces._serve import FrontDoor

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "AgentKVError",
    "Colocated",
    "ContextLengthError",
    "CorePolicy",
    "EmbeddedPair",
    "Engine",
    "EngineDeadError",
    "EngineError",
    "EngineGroup",
    "EngineInfo",
    "EngineStartError",
    "EngineState",
    "EngineUnavailableError",
    "Event",
    "EventLoopHome",
    "FrontDoor",
    "InvalidMessageError",
    "KVHandle",
    "LaunchedPair",
    "LifecycleState",
    "MemoryResponseStore",
    "Message",
    "MissReason",
    "Mode",
    "ModelPreparationError",
    "PairConfig",
    "PairSettings",
    "Placement",
    "PrefillEngine",
    "ReasoningDelta",
    "RemotePair",
    "ResponseStore",
    "Sampling",
    "SamplingOptions",
    "SavedSegment",
    "SavedTranscript",
    "ServerCapabilities",
    "Session",
    "SessionBusyError",
    "SessionClosedError",
    "SessionPool",
    "SessionSnapshot",
    "SessionStats",
    "SessionStore",
    "SqliteResponseStore",
    "SqliteSessionStore",
    "Step",
    "StepDone",
    "StepEnd",
    "StepEvent",
    "StepOptions",
    "StepReply",
    "StepRequest",
    "StepStats",
    "StepTimings",
    "StoreUnavailableError",
    "StoredResponse",
    "TemplateError",
    "TextDelta",
    "TextPiece",
    "TokenDelta",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallEvent",
    "ToolChoice",
    "ToolFormat",
    "ToolResult",
    "ToolResultEvent",
    "ToolSpec",
    "TurnEnd",
    "TurnResult",
    "TurnStats",
    "UserError",
    "__version__",
    "plot_stats",
    "prepare_model",
    "tool",
]

for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("agentkv._"):
        try:
            _obj.__module__ = "agentkv"
        except (AttributeError, TypeError):
            pass
del _name, _obj
