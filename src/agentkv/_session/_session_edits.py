"""`SessionEdits`: what a caller changes of a session's conversation between turns.

``rewind``, ``replace_message``, ``snapshot``/``restore`` and ``fork``, over the conversation, pin and lock that
`SessionCore` (src/agentkv/_session/_session_core.py) keeps. Separate from it: none of them runs a model call or
touches the engine's pins other than by giving the session's up, and `Session` (src/agentkv/_session/_session.py)
takes them beside its two APIs.
"""

from __future__ import annotations

from typing import Self

from .._conversation._conversation import Conversation
from .._errors import UserError
from .._lifecycle import LifecycleState
from ._session_config import check_count, check_message
from ._session_core import SessionCore
from ._snapshot import SessionSnapshot, load_transcript, save_transcript

__all__ = ["SessionEdits"]


class SessionEdits(SessionCore):
    """``rewind``, ``replace_message``, ``snapshot``/``restore`` and ``fork``: the conversation edited between turns."""

    def rewind(self, turns: int = 1) -> None:
        """Drop the last ``turns`` turns from the conversation (and their stats)."""
        check_count(turns, "turns")
        with self._lock:
            conversation = self._require_idle()
            conversation.rewind(turns)
            del self._turns[len(conversation.turn_starts()) :]
            self._transcript = None
            self._drop_pin()

    def replace_message(self, index: int, content: str) -> None:
        """Replace the content of message ``index`` of `messages`; later messages are kept.

        The tokens after the edit are re-rendered, so the next step's prompt no longer
        extends D's pin: the pin is released. Replacing the system message keeps the
        instructions that schema-format tools append to it.
        """
        check_count(index, "index")
        check_message(content)
        with self._lock:
            conversation = self._require_idle()
            if index == 0 and conversation.system is not None:
                content = self._config.system_text(content) or content
            conversation.replace(index, content)
            self._transcript = None
            self._drop_pin()

    def snapshot(self) -> SessionSnapshot:
        """The conversation so far (finished turns), to `restore` later: after a restart, on another engine.

        The snapshot keeps the token ids (outputs exactly as generated), the messages, what `step`
        last answered and the stats; not the KV, which a restored session computes once.
        """
        with self._lock:
            conversation = self._readable_conversation()
            transcript = self._transcript
            return SessionSnapshot(
                model=self.engine.info.model_path.name,
                system=conversation.system,
                tokens=list(conversation.tokens),
                segments=conversation.saved(),
                transcript=save_transcript(transcript) if transcript is not None else None,
                turns=list(self._turns),
            )

    def restore(self, snapshot: SessionSnapshot) -> None:
        """Replace the conversation with a saved one (`snapshot`); the next step extends its tokens exactly.

        No KV comes with it: the next step computes the prompt once (its ``miss_reason`` is
        ``"resumed"``), later steps push back as usual. A snapshot of another model, or anything that is not a
        `SessionSnapshot` (a saved one's JSON: ``SessionSnapshot.model_validate_json(text)``), raises `UserError`.
        """
        if not isinstance(snapshot, SessionSnapshot):
            raise UserError(
                f"restore takes a SessionSnapshot (from Session.snapshot(), or SessionSnapshot.model_validate_json() "
                f"of a saved one), not {type(snapshot).__name__}"
            )
        model = self.engine.info.model_path.name
        if snapshot.model != model:
            raise UserError(f"this snapshot was made on model {snapshot.model!r}; the session runs {model!r}")
        transcript = load_transcript(snapshot.transcript) if snapshot.transcript is not None else None
        with self._lock:
            current = self._require_idle()
            renderer = (
                self._renderer_for(transcript.key)
                if transcript is not None
                else current.renderer.with_system(snapshot.system)
            )
            self._conversation = Conversation.loaded(
                renderer, system=snapshot.system, tokens=snapshot.tokens, segments=snapshot.segments
            )
            self._transcript = transcript
            self._turns = list(snapshot.turns)
            self._resumed = True
            self._drop_pin()

    def fork(self) -> Self:
        """A new open session on the same engine with a copy of this conversation (and its stats).

        The fork has the same configuration and no pin (handles are single-use); its first
        step reuses the engine's prefix cache. Closing the fork leaves the engine running;
        closing this session closes the fork too when this session's engine closes with it.
        """
        with self._lock:
            conversation = self._require_idle()
            twin = self._of_config(self._config, self._engine)
            twin.mode = self.mode
            twin._home = self._home
            twin._conversation = conversation.copy()
            twin._turns = list(self._turns)
            twin._tokenizer, twin._transcript, twin._parsers = self._tokenizer, self._transcript, self._parsers
            twin._trace = self._trace.of_conversation(twin._conversation_id) if self._trace is not None else None
            twin._state = LifecycleState.OPEN
            twin._engine_owner = self if self._owns_engine else self._engine_owner
            if twin._engine_owner is not None:
                twin._engine_owner._forks.add(twin)
        return twin
