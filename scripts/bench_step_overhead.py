"""What the OpenTelemetry spans and metrics cost on the step path when the application configures no SDK.

    .venv/bin/python scripts/bench_step_overhead.py [--before MAIN/src --rounds 4] [--blocks 20 --steps 100]

Measured on `Session.step` on `HonestPairEngine` (no model: what is left is agentkv's own work per step, rendering
and tokenizing included), the same messages every step; in one run:

* **the check against the no-op spans, in one process**: blocks of ``--steps`` steps alternate between the step
  path with its spans forced on (``sdk_configured`` answering yes: the API's no-op spans started and ended, the
  step's metrics handed to its no-op instruments, as every step did before the check) and the step path as it is (the
  check finds no SDK and skips them); the median per step of each side's blocks, and the difference.
* **before and after**, with ``--before`` (a checkout's ``src`` without the spans): child processes alternate
  between it and ``--after`` (default: this checkout's ``src``), ``--rounds`` each, each timing ``--steps`` steps
  after a warm-up (a child's start imports transformers: slow, hence few rounds).
* **alone**, against the API's no-op providers, in loops of 100,000: the calls a step would add with the spans on
  (a ``chat`` span started and ended, its attributes computed only if recording, the step metrics recorded), and the
  check (``sdk_configured``) that the step makes instead.

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
    """Per-step medians of blocks of steps, alternating between the spans forced on and the step path as it is."""
    import unittest.mock

    import anyio

    from agentkv import Session
    from agentkv._session import _turn
    from agentkv.testing import HonestPairEngine

    medians: dict[str, list[float]] = {"spans on": [], "as is": []}

    def configured() -> bool:
        return True

    async def run() -> None:
        async with HonestPairEngine(lambda request: "An answer.") as engine, Session(engine=engine, max_tokens=16) as s:
            for _ in range(20):
                await s.step(HISTORY)
            for block in range(blocks):
                for side in list(medians)[:: 1 if block % 2 == 0 else -1]:  # ABBA: no side always goes first
                    forced = configured if side == "spans on" else _turn.sdk_configured
                    with unittest.mock.patch.object(_turn, "sdk_configured", forced):
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


def _check_alone(loops: int) -> float:
    """Microseconds per step of the check a step makes instead, no SDK configured."""
    from agentkv._stats._telemetry import sdk_configured

    started = time.perf_counter()
    for _ in range(loops):
        sdk_configured()
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
    sys.stdout.write(f"the check alone, no SDK: {_check_alone(100_000):.3f} us/step\n")


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
