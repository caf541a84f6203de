"""What the tests of client-run tools script a model double with: raw outputs in the schema tool format."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import warnings
from typing import Any

from agentkv.engines import StepRequest


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


def with_logprobs(engine_class: Any) -> Any:
    """``engine_class`` (a scripted double) whose steps report log probabilities when asked, as an engine does:
    token ``t`` at position ``i`` has log probability ``-0.5 * i`` and alternatives ``t + 1``, ``t + 2``..."""

    from agentkv import TokenLogprob
    from agentkv.engines import StepDone, TokenDelta

    def logprobs(request: StepRequest, token_ids: Any, start: int = 0) -> list[TokenLogprob] | None:
        top = request.sampling.options.logprobs
        if top is None:
            return None
        return [
            TokenLogprob(
                token_id=t,
                logprob=-0.5 * (start + i),
                top=tuple((t + k, -0.5 * (start + i) - k) for k in range(top)),
            )
            for i, t in enumerate(token_ids)
        ]

    class Logprobs(engine_class):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.asked: list[StepRequest] = []
            """Every step request as it came (logprobs included)."""

        async def step(self, request: StepRequest) -> Any:
            done = 0
            options = request.sampling.options.model_copy(update={"logprobs": None})  # the double would refuse it
            inner = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, options=options))
            self.asked.append(request)
            async for event in super().step(inner):
                if isinstance(event, TokenDelta):
                    event = TokenDelta(
                        token_ids=event.token_ids, text=event.text, logprobs=logprobs(request, event.token_ids, done)
                    )
                    done += len(event.token_ids)
                elif isinstance(event, StepDone):
                    event = dataclasses.replace(event, logprobs=logprobs(request, event.token_ids))
                yield event

    return Logprobs
