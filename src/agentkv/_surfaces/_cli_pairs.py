"""The pair (or pairs) a session command of ``agentkv`` runs on (``demo``, ``chat``, ``serve``): the ``--engine``,
``--remote`` and ``--transfer`` options (and serve's objective, ``--slo-ttft-s`` and ``--slo-itl-s``), and the engine
arguments of the `Session` or `SessionPool` they ask for."""

from __future__ import annotations

import argparse
from typing import Any, get_args

from .._engines import EmbeddedPair, Engine, EngineGroup, LaunchedPair, RemotePair, Slo
from .._engines._pair_config import Transfer
from .._engines._platforms import current_platform, split_devices_among_pairs
from .._engines._slo import DEFAULT_SLO
from .._engines._system import split_cores_among_pairs
from .._errors import UserError
from .._session._session import Mode
from ._cli_options import add_model_argument, device_options

__all__ = ["add_engine_choice", "add_session_arguments", "add_slo_arguments", "engine_options"]


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


def add_slo_arguments(parser: argparse.ArgumentParser) -> None:
    """``--slo-ttft-s`` and ``--slo-itl-s``: the objective mode auto places each step for (`Slo`)."""
    parser.add_argument(
        "--slo-ttft-s",
        type=float,
        default=None,
        metavar="S",
        help=f"mode auto: the time to first token each step aims at (default {DEFAULT_SLO.ttft_s:g} s)",
    )
    parser.add_argument(
        "--slo-itl-s",
        type=float,
        default=None,
        metavar="S",
        help=f"mode auto: the longest gap between tokens it keeps D's decodes within (default {DEFAULT_SLO.itl_s:g} s)",
    )


def _slo(args: argparse.Namespace) -> Slo | None:
    """The objective ``--slo-ttft-s`` and ``--slo-itl-s`` ask for (the default's for the one not given), or None."""
    ttft_s, itl_s = getattr(args, "slo_ttft_s", None), getattr(args, "slo_itl_s", None)
    if ttft_s is None and itl_s is None:
        return None
    return Slo(
        ttft_s=DEFAULT_SLO.ttft_s if ttft_s is None else ttft_s, itl_s=DEFAULT_SLO.itl_s if itl_s is None else itl_s
    )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments of a session or pool the command line asks for (the engine opens and closes with it)."""
    pairs: int = getattr(args, "pairs", 1)
    engine_args: dict[str, Any] = getattr(args, "engine_args", None) or {}
    options: dict[str, Any] = {"engine_args": engine_args} if engine_args else {}
    for name in ("max_model_len", "dtype", "pin_ttl_s"):  # those given (serve: --max-model-len's default too)
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    if "pin_ttl_s" in options and args.mode == "colocated":
        raise UserError("--pin-ttl-s is how long D keeps a pin; colocated is one engine, which pins nothing")
    slo = _slo(args)
    if slo is not None and args.mode == "colocated":
        raise UserError("--slo-ttft-s and --slo-itl-s place mode auto's steps on a pair; colocated is one engine")
    devices = device_options(args)
    if devices and pairs > 1:
        raise UserError(
            "--pairs splits the visible GPUs among its pairs; --prefill-devices and --decode-devices place one"
        )
    if args.remote:
        if options or devices:
            raise UserError(
                "servers given with --remote take their vLLM arguments and devices where they start (agentkv engine)"
            )
        objective = DEFAULT_SLO if slo is None else slo
        remotes = [RemotePair(*urls, model=args.model, transfer=args.transfer, slo=objective) for urls in args.remote]
        return {"engine": remotes[0] if len(remotes) == 1 else EngineGroup(remotes)}
    if slo is not None:
        options["slo"] = slo
    options |= devices
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
