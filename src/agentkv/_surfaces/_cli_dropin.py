"""The flags that make ``agentkv serve`` a drop-in for ``vllm serve``, spelled as vLLM spells them and meaning what
they mean there: ``--served-model-name``, ``--dtype``, ``--max-model-len`` (default: the model's own context, as
vLLM takes it), ``--generation-config`` and ``--override-generation-config`` (the sampling defaults an omitted
request field takes), and agentkv's ``--pin-ttl-s`` (as ``agentkv engine`` takes it). What they decide is read from
the model's folder by src/agentkv/_surfaces/_model_defaults.py."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import UserError
from ._cli_options import positive_int, positive_seconds

__all__ = ["DTYPES", "DropIn", "add_dropin_arguments", "dropin_options"]

logger = logging.getLogger("agentkv")

DTYPES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
"""``--dtype``'s words as vLLM takes them (its aliases ``half`` and ``float`` included), each to agentkv's dtype."""

_FALLBACK_MAX_TOKENS = 256
"""The answer length when neither the request, ``--max-tokens`` nor the generation config names one."""
_NEUTRAL_TEMPERATURE = 1.0
"""vLLM's temperature when neither the request nor the generation config names one."""


def add_dropin_arguments(parser: argparse.ArgumentParser) -> None:
    """``--served-model-name``, ``--dtype``, ``--max-model-len``, ``--pin-ttl-s``, ``--generation-config``,
    ``--override-generation-config``."""
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model ids clients name, as vllm serve takes them: replies name the first, /v1/models lists all, "
        "another name is a 404 (default: the model folder's name or its HF id)",
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="weights and KV dtype of every engine (default auto: on CPU bfloat16 where the CPU computes it "
        "natively, else float32; on CUDA the model's); not with --remote",
    )
    parser.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="the engines' context length in tokens (default: the model's own, as vllm serve; on CPU at most what "
        "one engine's KV cache holds); not with --remote",
    )
    parser.add_argument(
        "--pin-ttl-s",
        type=_pin_ttl,
        default=None,
        metavar="S",
        help="how long D keeps a conversation's pinned KV without a renewal (default 480; more than 10); not with "
        "--remote (agentkv engine --pin-ttl-s)",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|FOLDER",
        help="the sampling defaults of requests that omit them: auto (default), the model's generation_config.json; "
        "vllm, vLLM's neutral ones (temperature 1.0); or a folder's generation_config.json",
    )
    parser.add_argument(
        "--override-generation-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help='put over the generation config, e.g. \'{"temperature": 0.5, "top_p": 0.9}\'',
    )


def _pin_ttl(text: str) -> float:
    value = positive_seconds(text)
    if value <= 10:
        raise argparse.ArgumentTypeError(
            f"must exceed 10 s (P declines reads within 5 s of a pin's expiry), not {text}"
        )
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("takes a JSON object")
    return value


@dataclass(frozen=True)
class DropIn:
    """What the drop-in flags give the pool (its sampling defaults) and the door (its model names)."""

    pool: dict[str, Any]
    door: dict[str, Any]


def dropin_options(args: argparse.Namespace) -> DropIn:
    """Read the drop-in flags: the pool's sampling defaults (``temperature``, ``sampling``, ``max_tokens``), the door's
    ``model_name``; ``args.dtype`` becomes agentkv's word and ``args.max_model_len`` the model's context when it was
    not given (not with ``--remote``: its servers have their own)."""
    from .._engines._pair_config import PairConfig
    from .._engines._platform_settings import resolve_dtype
    from .._engines._platforms import current_platform
    from .._model import prepare_model
    from ._model_defaults import default_max_model_len, generation_defaults

    if args.dtype is not None:
        args.dtype = DTYPES[args.dtype]
    if args.remote and args.model is None:  # the servers' model is known once the pool opens: not read here
        if args.generation_config == "auto":
            logger.warning(
                "agentkv serve: with --remote and no --model the model's generation config is not read; requests "
                "that omit sampling fields take vLLM's neutral defaults (--generation-config FOLDER reads one)"
            )
        source = "vllm" if args.generation_config == "auto" else args.generation_config
        return _dropin(args, generation_defaults(Path("."), source, args.override_generation_config))
    model_path = prepare_model(args.model)
    if args.max_model_len is None and not args.remote:
        platform = current_platform()
        dtype = resolve_dtype(args.dtype or "auto") if platform.is_cpu else args.dtype or "auto"
        space = PairConfig().kv_cache_gib if platform.is_cpu else None  # on CUDA vLLM checks it as it starts
        args.max_model_len = default_max_model_len(model_path, dtype=dtype, kv_cache_gib=space)
    return _dropin(args, generation_defaults(model_path, args.generation_config, args.override_generation_config))


def _dropin(args: argparse.Namespace, defaults: dict[str, Any]) -> DropIn:
    """The pool's sampling defaults of ``defaults`` (`generation_defaults`) and the door's model names."""
    from .._engines._sampling import SamplingOptions

    max_tokens = args.max_tokens or defaults.pop("max_tokens", _FALLBACK_MAX_TOKENS)
    defaults.pop("max_tokens", None)
    try:
        temperature = float(defaults.pop("temperature", _NEUTRAL_TEMPERATURE))
        sampling = SamplingOptions(**defaults)
        pool = {"max_tokens": int(max_tokens), "temperature": temperature, "sampling": sampling}
    except (TypeError, ValueError) as exc:
        said = " ".join(str(exc).split())[:300]
        raise UserError(f"the generation config's sampling defaults are not valid: {said}") from None
    door = {"model_name": args.served_model_name} if args.served_model_name else {}
    return DropIn(pool=pool, door=door)
