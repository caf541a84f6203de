"""``agentkv bench``: one multi-turn workload under each mode, in one run, side by side."""

from __future__ import annotations

import functools
import logging
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from .._engines import Engine
from .._engines._platform_settings import resolve_dtype
from .._errors import AgentKVError, UserError
from ._modes import DEFAULT_DTYPE, DEFAULT_MODES, DTYPES, MODES
from ._records import SERVED_TTFT_TARGET, BenchReport, ModeSummary, TurnRecord, first_prompt_divergence, summarize
from ._report import header, plot, push_against_pull, served_overhead, table
from ._runner import Progress, run_modes
from ._workloads import WORKLOADS, Workload, load_replay, make_workload

__all__ = [
    "DEFAULT_DTYPE",
    "DEFAULT_MODES",
    "DTYPES",
    "MODES",
    "SERVED_TTFT_TARGET",
    "Progress",
    "WORKLOADS",
    "BenchReport",
    "ModeSummary",
    "TurnRecord",
    "Workload",
    "header",
    "load_replay",
    "make_workload",
    "plot",
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
    sessions: int = 1,
    max_model_len: int = 4096,
    dtype: str | None = None,
    engines: Mapping[str, Engine] | None = None,
    progress: Progress | None = None,
    log: Callable[[str], None] | None = None,
) -> BenchReport:
    """Run ``workload`` under ``modes`` (interleaved turn by turn) and return what was measured.

    ``progress`` is called before each round with (what runs, steps done, steps in all);
    ``log`` with one line per start-up stage (default: the ``agentkv`` logger).
    ``engines`` maps each mode to an open engine to use (the caller's to close); by default
    the bench starts what the modes need, every engine in ``dtype`` (one of `DTYPES`; default
    float32, see `DEFAULT_DTYPE`: it keeps the modes' greedy answers, hence their prompts,
    identical), and closes them at the end. ``dtype`` and ``engines`` exclude each other. Mode ``served``
    puts a front door in a thread before its sessions: a given engine for it must be open on a loop that
    thread can call (opened with ``with``).

    Raises `AgentKVError` when a mode gave the model another prompt than bidirectional on the same history:
    its figures would not compare (served: the front door did not give the model what `Session.run` gives it).
    """
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise UserError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if sessions < 1:
        raise UserError("sessions must be at least 1")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"dtype is one of {', '.join(DTYPES)}, not {dtype!r}")
    if dtype is not None and engines is not None:
        raise UserError("dtype applies to the engines the bench starts; the given engines run in their own")
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
        sessions=sessions,
        max_model_len=max_model_len,
        dtype=started_dtype or DEFAULT_DTYPE,
        engines=engines,
        progress=progress or (lambda *_: None),
        log=log or (lambda line: logger.info("%s", line)),
    )
    home = next(iter(homes.values()), None)
    if home is not None and not home.is_current():  # engines opened with `with`: run where they live
        records, walls, floor = await home.call_async(measure)
    else:
        records, walls, floor = await measure()
    records.sort(key=lambda r: (list(modes).index(r.mode), r.session, r.turn))
    divergence = first_prompt_divergence(records)
    if divergence is not None:
        raise AgentKVError(f"agentkv bench: the modes did not replay the same conversation ({divergence})")
    return BenchReport(
        workload=workload.name,
        workload_description=workload.description,
        modes=list(dict.fromkeys(modes)),
        sessions=sessions,
        turns=len(workload.turns),
        machine=_machine(),
        dtype=started_dtype,
        floor=floor,
        records=records,
        round_wall_s=walls,
        summaries=summarize(records, walls, floor),
        answers_agree=_answers_agree(records),
    )


def _answers_agree(records: Sequence[TurnRecord]) -> dict[str, bool]:
    reference = {(r.session, r.turn): r.output_token_ids for r in records if r.mode == "bidirectional"}
    if not reference:
        return {}
    modes = dict.fromkeys(r.mode for r in records if r.mode != "bidirectional")
    return {
        mode: all(r.output_token_ids == reference[(r.session, r.turn)] for r in records if r.mode == mode)
        for mode in modes
    }


def run_bench_sync(workload: Workload, **options: Any) -> BenchReport:
    """`run_bench` from synchronous code (the CLI); ``options`` are `run_bench`'s."""
    return anyio.run(functools.partial(run_bench, workload, **options))
