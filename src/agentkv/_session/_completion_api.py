"""`CompletionAPI`: a session's raw-token step, the model's continuation of a prompt given as token ids (what
``POST /v1/completions`` runs: src/agentkv/_surfaces/_openai_completions.py).

Each call's prompt replaces the conversation (no chat template, no messages); the step's output is appended to it
exactly as generated, and the engine's pin of prompt and output is kept for the next call. An editor re-sends a
growing file prefix: the next prompt usually shares only a prefix with the pinned tokens (the answer is not in it).
The token-exact rule still holds (src/agentkv/_engines/_pinning.py): the pin is cut to the whole blocks the two share
(`cut_to_prompt`, `Engine.cut_pin`), and that cut pin, which the new prompt extends exactly, is what the step
forwards; P pulls those blocks and computes the rest. Nothing is forwarded when not one whole block is shared.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

from .._conversation._conversation import Conversation, SavedSegment
from .._engines._sampling import SamplingOptions
from .._errors import ContextLengthError, SessionBusyError, UserError
from .._stats._stats import TurnStats
from ._results import Step, TextDelta
from ._session_config import SessionConfig, check_stop
from ._session_core import SessionCore
from ._turn import Turn, model_step, upkeep_counts

__all__ = ["CompletionAPI"]


class CompletionAPI(SessionCore):
    """``complete``: the model's continuation of a raw-token prompt, on the session's pin."""

    async def complete(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        sampling: SamplingOptions | None = None,
        cache_salt: str | None = None,
        on_delta: Callable[[TextDelta], None] | None = None,
    ) -> Step:
        """Continue ``prompt_token_ids`` (the whole prompt, as token ids): the `Step` with the output exactly as
        generated and its stats (where each prompt token's KV came from: pulled back from D, P's cache, computed).

        The prompt becomes the conversation, the output is appended, and the pin of both is kept for the next call,
        which forwards it whole when its prompt extends them, cut to their shared whole blocks when it shares only a
        prefix (an editor's growing file), or not at all. ``on_delta``: called with each piece of output as it is
        generated. ``cache_salt``: the step's prefix-cache salt instead of the session's (a pool gives its tenant's). A
        failed call (bad input, an engine error, cancellation) changes nothing in the session.
        """
        prompt = [int(token) for token in prompt_token_ids]
        if not prompt:
            raise UserError("the prompt is empty: it needs at least one token")
        self._require_conversation()
        vocabulary = _vocabulary(self._tokenizer)
        if any(not 0 <= token < vocabulary for token in prompt):
            raise UserError(f"a prompt token id is outside the model's vocabulary (0 to {vocabulary - 1})")
        max_model_len = self.engine.info.max_model_len
        if len(prompt) >= max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens; the model's context is {max_model_len}",
                prompt_tokens=len(prompt),
                max_model_len=max_model_len,
            )
        config = self._config.with_sampling(
            max_tokens=max_tokens, temperature=temperature, seed=seed, stop=check_stop(stop), sampling=sampling
        )
        if cache_salt is not None:
            config = config.model_copy(update={"cache_salt": cache_salt})
        home = self._require_home()
        step = functools.partial(self._complete, prompt, config, on_delta)
        if not home.is_current():
            return await home.call_async(step)
        return await step()

    async def _complete(
        self, prompt: list[int], config: SessionConfig, on_delta: Callable[[TextDelta], None] | None
    ) -> Step:
        with self._lock:
            self._require_idle(
                "a step is already running in this session; sessions take one at a time", SessionBusyError
            )
            turn = self._claim(len(self._turns) + 1)

        def change(turn: Turn) -> None:
            turn.conversation = _raw_conversation(turn.conversation, prompt)

        await self._prepare(turn, change)
        try:
            context = dataclasses.replace(self._step_context(config), cut_pins=True)
            step: Step | None = None
            async for event in model_step(turn, 1, context, json_schema=None):
                if isinstance(event, Step):
                    step = event
                elif on_delta is not None:
                    on_delta(event)
            assert step is not None
            with self._lock:
                self._take(turn)
                self._transcript = None  # no chat step extends a raw prompt
                wall_s = time.perf_counter() - turn.started
                self._turns.append(
                    TurnStats(turn=turn.number, steps=[step.stats], wall_s=wall_s, **upkeep_counts(turn))
                )
            return step
        finally:
            self._end_turn(turn)


def _raw_conversation(before: Conversation, prompt: list[int]) -> Conversation:
    """A conversation of ``prompt`` alone, as raw tokens: one segment of no message, which the output follows."""
    return Conversation.loaded(
        before.renderer, system=None, tokens=prompt, segments=[SavedSegment(start=0, messages=[])]
    )


def _vocabulary(tokenizer: object) -> int:
    """How many token ids the tokenizer knows (added tokens included)."""
    return len(tokenizer) if hasattr(tokenizer, "__len__") else len(tokenizer.get_vocab())  # type: ignore[arg-type, attr-defined]
