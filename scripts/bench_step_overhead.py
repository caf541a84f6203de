"""What the OpenTelemetry spans and metrics cost on the step path when the application configures no SDK.

    .venv/bin/python scripts/bench_step_overhead.py [--before MAIN/src --rounds 4] [--blocks 20 --steps 100]

Measured on `Session.step` on `HonestPairEngine` (no model: what is left is agentkv's own work per step, rendering
and tokenizing included), the same messages every step; in one run:

* **with and without the spans, in one process**: blocks of ``--steps`` steps alternate between the step path as it
  is and the same path with its span calls replaced by nothing (``start_step``/``end_step``); the median per step of
  each side's blocks, and the difference.
* **before and after**, with ``--before`` (a checkout's ``src`` without the spans): child processes alternate
  between it and ``--after`` (default: this checkout's ``src``), ``--rounds`` each, each timing ``--steps`` steps
  after a warm-up (a child's start imports transformers: slow, hence few rounds).
* **the spans alone**: the calls a step adds (a ``chat`` span started and ended, its attributes computed only if
  recording, the step metrics recorded), timed in a loop of 100,000 against the API's no-op providers.

Used in docs/observability.md ("What it costs").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HISTORY = [{"role": "user", "content": "What is the capital of France?"}]


def _child(steps: int) -> None:
    import anyio

    from agentkv import Session
    from agentkv.testing import HonestPairEngine

    async def run() -> list[float]:
        async with HonestPairEngine(lambda request: "An answer.") as engine, Session(engine=engine, max_tokens=16) as s:
            for _ in range(20):  # warm-up
                await s.step(HISTORY)
            took = []
            for _ in range(steps):
                started = time.perf_counter()
                await s.step(HISTORY)  # the same messages: a rebuilt conversation each time, the same work
                took.append(time.perf_counter() - started)
            return took

    took = anyio.run(run)
    sys.stdout.write(json.dumps({"median_us": statistics.median(took) * 1e6}) + "\n")


def _toggled(blocks: int, steps: int) -> dict[str, list[float]]:
    """Per-step medians of blocks of steps, alternating between the spans on and replaced by nothing."""
    import unittest.mock

    import anyio
    from opentelemetry import trace

    from agentkv import Session
    from agentkv._session import _turn
    from agentkv.testing import HonestPairEngine

    medians: dict[str, list[float]] = {"without": [], "with spans": []}

    def nothing_started(*args: object, **kwargs: object) -> object:
        return trace.INVALID_SPAN

    def nothing_ended(*args: object, **kwargs: object) -> None:
        return None

    async def run() -> None:
        async with HonestPairEngine(lambda request: "An answer.") as engine, Session(engine=engine, max_tokens=16) as s:
            for _ in range(20):
                await s.step(HISTORY)
            for block in range(blocks):
                for side in list(medians)[:: 1 if block % 2 == 0 else -1]:  # ABBA: no side always goes first
                    off = side == "without"
                    with (
                        unittest.mock.patch.object(_turn, "start_step", nothing_started if off else _turn.start_step),
                        unittest.mock.patch.object(_turn, "end_step", nothing_ended if off else _turn.end_step),
                    ):
                        took = []
                        for _ in range(steps):
                            started = time.perf_counter()
                            await s.step(HISTORY)
                            took.append(time.perf_counter() - started)
                    medians[side].append(statistics.median(took) * 1e6)

    anyio.run(run)
    return medians


def _spans_alone(loops: int) -> float:
    """Microseconds per step of the calls the spans add, no SDK configured."""
    from agentkv._engines import Sampling, StepDone, StepRequest, StepTimings
    from agentkv._session._tracing import TraceInfo, end_step, start_step
    from agentkv._stats._stats import StepStats

    info = TraceInfo(conversation_id="c", model="m")
    request = StepRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=Sampling(max_tokens=16))
    done = StepDone(token_ids=[4], text="x", finish_reason="stop", timings=StepTimings(ttft_s=0.1))
    stats = StepStats(turn=1, step=1, ttft_s=0.1, prompt_tokens=3, output_tokens=1, computed_tokens=3)
    started = time.perf_counter()
    for _ in range(loops):
        span = start_step(info, request, turn=1, step=1, parent=None)
        end_step(span, info, stats=stats, done=done, upkeep=None, error=None)
    return (time.perf_counter() - started) / loops * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="the src folder of a checkout without the spans")
    parser.add_argument("--after", default=str(Path(__file__).parent.parent / "src"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.steps)
        return
    toggled = _toggled(args.blocks, args.steps)
    _report(toggled, "in one process")
    if args.before:
        medians: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(args.rounds):
            for side in ("before", "after"):  # alternating: a change in the machine's load hits both alike
                env = {**os.environ, "PYTHONPATH": getattr(args, side)}
                out = subprocess.run(
                    [sys.executable, __file__, "--child", "--steps", str(args.steps)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                medians[side].append(json.loads(out.strip().splitlines()[-1])["median_us"])
        _report(medians, "child processes")
    sys.stdout.write(f"the spans and metrics alone, no SDK: {_spans_alone(100_000):.2f} us/step\n")


def _report(medians: dict[str, list[float]], how: str) -> None:
    for side, values in medians.items():
        sys.stdout.write(
            f"{how}: {side:10} median of {len(values)} {statistics.median(values):8.1f} us/step"
            f"  (from {min(values):.1f} to {max(values):.1f})\n"
        )
    first, second = medians.values()
    sys.stdout.write(f"{how}: difference {statistics.median(second) - statistics.median(first):+.1f} us/step\n")


if __name__ == "__main__":
    main()
