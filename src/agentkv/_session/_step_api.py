"""The step API of `Session`: ``step``/``step_sync``/``extends``, one model call over caller-made messages.

The caller keeps the conversation and runs the tools (a `SessionPool`, the front door and the framework
adapters work this way). What ``step`` last answered is the session's transcript: messages that extend
it are appended and D's KV of the rest pushed back; others rebuild the conversation (with the renderer
`SessionCore._renderer_for` keeps). The request is read by `agentkv._session._message_step`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any, Unpack

from .._conversation._conversation import Message
from .._conversation._tools import ToolChoice
from .._conversation._transcript import Transcript, append, rebuild
from .._engines._sampling import SamplingOptions, TokenLogprob
from .._errors import SessionBusyError
from .._stats._stats import TurnStats
from ._answer_text import tool_call_delta
from ._message_step import MessageRequest, StepOptions, ToolsArgument, read_reply
from ._prompt_work import check_fits, off_loop
from ._results import ReasoningDelta, Step, StepReply, TextPiece, ToolCallDelta
from ._session_core import SessionCore
from ._turn import Turn, model_step, upkeep_counts

__all__ = ["StepAPI"]


class StepAPI(SessionCore):
    """``step``: one model call; the caller keeps the messages and runs the tools."""

    async def step(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        tools: ToolsArgument = None,
        tool_choice: ToolChoice | Mapping[str, Any] = "auto",
        max_tokens: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        sampling: SamplingOptions | Mapping[str, Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        on_text: Callable[[str], None] | None = None,
        on_first_token: Callable[[], None] | None = None,
        on_tool_call: Callable[[ToolCallDelta], None] | None = None,
        on_reasoning: Callable[[ReasoningDelta], None] | None = None,
    ) -> StepReply:
        """One model call over the whole conversation as the caller keeps it; the caller runs the tools.

        ``messages`` are `Message` objects or OpenAI chat dicts (assistant ``tool_calls``, tool
        ``tool_call_id``). When they extend what this session last answered, only the new ones
        are appended and D's KV of the rest is pushed back; otherwise the conversation is
        rebuilt from them (its KV recomputed unless the rebuilt tokens still extend the pin).
        The reply is an answer or tool calls; nothing runs them here.

        Args:
            tools: the tools the model may call this step (`ToolSpec`, `Tool` or OpenAI tool
                dicts); default: the session's tools. A new tool list re-renders the conversation.
            tool_choice: as in `Session`, or OpenAI's ``{"type": "function", "function": {"name": ...}}``.
            max_tokens: the most tokens this step may generate; default: the session's.
            temperature: this step's sampling temperature; default: the session's.
            seed: this step's sampling seed; default: the session's.
            stop: a stop string or a list of up to 4 (OpenAI's ``stop``; none empty): the output ends at the
                first one, and the reply's text ends before it (finish reason ``"stop"``). It applies to
                output the model writes freely (plain answers, ``tool_format="native"``); a schema-format
                step with tools writes JSON forced by a grammar, which a stop string would cut, and takes
                none. The history keeps the output's token ids as generated, stop string included. On a
                pair, a step a stop string ended leaves no pin (vLLM aborts it on D, freeing its blocks), so
                the session pins the conversation again right after it, from D's prefix cache (a one-token
                step, `TurnStats.repins`; not with ``renew_pins=False``): the next step still pulls.
            sampling: this step's other sampling settings (`SamplingOptions` or a mapping of its fields), put
                over the session's ``sampling`` field by field (the fields given replace the session's). With
                ``logprobs``, `Step.logprobs` of the reply carries each output token's log probability.
                ``structured_outputs`` with tools in schema format is refused (`UserError`; see `Session`).
            chat_template_kwargs: extra arguments of the model's chat template (vLLM's request field, e.g.
                ``{"enable_thinking": False}``), those the template reads (src/agentkv/_conversation/_template_kwargs.py).
                Other arguments than the last step's re-render the conversation; its pin is still used when the
                rendered tokens still extend it.
            on_text: called with the answer's text as it is generated (not for tool calls); with ``logprobs``,
                each piece is a `TextPiece` carrying the log probabilities of the tokens since the last piece.
            on_first_token: called once, when the model's first output token arrives (TTFT's end; a
                front door sends its first chunk then, tool calls or not).
            on_tool_call: called with each `ToolCallDelta` as the model writes a tool call: the call's id and
                name first, then its arguments' JSON text piece by piece (joined: the call's arguments).
            on_reasoning: called with each `ReasoningDelta` (with a ``reasoning_parser``: the reasoning's text).

        A failed step (bad input, an engine error, cancellation) changes nothing in the session.
        """
        options = StepOptions(tools=tools, tool_choice=tool_choice, max_tokens=max_tokens, temperature=temperature)
        options.update(StepOptions(seed=seed, stop=stop, sampling=sampling, chat_template_kwargs=chat_template_kwargs))
        if tools is None:  # the session's own tools: a changed MCP list is taken now
            with self._lock:
                self._take_new_tools()
        request = MessageRequest.build(self._config, messages, options)
        return await self._step_request(
            request,
            on_text=on_text,
            on_first_token=on_first_token,
            on_tool_call=on_tool_call,
            on_reasoning=on_reasoning,
        )

    async def _step_request(
        self,
        request: MessageRequest,
        *,
        on_text: Callable[[str], None] | None = None,
        on_first_token: Callable[[], None] | None = None,
        on_tool_call: Callable[[ToolCallDelta], None] | None = None,
        on_reasoning: Callable[[ReasoningDelta], None] | None = None,
    ) -> StepReply:
        """`step` on a request already read (a pool reads each request once for all its sessions)."""
        home = self._require_home()
        step = functools.partial(self._step, request, on_text, on_first_token, on_tool_call, on_reasoning)
        if not home.is_current():
            return await home.call_async(step)
        return await step()

    def step_sync(self, messages: Sequence[Message | Mapping[str, Any]], **options: Unpack[StepOptions]) -> StepReply:
        """Blocking `step` (the same arguments), for a session opened with ``with``."""
        return self._require_home().call(functools.partial(self.step, messages, **options))

    def extends(self, messages: Sequence[Message | Mapping[str, Any]], *, tools: ToolsArgument = None) -> bool:
        """Whether ``messages`` extend what this session last answered in `step` (a front door routes by it)."""
        return self._extends_request(MessageRequest.build(self._config, messages, {"tools": tools}))

    def _extends_request(self, request: MessageRequest) -> bool:
        """`extends`, for a request already read."""
        with self._lock:
            transcript = self._transcript
        return transcript is not None and transcript.new_messages(request.key, request.messages) is not None

    async def _step(
        self,
        request: MessageRequest,
        on_text: Callable[[str], None] | None,
        on_first_token: Callable[[], None] | None = None,
        on_tool_call: Callable[[ToolCallDelta], None] | None = None,
        on_reasoning: Callable[[ReasoningDelta], None] | None = None,
    ) -> StepReply:
        turn, continues = await self._begin_step(request)
        number = len(self._turns[-1].steps) + 1 if continues else 1
        context = self._step_context(request.step_config(self._parsers))
        reader = request.reader(self._parsers)
        watched = on_text is not None or on_tool_call is not None or on_reasoning is not None
        stream = reader.stream() if watched else None
        wants_logprobs = request.config.sampling.logprobs is not None
        pending: list[TokenLogprob] = []
        """Log probabilities of the tokens since the last piece of text given to ``on_text``."""
        try:
            step: Step | None = None
            async with aclosing(model_step(turn, number, context, json_schema=request.json_schema())) as events:
                async for event in events:
                    if isinstance(event, Step):
                        step = event
                        continue
                    if on_first_token is not None:
                        on_first_token()
                        on_first_token = None
                    if wants_logprobs and event.logprobs:
                        pending.extend(event.logprobs)
                    if stream is None:
                        continue
                    pieces = stream.feed(event.text, event.token_ids)
                    if on_reasoning is not None and pieces.reasoning:
                        on_reasoning(ReasoningDelta(turn=turn.number, step=number, text=pieces.reasoning))
                    if on_text is not None and (text := pieces.answer):
                        on_text(TextPiece(text, pending) if wants_logprobs else text)
                        pending = []
                    if on_tool_call is not None:
                        for piece in pieces.calls:
                            on_tool_call(tool_call_delta(turn.number, number, piece))
            assert step is not None
            reply = read_reply(request, step, reader)
            with self._lock:
                self._take(turn)
                self._transcript = Transcript(request.key, (*request.messages, reply.message))
                wall_s = time.perf_counter() - turn.started
                if continues:
                    last = self._turns[-1]
                    wall_s += last.wall_s
                    counts = {name: getattr(last, name) + value for name, value in upkeep_counts(turn).items()}
                    steps = [*last.steps, step.stats]
                    self._turns[-1] = TurnStats(turn=last.turn, steps=steps, wall_s=wall_s, **counts)
                else:
                    stats = TurnStats(turn=turn.number, steps=[step.stats], wall_s=wall_s, **upkeep_counts(turn))
                    self._turns.append(stats)
            return reply
        finally:
            self._end_turn(turn)

    async def _begin_step(self, request: MessageRequest) -> tuple[Turn, bool]:
        """Claim the session and make the step's conversation: the committed one extended, or a rebuilt one.

        Also says whether the step continues the last turn (the caller added only tool results)."""
        with self._lock:
            self._require_idle(
                "a step is already running in this session; sessions take one at a time", SessionBusyError
            )
            transcript = self._transcript
            new = transcript.new_messages(request.key, request.messages) if transcript is not None else None
            continues = new is not None and not any(m.role == "user" for m in new) and bool(self._turns)
            turn = self._claim(len(self._turns) if continues else len(self._turns) + 1)

        rendered = new if new is not None else request.messages
        held = len(turn.conversation.tokens) if new is not None else 0

        def change(turn: Turn) -> None:
            check_fits(
                self._tokenizer, held_tokens=held, messages=rendered, max_model_len=self.engine.info.max_model_len
            )
            if new is not None:
                append(turn.conversation, new, request.key)
            else:
                turn.conversation = rebuild(self._renderer_for(request.key), request.key, request.messages)

        await self._prepare(turn, change, off_loop=off_loop(rendered))
        return turn, continues
