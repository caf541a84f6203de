"""The agentkv error tree.

Every error agentkv raises on purpose derives from `AgentKVError`::

    AgentKVError
    ├── UserError                  a mistake in the calling code (bad argument, bad tool definition)
    │   ├── InvalidMessageError    a message that cannot be sent (empty, not a string)
    │   └── SessionBusyError       a turn or step is already running on that session (or conversation)
    ├── SessionClosedError         the session or engine was used after close (or before open)
    ├── ModelPreparationError      the bundled or given model could not be prepared or loaded
    ├── TemplateError              the chat template cannot give token-exact deltas
    ├── ContextLengthError         the prompt does not fit the model's context length
    ├── StoreUnavailableError      a saved session or response could not be kept (store locked, full, read-only)
    └── EngineError                the inference backend failed
        ├── EngineStartError       an engine did not come up
        ├── EngineDeadError        an engine died; the engine must be replaced
        └── EngineUnavailableError a server of an HTTP pair could not be reached; the next step tries again

Errors from vLLM, NIXL or the network are translated at the engine boundary
(``raise EngineError(...) from exc``), so callers never need to import vLLM to catch them.
"""

from __future__ import annotations

__all__ = [
    "AgentKVError",
    "ContextLengthError",
    "EngineDeadError",
    "EngineError",
    "EngineStartError",
    "EngineUnavailableError",
    "InvalidMessageError",
    "ModelPreparationError",
    "SessionBusyError",
    "SessionClosedError",
    "StoreUnavailableError",
    "TemplateError",
    "UserError",
]


class AgentKVError(Exception):
    """Base class of every error agentkv raises on purpose."""


class UserError(AgentKVError):
    """A usage mistake by the application developer: fix the calling code."""


class InvalidMessageError(UserError):
    """A message that cannot be sent: empty, not a string, or of an unknown role."""


class SessionBusyError(UserError):
    """A turn or step was started on a session (or a pool's named conversation) that is running one."""


class SessionClosedError(AgentKVError):
    """A session or engine was used after it was closed, or before it was opened."""


class ModelPreparationError(AgentKVError):
    """The model could not be prepared (converted, cached) or loaded."""


class TemplateError(AgentKVError):
    """The model's chat template cannot produce token-exact deltas for this conversation."""


class ContextLengthError(AgentKVError):
    """The prompt, with room for the answer, does not fit the model's context length.

    Nothing is sent to the engine and nothing is added to the conversation.
    """

    def __init__(self, message: str, *, prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len


class StoreUnavailableError(AgentKVError):
    """The store a `SessionPool` saves its sessions in, or the front door its responses in, could not be read or
    written: its file is locked by another process (past the store's ``timeout_s``), the disk or the database is
    full, the file is read-only, or the disk failed (``_sqlite.py``'s ``SqliteTable`` raises it).

    Nothing of the failed call is kept: a pool's step that could not be saved is not answered, and its
    conversation resumes from its last saved step. The store tries again on its next call, so saving resumes
    once the fault clears; ``agentkv serve`` answers 503 with ``Retry-After`` meanwhile.
    """

    def __init__(
        self, message: str, *, path: str, reason: str, retry_after_s: int = 1, public: str | None = None
    ) -> None:
        super().__init__(message)
        self.path = path
        """The store's file (a PostgreSQL store: its URL, password hidden)."""
        self.public = public if public is not None else message
        """The message without the store's file, its server's address or its driver's words: what a client of
        ``agentkv serve`` is told (the whole message goes to the log)."""
        self.reason = reason
        """``locked``, ``full``, ``read_only``, ``io`` (the disk failed) or ``other``; a PostgreSQL store's also
        ``unreachable`` (no connection to its server) or ``timeout`` (the server did not answer in time)."""
        self.retry_after_s = retry_after_s
        """When a caller may try again (``agentkv serve``'s ``Retry-After``)."""


class EngineError(AgentKVError):
    """The inference backend failed to serve a step."""


class EngineStartError(EngineError):
    """An engine did not start; its processes were stopped."""


class EngineDeadError(EngineError):
    """An engine process died. The engine is closed; start a new one to go on.

    The conversation that was being served is intact: a new session or a session given a
    new engine can continue it (its KV is recomputed).
    """


class EngineUnavailableError(EngineError):
    """A server of a `LaunchedPair` or `RemotePair` could not be reached, or died during a step.

    The engine stays open and the conversation is intact (the failed step added nothing); the
    next step tries again, without the KV handle (the conversation's KV is recomputed). A
    launched pair restarts a server whose process died before that next step.
    """
