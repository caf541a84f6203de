"""What ``agentkv serve`` takes from the model's own folder when a flag is not given, as ``vllm serve`` decides it:
the context length (``--max-model-len``; `default_max_model_len`) and the sampling defaults of its
``generation_config.json`` (``--generation-config``, ``--override-generation-config``; `generation_defaults`).

vLLM's rules, read in its code (vllm/config/model.py, ``_get_and_verify_max_len`` and
``ModelConfig.get_diff_sampling_param``; vllm/transformers_utils/model_arch_config_convertor.py for the keys):

* The context is the smallest of the config's length keys, at most the tokenizer's ``model_max_length``, times
  the RoPE scaling factor (not for the types whose length is already scaled).
* The sampling defaults are the config's non-null values of eight keys (``max_new_tokens`` is vLLM's
  ``max_tokens``), with the override put over them; ``vllm``: the override alone. A request's own value wins;
  an omitted one takes the default, else vLLM's neutral value (temperature 1.0).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._errors import UserError

__all__ = ["GENERATION_KEYS", "default_max_model_len", "generation_defaults", "model_context_len"]

logger = logging.getLogger("agentkv")

GENERATION_KEYS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)
"""The generation-config keys vLLM takes as sampling defaults (its ``available_params``)."""

_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
_SCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_BLOCK = 16
"""A fallback context is a whole number of these tokens."""


def _json(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _text_config(model_path: Path) -> dict[str, Any]:
    config = _json(model_path / "config.json")
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def model_context_len(model_path: Path) -> int | None:
    """The model's own context length as vLLM derives it from its folder (None: the config names none)."""
    config = _text_config(model_path)
    lengths = [value for key in _LENGTH_KEYS if isinstance(value := config.get(key), int | float)]
    if not lengths:
        return None
    length = float(min(lengths))
    tokenizer_max = _json(model_path / "tokenizer_config.json").get("model_max_length")
    if isinstance(tokenizer_max, int | float):
        length = min(length, float(tokenizer_max))
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if isinstance(rope, dict) and "gemma3" not in str(config.get("model_type", "")):
        kind = rope.get("rope_type", rope.get("type", "default"))
        factor = rope.get("factor")
        if kind not in _SCALED_ROPE and isinstance(factor, int | float):
            length *= factor
        if kind == "longrope" and isinstance(config.get("original_max_position_embeddings"), int):
            length = config["original_max_position_embeddings"]
    return int(length)


def _kv_bytes_per_token(model_path: Path, dtype: str) -> int | None:
    """Bytes of KV one token takes in one engine (None: the config does not say)."""
    config = _text_config(model_path)
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    if not isinstance(layers, int) or not isinstance(heads, int) or dtype not in _DTYPE_BYTES:
        return None
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size") or 0) // heads
    if not isinstance(kv_heads, int) or not isinstance(head_dim, int) or head_dim < 1:
        return None
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES[dtype]


def default_max_model_len(model_path: Path, *, dtype: str, kv_cache_gib: float | None, fallback: int = 4096) -> int:
    """``--max-model-len`` when none is given: the model's own context, as ``vllm serve`` takes it; where the KV
    cache is a known size (``kv_cache_gib``, on CPU) and one request of that length would not fit in it, the
    longest that fits (a whole number of blocks), said in a log line. ``dtype``: the engines' resolved dtype.
    ``fallback``: when the config names no length (vLLM assumes 2048 there; agentkv's engines default to this)."""
    context = model_context_len(model_path)
    if context is None:
        return fallback
    per_token = _kv_bytes_per_token(model_path, dtype)
    if kv_cache_gib is None or per_token is None:
        return context
    fits = int(kv_cache_gib * 2**30 // per_token) // _BLOCK * _BLOCK
    if context <= fits:
        return context
    length = max(fits, _BLOCK)
    logger.warning(
        "agentkv serve: the model's context (%d tokens) does not fit in one engine's %g GiB KV cache in %s; "
        "serving %d tokens (--max-model-len sets it)",
        context,
        kv_cache_gib,
        dtype,
        length,
    )
    return length


def _generation_config(folder: Path) -> dict[str, Any]:
    """The folder's generation config: ``generation_config.json``, else what ``config.json`` says of generation (as
    transformers' ``GenerationConfig.from_model_config``), else nothing."""
    found = _json(folder / "generation_config.json")
    if found or (folder / "generation_config.json").is_file():
        return found
    config = _json(folder / "config.json")
    return {key: config[key] for key in GENERATION_KEYS if key in config}


def generation_defaults(
    model_path: Path, source: str = "auto", override: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The sampling defaults ``vllm serve --generation-config SOURCE --override-generation-config OVERRIDE``
    takes: ``auto``: the model folder's generation config; ``vllm``: none (vLLM's neutral defaults); another
    word: a folder holding a ``generation_config.json``. The override goes over it; the result names vLLM's
    sampling parameters (``max_tokens`` for ``max_new_tokens``), non-null values only."""
    if source == "vllm":
        config: dict[str, Any] = {}
    else:
        folder = model_path if source == "auto" else Path(source)
        if source != "auto" and not folder.is_dir():
            raise UserError(f"--generation-config takes auto, vllm or a folder; {source!r} is none of them")
        config = _generation_config(folder)
    config.update(override or {})
    found = {key: config[key] for key in GENERATION_KEYS if config.get(key) is not None}
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    return found
