"""One conversation of a bench mode, turn by turn, timed on the client's side (`Clock`): driven by hand on the
engine contract (``raw``), a `Session` (the session modes), or sent through the front door by the `openai` client
(``served``). src/agentkv/_bench/_runner.py runs them."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import openai
from openai import AsyncStream
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from .._conversation._conversation import ChatRenderer, Conversation, Message
from .._engines import Engine
from .._engines._base import Pin, Sampling, StepDone, StepRequest, TokenDelta
from .._errors import AgentKVError
from .._session._pool import SessionPool
from .._session._results import TextDelta
from .._session._session import Session
from .._stats._stats import StepStats

__all__ = [
    "Answer",
    "Clock",
    "BenchConversation",
    "ClientConversation",
    "RawConversation",
    "ServedConversation",
    "SessionConversation",
    "drain",
]


@dataclass
class Clock:
    """Client-side times of one step: the call, the request sent, the first token, then its tokens (or text chunks)."""

    started: float = field(default_factory=time.perf_counter)
    arrivals: list[tuple[float, int]] = field(default_factory=list[tuple[float, int]])
    sent: float | None = None
    """When the request left the client (served: its HTTP request), if that is not the call."""
    first: float | None = None
    """When the first token was seen, if before its text (the front door's role chunk); else the first arrival."""

    def request_sent(self) -> None:
        self.sent = time.perf_counter()

    def first_token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def tokens(self, count: int) -> None:
        self.arrivals.append((time.perf_counter(), count))

    @property
    def ttft_s(self) -> float:
        """From the request sent (or the call) to the first token."""
        start = self.sent if self.sent is not None else self.started
        if self.first is not None:
            return self.first - start
        return self.arrivals[0][0] - start if self.arrivals else float("nan")

    @property
    def request_s(self) -> float:
        """From the call to the request sent: the client's own work before it."""
        return 0.0 if self.sent is None else self.sent - self.started

    @property
    def itl_s(self) -> list[float]:
        """Per-token gaps: a gap that brought k tokens counts as k gaps of 1/k each."""
        gaps: list[float] = []
        for (before, _), (after, count) in zip(self.arrivals, self.arrivals[1:], strict=False):
            gaps.extend([(after - before) / count] * count)
        return gaps


@dataclass(frozen=True)
class Answer:
    """One turn of one conversation (one model step): its stats, output, and the prompt the model read."""

    stats: StepStats
    output: list[int]
    prompt: list[int]


class BenchConversation(Protocol):
    """One session of a mode: runs a turn, feeding the clock as the output arrives."""

    async def turn(self, message: str, clock: Clock) -> Answer: ...


class RawConversation:
    """Push-back driven by hand on the engine contract: no Session, no checks, no stats models."""

    def __init__(self, engine: Engine, renderer: ChatRenderer, system: str, max_tokens: int, cache_salt: str) -> None:
        self._engine = engine
        self._cache_salt = cache_salt
        system_message = Message(role="system", content=system)
        self._conversation = Conversation(renderer.with_system(system_message), system=system_message)
        self._max_tokens = max_tokens
        self._pin: Pin | None = None
        self._turns = 0

    async def turn(self, message: str, clock: Clock) -> Answer:
        self._conversation.add_messages([Message(role="user", content=message)])
        prompt = list(self._conversation.tokens)
        request = StepRequest(
            request_id=f"agentkv-raw-{uuid.uuid4().hex}",
            prompt_token_ids=prompt,
            sampling=Sampling(max_tokens=self._max_tokens),
            pin=self._pin,
            cache_salt=self._cache_salt,
            placement="prefill",  # the plain protocol (P, push-back), what `bidirectional` runs through a Session
        )
        done = await drain(self._engine, request, clock)
        self._conversation.add_output(done.token_ids, done.text)
        self._pin = done.pin
        self._turns += 1
        output = list(done.token_ids)
        stats = StepStats(
            turn=self._turns,
            step=1,
            prompt_tokens=len(prompt),
            output_tokens=len(output),
            **done.timings.stats_fields(),
        )
        return Answer(stats, output, prompt)


@dataclass(frozen=True)
class SessionConversation:
    """A `Session`, one `Session.run` per turn."""

    session: Session

    async def turn(self, message: str, clock: Clock) -> Answer:
        def on_event(event: object) -> None:
            if isinstance(event, TextDelta):
                clock.tokens(len(event.token_ids))

        result = await self.session.run(message, on_event=on_event)
        step = result.steps[0]
        return Answer(step.stats, list(step.token_ids), self.session.token_ids[: step.stats.prompt_tokens])


class ClientConversation:
    """What the conversations sent over HTTP share: an `openai` client whose request hook marks the request sent
    on the turn's clock, the messages so far, and one streamed chat completion a turn (`_send`)."""

    def __init__(self, url: str, model: str, system: str, max_tokens: int) -> None:
        self._clock: Clock | None = None
        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [self._sent]})
        self._client = openai.AsyncOpenAI(base_url=url, api_key="agentkv-bench", max_retries=0, http_client=http)
        self._model = model
        self._max_tokens = max_tokens
        self._messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": system}]
        self._asked: list[ChatCompletionMessageParam] = self._messages
        """The messages of the turn in flight (the conversation and its new message)."""

    async def _sent(self, request: httpx.Request) -> None:
        if self._clock is not None:
            self._clock.request_sent()

    async def aclose(self) -> None:
        await self._client.close()

    async def _send(self, message: str, clock: Clock, **extra: Any) -> AsyncStream[ChatCompletionChunk]:
        """The whole conversation with ``message`` added, sent as one streamed, greedy chat completion with its
        usage at the end (``extra``: the mode's own arguments of ``chat.completions.create``). The message joins
        the conversation with its answer (`_answered`), so a failed turn leaves the conversation as it was."""
        self._asked = [*self._messages, {"role": "user", "content": message}]
        self._clock = clock
        stream: AsyncStream[ChatCompletionChunk] = await self._client.chat.completions.create(
            model=self._model,
            messages=self._asked,
            max_tokens=self._max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            **extra,
        )
        return stream

    def _answered(self, text: str) -> None:
        """The turn's message and its answer join the conversation (the answer as the assistant message)."""
        self._messages = [*self._asked, {"role": "assistant", "content": text}]


class ServedConversation(ClientConversation):
    """A conversation sent through the front door by the `openai` client, as an app sends it: the whole
    conversation each turn, streamed, under its own ``x-session-id``; the answer goes back as the
    assistant message. TTFT runs from the HTTP request sent (the client's own work before it, building
    the request from the messages, is `TurnRecord.request_s`) to the first chunk, which the door sends at
    the model's first token; the step's stats come from the ``agentkv`` object of the last chunk."""

    def __init__(self, url: str, pool: SessionPool, model: str, system: str, max_tokens: int) -> None:
        super().__init__(url, model, system, max_tokens)
        self._pool = pool
        self._id = f"agentkv-bench-{uuid.uuid4().hex}"

    async def turn(self, message: str, clock: Clock) -> Answer:
        stream = await self._send(message, clock, extra_headers={"x-session-id": self._id})
        text, stats = "", None
        async for chunk in stream:
            clock.first_token()
            for choice in chunk.choices:
                if choice.delta.tool_calls:
                    raise AgentKVError("agentkv bench: the model called a tool, but the workloads offer none")
                if choice.delta.content:
                    clock.tokens(1)  # one chunk per engine delta that brought text: ITL is per chunk
                    text += choice.delta.content
            extension = (chunk.model_extra or {}).get("agentkv")
            if extension is not None:
                stats = StepStats.model_validate(extension["stats"])
        if stats is None:
            raise AgentKVError("agentkv bench: the front door's stream ended without the step's stats")
        self._answered(text)
        session = self._pool.session_for(self._id)
        if session is None:
            raise AgentKVError(f"agentkv bench: the front door holds no session {self._id!r} after its step")
        tokens = session.token_ids  # the server's own record: the prompt the model read, then the output
        return Answer(stats, tokens[stats.prompt_tokens :], tokens[: stats.prompt_tokens])


async def drain(engine: Engine, request: StepRequest, clock: Clock) -> StepDone:
    """Run one step on the engine, its tokens timed by ``clock``; return its end."""
    done: StepDone | None = None
    async for event in engine.step(request):
        if isinstance(event, TokenDelta):
            clock.tokens(len(event.token_ids))
        else:
            done = event
    assert done is not None, "an engine's step ends with StepDone"
    return done
