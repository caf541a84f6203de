"""``agentkv serve``: the front door (src/agentkv/_surfaces/_serve.py) over a `SessionPool` on the pairs the
command line names, its stores opened and closed with it, stopped in order on SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import signal
from typing import Any

from ._cli_dropin import add_dropin_arguments, dropin_options
from ._cli_options import Commands, add_device_arguments, add_vllm_command, positive_int, positive_seconds
from ._cli_pairs import add_session_arguments, add_slo_arguments, engine_options
from ._cli_tenants import add_tenant_arguments, door_options, pool_quotas, retention
from ._signals import StopSignals

__all__ = ["add_serve_command"]

_VLLM_PARSERS = (
    (
        "--tool-call-parser",
        "read the model's own tool calls with this vLLM tool parser (as vllm serve's: hermes, llama3_json, "
        "mistral...); without it tool calls are forced to JSON by a schema (docs/tools.md)",
    ),
    (
        "--reasoning-parser",
        "split a reasoning model's thinking from its answer with this vLLM reasoning parser (deepseek_r1, "
        "qwen3...): the reply's reasoning_content (docs/tools.md)",
    ),
)
"""The options naming a vLLM parser of the model's output (`_parsers` reads them)."""


def add_serve_command(commands: Commands) -> None:
    """``serve``."""
    serve = add_vllm_command(commands, "serve", _serve, epilog=" (for serve: of every engine it starts)")
    add_session_arguments(serve)
    serve.add_argument(
        "--pairs",
        type=positive_int,
        default=1,
        help="pairs behind the door, the cores (on a GPU host: the GPUs) split among them (default 1)",
    )
    add_device_arguments(serve)
    add_dropin_arguments(serve)
    add_slo_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this host only)")
    serve.add_argument("--port", type=int, default=8000)
    add_tenant_arguments(serve)
    serve.add_argument("--max-sessions", type=int, default=64, help="sessions kept; least recently used closed first")
    serve.add_argument("--idle-ttl-s", type=float, default=600.0, help="a session idle this long is closed")
    serve.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="answer length when a request names none (default: the generation config's max_new_tokens, else 256)",
    )
    for flag, said in _VLLM_PARSERS:
        serve.add_argument(flag, default=None, metavar="NAME", help=said)
    serve.add_argument("--max-request-mb", type=float, default=4.0, help="largest request body (413 above it)")
    serve.add_argument(
        "--max-header-kb", type=float, default=16.0, help="most bytes of request headers, in KiB (431 above it)"
    )
    serve.add_argument(
        "--max-messages", type=positive_int, default=2048, help="most messages in one request (400 above it)"
    )
    serve.add_argument(
        "--max-in-flight",
        type=positive_int,
        default=None,
        help="most steps running at once; one more gets a 429 with Retry-After at once (default: --max-sessions)",
    )
    serve.add_argument("--timeout-s", type=float, default=300.0, help="the most one request may take")
    serve.add_argument(
        "--store",
        default=None,
        metavar="PATH|URL",
        help="the SQLite file sessions (to resume after a restart) and responses (for previous_response_id) "
        "are kept in (default: $AGENTKV_HOME/serve.sqlite3), or a postgresql://user:password@host/database URL "
        "that several doors share (pip install 'agentkv-vllm[postgresql]'); 'memory': in this process only",
    )
    serve.add_argument(
        "--store-timeout-s",
        type=positive_seconds,
        default=2.0,
        help="the most a save waits for the store's lock (another process's) or its server before its request "
        "gets a 503",
    )


def _serve(args: argparse.Namespace) -> int:
    """the front door: OpenAI's chat-completions and Responses APIs on pinned sessions (docs/serve.md)

    Start the pool's engines, serve, and stop in order on SIGINT or SIGTERM, whenever it comes (`StopSignals`):
    0 once serving, 128 + the signal's number when it interrupted the start-up."""
    with StopSignals("agentkv serve") as signals:
        try:
            _serve_until(args, signals)
        except KeyboardInterrupt:  # a signal while the engines started: they were stopped as the start-up unwound
            return 128 + (signals.received or signal.SIGINT)
    return 0


def _serve_until(args: argparse.Namespace, signals: StopSignals) -> None:
    from .._postgres import is_postgres_url
    from .._session._pool import SessionPool
    from .._session._session_store import PostgresSessionStore, SessionStore, SqliteSessionStore
    from .._sqlite import default_store_path
    from ._response_store import MemoryResponseStore, PostgresResponseStore, ResponseStore, SqliteResponseStore
    from ._serve import FrontDoor

    responses: ResponseStore
    sessions: SessionStore | None = None
    where = "memory"
    door = door_options(args)  # the keys checked before anything opens
    dropin = dropin_options(args)  # the model's context and sampling defaults, as vllm serve takes them
    kept = {"timeout_s": args.store_timeout_s, "max_age_s": retention(args)}
    if args.store == "memory":
        responses = MemoryResponseStore(max_age_s=kept["max_age_s"])
    elif is_postgres_url(args.store):
        responses = PostgresResponseStore(args.store, **kept)
        with contextlib.ExitStack() as opened:  # the responses' store closed if the sessions' cannot open
            opened.callback(responses.close)
            sessions = PostgresSessionStore(args.store, **kept)
            opened.pop_all()
        where = sessions.url
    else:
        path = args.store or default_store_path()
        responses = SqliteResponseStore(path, **kept)
        sessions = SqliteSessionStore(path, **kept)
        where = str(sessions.path)
    pool = SessionPool(
        mode=args.mode,
        max_sessions=args.max_sessions,
        idle_ttl_s=args.idle_ttl_s,
        store=sessions,
        **dropin.pool,
        **pool_quotas(args),
        **_parsers(args),
        **engine_options(args),
    )
    with responses, sessions or contextlib.nullcontext(), pool:
        front = FrontDoor(
            pool,
            **door,
            **dropin.door,
            max_request_bytes=int(args.max_request_mb * 1024 * 1024),
            max_header_bytes=int(args.max_header_kb * 1024),
            max_messages=args.max_messages,
            max_in_flight=args.max_in_flight,
            timeout_s=args.timeout_s,
            host=args.host,
            port=args.port,
            store=responses,
        )
        tenants = len(front.settings.tenants.names)
        key = f"API keys of {tenants} tenants" if tenants > 1 else "an API key" if tenants else "no API key"
        where = f"sessions and responses kept in {where}" if sessions is not None else "kept in memory"
        pairs = f"{args.pairs} pairs" if args.pairs > 1 else type(pool.engine).__name__
        print(
            f"agentkv serve: {front.url}/v1 (model {front.settings.model_name!r}, {pairs}, {key}, {where}); "
            "Ctrl-C to stop",
            flush=True,
        )
        signals.serving()
        front.run(until=signals.requested)


def _parsers(args: argparse.Namespace) -> dict[str, Any]:
    """The pool's session options of ``--tool-call-parser`` (native tool calls) and ``--reasoning-parser``."""
    options: dict[str, Any] = {}
    if args.tool_call_parser is not None:
        options |= {"tool_format": "native", "tool_call_parser": args.tool_call_parser}
    if args.reasoning_parser is not None:
        options["reasoning_parser"] = args.reasoning_parser
    return options
