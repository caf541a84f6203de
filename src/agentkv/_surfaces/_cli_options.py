"""What the ``agentkv`` command's subcommands share (src/agentkv/_surfaces/_cli.py): adding a subcommand, the
``--model`` option, the device options, the option types that check their values, and the words after ``--``."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any, TypeAlias

__all__ = [
    "AFTER_DASHES",
    "Commands",
    "add_command",
    "add_device_arguments",
    "add_model_argument",
    "add_vllm_command",
    "cores",
    "device_options",
    "devices",
    "positive_int",
    "positive_seconds",
]

Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""The type of ``parser.add_subparsers()`` (argparse names it privately)."""

AFTER_DASHES = (
    "Arguments after -- are vLLM engine arguments, as vllm serve takes them (e.g. -- --tensor-parallel-size 2 "
    "--max-num-seqs 128), over agentkv's settings; those agentkv owns (the model, --kv-transfer-config, "
    "--max-model-len, --dtype, ...) are refused"
)


def add_command(
    commands: Commands, name: str, run: Callable[[argparse.Namespace], int], **options: Any
) -> argparse.ArgumentParser:
    """The subcommand ``name``, run by ``run(args)``; its help is the first paragraph of ``run``'s docstring.
    ``options``: argparse's (``usage``, ``epilog``, ...)."""
    summary = (inspect.getdoc(run) or "").split("\n\n")[0]
    parser = commands.add_parser(name, help=" ".join(summary.split()) or None, **options)
    parser.set_defaults(run=run, vllm_args=False)
    return parser


def add_vllm_command(
    commands: Commands, name: str, run: Callable[[argparse.Namespace], int], *, epilog: str, options: str = "[options]"
) -> argparse.ArgumentParser:
    """A subcommand that takes vLLM engine arguments after ``--`` (`AFTER_DASHES`, then ``epilog``); ``options``:
    its usage's words before them."""
    parser = add_command(
        commands, name, run, usage=f"%(prog)s {options} [-- VLLM_ENGINE_ARGS ...]", epilog=AFTER_DASHES + epilog
    )
    parser.set_defaults(vllm_args=True)
    return parser


def add_model_argument(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """``--model``: the model the command serves."""
    parser.add_argument(
        "--model", default=None, help=help or "bundled name, HF folder or org/name[@rev] (default: SmolLM2)"
    )


def add_device_arguments(parser: argparse.ArgumentParser, *, one_server: bool = False) -> None:
    """``--prefill-devices`` and ``--decode-devices``: the GPUs of P and of D on a CUDA host (`devices`), as
    `PairConfig`'s ``prefill_devices`` and ``decode_devices`` take them (an index counts the visible GPUs from 0,
    as vLLM's ``cuda:N``; another word names a device as ``CUDA_VISIBLE_DEVICES`` does). ``one_server``: the command
    runs one server of a pair (``agentkv engine``), which takes the flag of its ``--role``."""
    which = " (the one of --role)" if one_server else ""
    parser.add_argument(
        "--prefill-devices",
        type=devices,
        default=None,
        metavar="GPUS",
        help=f"P's GPUs{which}, e.g. 0,1 (default: the visible GPUs in two halves; one GPU for both: "
        "--prefill-devices 0 --decode-devices 0; CUDA only)",
    )
    parser.add_argument(
        "--decode-devices", type=devices, default=None, metavar="GPUS", help=f"D's GPUs{which}, e.g. 2,3"
    )


def device_options(args: argparse.Namespace) -> dict[str, Any]:
    """The pair keywords of ``--prefill-devices`` and ``--decode-devices`` (none when neither was given)."""
    prefill, decode = getattr(args, "prefill_devices", None), getattr(args, "decode_devices", None)
    if prefill is None and decode is None:
        return {}
    return {"prefill_devices": prefill, "decode_devices": decode}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def cores(text: str) -> list[int]:
    """``--cores``: ``"0-2,5"`` -> ``[0, 1, 2, 5]``."""
    found: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        try:
            span = range(int(first), int(last or first) + 1)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a core list like 0-3,6") from None
        if not span:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} names no core")
        found.extend(span)
    return found


def devices(text: str) -> list[int | str]:
    """``--prefill-devices``: ``"0,1"`` -> ``[0, 1]`` (indices of the visible GPUs); other words are device names
    as ``CUDA_VISIBLE_DEVICES`` takes them (``GPU-<uuid>``)."""
    words = [word.strip() for word in text.split(",") if word.strip()]
    if not words:
        raise argparse.ArgumentTypeError(f"{text!r} names no device")
    return [int(word) if word.isdigit() else word for word in words]
