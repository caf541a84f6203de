"""``agentkv bench``: one multi-turn workload under each mode, side by side, in one run (src/agentkv/_bench), with a
progress bar, a table, a JSON report and a plot."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .._bench._goodput import DEFAULT_SLO_ITL, DEFAULT_SLO_TTFT
from .._bench._modes import DEFAULT_DTYPE, DEFAULT_MODES, DTYPES, MODES
from .._bench._population import AGENTIC_THINK_S, ARRIVALS
from .._bench._workloads import WORKLOADS
from ._cli_options import Commands, add_device_arguments, add_model_argument, add_vllm_command, device_options

__all__ = ["BenchProgress", "add_bench_command"]


def add_bench_command(commands: Commands) -> None:
    """``bench``."""
    bench = add_vllm_command(
        commands,
        "bench",
        _bench,
        epilog=" (for bench: of every engine it starts, stock vllm serve's included)",
    )
    add_model_argument(
        bench,
        help="the model of every engine the bench starts: bundled name, HF folder or org/name[@rev] (default: SmolLM2)",
    )
    add_device_arguments(bench)
    conversation = bench.add_mutually_exclusive_group()
    conversation.add_argument("--workload", choices=tuple(WORKLOADS), default="agentic", help="(default: agentic)")
    conversation.add_argument(
        "--replay", metavar="FILE", help="replay the user messages of an OpenAI messages JSON file"
    )
    bench.add_argument(
        "--modes",
        type=modes,
        default=list(DEFAULT_MODES),
        help=f"comma-separated, from {', '.join(MODES)} (default: {','.join(DEFAULT_MODES)})",
    )
    bench.add_argument("--turns", type=int, default=4)
    bench.add_argument(
        "--sessions",
        default="1",
        metavar="N[,N...]",
        help="concurrent sessions per mode; several loads (1,2,4,8,16) run each mode at each (default: 1)",
    )
    bench.add_argument(
        "--arrivals",
        choices=ARRIVALS,
        default=None,
        help="staggered: sessions start at seeded exponential gaps and each runs its own turns; barrier: every "
        "session sends turn t together (default: staggered for several loads, barrier for one)",
    )
    bench.add_argument(
        "--arrival-s",
        type=float,
        default=None,
        metavar="MEAN",
        help="mean gap between staggered sessions' starts (default: half a solo turn, measured at load 1)",
    )
    bench.add_argument(
        "--think-s",
        type=float,
        default=None,
        metavar="MEAN",
        help="mean pause before each turn after the first (seeded lognormal; 0: none); default: "
        f"{AGENTIC_THINK_S:g} s of tool latency on the agentic workload when staggered, else 0",
    )
    bench.add_argument(
        "--slo-ttft",
        type=float,
        default=DEFAULT_SLO_TTFT,
        metavar="X",
        help=f"goodput's TTFT objective: X times the turn's floor (default: {DEFAULT_SLO_TTFT:g})",
    )
    bench.add_argument(
        "--slo-itl",
        type=float,
        default=DEFAULT_SLO_ITL,
        metavar="X",
        help="goodput's token-gap objective: the turn's worst gap at most X times a solo colocated session's "
        f"median gap (default: {DEFAULT_SLO_ITL:g})",
    )
    bench.add_argument("--scale", type=float, default=1.0, help="multiply the workload's sizes")
    bench.add_argument("--max-tokens", type=int, default=None, help="answer length (default: the workload's)")
    bench.add_argument("--seed", type=int, default=0, help="seeds the workload and the population (default: 0)")
    bench.add_argument("--max-model-len", type=int, default=4096)
    bench.add_argument(
        "--dtype",
        choices=DTYPES,
        default=DEFAULT_DTYPE,
        help=f"dtype of every engine the bench starts (default: {DEFAULT_DTYPE}). In bfloat16, KV that came from "
        "a prefix cache, a pull or a recompute differs in the last bits, so greedy answers diverge between modes "
        "and later prompts differ; float32 keeps them token-exact, so every mode sees the same prompts",
    )
    bench.add_argument(
        "--probes",
        action="store_true",
        help="after the workload, on each pair mode that pushes back: a turn ended by a stop string then the next "
        "turn, and a turn after a pause past the pin TTL against one after 1 s (use with a short --pin-ttl-s)",
    )
    bench.add_argument(
        "--pin-ttl-s",
        type=float,
        default=None,
        metavar="S",
        help="the pin TTL of every pair the bench starts (above 10 s; default: the pairs' own)",
    )
    bench.add_argument(
        "--compiled",
        action="store_true",
        help="every engine the bench starts compiles its model as stock vLLM does (on a CPU agentkv runs them eager "
        "for a quick start): compare with vllm-serve this way; each start then takes minutes",
    )
    bench.add_argument(
        "--block-size",
        type=int,
        default=None,
        metavar="N",
        help="KV block size, in tokens, of every engine the bench starts, stock vllm serve's included (default: "
        "vLLM's own, 128 on a CPU: a prefix cache holds whole blocks only, so a turn recomputes its history's last "
        "partial block on one engine)",
    )
    bench.add_argument("--json", default="agentkv-bench.json", help="write the report here ('' for none)")
    bench.add_argument("--plot", default="agentkv-bench.png", help="draw the plot here ('' for none)")


def modes(text: str) -> list[str]:
    """``--modes``: ``"bidirectional,raw"`` -> ``["bidirectional", "raw"]``, each a known mode."""
    modes = [mode.strip() for mode in text.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODES)}"
        )
    return modes


class BenchProgress:
    """The bench's progress bar on stderr (tqdm), fed by `run_bench`'s progress calls."""

    def __init__(self) -> None:
        self._bar: Any = None

    def __call__(self, label: str, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True)
        self._bar.set_description_str(label, refresh=False)
        self._bar.update(done - self._bar.n)
        if done >= total:
            self._bar.close()

    @staticmethod
    def log(line: str) -> None:
        """A line of its own above the bar."""
        tqdm.write(line, file=sys.stderr)


def _bench(args: argparse.Namespace) -> int:
    """one multi-turn workload under each mode, side by side, in one run"""
    from .._bench import (
        PAIR_MODES,
        after_pause_lines,
        early_ratio_line,
        floor_line,
        goodput_lines,
        header,
        load_replay,
        load_tables,
        make_workload,
        parse_loads,
        plot,
        probe_lines,
        push_against_pull,
        run_bench_sync,
        served_overhead,
        table,
    )

    loads = parse_loads(args.sessions)
    if args.replay:
        workload = load_replay(args.replay, max_tokens=args.max_tokens or 64, turns=args.turns)
    else:
        workload = make_workload(args.workload, turns=args.turns, scale=args.scale, seed=args.seed)
        if args.max_tokens:
            workload = dataclasses.replace(workload, max_tokens=args.max_tokens)
    progress = BenchProgress()
    population = ("arrivals", "arrival_s", "think_s", "seed", "slo_ttft", "slo_itl")  # run_bench's names too
    report = run_bench_sync(
        workload,
        modes=args.modes,
        sessions=loads,
        **{name: getattr(args, name) for name in population},
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        probes=args.probes,
        pin_ttl_s=args.pin_ttl_s,
        compiled=args.compiled,
        block_size=args.block_size,
        model=args.model,
        engine_args=args.engine_args,
        **device_options(args),
        progress=progress,
        log=progress.log,
    )
    print(f"\n{header(report)}\n")
    if len(report.loads) > 1:
        print(f"at {report.loads[0]} session(s) per mode, the lightest load:\n")
    print(table(report.summaries))
    if report.floor is not None:
        print(f"\n{floor_line(report.floor)}")
    if report.answers_agree:
        agree = ", ".join(f"{mode} {'yes' if same else 'NO'}" for mode, same in report.answers_agree.items())
        print(f"greedy answers equal to bidirectional's: {agree}")
    for line in (served_overhead(report.summaries), push_against_pull(report.summaries)):
        if line is not None:
            print(line)
    if len(report.loads) > 1:
        print("\nper load, turns 2+ (tok/s: output tokens over the time a turn of the mode was in flight):\n")
        print(load_tables(report.load_rows))
        print()
    for line in goodput_lines(report):
        print(line)
    pairs = any(mode in PAIR_MODES for mode in report.modes)
    for line in (*after_pause_lines(report.after_pause, pair_modes_ran=pairs), early_ratio_line(report.after_pause)):
        if line is not None:
            print(line)
    for line in probe_lines(report.probes):
        print(line)
    if args.json:
        Path(args.json).write_text(report.model_dump_json(indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        try:
            plot(report, args.plot)
            print(f"wrote {args.plot}")
        except ImportError as exc:
            print(f"agentkv bench: no plot: {exc}", file=sys.stderr)
    return 0
