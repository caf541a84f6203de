"""The ``agentkv`` command: ``demo``, ``chat``, ``bench``, ``serve`` (the front door), ``engine`` (one server of a pair),
``smoke`` (a pair's check on this host: `agentkv._surfaces._smoke`) and ``models``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from tqdm import tqdm

from .._bench._runner import DEFAULT_DTYPE, DEFAULT_MODES, DTYPES, MODES
from .._bench._workloads import WORKLOADS
from .._engines import EmbeddedPair, Engine, EngineGroup, LaunchedPair, RemotePair
from .._engines._pair_config import Transfer
from .._engines._platforms import current_platform, split_devices_among_pairs
from .._engines._system import split_cores_among_pairs
from .._errors import AgentKVError, UserError
from .._model import list_models, prepare_model
from .._session._results import TextDelta
from .._session._session import Mode, Session
from ._signals import StopSignals

__all__ = ["main"]


_DEMO_SYSTEM = (
    "You are a coding agent working in the repository of a small Python web service. "
    "The service has modules app.py (routes), db.py (a SQLite layer), auth.py (token checks) "
    "and tests in tests/test_app.py. Conventions: functions are typed, pure where possible, "
    "and every change comes with a test. Answer in one or two short sentences. "
    + " ".join(f"Rule {i}: keep module m{i} documented and covered by tests." for i in range(1, 25))
)
_DEMO_TURNS = (
    "The test test_login fails with a 401. Which module should I look at first?",
    "The token check compares the header with a stale secret. What is the fix?",
    "Write the name of the test you would add for it.",
    "Summarise the change in one sentence for the commit message.",
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``agentkv`` command."""
    parser = argparse.ArgumentParser(prog="agentkv", description="Agent sessions pinned to their KV on a vLLM pair.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what agentkv does")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="a multi-turn agent conversation on the real pair, with a stats table")
    demo.set_defaults(run=_demo)
    demo.add_argument("--mode", choices=get_args(Mode), default=None)
    demo.add_argument("--model", default=None, help="bundled name, HF folder or org/name[@rev] (default: SmolLM2)")
    _engine_arguments(demo)
    demo.add_argument(
        "--turns", type=int, choices=range(1, len(_DEMO_TURNS) + 1), default=len(_DEMO_TURNS), help="number of turns"
    )
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--json", metavar="FILE", help="also write the session stats as JSON to FILE")

    chat = commands.add_parser("chat", help="chat with the model in the terminal (empty line to quit)")
    chat.set_defaults(run=_chat)
    chat.add_argument("--mode", choices=get_args(Mode), default=None)
    chat.add_argument("--model", default=None)
    _engine_arguments(chat)
    chat.add_argument("--system", default="You are a helpful assistant.")
    chat.add_argument("--max-tokens", type=int, default=128)

    bench = commands.add_parser("bench", help="one multi-turn workload under each mode, side by side, in one run")
    bench.set_defaults(run=_bench)
    conversation = bench.add_mutually_exclusive_group()
    conversation.add_argument("--workload", choices=tuple(WORKLOADS), default="agentic", help="(default: agentic)")
    conversation.add_argument(
        "--replay", metavar="FILE", help="replay the user messages of an OpenAI messages JSON file"
    )
    bench.add_argument(
        "--modes",
        type=_modes,
        default=list(DEFAULT_MODES),
        help=f"comma-separated, from {', '.join(MODES)} (default: {','.join(DEFAULT_MODES)})",
    )
    bench.add_argument("--turns", type=int, default=4)
    bench.add_argument("--sessions", type=int, default=1, help="concurrent sessions per mode")
    bench.add_argument("--scale", type=float, default=1.0, help="multiply the workload's sizes")
    bench.add_argument("--max-tokens", type=int, default=None, help="answer length (default: the workload's)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--max-model-len", type=int, default=4096)
    bench.add_argument(
        "--dtype",
        choices=DTYPES,
        default=DEFAULT_DTYPE,
        help=f"dtype of every engine the bench starts (default: {DEFAULT_DTYPE}). In bfloat16, KV that came from "
        "a prefix cache, a pull or a recompute differs in the last bits, so greedy answers diverge between modes "
        "and later prompts differ; float32 keeps them token-exact, so every mode sees the same prompts",
    )
    bench.add_argument("--json", default="agentkv-bench.json", help="write the report here ('' for none)")
    bench.add_argument("--plot", default="agentkv-bench.png", help="draw the plot here ('' for none)")

    serve = commands.add_parser(
        "serve",
        help="the front door: OpenAI's chat-completions and Responses APIs on pinned sessions (docs/serve.md)",
        usage="%(prog)s [options] [-- VLLM_ENGINE_ARGS ...]",
        epilog=f"{_AFTER_DASHES} (for serve: of every engine it starts)",
    )
    serve.set_defaults(run=_serve)
    serve.add_argument("--mode", choices=get_args(Mode), default=None)
    serve.add_argument("--model", default=None, help="bundled name, HF folder or org/name[@rev] (default: SmolLM2)")
    _engine_arguments(serve)
    serve.add_argument(
        "--pairs",
        type=_positive_int,
        default=1,
        help="pairs behind the door, the cores (on a GPU host: the GPUs) split among them (default 1)",
    )
    serve.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="the engines' context length in tokens (default 4096; not with --remote)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this host only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=os.environ.get("AGENTKV_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $AGENTKV_API_KEY; none: no key needed)",
    )
    serve.add_argument("--max-sessions", type=int, default=64, help="sessions kept; least recently used closed first")
    serve.add_argument("--idle-ttl-s", type=float, default=600.0, help="a session idle this long is closed")
    serve.add_argument("--max-tokens", type=int, default=256, help="answer length when a request names none")
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="read the model's own tool calls with this vLLM tool parser (as vllm serve's: hermes, llama3_json, "
        "mistral...); without it tool calls are forced to JSON by a schema (docs/tools.md)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split a reasoning model's thinking from its answer with this vLLM reasoning parser (deepseek_r1, "
        "qwen3...): the reply's reasoning_content (docs/tools.md)",
    )
    serve.add_argument("--max-request-mb", type=float, default=4.0, help="largest request body (413 above it)")
    serve.add_argument(
        "--max-header-kb", type=float, default=16.0, help="most bytes of request headers, in KiB (431 above it)"
    )
    serve.add_argument(
        "--max-messages", type=_positive_int, default=2048, help="most messages in one request (400 above it)"
    )
    serve.add_argument(
        "--max-in-flight",
        type=_positive_int,
        default=None,
        help="most steps running at once; one more gets a 429 with Retry-After at once (default: --max-sessions)",
    )
    serve.add_argument("--timeout-s", type=float, default=300.0, help="the most one request may take")
    serve.add_argument(
        "--store",
        default=None,
        metavar="PATH",
        help="the SQLite file sessions (to resume after a restart) and responses (for previous_response_id) "
        "are kept in (default: $AGENTKV_HOME/serve.sqlite3; a path, not a URL); 'memory': in this process only",
    )
    serve.add_argument(
        "--store-timeout-s",
        type=_positive_seconds,
        default=2.0,
        help="the most a save waits for the store's lock (another process's) before its request gets a 503",
    )

    engine = commands.add_parser(
        "engine",
        help="run one server of a P/D pair in the foreground (for a pair across hosts: RemotePair)",
        usage="%(prog)s --role {prefill,decode} --nixl-host NIXL_HOST [options] [-- VLLM_ENGINE_ARGS ...]",
        epilog=f"{_AFTER_DASHES}. On a GPU host the server runs on the GPUs CUDA_VISIBLE_DEVICES leaves it, "
        "its tensor-parallel size their number",
    )
    engine.set_defaults(run=_engine_server)
    engine.add_argument("--role", choices=("prefill", "decode"), required=True)
    engine.add_argument("--model", default=None, help="bundled name, HF folder or org/name[@rev] (default: SmolLM2)")
    engine.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    engine.add_argument("--port", type=int, default=8100)
    engine.add_argument("--nixl-host", required=True, help="this host's address as the peer server reaches it")
    engine.add_argument("--nixl-port", type=int, default=5600, help="NIXL side-channel port")
    engine.add_argument(
        "--cores", type=_cores, default=None, help="cores for the engine, e.g. 0-3,6 (default: all available; CPU)"
    )
    engine.add_argument("--max-model-len", type=int, default=4096)
    engine.add_argument("--kv-cache-gib", type=float, default=4.0)
    engine.add_argument("--pin-ttl-s", type=float, default=480.0)
    engine.add_argument("--no-push-back", action="store_true", help="standard disaggregated (no bidirectional)")
    engine.add_argument(
        "--transfer", choices=get_args(Transfer), default="pull", help="the connector: pull (default) or push"
    )
    engine.add_argument("--no-prefix-cache", action="store_true", help="a prefill server without its own prefix cache")

    smoke = commands.add_parser(
        "smoke",
        help="open a pair on this host (CPU or GPUs) and check 3 turns with a tool: turns 2+ pull KV back from D",
        usage="%(prog)s [options] [-- VLLM_ENGINE_ARGS ...]",
        epilog=f"{_AFTER_DASHES} (for smoke: of both engines of the pair). Exit status 0 when every check "
        "passed, 1 when one failed (the report says which). docs/gpu.md",
    )
    smoke.set_defaults(run=_smoke)
    smoke.add_argument("--model", default=None, help="bundled name, HF folder or org/name[@rev] (default: SmolLM2)")
    smoke.add_argument(
        "--engine", choices=("embedded", "launched"), default="embedded", help="the pair in-process or as two servers"
    )
    smoke.add_argument("--max-model-len", type=int, default=4096)
    smoke.add_argument("--turns", type=_smoke_turns, default=3, help="turns of the conversation, 2 or more (default 3)")
    smoke.add_argument(
        "--mode",
        choices=("bidirectional", "auto"),
        default="bidirectional",
        help="auto: the pair may place steps on D alone (they reuse D's cache instead of pulling)",
    )
    smoke.add_argument(
        "--prefill-devices",
        type=_devices,
        default=None,
        metavar="GPUS",
        help="P's GPUs, e.g. 0,1 (with --decode-devices; default: the visible GPUs in two halves; "
        "one GPU: --prefill-devices 0 --decode-devices 0)",
    )
    smoke.add_argument("--decode-devices", type=_devices, default=None, metavar="GPUS", help="D's GPUs, e.g. 2,3")

    models = commands.add_parser("models", help="list the bundled models, or prepare one")
    models.set_defaults(run=_models)
    models.add_argument("action", nargs="?", choices=("list", "prepare"), default="list")
    models.add_argument("name", nargs="?", default=None)

    argv, vllm_words = _split_at_dashes(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if not args.verbose:  # vLLM's own start-up logging is long; read before vLLM is imported
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    logging.getLogger("agentkv").setLevel(logging.INFO)  # start-up progress is shown
    try:
        args.engine_args = _engine_args_after_dashes(args.command, vllm_words)
        code: int = args.run(args)
        return code
    except UserError as exc:  # a mistake in the command line: say which, like argparse does
        print(f"agentkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except AgentKVError as exc:
        print(f"agentkv {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _modes(text: str) -> list[str]:
    """``--modes``: ``"bidirectional,raw"`` -> ``["bidirectional", "raw"]``, each a known mode."""
    modes = [mode.strip() for mode in text.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODES)}"
        )
    return modes


def _devices(text: str) -> list[int | str]:
    """``--prefill-devices``: ``"0,1"`` -> ``[0, 1]`` (indices of the visible GPUs); other words are device names
    as ``CUDA_VISIBLE_DEVICES`` takes them (``GPU-<uuid>``)."""
    words = [word.strip() for word in text.split(",") if word.strip()]
    if not words:
        raise argparse.ArgumentTypeError(f"{text!r} names no device")
    return [int(word) if word.isdigit() else word for word in words]


def _smoke_turns(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (pull-back starts at turn 2), not {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def _cores(text: str) -> list[int]:
    """``--cores``: ``"0-2,5"`` -> ``[0, 1, 2, 5]``."""
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        try:
            span = range(int(first), int(last or first) + 1)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a core list like 0-3,6") from None
        if not span:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} names no core")
        cores.extend(span)
    return cores


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine", choices=("embedded", "launched"), default="embedded", help="the pair in-process or as two servers"
    )
    parser.add_argument(
        "--remote",
        nargs=2,
        action="append",
        metavar=("PREFILL_URL", "DECODE_URL"),
        help="use servers started elsewhere (agentkv engine); repeat it for several pairs",
    )
    parser.add_argument(
        "--transfer",
        choices=get_args(Transfer),
        default="pull",
        help="how P's KV reaches D: D reads it (pull, default) or P writes it (push); docs/transfer.md",
    )


_AFTER_DASHES = (
    "Arguments after -- are vLLM engine arguments, as vllm serve takes them (e.g. -- --tensor-parallel-size 2 "
    "--max-num-seqs 128), over agentkv's settings; those agentkv owns (the model, --kv-transfer-config, "
    "--max-model-len, --dtype, ...) are refused"
)


def _split_at_dashes(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """The command line before ``--``, and the words after it (None: no ``--``)."""
    words = list(argv)
    if "--" not in words:
        return words, None
    cut = words.index("--")
    return words[:cut], words[cut + 1 :]


def _engine_args_after_dashes(command: str, words: list[str] | None) -> dict[str, Any]:
    """The vLLM engine arguments given after ``--`` (``engine``, ``serve`` and ``smoke`` only), checked as
    `PairConfig` checks its ``engine_args``."""
    if words is None:
        return {}
    if command not in ("engine", "serve", "smoke"):
        raise UserError("only agentkv engine, agentkv serve and agentkv smoke take vLLM engine arguments after --")
    from .._engines._pair_config import check_engine_args
    from .._engines._server_process import parse_vllm_flags

    return check_engine_args(parse_vllm_flags(words), "the vLLM engine arguments after --")


def _engine(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments of a session or pool the command line asks for (the engine opens and closes with it)."""
    pairs: int = getattr(args, "pairs", 1)
    engine_args: dict[str, Any] = getattr(args, "engine_args", None) or {}
    options: dict[str, Any] = {"engine_args": engine_args} if engine_args else {}
    if getattr(args, "max_model_len", None) is not None:
        options["max_model_len"] = args.max_model_len
    if args.remote:
        if options:
            raise UserError("servers given with --remote take their vLLM arguments where they start (agentkv engine)")
        remotes = [RemotePair(*urls, model=args.model, transfer=args.transfer) for urls in args.remote]
        return {"engine": remotes[0] if len(remotes) == 1 else EngineGroup(remotes)}
    kind = LaunchedPair if args.engine == "launched" else EmbeddedPair
    if pairs == 1:
        if args.engine == "embedded" and args.transfer == "pull":  # the session's own default pair
            return {"model": args.model, "engine_options": options} if options else {"model": args.model}
        return {"engine": kind(args.model, transfer=args.transfer, **options)}
    bidirectional = args.mode in (None, "bidirectional", "auto")
    engines = [
        kind(args.model, bidirectional=bidirectional, transfer=args.transfer, **placement, **options)
        for placement in _pair_placements(pairs)
    ]
    return {"engine": EngineGroup(engines, replace=_replacement)}


def _pair_placements(pairs: int) -> list[dict[str, Any]]:
    """Each of ``pairs`` pairs' share of this host: its cores, or on a GPU host its GPUs."""
    platform = current_platform()
    if platform.pins_cores:
        return [{"cores": cores} for cores in split_cores_among_pairs(pairs)]
    return [
        {"prefill_devices": list(devices.prefill), "decode_devices": list(devices.decode)}
        for devices in split_devices_among_pairs(pairs, platform)
    ]


def _replacement(dead: Engine) -> Engine:
    """A new pair with a dead one's settings (for `EngineGroup`)."""
    if isinstance(dead, LaunchedPair):
        return LaunchedPair(config=dead.config)
    if isinstance(dead, EmbeddedPair):
        return EmbeddedPair(config=dead.config)
    raise UserError(f"a {type(dead).__name__} is not restarted here")


def _session(args: argparse.Namespace, **options: Any) -> Session:
    """The session the command line asks for."""
    return Session(mode=args.mode, **_engine(args), **options)


def _serve(args: argparse.Namespace) -> int:
    """Start the pool's engines, serve, and stop in order on SIGINT or SIGTERM, whenever it comes (`StopSignals`):
    0 once serving, 128 + the signal's number when it interrupted the start-up."""
    with StopSignals("agentkv serve") as signals:
        try:
            _serve_until(args, signals)
        except KeyboardInterrupt:  # a signal while the engines started: they were stopped as the start-up unwound
            return 128 + (signals.received or signal.SIGINT)
    return 0


def _serve_until(args: argparse.Namespace, signals: StopSignals) -> None:
    from .._session._pool import SessionPool
    from .._session._session_store import SqliteSessionStore
    from .._sqlite import default_store_path
    from ._response_store import MemoryResponseStore, ResponseStore, SqliteResponseStore
    from ._serve import FrontDoor

    responses: ResponseStore
    sessions: SqliteSessionStore | None = None
    if args.store == "memory":
        responses = MemoryResponseStore()
    else:
        path = args.store or default_store_path()
        timeout_s = args.store_timeout_s
        responses = SqliteResponseStore(path, timeout_s=timeout_s)
        sessions = SqliteSessionStore(path, timeout_s=timeout_s)
    pool = SessionPool(
        mode=args.mode,
        max_sessions=args.max_sessions,
        idle_ttl_s=args.idle_ttl_s,
        max_tokens=args.max_tokens,
        store=sessions,
        **_parsers(args),
        **_engine(args),
    )
    with responses, sessions or contextlib.nullcontext(), pool:
        door = FrontDoor(
            pool,
            api_key=args.api_key or None,
            max_request_bytes=int(args.max_request_mb * 1024 * 1024),
            max_header_bytes=int(args.max_header_kb * 1024),
            max_messages=args.max_messages,
            max_in_flight=args.max_in_flight,
            timeout_s=args.timeout_s,
            host=args.host,
            port=args.port,
            store=responses,
        )
        key = "an API key" if door.settings.api_key else "no API key"
        kept = f"sessions and responses kept in {sessions.path}" if sessions is not None else "kept in memory"
        pairs = f"{args.pairs} pairs" if args.pairs > 1 else type(pool.engine).__name__
        print(
            f"agentkv serve: {door.url}/v1 (model {door.settings.model_name!r}, {pairs}, {key}, {kept}); Ctrl-C to stop",
            flush=True,
        )
        signals.serving()
        door.run(until=signals.requested)


def _parsers(args: argparse.Namespace) -> dict[str, Any]:
    """The pool's session options of ``--tool-call-parser`` (native tool calls) and ``--reasoning-parser``."""
    options: dict[str, Any] = {}
    if args.tool_call_parser is not None:
        options |= {"tool_format": "native", "tool_call_parser": args.tool_call_parser}
    if args.reasoning_parser is not None:
        options["reasoning_parser"] = args.reasoning_parser
    return options


def _smoke(args: argparse.Namespace) -> int:
    from ._smoke import smoke_command

    return smoke_command(
        model=args.model,
        engine=args.engine,
        max_model_len=args.max_model_len,
        turns=args.turns,
        prefill_devices=args.prefill_devices,
        decode_devices=args.decode_devices,
        engine_args=args.engine_args,
        mode=args.mode,
    )


def _demo(args: argparse.Namespace) -> int:
    turns = _DEMO_TURNS[: args.turns]
    with _session(args, system=_DEMO_SYSTEM, max_tokens=args.max_tokens) as session:
        for number, message in enumerate(turns, start=1):
            print(f"\n[turn {number}] user: {message}")
            result = session.run_sync(message)
            print(f"[turn {number}] model: {result.text.strip()}")
            print(f"           {result.steps[-1].stats.summary()}")
        summary = session.stats
        print(f"\nmode: {summary.mode}\n{summary.table()}")
        if summary.mean_ttft_after_first_turn_s is not None:
            print(
                f"mean TTFT, turns 2+: {summary.mean_ttft_after_first_turn_s:.3f} s; "
                f"reuse over the session: {summary.reuse_ratio:.0%}"
            )
        if args.json:
            with open(args.json, "w") as file:
                file.write(summary.to_json())
    return 0


class _BenchProgress:
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
    from .._bench import (
        header,
        load_replay,
        make_workload,
        plot,
        push_against_pull,
        run_bench_sync,
        served_overhead,
        table,
    )

    if args.replay:
        workload = load_replay(args.replay, max_tokens=args.max_tokens or 64, turns=args.turns)
    else:
        workload = make_workload(args.workload, turns=args.turns, scale=args.scale, seed=args.seed)
        if args.max_tokens:
            workload = dataclasses.replace(workload, max_tokens=args.max_tokens)
    progress = _BenchProgress()
    report = run_bench_sync(
        workload,
        modes=args.modes,
        sessions=args.sessions,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        progress=progress,
        log=progress.log,
    )
    print(f"\n{header(report)}\n")
    print(table(report.summaries))
    if report.floor is not None:
        print(
            f"\nfloor: {report.floor.a_s:.3f} s + {report.floor.b_s_per_token * 1000:.2f} ms/token"
            f" + {report.floor.c_s_per_attended * 1e6:.2f} us per (new token x token it attends to)"
            " (+ the step's transfer)"
        )
    if report.answers_agree:
        agree = ", ".join(f"{mode} {'yes' if same else 'NO'}" for mode, same in report.answers_agree.items())
        print(f"greedy answers equal to bidirectional's: {agree}")
    for line in (served_overhead(report.summaries), push_against_pull(report.summaries)):
        if line is not None:
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


def _chat(args: argparse.Namespace) -> int:
    with _session(args, system=args.system, max_tokens=args.max_tokens) as session:
        while True:
            try:
                message = input("you> ")
            except EOFError:
                break
            if not message.strip():
                break
            result = session.run_sync(message, on_event=_print_delta)
            stats = result.steps[-1].stats
            print(f"\n  [ttft {stats.ttft_s:.3f} s, reused {stats.reuse_ratio:.0%} of {stats.prompt_tokens} tokens]")
    return 0


def _print_delta(event: object) -> None:
    if isinstance(event, TextDelta):
        print(event.text, end="", flush=True)


def _engine_server(args: argparse.Namespace) -> int:
    import socket
    import uuid

    from .._engines._pair_config import PairConfig, pair_engine_launch
    from .._engines._platforms import PairDevices
    from .._engines._server_process import ServerSpec, server_command, server_env

    config = PairConfig(
        bidirectional=not args.no_push_back,
        transfer=args.transfer,
        prefill_prefix_cache=not args.no_prefix_cache,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        pin_ttl_s=args.pin_ttl_s,
        engine_args=args.engine_args,
    )
    platform = current_platform()
    devices: PairDevices | None = None
    if not platform.pins_cores:  # a GPU host: the server's GPUs are those its environment leaves it
        if args.cores is not None:
            raise UserError(
                "--cores binds the engine's threads on vLLM's CPU platform; on a GPU host choose "
                "the server's GPUs with CUDA_VISIBLE_DEVICES"
            )
        mine = platform.visible_devices
        devices = PairDevices(prefill=mine) if args.role == "prefill" else PairDevices(decode=mine)
    launch = pair_engine_launch(
        config,
        args.role,
        model_path=prepare_model(args.model, progress=print),
        cores=args.cores,
        engine_id=f"agentkv-{args.role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}",
        side_channel_port=args.nixl_port,
        nixl_host=args.nixl_host,
        platform=platform,
        devices=devices,
    )
    spec = ServerSpec(role=args.role, launch=launch, host=args.host, port=args.port)
    command = server_command(spec)
    print(
        f"agentkv engine: {args.role} server on http://{args.host}:{args.port}, NIXL at {args.nixl_host}:{args.nixl_port}"
    )
    sys.stdout.flush()
    os.execvpe(command[0], command, {**os.environ, **server_env(spec)})


def _models(args: argparse.Namespace) -> int:
    if args.action == "prepare":
        print(prepare_model(args.name, progress=print))
        return 0
    print(json.dumps(list_models(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
