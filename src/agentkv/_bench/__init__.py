"""``agentkv bench``: one multi-turn workload under each mode, in one run, side by side."""

from __future__ import annotations

import functools
import logging
import math
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from .._engines import Engine
from .._engines._pair_config import check_engine_args
from .._engines._platform_settings import resolve_dtype
from .._errors import AgentKVError, UserError
from ._after_pause import after_pause, after_pause_lines, early_ratio_line
from ._goodput import DEFAULT_SLO_ITL, DEFAULT_SLO_TTFT, load_rows, measure_slo
from ._modes import DEFAULT_DTYPE, DEFAULT_MODES, DTYPES, EARLY_MODE, MODES, PAIR_MODES, StartedEngines
from ._population import AGENTIC_THINK_S, ARRIVALS, Arrivals, Plan, parse_loads
from ._probes import probe_lines
from ._records import SERVED_TTFT_TARGET, BenchReport, ModeSummary, TurnRecord, first_prompt_divergence, summarize
from ._report import floor_line, goodput_lines, header, load_tables, plot, push_against_pull, served_overhead, table
from ._runner import Progress, run_modes
from ._workloads import WORKLOADS, Workload, load_replay, make_workload

__all__ = [
    "AGENTIC_THINK_S",
    "ARRIVALS",
    "DEFAULT_DTYPE",
    "DEFAULT_MODES",
    "DEFAULT_SLO_ITL",
    "DEFAULT_SLO_TTFT",
    "DTYPES",
    "EARLY_MODE",
    "MODES",
    "PAIR_MODES",
    "SERVED_TTFT_TARGET",
    "Progress",
    "WORKLOADS",
    "BenchReport",
    "ModeSummary",
    "TurnRecord",
    "Workload",
    "after_pause_lines",
    "floor_line",
    "goodput_lines",
    "header",
    "early_ratio_line",
    "load_replay",
    "load_tables",
    "make_workload",
    "parse_loads",
    "plot",
    "probe_lines",
    "run_bench",
    "run_bench_sync",
    "push_against_pull",
    "served_overhead",
    "table",
]

logger = logging.getLogger("agentkv")


def _machine() -> dict[str, str | int]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


async def run_bench(
    workload: Workload,
    *,
    modes: Sequence[str] = DEFAULT_MODES,
    sessions: int | Sequence[int] = 1,
    arrivals: Arrivals | None = None,
    arrival_s: float | None = None,
    think_s: float | None = None,
    seed: int = 0,
    slo_ttft: float = DEFAULT_SLO_TTFT,
    slo_itl: float = DEFAULT_SLO_ITL,
    max_model_len: int = 4096,
    dtype: str | None = None,
    engines: Mapping[str, Engine] | None = None,
    probes: bool = False,
    pin_ttl_s: float | None = None,
    compiled: bool = False,
    block_size: int | None = None,
    model: str | None = None,
    prefill_devices: Sequence[int | str] | None = None,
    decode_devices: Sequence[int | str] | None = None,
    engine_args: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
    log: Callable[[str], None] | None = None,
) -> BenchReport:
    """Run ``workload`` under ``modes`` at each load of ``sessions`` and return what was measured.

    ``sessions``: how many sessions of each mode run at once, or several such loads (a load sweep).
    ``arrivals``: ``"barrier"`` (every session of a mode sends turn t together, modes interleaved turn by turn)
    or ``"staggered"`` (seeded starts, ``arrival_s`` apart on average, by default half a solo turn measured at
    load 1; each session runs its own turns, pausing a seeded think time of mean ``think_s`` before each after
    the first); by default staggered for several loads, a barrier for one. ``think_s`` defaults to
    `AGENTIC_THINK_S` on the agentic workload when staggered, else 0. ``seed`` seeds the population.
    Goodput counts turns within ``slo_ttft`` x their floor and ``slo_itl`` x a solo colocated session's median
    token gap (src/agentkv/_bench/_goodput.py); from the load after the solo one, ``auto``'s pair places its steps
    for that objective as measured at 1 session (a given pair's ``slo`` is changed for good).

    ``progress`` is called before each round with (what runs, steps done, steps in all);
    ``log`` with one line per start-up stage (default: the ``agentkv`` logger).
    ``engines`` maps each mode to an open engine to use (the caller's to close); by default
    the bench starts what the modes need, every engine in ``dtype`` (one of `DTYPES`; default
    float32, see `DEFAULT_DTYPE`: it keeps the modes' greedy answers, hence their prompts,
    identical), and closes them at the end. ``dtype`` and ``engines`` exclude each other, as do ``pin_ttl_s`` (the
    pin TTL of every pair the bench starts; above 10 s) and ``engines``, and ``compiled`` (every engine the bench
    starts compiles its model as stock vLLM does, instead of agentkv's eager mode on a CPU) and ``engines``, and
    ``block_size`` (every engine the bench starts, stock ``vllm serve`` included, keeps KV in blocks of that many
    tokens; default vLLM's: 128 on a CPU) and ``engines``. ``model`` (a bundled name, an HF folder or an HF id, as
    ``--model`` takes one), ``prefill_devices`` and ``decode_devices`` (each pair's GPUs on a CUDA host) and
    ``engine_args`` (vLLM engine arguments over agentkv's, stock ``vllm serve``'s flags too) apply to the engines
    the bench starts, and exclude ``engines``. ``probes``: after the workload, each pair
    mode that pushes back runs the probes on its engine (src/agentkv/_bench/_probes.py). Mode ``served``
    puts a front door in a thread before its sessions: a given engine for it must be open on a loop that
    thread can call (opened with ``with``).

    Raises `AgentKVError` when a mode gave the model another prompt than bidirectional on the same history:
    its figures would not compare (served: the front door did not give the model what `Session.run` gives it).
    """
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise UserError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    plan = Plan.make(
        sessions,
        turns=len(workload.turns),
        workload=workload.name,
        arrivals=arrivals,
        arrival_s=arrival_s,
        think_s=think_s,
        seed=seed,
    )
    if not (slo_ttft > 0 and slo_itl > 0):
        raise UserError(f"the SLO's factors must be above 0, not {slo_ttft!r} (TTFT) and {slo_itl!r} (ITL)")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"dtype is one of {', '.join(DTYPES)}, not {dtype!r}")
    if dtype is not None and engines is not None:
        raise UserError("dtype applies to the engines the bench starts; the given engines run in their own")
    if pin_ttl_s is not None and engines is not None:
        raise UserError("pin_ttl_s applies to the pairs the bench starts; the given engines keep their own")
    if compiled and engines is not None:
        raise UserError("compiled applies to the engines the bench starts; the given engines run as they were started")
    if block_size is not None and engines is not None:
        raise UserError("block_size applies to the engines the bench starts; the given engines keep their own")
    placement = StartedEngines(model=model, prefill_devices=prefill_devices, decode_devices=decode_devices)
    started = {"model": model, "devices": prefill_devices or decode_devices, "engine_args": engine_args}
    given = [name for name, value in started.items() if value]
    if given and engines is not None:
        raise UserError(f"{', '.join(given)} apply to the engines the bench starts; the given engines keep their own")
    if engine_args:
        engine_args = check_engine_args(engine_args, "engine_args")
    if block_size is not None and not (isinstance(block_size, int) and block_size > 0):
        raise UserError(f"the KV block size is a number of tokens above 0, not {block_size!r}")
    if pin_ttl_s is not None and not (math.isfinite(pin_ttl_s) and pin_ttl_s > 10):
        raise UserError(f"the pin TTL must be a number of seconds above 10, not {pin_ttl_s!r}")
    started_dtype = None if engines is not None else resolve_dtype(dtype or DEFAULT_DTYPE)
    homes = {id(engine.home): engine.home for engine in (engines or {}).values() if engine.home is not None}
    served = (engines or {}).get("served")
    if "served" in modes and served is not None and (served.home is None or not served.home.owns_thread):
        raise UserError("mode served needs its engine opened with `with`: the front door's thread calls into its loop")
    if len(homes) > 1:
        raise UserError("the given engines live on different event loops; open them on one")
    measure = functools.partial(
        run_modes,
        workload,
        list(dict.fromkeys(modes)),
        plan=plan,
        max_model_len=max_model_len,
        dtype=started_dtype or DEFAULT_DTYPE,
        engines=engines,
        probes=probes,
        pin_ttl_s=pin_ttl_s,
        compiled=compiled,
        block_size=block_size,
        placement=placement,
        engine_args=engine_args,
        progress=progress or (lambda *_: None),
        log=log or (lambda line: logger.info("%s", line)),
        slo_factors=(slo_ttft, slo_itl),
    )
    home = next(iter(homes.values()), None)
    if home is not None and not home.is_current():  # engines opened with `with`: run where they live
        records, walls, floor, plan, probed = await home.call_async(measure)
    else:
        records, walls, floor, plan, probed = await measure()
    records.sort(key=lambda r: (list(modes).index(r.mode), r.load, r.session, r.turn))
    divergence = first_prompt_divergence(records)
    if divergence is not None:
        raise AgentKVError(f"agentkv bench: the modes did not replay the same conversation ({divergence})")
    lightest = plan.loads[0]
    slo, slo_note = measure_slo(records, floor, ttft_factor=slo_ttft, itl_factor=slo_itl)
    return BenchReport(
        workload=workload.name,
        workload_description=workload.description,
        modes=list(dict.fromkeys(modes)),
        sessions=plan.loads[-1],
        turns=len(workload.turns),
        machine=_machine(),
        dtype=started_dtype,
        floor=floor,
        records=records,
        round_wall_s=walls[lightest],
        summaries=summarize([r for r in records if r.load == lightest], walls[lightest], floor),
        answers_agree=_answers_agree(records),
        loads=plan.loads,
        population=plan.report(),
        slo=slo,
        slo_note=slo_note,
        load_rows=load_rows(records, walls, slo, floor),
        after_pause=after_pause([r for r in records if r.load == lightest]),
        probes=probed,
        pin_ttl_s=pin_ttl_s,
        compiled=compiled,
        block_size=block_size,
    )


def _answers_agree(records: Sequence[TurnRecord]) -> dict[str, bool]:
    reference = {(r.load, r.session, r.turn): r.output_token_ids for r in records if r.mode == "bidirectional"}
    if not reference:
        return {}
    modes = dict.fromkeys(r.mode for r in records if r.mode != "bidirectional")
    return {
        mode: all(r.output_token_ids == reference[(r.load, r.session, r.turn)] for r in records if r.mode == mode)
        for mode in modes
    }


def run_bench_sync(workload: Workload, **options: Any) -> BenchReport:
    """`run_bench` from synchronous code (the CLI); ``options`` are `run_bench`'s."""
    return anyio.run(functools.partial(run_bench, workload, **options))
