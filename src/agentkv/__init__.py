"""agentkv: multi-turn agent sessions pinned to their KV on a disaggregated vLLM pair.

This module holds what agent code needs. The engine contract, for those who implement or drive an
engine, is `agentkv.engines`; the front door's parts, `agentkv.serve`; test doubles, `agentkv.testing`; MCP
servers as tool sources, `agentkv.mcp`.

from agentkv import Session

with Session(system="You are terse.") as s:
    r = s.run_sync("What is the capital of France?")
    print(r.text, r.steps[-1].stats.ttft_s, r.steps[-1].stats.pulled_tokens)
"""

# First: refuses an environment where another project's `agentkv` shadows this one (src/agentkv/_distribution.py).
from . import _distribution as _distribution
from ._conversation._conversation import Message
from ._conversation._tools import Tool, ToolCall, ToolChoice, ToolFormat, ToolResult, ToolSpec, tool
from ._engines import Colocated, CorePolicy, EmbeddedPair, EngineGroup, LaunchedPair, PairConfig, RemotePair
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
from ._lifecycle import LifecycleState
from ._model import DEFAULT_MODEL, prepare_model
from ._postgres import StoreLease
from ._public import present_as as _present_as
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
from ._session._session_store import PostgresSessionStore, SessionStore, SqliteSessionStore
from ._session._snapshot import SessionSnapshot
from ._stats._stats import MissReason, SessionStats, StepStats, TurnStats, plot_stats

__version__ = "1.0.0"

__all__ = [
    "DEFAULT_MODEL",
    "AgentKVError",
    "Colocated",
    "ContextLengthError",
    "CorePolicy",
    "EmbeddedPair",
    "EngineDeadError",
    "EngineError",
    "EngineGroup",
    "EngineStartError",
    "EngineUnavailableError",
    "Event",
    "InvalidMessageError",
    "LaunchedPair",
    "LifecycleState",
    "Message",
    "MissReason",
    "Mode",
    "ModelPreparationError",
    "PairConfig",
    "PostgresSessionStore",
    "ReasoningDelta",
    "RemotePair",
    "SamplingOptions",
    "Session",
    "SessionBusyError",
    "SessionClosedError",
    "SessionPool",
    "SessionSnapshot",
    "SessionStats",
    "SessionStore",
    "SqliteSessionStore",
    "Step",
    "StepEnd",
    "StepOptions",
    "StepReply",
    "StepStats",
    "StoreLease",
    "StoreUnavailableError",
    "TemplateError",
    "TextDelta",
    "TextPiece",
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

_present_as(__name__, globals(), __all__)
