"""The probes (``agentkv bench --probes``, issue 30): after the workload, once per pair mode that pushes back
(`PROBE_MODES`), on that mode's engine, with fresh conversations of the workload's first two messages under cache
salts of their own:

* **stop string** (`stop_probe`): the first message is answered without stop, a word from the middle of that answer
  becomes the stop string of the same first turn in a second conversation (greedy: the answer is the same up to the
  word, so the word ends it early), then after `SHORT_PAUSE_S` (an agent's tool run: room for the session to pin
  the conversation again) the second message follows: its step's pulled tokens and miss reason say
  whether D's KV still came back after a step a stop string ended (vLLM aborts such a step on D, which then pins
  nothing unless the session pins again);
* **pause past the pin's TTL** (`pin_ttl_probe`): two conversations take the same two turns, one pausing
  `SHORT_PAUSE_S` before the second, the other the pair's pin TTL plus `PAST_TTL_S`; the session renews its pin
  during the long pause (``Session(renew_pins=True)``, src/agentkv/_session/_renewal.py), so both second turns
  should pull and take about as long. The pin TTL is the engine's (``agentkv bench --pin-ttl-s`` sets it short).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

import anyio

from .._engines import Engine
from .._session._session import Session
from ._conversations import Clock, SessionConversation
from ._modes import session_options
from ._target_records import PIN_TTL_RATIO_TARGET, ModeProbes, PinTtlProbe, StopProbe
from ._workloads import Workload

__all__ = [
    "PAST_TTL_S",
    "SHORT_PAUSE_S",
    "long_pause_s",
    "pick_stop",
    "pin_ttl_of",
    "pin_ttl_probe",
    "probe_lines",
    "run_probes",
    "stop_probe",
]

SHORT_PAUSE_S = 1.0
"""The pause before the turn after the stopped one, and the short pause before the pause probe's reference turn."""
PAST_TTL_S = 10.0
"""How far past the pin's TTL the long pause goes."""


def long_pause_s(pin_ttl_s: float) -> float:
    """The long pause of the pause probe: the pin's TTL plus `PAST_TTL_S`."""
    return pin_ttl_s + PAST_TTL_S


def pin_ttl_of(engine: Engine) -> float | None:
    """The engine's pin TTL as it reports it (its details, else its configuration's: a launched pair's
    `PairConfig.pin_ttl_s`); None if it says none."""
    ttl = engine.info.details.get("pin_ttl_s", getattr(getattr(engine, "config", None), "pin_ttl_s", None))
    return None if ttl is None else float(ttl)


def pick_stop(text: str) -> str | None:
    """A word of ``text`` (3+ letters) whose first occurrence, where a stop string would end the text, is nearest
    the middle and not at the start; None when there is none."""
    middle, best = len(text) / 2, None
    for match in re.finditer(r"[A-Za-z]{3,}", text):
        at = text.find(match.group())
        if at > 0 and (best is None or abs(at - middle) < best[0]):
            best = (abs(at - middle), match.group())
    return None if best is None else best[1]


def _session(engine: Engine, mode: str, workload: Workload, salt: str, **extra: Any) -> Session:
    return Session(engine=engine, **session_options(mode), max_tokens=workload.max_tokens, cache_salt=salt, **extra)


async def stop_probe(engine: Engine, mode: str, workload: Workload, salt: str) -> StopProbe:
    """A first turn ended by a stop string picked from its answer without stop (`pick_stop`), then the next turn."""
    system = {"role": "system", "content": workload.system}
    first, second = ({"role": "user", "content": text} for text in workload.turns[:2])
    async with _session(engine, mode, workload, f"{salt}-free") as free:
        full = await free.step([system, first])
    stop = pick_stop(full.text)
    if stop is None:
        note = f"no word of the answer to the first message ends it early ({full.text!r})"
        return StopProbe(stop=None, note=note, full_output_tokens=full.stats.output_tokens)
    async with _session(engine, mode, workload, f"{salt}-stop") as session:
        stopped = await session.step([system, first], stop=stop)
        if not (stopped.stats.output_tokens < full.stats.output_tokens and full.text.startswith(stopped.text)):
            return StopProbe(
                stop=None,
                note=f"the stop string {stop!r} did not end the answer early ({stopped.text!r})",
                full_output_tokens=full.stats.output_tokens,
                stopped_output_tokens=stopped.stats.output_tokens,
            )
        await anyio.sleep(SHORT_PAUSE_S)  # as an agent's tool runs: room for the session to pin again
        after = await session.step([system, first, {"role": "assistant", "content": stopped.text}, second])
        turn = session.stats.turns[-1]
    return StopProbe(
        stop=stop,
        full_output_tokens=full.stats.output_tokens,
        stopped_output_tokens=stopped.stats.output_tokens,
        next_pulled_tokens=after.stats.pulled_tokens,
        next_miss_reason=after.stats.miss_reason,
        next_prefill_engine=after.stats.prefill_engine,
        next_ttft_s=after.stats.ttft_s,
        repins=getattr(turn, "repins", None),  # counted once the session pins again after a stop string
    )


async def _second_turn(engine: Engine, mode: str, workload: Workload, salt: str, pause_s: float) -> tuple[Any, ...]:
    """(client TTFT, pulled tokens, miss reason, renewals) of the second turn of a fresh conversation, after
    ``pause_s``."""
    async with _session(engine, mode, workload, salt, system=workload.system) as session:
        conversation = SessionConversation(session)
        await conversation.turn(workload.turns[0], Clock())
        await anyio.sleep(pause_s)
        clock = Clock()
        answer = await conversation.turn(workload.turns[1], clock)
        renewals = session.stats.turns[-1].pin_renewals
    return clock.ttft_s, answer.stats.pulled_tokens, answer.stats.miss_reason, renewals


async def pin_ttl_probe(
    engine: Engine, mode: str, workload: Workload, salt: str, *, short_s: float, long_s: float
) -> PinTtlProbe:
    """The same second turn after ``short_s`` and after ``long_s`` (past the pin's TTL), each in a fresh
    conversation."""
    short = await _second_turn(engine, mode, workload, f"{salt}-short", short_s)
    long = await _second_turn(engine, mode, workload, f"{salt}-long", long_s)
    return PinTtlProbe(
        pin_ttl_s=pin_ttl_of(engine),
        short_pause_s=short_s,
        long_pause_s=long_s,
        short_ttft_s=short[0],
        long_ttft_s=long[0],
        short_pulled_tokens=short[1],
        long_pulled_tokens=long[1],
        short_miss_reason=short[2],
        long_miss_reason=long[2],
        short_renewals=short[3],
        long_renewals=long[3],
    )


async def run_probes(
    engine: Engine,
    mode: str,
    workload: Workload,
    *,
    log: Callable[[str], None],
    long_s: float | None = None,
) -> ModeProbes:
    """Both probes of ``mode`` on ``engine``; the long pause is `long_pause_s` of the engine's pin TTL unless
    ``long_s`` is given."""
    salt = f"agentkv-bench-probe-{uuid.uuid4().hex[:8]}-{mode}"
    ttl = pin_ttl_of(engine)
    if long_s is None and ttl is not None:
        long_s = long_pause_s(ttl)
    ttl_text = "unknown" if ttl is None else f"{ttl:g} s"
    pauses = "" if long_s is None else f", then pauses of {SHORT_PAUSE_S:g} s and {long_s:g} s (pin TTL {ttl_text})"
    log(f"agentkv bench: probes on {mode}: a stop string{pauses}")
    stop = await stop_probe(engine, mode, workload, salt)
    if long_s is None:
        note = "the engine does not say its pin TTL: no pause past it"
        return ModeProbes(mode=mode, stop=stop, pin_ttl=None, pin_ttl_note=note)
    pause = await pin_ttl_probe(engine, mode, workload, salt, short_s=SHORT_PAUSE_S, long_s=long_s)
    return ModeProbes(mode=mode, stop=stop, pin_ttl=pause)


def probe_lines(probes: list[ModeProbes]) -> list[str]:
    """The probes' lines under the tables, two per mode: the stop string's next step, and the pause past the pin's
    TTL against the short one."""
    lines: list[str] = []
    for probe in probes:
        stop, pause = probe.stop, probe.pin_ttl
        if stop.stop is None:
            stopped = f"no stop string: {stop.note}"
        else:
            repins = "" if stop.repins is None else f", {stop.repins} repin(s)"
            verdict = "met" if (stop.next_pulled_tokens or 0) > 0 else "NOT met"
            stopped = (
                f"stop {stop.stop!r} ended the answer at {stop.stopped_output_tokens} of {stop.full_output_tokens} "
                f"tokens; the next step pulled {stop.next_pulled_tokens} tokens (target > 0: {verdict}), miss "
                f"{stop.next_miss_reason or '-'}, on {stop.next_prefill_engine or '-'}{repins}"
            )
        lines.append(f"probe {probe.mode}: {stopped}")
        if pause is None:
            lines.append(f"probe {probe.mode}: {probe.pin_ttl_note}")
            continue
        verdict = "met" if pause.ratio <= PIN_TTL_RATIO_TARGET else "NOT met"
        ttl = "?" if pause.pin_ttl_s is None else f"{pause.pin_ttl_s:g}"
        lines.extend(
            (
                f"probe {probe.mode}: after {pause.long_pause_s:g} s (pin TTL {ttl} s) TTFT "
                f"{pause.long_ttft_s:.3f} s against {pause.short_ttft_s:.3f} s after {pause.short_pause_s:g} s: "
                f"{pause.ratio:.2f}x (target <= {PIN_TTL_RATIO_TARGET:g}x: {verdict}); pulled {pause.long_pulled_tokens}"
                f" vs {pause.short_pulled_tokens} tokens, miss {pause.long_miss_reason or '-'} vs "
                f"{pause.short_miss_reason or '-'}; renewals {pause.long_renewals} vs {pause.short_renewals}",
            )
        )
    return lines
