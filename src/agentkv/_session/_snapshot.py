"""`SessionSnapshot`: a session's conversation saved, to resume it after a restart or on another engine.

A snapshot holds the token ids the model read and generated (a restored conversation is
never re-tokenized: its next prompt extends the saved tokens exactly), the messages they
render, what `Session.step` last answered (so the next request is known to extend it) and
every turn's statistics. It holds no KV: a restored session computes its prompt once, and
that step's ``miss_reason`` is ``"resumed"``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from .._conversation._conversation import Message, SavedSegment
from .._conversation._tools import ToolFormat, ToolSpec
from .._conversation._transcript import Transcript, TranscriptKey
from .._stats._stats import TurnStats

__all__ = ["SavedSegment", "SavedTranscript", "SessionSnapshot", "load_transcript", "save_transcript"]


class SavedTranscript(BaseModel):
    """What `Session.step` last answered, in the caller's shape, and the key it was rendered with."""

    model_config = ConfigDict(frozen=True)

    system: str | None
    tools: list[ToolSpec]
    format: ToolFormat
    messages: list[Message]
    template_kwargs: str | None = None
    """The chat template's extra arguments it was rendered with (canonical JSON; None: none)."""


class SessionSnapshot(BaseModel):
    """A session's conversation, as `Session.snapshot` saves it and `Session.restore` resumes it.

    JSON round-trips (``model_dump_json`` / ``model_validate_json``); `SqliteSessionStore` keeps
    them for `SessionPool` and ``agentkv serve``.
    """

    model_config = ConfigDict(frozen=True)

    version: Literal[1] = 1
    model: str
    """The name of the model folder it was made on; restoring on another model is refused."""
    system: Message | None
    """The system message the conversation starts with."""
    tokens: list[int]
    """The conversation as the model read it, outputs exactly as generated."""
    segments: list[SavedSegment]
    """How the tokens split into rendered messages and generated outputs."""
    transcript: SavedTranscript | None = None
    """What `Session.step` last answered (None after `Session.run` or an edit)."""
    turns: list[TurnStats]
    """Every turn's statistics."""


def save_transcript(transcript: Transcript) -> SavedTranscript:
    """A transcript as a snapshot keeps it."""
    key = transcript.key
    return SavedTranscript(
        system=key.system,
        tools=list(key.tools),
        format=key.format,
        messages=list(transcript.messages),
        template_kwargs=key.template_kwargs,
    )


def load_transcript(saved: SavedTranscript) -> Transcript:
    """A snapshot's transcript as the session holds it."""
    key = TranscriptKey(saved.system, tuple(saved.tools), saved.format, saved.template_kwargs)
    return Transcript(key, tuple(saved.messages))
