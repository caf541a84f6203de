"""The ``agentkv`` command: ``demo`` and ``chat`` (src/agentkv/_surfaces/_cli_session.py), ``bench``
(`_cli_bench.py`), ``serve``, the front door (`_cli_serve.py`), and what runs on this host itself: ``engine`` (one
server of a pair), ``smoke`` (a pair's check on this host: `agentkv._surfaces._smoke`) and ``models``
(`_cli_host.py`). Here: the command line parsed, the vLLM engine arguments after ``--`` read, and the subcommand
run with its errors said as a command line says them."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from .._errors import AgentKVError, UserError
from ._cli_bench import add_bench_command
from ._cli_host import add_host_commands
from ._cli_serve import add_serve_command
from ._cli_session import add_session_commands

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``agentkv`` command."""
    parser = argparse.ArgumentParser(prog="agentkv", description="Agent sessions pinned to their KV on a vLLM pair.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what agentkv does")
    commands = parser.add_subparsers(dest="command", required=True)
    add_session_commands(commands)
    add_bench_command(commands)
    add_serve_command(commands)
    add_host_commands(commands)

    argv, vllm_words = _split_at_dashes(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if not args.verbose:  # vLLM's own start-up logging is long; read before vLLM is imported
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    logging.getLogger("agentkv").setLevel(logging.INFO)  # start-up progress is shown
    try:
        args.engine_args = _engine_args_after_dashes(args, vllm_words)
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


def _split_at_dashes(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """The command line before ``--``, and the words after it (None: no ``--``)."""
    words = list(argv)
    if "--" not in words:
        return words, None
    cut = words.index("--")
    return words[:cut], words[cut + 1 :]


def _engine_args_after_dashes(args: argparse.Namespace, words: list[str] | None) -> dict[str, Any]:
    """The vLLM engine arguments given after ``--`` (only to the commands made by `add_vllm_command`: ``engine``,
    ``serve``, ``smoke`` and ``bench``), checked as `PairConfig` checks its ``engine_args``."""
    if words is None:
        return {}
    if not args.vllm_args:
        raise UserError(
            "only agentkv engine, agentkv serve, agentkv smoke and agentkv bench take vLLM engine arguments after --"
        )
    from .._engines._pair_config import check_engine_args
    from .._engines._server_process import parse_vllm_flags

    return check_engine_args(parse_vllm_flags(words), "the vLLM engine arguments after --")


if __name__ == "__main__":
    raise SystemExit(main())
