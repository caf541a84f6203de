"""agentkv's vLLM server: vLLM's own OpenAI API server, plus what a stateful client needs.

Run as ``python -m agentkv._engines._server <vllm serve arguments>`` (``LaunchedPair`` and
``agentkv serve`` build that command). It is vLLM's server unchanged, with one addition:
every ``/v1/completions`` response carries an ``agentkv`` object, and a streamed response
ends with one more chunk (no choices) that carries it and the ``kv_transfer_params``.

vLLM 0.32 returns the KV handle only in non-streamed responses, so a client that streams
tokens from D never sees it and cannot push it back (upstream PR #40186 adds it to the
last chunk). The ``agentkv`` object holds what the embedded engines read in-process::

    {"prefill": {"local": 2816, "external": 12, "computed": 40} | null,   # PrefillStats
     "seconds": {"prefill": 0.14, "wait": 0.01, "decode": 0.8},           # RequestStateStats
     "nixl": {"bytes": 123, "seconds": 0.01, "expired": 0},               # totals since start
     "clock": 22914.9}                                                    # the server's perf_counter()

``nixl`` holds the server's running NIXL totals (what the reading side recorded, as vLLM's
``kv_connector_stats``); a client that knows it was the server's only user between two
responses takes the difference. ``clock`` lets a client on another host turn D's
``remote_blocks_expiry_time`` (the server's ``time.perf_counter()``) into its own clock.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from ._handle import SERVER_EXTRAS_FIELD

__all__ = ["main"]


@dataclass
class _Totals:
    bytes: int = 0
    seconds: float = 0.0
    expired: int = 0

    def add(self, data: dict[str, Any]) -> None:
        with _LOCK:
            self.bytes += int(sum(data.get("bytes_transferred", ())))
            self.seconds += float(sum(data.get("transfer_duration", ())))
            self.expired += len(data.get("num_kv_expired_reqs", ()))


class _Recent(collections.OrderedDict[str, Any]):
    """The prefill stats of the latest requests (those no completion reply took, e.g. chat, age out)."""

    LIMIT = 4096

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        while len(self) > self.LIMIT:
            self.popitem(last=False)


_LOCK = threading.Lock()
_TOTALS = _Totals()
_PREFILL_STATS = _Recent()


def _extras(output: Any) -> dict[str, Any]:
    """The ``agentkv`` object for one finished request (a vLLM ``RequestOutput``)."""
    from ._vllm import engine_seconds

    stats = _PREFILL_STATS.pop(output.request_id, None)
    prefill_s, wait_s, decode_s = engine_seconds(output)
    with _LOCK:
        nixl = {"bytes": _TOTALS.bytes, "seconds": _TOTALS.seconds, "expired": _TOTALS.expired}
    return {
        "prefill": None
        if stats is None
        else {
            "local": stats.num_local_cached_tokens,
            "external": stats.num_external_cached_tokens,
            "computed": stats.num_computed_tokens,
        },
        "seconds": {"prefill": prefill_s, "wait": wait_s, "decode": decode_s},
        "nixl": nixl,
        "clock": time.perf_counter(),
    }


def _patch_engine_construction() -> None:
    """Give the server's ``AsyncLLM`` the read-outs: prefill split per request, NIXL totals."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from ._vllm import keep_prefill_stats, transfer_stat_logger

    original = AsyncLLM.from_vllm_config.__func__  # type: ignore[attr-defined]

    def from_vllm_config(cls: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["stat_loggers"] = [*(kwargs.get("stat_loggers") or []), transfer_stat_logger(_TOTALS.add)]
        llm = original(cls, *args, **kwargs)
        keep_prefill_stats(llm, _PREFILL_STATS)
        return llm

    AsyncLLM.from_vllm_config = classmethod(from_vllm_config)  # type: ignore[method-assign,assignment]


def _patch_completions() -> None:
    """Add the ``agentkv`` object to completions, and the handle to the end of streams."""
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    stream_original = OpenAIServingCompletion.completion_stream_generator
    response_original = OpenAIServingCompletion.request_output_to_completion_response

    async def completion_stream_generator(
        self: Any,
        request: Any,
        engine_inputs: Any,
        result_generator: AsyncIterator[Any],
        request_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> AsyncGenerator[str, None]:
        last: list[Any] = []

        async def watched() -> AsyncIterator[Any]:
            async for prompt_index, output in result_generator:
                last[:] = [output]
                yield prompt_index, output

        async for chunk in stream_original(self, request, engine_inputs, watched(), request_id, *args, **kwargs):
            if chunk.startswith("data: [DONE]") and last and last[0].finished:
                trailer = {
                    "id": request_id,
                    "object": "text_completion",
                    "created": 0,
                    "model": request.model or "",
                    "choices": [],
                    "kv_transfer_params": last[0].kv_transfer_params,
                    SERVER_EXTRAS_FIELD: _extras(last[0]),
                }
                yield f"data: {json.dumps(trailer)}\n\n"
            yield chunk

    def request_output_to_completion_response(self: Any, final_res_batch: list[Any], *args: Any, **kwargs: Any) -> Any:
        response = response_original(self, final_res_batch, *args, **kwargs)
        if len(final_res_batch) == 1:
            setattr(response, SERVER_EXTRAS_FIELD, _extras(final_res_batch[0]))
        return response

    OpenAIServingCompletion.completion_stream_generator = completion_stream_generator  # type: ignore[method-assign,assignment]
    OpenAIServingCompletion.request_output_to_completion_response = request_output_to_completion_response  # type: ignore[method-assign]


def main() -> None:
    """Run vLLM's OpenAI API server (arguments from ``sys.argv``) with agentkv's additions."""
    _patch_engine_construction()
    _patch_completions()
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
