"""Run one workload under several modes (src/agentkv/_bench/_modes.py) in one process, at each load of the run's
population (src/agentkv/_bench/_population.py), lightest first.

Under a barrier (one load, by default), in every turn each mode takes its turn in a rotated order, so machine noise
and warm caches hit every mode alike; a mode's sessions (src/agentkv/_bench/_conversations.py) run concurrently. With
staggered arrivals, each mode in turn (the order rotated from load to load) runs the load's whole population: its
sessions start at their drawn times and each runs its own turns, with its drawn pauses between them. The floor
(`FloorSampler`) is measured on the colocated engine before the first turn and after each (staggered: after each
load). Each load's sessions are opened for its rounds and closed after them, under cache salts of their own.
Once the solo load (1 session) has run and more loads follow, the pairs that run ``auto`` are given the objective
measured so far (`pair_slo`, src/agentkv/_bench/_goodput.py) to place their steps for. Asked for, the probes
(src/agentkv/_bench/_probes.py) run after the last load, once per pair mode that pushes back.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._conversation._conversation import ChatRenderer
from .._engines import Engine
from .._engines._base import Sampling, StepRequest
from .._engines._pair_config import PairConfig
from .._engines._pair_layer import PairLayer
from .._engines._system import free_port
from .._model import prepare_model
from .._session._pool import SessionPool
from .._session._session import Session, load_tokenizer
from .._surfaces._serve import FrontDoor
from ._conversations import BenchConversation, Clock, RawConversation, ServedConversation, SessionConversation, drain
from ._fits import check_fits
from ._goodput import busy_s, pair_slo
from ._modes import PROBE_MODES, SESSION_MODES, StartedEngines, open_engines, session_options, started_engine_args
from ._population import Plan
from ._probes import run_probes
from ._records import FloorFit, FloorPoint, TurnRecord
from ._stock import STOCK_MODE, StockConversation, StockServer, stock_server
from ._target_records import ModeProbes
from ._workloads import Workload

__all__ = ["FloorSampler", "Progress", "run_modes"]

_NEVER_IDLE_S = 7 * 24 * 3600.0
"""A served session's idle expiry: longer than any run (a round of slow modes must not expire it)."""

Progress = Callable[[str, int, int], None]
"""Called with (what is running, steps done, steps in all)."""


def _digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]


@dataclass
class _Lane:
    """One mode's sessions, and where each conversation stands."""

    mode: str
    conversations: list[BenchConversation]
    previous_end: list[int]
    """Per session: prompt tokens plus output tokens of its last turn (what the next turn extends)."""
    origin: float = 0.0
    """The run's clock origin (its records' `TurnRecord.start_s`)."""

    async def turn(self, index: int, turn: int, message: str, *, load: int, think_s: float) -> TurnRecord:
        clock = Clock()
        answer = await self.conversations[index].turn(message, clock)
        wall = time.perf_counter() - clock.started
        stats = answer.stats
        new_tokens = stats.prompt_tokens - self.previous_end[index]
        self.previous_end[index] = stats.prompt_tokens + len(answer.output)
        return TurnRecord.from_stats(
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
            load=load,
            start_s=clock.started - self.origin,
            think_s=think_s,
        )


class FloorSampler:
    """Measures the floor (`FloorFit`) on one engine in rounds, one before the first turn and one after each turn,
    so that the machine's speed over the run weighs on the floor as on every mode (a shared host's speed drifts).

    A round runs ``one_token_steps`` one-token steps (a fresh one-token prompt, one token out: one forward pass,
    the floor's fixed cost, measured rather than fitted), prefills fresh prompts, then tokens appended to cached
    histories. The longest history that fits ``max_model_len`` is prefilled in the first round (a fresh point
    itself) so that the engine's prefix cache holds it; the appended prompts then compute only their new tokens.
    Each point's split between cached and computed tokens comes from the engine's own report, not from what was
    meant.
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
        one_token_steps: int = 3,
    ) -> None:
        self._engine = engine
        self._rng = random.Random(seed)
        self._sizes = sizes
        self._histories = [size for size in histories if size + max(appended) < max_model_len]
        self._appended = appended
        self._history: list[int] | None = None
        self._one_token_steps = one_token_steps
        self.points: list[FloorPoint] = []
        self.fixed_s: list[float] = []
        """The one-token steps' TTFTs."""

    async def sample(self) -> None:
        """One round: the one-token steps, then every prompt shape."""
        for _ in range(self._one_token_steps):
            self.fixed_s.append((await self._prefill(self._fresh(1))).ttft_s)
        self.points.extend([await self._prefill(self._fresh(size)) for size in self._sizes])
        if not self._histories:
            return
        if self._history is None:
            self._history = self._fresh(max(self._histories))
            self.points.append(await self._prefill(self._history))
        for size in self._histories:
            self.points.extend([await self._prefill(self._history[:size] + self._fresh(n)) for n in self._appended])

    def fit(self) -> FloorFit:
        return FloorFit.fit(self.points, self.fixed_s)

    def _fresh(self, size: int) -> list[int]:
        return [self._rng.randrange(1000, 20000) for _ in range(size)]  # random ids: no cached block

    async def _prefill(self, prompt: list[int]) -> FloorPoint:
        clock = Clock()
        request = StepRequest(
            request_id=f"agentkv-floor-{uuid.uuid4().hex}", prompt_token_ids=prompt, sampling=Sampling(max_tokens=1)
        )
        timings = (await drain(self._engine, request, clock)).timings
        return FloorPoint(
            context=timings.local_hit_tokens + timings.pulled_tokens,
            computed=timings.computed_tokens,
            ttft_s=clock.ttft_s,
        )


async def run_modes(
    workload: Workload,
    modes: Sequence[str],
    *,
    plan: Plan,
    max_model_len: int,
    dtype: str,
    engines: Mapping[str, Engine] | None,
    progress: Progress,
    log: Callable[[str], None],
    slo_factors: tuple[float, float] | None = None,
    probes: bool = False,
    pin_ttl_s: float | None = None,
    compiled: bool = False,
    block_size: int | None = None,
    placement: StartedEngines | None = None,
    engine_args: Mapping[str, Any] | None = None,
) -> tuple[list[TurnRecord], dict[int, dict[str, float]], FloorFit | None, Plan, list[ModeProbes]]:
    """Replay the workload in every mode at every load of ``plan``; return the records, each mode's wall time
    per load (its rounds' under a barrier; staggered, the time any of its turns was in flight), the floor, the
    plan as played (its arrival gap measured), and with ``probes`` each probed mode's probes (after the loads, on
    the mode's engine). ``slo_factors``: the goodput objective's TTFT and gap factors, which the pairs running
    ``auto`` aim at from the load after the solo one (None: they keep their own). ``pin_ttl_s`` goes to every pair
    the bench starts; ``compiled``: every engine it starts compiles its model (no ``enforce_eager``);
    ``block_size``: every engine it starts, stock ``vllm serve`` included, keeps KV in blocks of that many tokens;
    ``placement``: the model of every engine it starts, stock ``vllm serve``'s included, and each pair's GPUs;
    ``engine_args``: vLLM engine arguments of every engine it starts, stock ``vllm serve``'s included."""
    placement = placement or StartedEngines()
    await _check_fits(workload, engines, max_model_len=max_model_len, model=placement.model)
    vllm_args = started_engine_args(compiled=compiled, block_size=block_size, engine_args=engine_args)
    engine_modes = [mode for mode in modes if mode != STOCK_MODE]
    started = open_engines(
        engine_modes,
        given=engines,
        max_model_len=max_model_len,
        dtype=dtype,
        progress=log,
        pin_ttl_s=pin_ttl_s,
        engine_args=vllm_args,
        placement=placement,
    )
    stock_server_of = _stock_if_asked(
        modes,
        max_model_len=max_model_len,
        dtype=dtype,
        block_size=block_size,
        model=placement.model,
        engine_args=engine_args,
        log=log,
    )
    async with (
        started as by_mode,
        stock_server_of as stock,
    ):
        floor = None
        if "colocated" in by_mode:
            after = "each" if plan.arrivals == "barrier" else "each load"
            log(f"agentkv bench: measuring the floor on the colocated engine (before the first turn and after {after})")
            floor = FloorSampler(by_mode["colocated"], max_model_len=max_model_len)
            await floor.sample()
        run = _Run(workload, by_mode, stock, plan, floor, progress)
        for position, load in enumerate(plan.loads):
            if plan.arrivals == "barrier":
                await run.barrier(load)
            else:
                await run.staggered(load, position)
            run.plan = run.plan.measured(run.records)
            if load == 1 and position + 1 < len(plan.loads) and slo_factors is not None:
                _aim_auto(by_mode, run.records, floor.fit() if floor is not None else None, slo_factors, log)
        probed = [mode for mode in by_mode if mode in PROBE_MODES] if probes else []
        results = [await run_probes(by_mode[mode], mode, workload, log=log) for mode in probed]
        progress("done", len(run.records), run.total)
        return run.records, run.walls, floor.fit() if floor is not None else None, run.plan, results


@dataclass
class _Run:
    """The rounds of one run: every mode at every load, the records, and each mode's wall time per load."""

    workload: Workload
    engines: dict[str, Engine]
    stock: StockServer | None
    plan: Plan
    floor: FloorSampler | None
    progress: Progress
    records: list[TurnRecord] = field(default_factory=list[TurnRecord])
    origin: float = field(default_factory=time.perf_counter)
    """The clock's origin of the records' `TurnRecord.start_s`."""

    def __post_init__(self) -> None:
        self.modes = [*self.engines, *([STOCK_MODE] if self.stock is not None else [])]
        self.walls = {load: dict.fromkeys(self.modes, 0.0) for load in self.plan.loads}
        self.total = len(self.workload.turns) * len(self.modes) * sum(self.plan.loads)

    async def _lanes(self, modes: Sequence[str], load: int, stack: contextlib.AsyncExitStack) -> list[_Lane]:
        lanes = await _open_lanes(self.workload, {m: self.engines[m] for m in modes if m in self.engines}, load, stack)
        if self.stock is not None and STOCK_MODE in modes:
            lanes.append(await _stock_lane(self.workload, self.stock, load, stack))
        for lane in lanes:
            lane.origin = self.origin
        return lanes

    async def barrier(self, load: int) -> None:
        """Turn by turn: each mode in a rotated order sends turn t from all its sessions at once, then waits for
        them; the floor is sampled after each turn."""
        label = f"{load} sessions, " if len(self.plan.loads) > 1 else ""
        turns = len(self.workload.turns)
        async with contextlib.AsyncExitStack() as opened:
            lanes = await self._lanes(self.modes, load, opened)
            for turn, message in enumerate(self.workload.turns, start=1):
                shift = (turn - 1) % len(lanes)
                for lane in lanes[shift:] + lanes[:shift]:  # rotate who goes first
                    self.progress(f"{label}turn {turn}/{turns} {lane.mode}", len(self.records), self.total)
                    started = time.perf_counter()
                    async with anyio.create_task_group() as group:
                        for index in range(load):
                            group.start_soon(self._turn, lane, load, index, turn, message)
                    self.walls[load][lane.mode] += time.perf_counter() - started
                if self.floor is not None:
                    await self.floor.sample()

    async def staggered(self, load: int, position: int) -> None:
        """Each mode in turn (the order rotated by the load's ``position``) runs the load's population: each session
        starts at its drawn time and runs its own turns, pausing its drawn think time before each; the floor is
        sampled after the load."""
        shift = position % len(self.modes)
        for mode in self.modes[shift:] + self.modes[:shift]:
            self.progress(f"{load} sessions {mode}", len(self.records), self.total)
            async with contextlib.AsyncExitStack() as opened:
                (lane,) = await self._lanes([mode], load, opened)
                async with anyio.create_task_group() as group:
                    for index in range(load):
                        group.start_soon(self._session, lane, load, index)
            self.walls[load][mode] = busy_s([r for r in self.records if r.mode == mode and r.load == load])
        if self.floor is not None:
            await self.floor.sample()

    async def _session(self, lane: _Lane, load: int, index: int) -> None:
        await anyio.sleep(self.plan.start_s(load, index))
        for turn, message in enumerate(self.workload.turns, start=1):
            think = self.plan.think_s(load, index, turn)
            await anyio.sleep(think)
            await self._turn(lane, load, index, turn, message, think)
            self.progress(f"{load} sessions {lane.mode}", len(self.records), self.total)

    async def _turn(self, lane: _Lane, load: int, index: int, turn: int, message: str, think: float = 0.0) -> None:
        self.records.append(await lane.turn(index, turn, message, load=load, think_s=think))


def _aim_auto(
    by_mode: Mapping[str, Engine],
    records: Sequence[TurnRecord],
    floor: FloorFit | None,
    slo_factors: tuple[float, float],
    log: Callable[[str], None],
) -> None:
    """Give the pair running ``auto`` the objective the solo load measured (`pair_slo`), and say so."""
    pair = by_mode.get("auto")
    if not isinstance(pair, PairLayer):
        return
    ttft_factor, itl_factor = slo_factors
    slo, how = pair_slo(records, floor, ttft_factor=ttft_factor, itl_factor=itl_factor)
    if slo is None:
        log(f"agentkv bench: auto keeps its pair's objective ({pair.slo}): {how}")
        return
    pair.slo = slo
    log(f"agentkv bench: auto now places its steps for the SLO measured at 1 session: {slo} ({how})")


async def _check_fits(
    workload: Workload, engines: Mapping[str, Engine] | None, *, max_model_len: int, model: str | None = None
) -> None:
    """Refuse a workload whose last turn may overflow the context before any engine starts (`check_fits`): the
    given engines' model and shortest context, or the model and ``max_model_len`` the bench starts engines with."""
    if engines:
        infos = [engine.info for engine in engines.values()]
        model_path, max_model_len = infos[0].model_path, min(info.max_model_len for info in infos)
    else:
        model_path = await anyio.to_thread.run_sync(prepare_model, model)
    tokenizer = await anyio.to_thread.run_sync(load_tokenizer, str(model_path))
    check_fits(workload, tokenizer, max_model_len=max_model_len)


async def _open_lanes(
    workload: Workload, engines: dict[str, Engine], sessions: int, stack: contextlib.AsyncExitStack
) -> list[_Lane]:
    """Every session of every mode, each under its own cache salt: the same prompts, no shared blocks.
    What they hold (sessions, the front doors and their clients) is closed with ``stack``."""
    run = uuid.uuid4().hex[:8]
    lanes = []
    for mode, engine in engines.items():
        conversations: list[BenchConversation] = []
        if mode == "raw":
            tokenizer = await anyio.to_thread.run_sync(load_tokenizer, str(engine.info.model_path))
        for index in range(sessions):
            salt = f"agentkv-bench-{run}-{mode}-{index}"
            if mode == "raw":
                renderer = ChatRenderer(tokenizer, system=None)
                conversations.append(RawConversation(engine, renderer, workload.system, workload.max_tokens, salt))
            elif mode == "served":
                conversations.append(await _served(engine, workload, salt, stack))
            else:
                session = Session(
                    engine=engine,
                    **session_options(mode),
                    system=workload.system,
                    max_tokens=workload.max_tokens,
                    cache_salt=salt,
                )
                await session.open()
                stack.push_async_callback(session.aclose)
                conversations.append(SessionConversation(session))
        lanes.append(_Lane(mode, conversations, [0] * sessions))
    return lanes


@contextlib.asynccontextmanager
async def _stock_if_asked(
    modes: Sequence[str],
    *,
    max_model_len: int,
    dtype: str,
    block_size: int | None,
    log: Callable[[str], None],
    model: str | None = None,
    engine_args: Mapping[str, Any] | None = None,
) -> AsyncIterator[StockServer | None]:
    """Stock ``vllm serve`` when the modes name it (started after agentkv's engines, stopped before them), on the
    run's ``model`` with the caller's ``engine_args`` as its flags."""
    if STOCK_MODE not in modes:
        yield None
        return
    model_path = await anyio.to_thread.run_sync(prepare_model, model)
    log(f"agentkv bench: starting stock vllm serve on {model_path.name} (vLLM's defaults: it compiles the model first)")
    kv_cache_gib = PairConfig().kv_cache_gib  # the size the bench's own engines start with (their default)
    async with stock_server(
        model_path,
        max_model_len=max_model_len,
        dtype=dtype,
        kv_cache_gib=kv_cache_gib,
        block_size=block_size,
        engine_args=engine_args,
    ) as server:
        log(f"agentkv bench: stock vllm serve up at {server.url} (its output: {server.log_path})")
        yield server


async def _stock_lane(
    workload: Workload, server: StockServer, sessions: int, stack: contextlib.AsyncExitStack
) -> _Lane:
    """The ``vllm-serve`` mode's conversations, one `openai` client each."""
    conversations: list[BenchConversation] = []
    run = uuid.uuid4().hex[:8]
    for index in range(sessions):
        salt = f"agentkv-bench-{run}-{STOCK_MODE}-{index}"
        conversation = StockConversation(server.url + "/v1", workload.system, workload.max_tokens, salt)
        stack.push_async_callback(conversation.aclose)
        conversations.append(conversation)
    return _Lane(STOCK_MODE, conversations, [0] * sessions)


async def _served(
    engine: Engine, workload: Workload, salt: str, stack: contextlib.AsyncExitStack
) -> ServedConversation:
    """One served session: a pool of its own (a pool's sessions share one cache salt) behind a front door of
    its own, in a thread, and an `openai` client on this loop."""
    pool = SessionPool(
        engine=engine,
        mode=SESSION_MODES["served"],
        max_tokens=workload.max_tokens,
        cache_salt=salt,
        max_sessions=1,
        idle_ttl_s=_NEVER_IDLE_S,
    )
    await stack.enter_async_context(pool)
    door = FrontDoor(pool, port=free_port())
    await anyio.to_thread.run_sync(door.start)
    stack.push_async_callback(anyio.to_thread.run_sync, door.stop)
    served = ServedConversation(door.url + "/v1", pool, door.settings.model_name, workload.system, workload.max_tokens)
    stack.push_async_callback(served.aclose)
    return served
