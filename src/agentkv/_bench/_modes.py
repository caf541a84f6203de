"""The bench's modes (src/agentkv/_bench/_runner.py runs them) and the engines each runs on.

Engines: one bidirectional pair (elastic cores) serves ``auto`` (each step placed on P or
on D alone), ``bidirectional`` (always P), ``disaggregated`` (P's prefix cache on) and ``raw``
(the protocol driven by hand); ``bidirectional-split`` gets a second pair with each engine
always on its own half of the cores (the first design's layout: the elastic-cores lever);
``disaggregated-nocache`` a pair whose P has no prefix cache and no push-back (the source's
baseline); ``colocated`` one engine with prefix caching; ``launched`` the bidirectional pair
as two API-server processes over HTTP (`LaunchedPair`); ``netns`` the same with P and D in
two network namespaces (KV over UCX/TCP; needs root: `two_hosts`); ``served`` sends the conversation
through the front door (`FrontDoor`) to sessions on the bidirectional pair; ``push`` and ``push-disaggregated``
get a pair with push transfer (P writes each step's KV into D), with push-back and without; ``vllm-serve`` is stock
``vllm serve`` with vLLM's defaults, driven as ``served`` is (src/agentkv/_bench/_stock.py); ``bidirectional-early`` is
bidirectional's session on the same default pair with the early transfer (`EARLY_MODE`: the KV moved into P during
the pause before each turn). All stay up for the whole run, all with the run's dtype; every pair with the run's pin TTL when one
is given.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from anyio.from_thread import BlockingPortal

from .._engines import Colocated, EmbeddedPair, Engine, LaunchedPair
from .._engines._netns import two_hosts
from .._errors import UserError
from .._home import EventLoopHome
from .._session._session import Mode

__all__ = [
    "DEFAULT_DTYPE",
    "DEFAULT_MODES",
    "DEFAULT_PAIR_MODES",
    "DTYPES",
    "EARLY_MODE",
    "MODES",
    "StartedEngines",
    "PAIR_MODES",
    "PROBE_MODES",
    "SESSION_MODES",
    "open_engines",
    "started_engine_args",
    "session_options",
]

SESSION_MODES: dict[str, Mode] = {
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
    "bidirectional-early": "bidirectional",
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
    "vllm-serve",
    "bidirectional-early",
)
EARLY_MODE = "bidirectional-early"
"""Bidirectional with the early transfer: its session on the default pair with ``early_transfer=True``, so that
during the pause before each turn a one-token step moves what D added into P's cache, where ``bidirectional``'s
session (the default, without it) pulls it when the step starts."""
PAIR_MODES = frozenset(MODES) - {"colocated", "vllm-serve"}
"""The modes that run on a pair of engines (P and D)."""
PROBE_MODES = frozenset(mode for mode, kind in SESSION_MODES.items() if kind != "disaggregated") - {
    "colocated",
    "served",
}
"""The pair modes that push back through a `Session` of their own: the probes' (src/agentkv/_bench/_probes.py)."""
DEFAULT_MODES = MODES[:6]
"""What ``agentkv bench`` runs unless told: the modes of one embedded pair, the source's baseline and the
colocated engine."""
DEFAULT_PAIR_MODES = frozenset({"auto", "bidirectional", "disaggregated", "raw", "served", EARLY_MODE})
"""The modes that share the default (elastic-cores, push-back) pair."""

DTYPES = ("auto", "float32", "bfloat16")
"""The dtypes ``agentkv bench`` starts its engines with (see `DEFAULT_DTYPE`)."""
DEFAULT_DTYPE = "float32"
"""The bench's default dtype. In bfloat16, KV that came from a prefix cache, a pull or a recompute
differs from freshly computed KV in the last bits, so greedy answers diverge between modes and the
later turns' prompts differ; float32 keeps every mode token-exact, so every mode sees the same prompts."""


def session_options(mode: str) -> dict[str, Any]:
    """The `Session` keywords of a bench mode's sessions besides the workload's: its `Session` mode, and for
    `EARLY_MODE` ``early_transfer=True``."""
    options: dict[str, Any] = {"mode": SESSION_MODES[mode]}
    if mode == EARLY_MODE:
        options["early_transfer"] = True
    return options


COMPILED_ENGINE_ARGS = {"enforce_eager": False}
"""``agentkv bench --compiled``: agentkv's engines compile their model as stock vLLM does (on a CPU agentkv runs them
eager, for a start-up of ~20 s instead of minutes: src/agentkv/_engines/_platform_settings.py), so that the
``vllm-serve`` mode's speed compares with theirs and not with eager mode's."""

_Start = Callable[[contextlib.AsyncExitStack], Engine]
"""Makes an engine (not yet open); what it needs besides (network namespaces) goes on the stack."""


def started_engine_args(
    *, compiled: bool, block_size: int | None, engine_args: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The vLLM engine arguments of every engine the bench starts: compiling its model when ``compiled``
    (`COMPILED_ENGINE_ARGS`), with KV blocks of ``block_size`` tokens when given (else vLLM's own: 128 on a CPU,
    16 on CUDA), and the caller's own ``engine_args`` (``agentkv bench -- <vLLM args>``) over both."""
    return {
        **(COMPILED_ENGINE_ARGS if compiled else {}),
        **({} if block_size is None else {"block_size": block_size}),
        **(engine_args or {}),
    }


@dataclass(frozen=True)
class StartedEngines:
    """The model and the GPUs of every engine the bench starts (``agentkv bench --model ... --prefill-devices ...``).

    ``model``: a bundled name, an HF folder or an HF id, as ``--model`` takes one (None: the bundled model).
    ``prefill_devices`` / ``decode_devices``: each pair's P and D GPUs (CUDA; None: the visible GPUs in two halves);
    a colocated engine runs where vLLM puts it (its first visible GPU)."""

    model: str | None = None
    prefill_devices: Sequence[int | str] | None = None
    decode_devices: Sequence[int | str] | None = None

    def pair_options(self) -> dict[str, Any]:
        devices = self.prefill_devices is not None or self.decode_devices is not None
        return {"prefill_devices": self.prefill_devices, "decode_devices": self.decode_devices} if devices else {}


def _starts(
    max_model_len: int,
    dtype: str,
    progress: Callable[[str], None],
    pin_ttl_s: float | None = None,
    engine_args: Mapping[str, Any] | None = None,
    placement: StartedEngines | None = None,
) -> list[tuple[frozenset[str], _Start]]:
    """Each engine the bench may start, in the order it starts them, with the modes it serves; every pair with
    ``pin_ttl_s`` when given; every engine with ``engine_args`` (`started_engine_args`) on ``placement``'s model,
    every pair on its GPUs."""
    placement = placement or StartedEngines()
    single: dict[str, Any] = {"max_model_len": max_model_len, "dtype": dtype, "progress": progress}
    if placement.model is not None:
        single["model"] = placement.model
    if engine_args:
        single["engine_args"] = dict(engine_args)
    common = {**single, **({} if pin_ttl_s is None else {"pin_ttl_s": pin_ttl_s}), **placement.pair_options()}

    def across_hosts(stack: contextlib.AsyncExitStack) -> Engine:
        hosts = stack.enter_context(two_hosts())
        prefixes = hosts.launch_prefixes
        return LaunchedPair(hosts=hosts.addresses, launch_prefixes=prefixes, server_env={"UCX_TLS": "tcp"}, **common)

    return [
        (DEFAULT_PAIR_MODES, lambda _: EmbeddedPair(**common)),
        (frozenset({"bidirectional-split"}), lambda _: EmbeddedPair(core_policy="split", **common)),
        (
            frozenset({"disaggregated-nocache"}),
            lambda _: EmbeddedPair(push_back=False, prefill_prefix_cache=False, **common),
        ),
        (frozenset({"push", "push-disaggregated"}), lambda _: EmbeddedPair(transfer="push", **common)),
        (frozenset({"colocated"}), lambda _: Colocated(**single)),
        (frozenset({"launched"}), lambda _: LaunchedPair(**common)),
        (frozenset({"netns"}), across_hosts),
    ]


@contextlib.asynccontextmanager
async def open_engines(
    modes: Sequence[str],
    *,
    given: Mapping[str, Engine] | None,
    max_model_len: int,
    dtype: str,
    progress: Callable[[str], None],
    pin_ttl_s: float | None = None,
    engine_args: Mapping[str, Any] | None = None,
    placement: StartedEngines | None = None,
) -> AsyncIterator[dict[str, Engine]]:
    """The engines the modes need (given, or started one after another, all in ``dtype``, every pair with
    ``pin_ttl_s`` when given, every engine with ``engine_args`` (`started_engine_args`) on ``placement``, and closed
    on the way out). Started ones live on the running loop, reachable from other threads (the front door's)."""
    if given is not None:
        missing = [mode for mode in modes if mode not in given]
        if missing:
            raise UserError(f"no engine given for mode(s) {', '.join(missing)}")
        yield {mode: given[mode] for mode in modes}
        return
    async with BlockingPortal() as portal, contextlib.AsyncExitStack() as stack:
        home = EventLoopHome(asyncio.get_running_loop(), portal)  # the home names asyncio's loop (the engines')
        by_mode: dict[str, Engine] = {}
        for served, start in _starts(max_model_len, dtype, progress, pin_ttl_s, engine_args, placement):
            if served & set(modes):
                engine = start(stack)
                await engine.open(home=home)
                stack.push_async_callback(engine.aclose)
                by_mode.update(dict.fromkeys(served, engine))
        yield {mode: by_mode[mode] for mode in modes}
