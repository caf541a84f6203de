"""The pair (or pairs) a session command of ``agentkv`` runs on (``demo``, ``chat``, ``serve``): the ``--engine``,
``--remote`` and ``--transfer`` options, and the engine arguments of the `Session` or `SessionPool` they ask for."""

from __future__ import annotations

import argparse
from typing import Any, get_args

from .._engines import EmbeddedPair, Engine, EngineGroup, LaunchedPair, RemotePair
from .._engines._pair_config import Transfer
from .._engines._platforms import current_platform, split_devices_among_pairs
from .._engines._system import split_cores_among_pairs
from .._errors import UserError
from .._session._session import Mode
from ._cli_options import add_model_argument

__all__ = ["add_engine_choice", "add_session_arguments", "engine_options"]


def add_engine_choice(parser: argparse.ArgumentParser) -> None:
    """``--engine``: the pair in-process or as two servers."""
    parser.add_argument(
        "--engine", choices=("embedded", "launched"), default="embedded", help="the pair in-process or as two servers"
    )


def add_session_arguments(parser: argparse.ArgumentParser) -> None:
    """``--mode``, ``--model``, ``--engine``, ``--remote`` and ``--transfer``."""
    parser.add_argument("--mode", choices=get_args(Mode), default=None)
    add_model_argument(parser)
    add_engine_choice(parser)
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


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
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
    push_back = args.mode in (None, "bidirectional", "auto")
    engines = [
        kind(args.model, push_back=push_back, transfer=args.transfer, **placement, **options)
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
