"""Run one workload under several modes in one process, interleaved turn by turn.

Engines: one bidirectional pair (elastic cores) serves ``auto`` (each step placed on P or
on D alone), ``bidirectional`` (always P), ``disaggregated`` (P's prefix cache on) and ``raw``
(the protocol driven by hand); ``bidirectional-split`` gets a second pair with each engine
always on its own half of the cores (the first design's layout: the elastic-cores lever);
``disaggregated-nocache`` a pair whose P has no prefix cache and no push-back (the source's
baseline); ``colocated`` one engine with prefix caching; ``launched`` the bidirectional pair
as two API-server processes over HTTP (`LaunchedPair`); ``netns`` the same with P and D in
two network namespaces (KV over UCX/TCP; needs root); ``served`` sends the conversation
through the front door (`FrontDoor`, in a thread) with the `openai` client, to sessions on the
bidirectional pair; ``push`` and ``push-disaggregated`` get a pair with push transfer (P writes each
step's KV into D), with push-back and without. All stay up for the whole run, all with the run's dtype. In every turn
each mode takes its turn in a rotated order, so machine noise and warm caches hit every mode
alike; a mode's sessions run concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import httpx
import openai
from anyio.from_thread import BlockingPortal
from openai.types.chat import ChatCompletionMessageParam

from .._conversation._conversation import ChatRenderer, Conversation, Message
from .._engines import Colocated, EmbeddedPair, Engine, LaunchedPair
from .._engines._base import Sampling, StepDone, StepRequest, TokenDelta
from .._engines._handle import KVHandle
from .._engines._netns import two_hosts
from .._engines._system import free_port
from .._errors import AgentKVError, UserError
from .._home import EventLoopHome
from .._session._pool import SessionPool
from .._session._results import TextDelta
from .._session._session import Mode, Session, load_tokenizer
from .._stats._stats import StepStats
from .._surfaces._serve import FrontDoor
from ._records import FloorFit, FloorPoint, StepRecord
from ._workloads import Workload

__all__ = ["DEFAULT_DTYPE", "DEFAULT_MODES", "DTYPES", "MODES", "FloorSampler", "Progress", "run_modes"]

_SESSION_MODES: dict[str, Mode] = {
    "auto": "auto",
    "bidirectional": "bidirectional",
    "bidirectional-split": "bidirectional",
    "disaggregated": "disaggregated",
    "disaggregated-nocache": "disaggregated",
    "colocated": "colocated",
    "launched": "bidirectional",
    "netns": "bidirectional",
    "served": "bidirectional",
    "push": "bidirectional",
    "push-disaggregated": "disaggregated",
}
"""The `Session` mode of each bench mode that runs sessions (``raw`` drives the engine by hand; ``served``'s
sessions are the front door's)."""
MODES = (
    "auto",
    "bidirectional",
    "disaggregated",
    "disaggregated-nocache",
    "colocated",
    "raw",
    "bidirectional-split",
    "launched",
    "netns",
    "served",
    "push",
    "push-disaggregated",
)
DEFAULT_MODES = MODES[:6]
"""What ``agentkv bench`` runs unless told: the modes of one embedded pair, the source's baseline and the
colocated engine."""
_DEFAULT_PAIR_MODES = frozenset({"auto", "bidirectional", "disaggregated", "raw", "served"})
"""The modes that share the default (elastic-cores, push-back) pair."""

DTYPES = ("auto", "float32", "bfloat16")
"""The dtypes ``agentkv bench`` starts its engines with (see `DEFAULT_DTYPE`)."""
DEFAULT_DTYPE = "float32"
"""The bench's default dtype. In bfloat16, KV that came from a prefix cache, a pull or a recompute
differs from freshly computed KV in the last bits, so greedy answers diverge between modes and the
later turns' prompts differ; float32 keeps every mode token-exact, so every mode sees the same prompts."""

_NEVER_IDLE_S = 7 * 24 * 3600.0
"""A served session's idle expiry: longer than any run (a round of slow modes must not expire it)."""

Progress = Callable[[str, int, int], None]
"""Called with (what is running, steps done, steps in all)."""


@dataclass
class _Clock:
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
class _Answer:
    """One turn of one conversation (one model step): its stats, output, and the prompt the model read."""

    stats: StepStats
    output: list[int]
    prompt: list[int]


class _Conversation(Protocol):
    """One session of a mode: runs a turn, feeding the clock as the output arrives."""

    async def turn(self, message: str, clock: _Clock) -> _Answer: ...


class _RawConversation:
    """Push-back driven by hand on the engine contract: no Session, no checks, no stats models."""

    def __init__(self, engine: Engine, renderer: ChatRenderer, system: str, max_tokens: int, cache_salt: str) -> None:
        self._engine = engine
        self._cache_salt = cache_salt
        system_message = Message(role="system", content=system)
        self._conversation = Conversation(renderer.with_system(system_message), system=system_message)
        self._max_tokens = max_tokens
        self._handle: KVHandle | None = None
        self._turns = 0

    async def turn(self, message: str, clock: _Clock) -> _Answer:
        self._conversation.add_messages([Message(role="user", content=message)])
        prompt = list(self._conversation.tokens)
        request = StepRequest(
            request_id=f"agentkv-raw-{uuid.uuid4().hex}",
            prompt_token_ids=prompt,
            sampling=Sampling(max_tokens=self._max_tokens),
            handle=self._handle,
            cache_salt=self._cache_salt,
            placement="prefill",  # the plain protocol (P, push-back), what `bidirectional` runs through a Session
        )
        done = await _drain(self._engine, request, clock)
        self._conversation.add_output(done.token_ids, done.text)
        self._handle = done.handle
        self._turns += 1
        output = list(done.token_ids)
        stats = StepStats(
            turn=self._turns,
            step=1,
            prompt_tokens=len(prompt),
            output_tokens=len(output),
            **done.timings.stats_fields(),
        )
        return _Answer(stats, output, prompt)


@dataclass(frozen=True)
class _SessionConversation:
    """A `Session`, one `Session.run` per turn."""

    session: Session

    async def turn(self, message: str, clock: _Clock) -> _Answer:
        def on_event(event: object) -> None:
            if isinstance(event, TextDelta):
                clock.tokens(len(event.token_ids))

        result = await self.session.run(message, on_event=on_event)
        step = result.steps[0]
        return _Answer(step.stats, list(step.token_ids), self.session.token_ids[: step.stats.prompt_tokens])


class _ServedConversation:
    """A conversation sent through the front door by the `openai` client, as an app sends it: the whole
    conversation each turn, streamed, under its own ``x-session-id``; the answer goes back as the
    assistant message. TTFT runs from the HTTP request sent (the client's own work before it, building
    the request from the messages, is `StepRecord.request_s`) to the first chunk, which the door sends at
    the model's first token; the step's stats come from the ``agentkv`` object of the last chunk."""

    def __init__(self, url: str, pool: SessionPool, model: str, system: str, max_tokens: int) -> None:
        self._clock: _Clock | None = None
        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [self._sent]})
        self._client = openai.AsyncOpenAI(base_url=url, api_key="agentkv-bench", max_retries=0, http_client=http)
        self._pool = pool
        self._model = model
        self._max_tokens = max_tokens
        self._id = f"agentkv-bench-{uuid.uuid4().hex}"
        self._messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": system}]

    async def _sent(self, request: httpx.Request) -> None:
        if self._clock is not None:
            self._clock.request_sent()

    async def aclose(self) -> None:
        await self._client.close()

    async def turn(self, message: str, clock: _Clock) -> _Answer:
        messages: list[ChatCompletionMessageParam] = [*self._messages, {"role": "user", "content": message}]
        self._clock = clock
        stream = await self._client.chat.completions.create(
            model=self._model,
            messages=messages,
            max_tokens=self._max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-session-id": self._id},
        )
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
        self._messages = [*messages, {"role": "assistant", "content": text}]
        session = self._pool.session_for(self._id)
        if session is None:
            raise AgentKVError(f"agentkv bench: the front door holds no session {self._id!r} after its step")
        tokens = session.token_ids  # the server's own record: the prompt the model read, then the output
        return _Answer(stats, tokens[stats.prompt_tokens :], tokens[: stats.prompt_tokens])


def _digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]


@dataclass
class _Lane:
    """One mode's sessions, and where each conversation stands."""

    mode: str
    conversations: list[_Conversation]
    previous_end: list[int]
    """Per session: prompt tokens plus output tokens of its last turn (what the next turn extends)."""

    async def turn(self, index: int, turn: int, message: str) -> StepRecord:
        clock = _Clock()
        answer = await self.conversations[index].turn(message, clock)
        wall = time.perf_counter() - clock.started
        stats = answer.stats
        new_tokens = stats.prompt_tokens - self.previous_end[index]
        self.previous_end[index] = stats.prompt_tokens + len(answer.output)
        return StepRecord.from_stats(
            stats,
            mode=self.mode,
            session=index,
            turn=turn,
            ttft_s=clock.ttft_s,
            itl_s=clock.itl_s,
            wall_s=wall,
            new_tokens=new_tokens,
            output_token_ids=answer.output,
            prompt_digest=_digest(answer.prompt),
            request_s=clock.request_s,
        )


@contextlib.asynccontextmanager
async def _engines(
    modes: Sequence[str],
    *,
    given: Mapping[str, Engine] | None,
    max_model_len: int,
    dtype: str,
    progress: Callable[[str], None],
) -> AsyncIterator[dict[str, Engine]]:
    """The engines the modes need (given, or started one after another, all in ``dtype``, and closed on the
    way out). Started ones live on the running loop, reachable from other threads (the front door's)."""
    if given is not None:
        missing = [mode for mode in modes if mode not in given]
        if missing:
            raise UserError(f"no engine given for mode(s) {', '.join(missing)}")
        yield {mode: given[mode] for mode in modes}
        return
    async with BlockingPortal() as portal, contextlib.AsyncExitStack() as stack:
        home = EventLoopHome(asyncio.get_running_loop(), portal)

        async def opened(engine: Engine) -> Engine:
            await engine.open(home=home)
            stack.push_async_callback(engine.aclose)
            return engine

        by_mode: dict[str, Engine] = {}
        if _DEFAULT_PAIR_MODES & set(modes):
            pair = await opened(EmbeddedPair(max_model_len=max_model_len, dtype=dtype, progress=progress))
            by_mode.update(dict.fromkeys(_DEFAULT_PAIR_MODES, pair))
        if "bidirectional-split" in modes:
            split = EmbeddedPair(max_model_len=max_model_len, core_policy="split", dtype=dtype, progress=progress)
            by_mode["bidirectional-split"] = await opened(split)
        if "disaggregated-nocache" in modes:
            baseline = EmbeddedPair(
                max_model_len=max_model_len,
                bidirectional=False,
                prefill_prefix_cache=False,
                dtype=dtype,
                progress=progress,
            )
            by_mode["disaggregated-nocache"] = await opened(baseline)
        if {"push", "push-disaggregated"} & set(modes):
            push = await opened(
                EmbeddedPair(max_model_len=max_model_len, dtype=dtype, transfer="push", progress=progress)
            )
            by_mode.update({"push": push, "push-disaggregated": push})
        if "colocated" in modes:
            colocated = Colocated(max_model_len=max_model_len, dtype=dtype, progress=progress)
            by_mode["colocated"] = await opened(colocated)
        if "launched" in modes:
            launched = LaunchedPair(max_model_len=max_model_len, dtype=dtype, progress=progress)
            by_mode["launched"] = await opened(launched)
        if "netns" in modes:
            hosts = stack.enter_context(two_hosts())
            across = LaunchedPair(
                max_model_len=max_model_len,
                hosts=hosts.addresses,
                launch_prefixes=hosts.launch_prefixes,
                server_env={"UCX_TLS": "tcp"},
                dtype=dtype,
                progress=progress,
            )
            by_mode["netns"] = await opened(across)
        yield {mode: by_mode[mode] for mode in modes}


async def _drain(engine: Engine, request: StepRequest, clock: _Clock) -> StepDone:
    """Run one step on the engine, its tokens timed by ``clock``; return its end."""
    done: StepDone | None = None
    async for event in engine.step(request):
        if isinstance(event, TokenDelta):
            clock.tokens(len(event.token_ids))
        else:
            done = event
    assert done is not None, "an engine's step ends with StepDone"
    return done


class FloorSampler:
    """Measures the floor (`FloorFit`) on one engine in rounds, one before the first turn and one after each turn,
    so that the machine's speed over the run weighs on the floor as on every mode (a shared host's speed drifts).

    A round prefills fresh prompts, then tokens appended to cached histories. The longest history that fits
    ``max_model_len`` is prefilled in the first round (a fresh point itself) so that the engine's prefix cache
    holds it; the appended prompts then compute only their new tokens. Each point's split between cached and
    computed tokens comes from the engine's own report, not from what was meant.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_model_len: int,
        seed: int = 0,
        sizes: Sequence[int] = (16, 64, 256, 512),
        histories: Sequence[int] = (1024, 2048),
        appended: Sequence[int] = (64, 512),
    ) -> None:
        self._engine = engine
        self._rng = random.Random(seed)
        self._sizes = sizes
        self._histories = [size for size in histories if size + max(appended) < max_model_len]
        self._appended = appended
        self._history: list[int] | None = None
        self.points: list[FloorPoint] = []

    async def sample(self) -> None:
        """One round of every prompt shape."""
        self.points.extend([await self._prefill(self._fresh(size)) for size in self._sizes])
        if not self._histories:
            return
        if self._history is None:
            self._history = self._fresh(max(self._histories))
            self.points.append(await self._prefill(self._history))
        for size in self._histories:
            self.points.extend([await self._prefill(self._history[:size] + self._fresh(n)) for n in self._appended])

    def fit(self) -> FloorFit:
        return FloorFit.fit(self.points)

    def _fresh(self, size: int) -> list[int]:
        return [self._rng.randrange(1000, 20000) for _ in range(size)]  # random ids: no cached block

    async def _prefill(self, prompt: list[int]) -> FloorPoint:
        clock = _Clock()
        request = StepRequest(
            request_id=f"agentkv-floor-{uuid.uuid4().hex}", prompt_token_ids=prompt, sampling=Sampling(max_tokens=1)
        )
        timings = (await _drain(self._engine, request, clock)).timings
        return FloorPoint(
            context=timings.local_hit_tokens + timings.pulled_tokens,
            computed=timings.computed_tokens,
            ttft_s=clock.ttft_s,
        )


async def run_modes(
    workload: Workload,
    modes: Sequence[str],
    *,
    sessions: int,
    max_model_len: int,
    dtype: str,
    engines: Mapping[str, Engine] | None,
    progress: Progress,
    log: Callable[[str], None],
) -> tuple[list[StepRecord], dict[str, float], FloorFit | None]:
    """Replay the workload in every mode; return the records, each mode's round wall time, the floor."""
    async with _engines(modes, given=engines, max_model_len=max_model_len, dtype=dtype, progress=log) as by_mode:
        floor = None
        if "colocated" in by_mode:
            log("agentkv bench: measuring the floor on the colocated engine (before the first turn and after each)")
            floor = FloorSampler(by_mode["colocated"], max_model_len=max_model_len)
            await floor.sample()
        async with contextlib.AsyncExitStack() as opened:
            lanes = await _open_lanes(workload, by_mode, sessions, opened)
            records: list[StepRecord] = []
            walls = dict.fromkeys(modes, 0.0)
            total = len(workload.turns) * len(modes) * sessions
            for turn, message in enumerate(workload.turns, start=1):
                shift = (turn - 1) % len(lanes)
                for lane in lanes[shift:] + lanes[:shift]:  # rotate who goes first
                    progress(f"turn {turn}/{len(workload.turns)} {lane.mode}", len(records), total)
                    started = time.perf_counter()
                    async with anyio.create_task_group() as group:
                        for index in range(sessions):
                            group.start_soon(_collect, lane, index, turn, message, records)
                    walls[lane.mode] += time.perf_counter() - started
                if floor is not None:
                    await floor.sample()
            progress("done", len(records), total)
        return records, walls, floor.fit() if floor is not None else None


async def _collect(lane: _Lane, index: int, turn: int, message: str, records: list[StepRecord]) -> None:
    records.append(await lane.turn(index, turn, message))


async def _open_lanes(
    workload: Workload, engines: dict[str, Engine], sessions: int, stack: contextlib.AsyncExitStack
) -> list[_Lane]:
    """Every session of every mode, each under its own cache salt: the same prompts, no shared blocks.
    What they hold (sessions, the front doors and their clients) is closed with ``stack``."""
    run = uuid.uuid4().hex[:8]
    lanes = []
    for mode, engine in engines.items():
        conversations: list[_Conversation] = []
        if mode == "raw":
            tokenizer = await anyio.to_thread.run_sync(load_tokenizer, str(engine.info.model_path))
        for index in range(sessions):
            salt = f"agentkv-bench-{run}-{mode}-{index}"
            if mode == "raw":
                renderer = ChatRenderer(tokenizer, system=None)
                conversations.append(_RawConversation(engine, renderer, workload.system, workload.max_tokens, salt))
            elif mode == "served":
                conversations.append(await _served(engine, workload, salt, stack))
            else:
                session = Session(
                    engine=engine,
                    mode=_SESSION_MODES[mode],
                    system=workload.system,
                    max_tokens=workload.max_tokens,
                    cache_salt=salt,
                )
                await session.open()
                stack.push_async_callback(session.aclose)
                conversations.append(_SessionConversation(session))
        lanes.append(_Lane(mode, conversations, [0] * sessions))
    return lanes


async def _served(
    engine: Engine, workload: Workload, salt: str, stack: contextlib.AsyncExitStack
) -> _ServedConversation:
    """One served session: a pool of its own (a pool's sessions share one cache salt) behind a front door of
    its own, in a thread, and an `openai` client on this loop."""
    pool = SessionPool(
        engine=engine,
        mode=_SESSION_MODES["served"],
        max_tokens=workload.max_tokens,
        cache_salt=salt,
        max_sessions=1,
        idle_ttl_s=_NEVER_IDLE_S,
    )
    await stack.enter_async_context(pool)
    door = FrontDoor(pool, port=free_port())
    await anyio.to_thread.run_sync(door.start)
    stack.push_async_callback(anyio.to_thread.run_sync, door.stop)
    served = _ServedConversation(door.url + "/v1", pool, door.settings.model_name, workload.system, workload.max_tokens)
    stack.push_async_callback(served.aclose)
    return served
