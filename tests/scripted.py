"""What the tests of client-run tools script a model double with: raw outputs in the schema tool format."""

from __future__ import annotations

import asyncio
import contextlib
import json
import warnings
from typing import Any

from agentkv import StepRequest


def answer(text: str) -> str:
    """The model's output when it answers (schema format)."""
    return json.dumps({"answer": text})


def calls(*pairs: tuple[int, int], tool: str = "add") -> str:
    """The model's output when it calls ``tool`` once per ``(a, b)`` (schema format)."""
    return json.dumps({"tool_calls": [{"name": tool, "arguments": {"a": a, "b": b}} for a, b in pairs]})


class Script:
    """Outputs in order (then ``then`` forever, if given), and the requests that asked for them."""

    def __init__(self, *outputs: str, then: str | None = None) -> None:
        self.outputs = list(outputs)
        self.then = then
        self.requests: list[StepRequest] = []

    def __call__(self, request: StepRequest) -> str:
        self.requests.append(request)
        if not self.outputs and self.then is not None:
            return self.then
        return self.outputs.pop(0)


def close_leftover_event_loop() -> None:
    """Close the event loop a framework's ``run_sync`` left set on this thread (openai-agents and
    pydantic-ai keep one for their next call): a later ``asyncio.run`` would drop it unclosed."""
    policy = asyncio.get_event_loop_policy()
    with warnings.catch_warnings(), contextlib.suppress(RuntimeError):
        warnings.simplefilter("ignore", DeprecationWarning)
        loop: Any = policy.get_event_loop()
        if not loop.is_running():
            loop.close()
            policy.set_event_loop(None)
