"""What the OpenTelemetry spans and metrics cost on the step path when the application configures no SDK.

    .venv/bin/python scripts/bench_step_overhead.py --before /work/main/src [--rounds 12] [--steps 300]

Two measurements, in one run:

* **the step path, before and after**: `Session.step` on `HonestPairEngine` (no model: what is left is agentkv's own
  work per step, rendering and tokenizing included), in child processes that alternate between ``--before`` (a
  checkout's ``src`` without the spans) and ``--after`` (default: this checkout's ``src``), ``--rounds`` each. Each
  child times ``--steps`` steps after a warm-up and reports the median per step; the table gives each side's
  median of those, the spread, and the difference.
* **the spans alone**: the calls a step adds (a ``chat`` span started and ended with its attributes computed only
  if recording, the step metrics recorded), timed in a loop of 100,000 against the API's no-op providers.

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


def _child(steps: int) -> None:
    import anyio

    from agentkv import Session
    from agentkv.testing import HonestPairEngine

    async def run() -> list[float]:
        async with HonestPairEngine(lambda request: "An answer.") as engine, Session(engine=engine, max_tokens=16) as s:
            history = [{"role": "user", "content": "What is the capital of France?"}]
            for _ in range(20):  # warm-up
                await s.step(history)
            took = []
            for _ in range(steps):
                started = time.perf_counter()
                await s.step(history)  # the same messages: a rebuilt conversation each time, the same work
                took.append(time.perf_counter() - started)
            return took

    took = anyio.run(run)
    sys.stdout.write(json.dumps({"median_us": statistics.median(took) * 1e6}) + "\n")


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
    parser.add_argument("--before", required=True, help="the src folder of a checkout without the spans")
    parser.add_argument("--after", default=str(Path(__file__).parent.parent / "src"))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.steps)
        return
    medians: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for side in ("before", "after"):  # alternating: a change in the machine's load hits both alike
            env = {**os.environ, "PYTHONPATH": getattr(args, side)}
            out = subprocess.run(
                [sys.executable, __file__, "--before", args.before, "--child", "--steps", str(args.steps)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            medians[side].append(json.loads(out.strip().splitlines()[-1])["median_us"])
    for side, values in medians.items():
        sys.stdout.write(
            f"{side:6}  median of {len(values)} rounds {statistics.median(values):8.1f} us/step"
            f"  (rounds from {min(values):.1f} to {max(values):.1f})\n"
        )
    difference = statistics.median(medians["after"]) - statistics.median(medians["before"])
    sys.stdout.write(f"after - before: {difference:+.1f} us/step\n")
    sys.stdout.write(f"the spans and metrics alone, no SDK: {_spans_alone(100_000):.2f} us/step\n")


if __name__ == "__main__":
    main()
