"""Soak: concurrent sessions on one embedded pair, many turns; no lost or crossed turn, flat memory, pins freed.

    make soak                      # 8 sessions x 20 turns (not part of `make test` or CI)
    .venv/bin/python scripts/soak.py --sessions 8 --turns 20 --pin-ttl-s 30

On a shared machine run it under the engines lock: ``flock /tmp/agentkv-engines.lock make soak``.

What it checks (and prints as JSON; the exit status is 1 when a check fails):

* no lost turn: every session completes every turn (no exception, an answer each time, the stats
  invariant on every step);
* no crossed turn: session i is asked again and again to repeat its own word (eight unusual words);
  a session's history that contains another session's word was served another session's output;
* memory flat: the resident memory of this process and its engine processes, sampled every second,
  grows by less than ``--rss-tolerance`` between the end of turn 3 (warm-up) and the end;
* pins freed: D's KV-cache usage (vLLM's scheduler statistics, read during a one-turn probe) falls
  when the sessions close (they release their pins) and, for sessions left open, once the pins
  expire (``--pin-ttl-s``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import anyio

from agentkv import EmbeddedPair, Session
from agentkv._engines import _vllm
from agentkv._engines._system import descendants

WORDS = ("giraffe", "violin", "copper", "tulip", "glacier", "saffron", "lantern", "walrus", "meteor", "orchid")
SYSTEM = "You are a helpful assistant. When asked to repeat a word, answer with that word only."

kv_usage: dict[str, float] = {}
"""The last KV-cache usage (0..1) each engine of the pair reported, by engine name."""


def record_kv_usage() -> None:
    """Make every engine started from now on report its KV-cache usage into `kv_usage`."""
    original = _vllm.AsyncLLMRunner._stat_logger_factory

    def factory(engine: Any) -> Any:
        base = original(engine)

        class UsageLogger(base):  # type: ignore[misc, valid-type]
            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
                if scheduler_stats is not None:
                    kv_usage[engine.name] = float(scheduler_stats.kv_cache_usage)
                super().record(scheduler_stats, iteration_stats, *args, **kwargs)

        return UsageLogger

    _vllm.AsyncLLMRunner._stat_logger_factory = factory


def resident_bytes() -> int:
    """RSS of this process and every process below it."""
    total = 0
    for pid in (os.getpid(), *descendants(os.getpid())):
        try:
            with open(f"/proc/{pid}/status") as handle:
                for line in handle:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


async def probe_usage(pair: EmbeddedPair) -> float:
    """D's KV-cache usage while it serves one short fresh turn (its own blocks included)."""
    kv_usage.pop("decode", None)
    async with Session(engine=pair, max_tokens=2, cache_salt=f"probe-{time.monotonic()}") as probe:
        await probe.run("Say ok.")
    return kv_usage.get("decode", float("nan"))


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"sessions": args.sessions, "turns": args.turns, "pin_ttl_s": args.pin_ttl_s}
    words = WORDS[: args.sessions]
    record_kv_usage()
    started = time.monotonic()
    async with EmbeddedPair(max_model_len=2048, pin_ttl_s=args.pin_ttl_s) as pair:
        report["pair_start_s"] = round(time.monotonic() - started, 1)
        sessions = [Session(engine=pair, system=SYSTEM, max_tokens=args.max_tokens) for _ in words]
        done = [0] * len(sessions)
        failures: list[str] = []
        turn_seconds: list[float] = []
        pulled = prompt = 0
        samples: list[tuple[int, int]] = []  # (turns all sessions completed, RSS)

        async def converse(index: int) -> None:
            nonlocal pulled, prompt
            session = sessions[index]
            for turn in range(1, args.turns + 1):
                began = time.monotonic()
                try:
                    result = await session.run(f"Turn {turn}. Repeat this word: {words[index]}")
                except Exception as exc:  # a lost turn: record it, keep the others going
                    failures.append(f"session {index} turn {turn}: {type(exc).__name__}: {exc}")
                    continue
                turn_seconds.append(time.monotonic() - began)
                for step in result.steps:
                    stats = step.stats
                    if stats.local_hit_tokens + stats.pulled_tokens + stats.computed_tokens != stats.prompt_tokens:
                        failures.append(f"session {index} turn {turn}: the stats invariant broke")
                    pulled += stats.pulled_tokens
                    prompt += stats.prompt_tokens
                if not result.text.strip():
                    failures.append(f"session {index} turn {turn}: an empty answer")
                done[index] = turn

        async def sample_rss() -> None:
            while True:
                samples.append((min(done), resident_bytes()))
                await anyio.sleep(1.0)

        for session in sessions:
            await session.open()
        ran = time.monotonic()
        async with anyio.create_task_group() as group:
            group.start_soon(sample_rss)
            async with anyio.create_task_group() as conversations:
                for index in range(len(sessions)):
                    conversations.start_soon(converse, index)
            samples.append((min(done), resident_bytes()))
            group.cancel_scope.cancel()
        report["soak_s"] = round(time.monotonic() - ran, 1)

        lost = list(failures)
        crossed: list[str] = []
        own_word_answers = 0
        for index, session in enumerate(sessions):
            turns = [m for m in session.messages if m.role == "user"]
            if len(turns) != args.turns:
                lost.append(f"session {index} has {len(turns)} turns, not {args.turns}")
            text = " ".join(m.content for m in session.messages if m.role != "system").lower()
            others = [word for word in words if word != words[index] and word in text]
            if others:
                crossed.append(f"session {index} ({words[index]}) shows {others}")
            own_word_answers += sum(
                1 for m in session.messages if m.role == "assistant" and words[index] in m.content.lower()
            )
        warm = [rss for turns, rss in samples if turns >= min(3, args.turns)]
        rss_warm, rss_end, rss_max = warm[0], warm[-1], max(warm)
        report.update(
            lost_turns=lost,
            crossed_turns=crossed,
            answers_with_own_word=f"{own_word_answers}/{args.sessions * args.turns}",
            turn_s_p50=round(statistics.median(turn_seconds), 3) if turn_seconds else None,
            turn_s_p95=round(statistics.quantiles(turn_seconds, n=20)[-1], 3) if len(turn_seconds) > 1 else None,
            pulled_share=round(pulled / prompt, 3) if prompt else None,
            rss_after_warmup_mib=round(rss_warm / 2**20),
            rss_end_mib=round(rss_end / 2**20),
            rss_max_mib=round(rss_max / 2**20),
            rss_growth=round((rss_end - rss_warm) / rss_warm, 4),
        )

        # Pins: held by open sessions, released when they close, freed by D at expiry otherwise.
        usage_open = await probe_usage(pair)
        for session in sessions:
            await session.aclose()
        usage_closed = await probe_usage(pair)
        left_open = [Session(engine=pair, system=SYSTEM, max_tokens=args.max_tokens) for _ in words]
        for index, session in enumerate(left_open):
            await session.open()
            await session.run(f"Repeat this word: {words[index]}. " * 40)  # long prompts: many pinned blocks
        usage_pinned = await probe_usage(pair)
        await anyio.sleep(args.pin_ttl_s + 5.0)
        usage_expired = await probe_usage(pair)
        for session in left_open:
            await session.aclose()
        report["d_kv_usage"] = {
            "sessions_open": round(usage_open, 4),
            "after_close": round(usage_closed, 4),
            "open_sessions_with_long_prompts": round(usage_pinned, 4),
            "after_pin_ttl": round(usage_expired, 4),
        }
        checks = {
            "no_lost_turn": not lost,
            "no_crossed_turn": not crossed,
            "rss_flat": report["rss_growth"] < args.rss_tolerance,
            "pins_released_on_close": usage_closed < usage_open,
            "pins_freed_at_expiry": usage_expired < usage_pinned,
        }
        report["checks"] = checks
    report["total_s"] = round(time.monotonic() - started, 1)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=8, help="concurrent sessions (at most 10)")
    parser.add_argument("--turns", type=int, default=20, help="turns per session")
    parser.add_argument("--max-tokens", type=int, default=12, help="tokens per answer")
    parser.add_argument("--pin-ttl-s", type=float, default=30.0, help="D's pin lifetime")
    parser.add_argument("--rss-tolerance", type=float, default=0.05, help="allowed RSS growth after warm-up")
    args = parser.parse_args()
    if not 1 <= args.sessions <= len(WORDS):
        parser.error(f"--sessions must be 1..{len(WORDS)}")
    report = anyio.run(soak, args)
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
