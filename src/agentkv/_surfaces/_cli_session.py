"""``agentkv demo`` and ``agentkv chat``: a conversation with the model on a pair, scripted (the demo, with its
stats table) or typed in the terminal."""

from __future__ import annotations

import argparse
from typing import Any

from .._session._results import TextDelta
from .._session._session import Session
from ._cli_options import Commands, add_command
from ._cli_pairs import add_session_arguments, engine_options

__all__ = ["add_session_commands"]

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


def add_session_commands(commands: Commands) -> None:
    """``demo`` and ``chat``."""
    demo = add_command(commands, "demo", _demo)
    add_session_arguments(demo)
    demo.add_argument(
        "--turns", type=int, choices=range(1, len(_DEMO_TURNS) + 1), default=len(_DEMO_TURNS), help="number of turns"
    )
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--json", metavar="FILE", help="also write the session stats as JSON to FILE")

    chat = add_command(commands, "chat", _chat)
    add_session_arguments(chat)
    chat.add_argument("--system", default="You are a helpful assistant.")
    chat.add_argument("--max-tokens", type=int, default=128)


def _session(args: argparse.Namespace, **options: Any) -> Session:
    """The session the command line asks for."""
    return Session(mode=args.mode, **engine_options(args), **options)


def _demo(args: argparse.Namespace) -> int:
    """a multi-turn agent conversation on the real pair, with a stats table"""
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


def _chat(args: argparse.Namespace) -> int:
    """chat with the model in the terminal (empty line to quit)"""
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
