"""Test doubles for agent code: a scripted engine for loop logic, no model needed.

    from agentkv.testing import ScriptedEngine

    engine = ScriptedEngine(["Paris.", "Rome."])
    async with engine, Session(engine=engine) as s:
        assert (await s.run("Capital of France?")).text == "Paris."
    engine.assert_complete()

A scripted engine never claims anything about KV reuse: it reports every prompt token as
computed and returns no handle. Tests that claim the pair works use the real pair.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from ._engines import Engine, EngineInfo, StepDone, StepEvent, StepRequest, StepTimings, TokenDelta, _vllm
from ._errors import AgentKVError
from ._model import DEFAULT_MODEL, cache_dir, prepare_model

__all__ = ["ScriptedEngine", "UnconsumedScriptError", "block_real_engines"]


@contextlib.contextmanager
def block_real_engines() -> Iterator[None]:
    """Within this block, starting a real vLLM engine raises `UserError` (use it around unit tests)."""
    previous = _vllm.ALLOW_REAL_ENGINES
    _vllm.ALLOW_REAL_ENGINES = False
    try:
        yield
    finally:
        _vllm.ALLOW_REAL_ENGINES = previous


class UnconsumedScriptError(AgentKVError):
    """`ScriptedEngine.assert_complete` found outputs the code under test never asked for."""


class ScriptedEngine(Engine):
    """Answers each step with the next scripted output, tokenized by the bundled model's tokenizer.

    Args:
        outputs: texts (or callables taking the request and returning text), one per step.
        model_path: the HF folder whose tokenizer the session uses (default: the bundled model).
        max_model_len: the context length to report.
        delay_s: how long each step takes before its output (for cancellation and timeout tests).
    """

    def __init__(
        self,
        outputs: Sequence[str | Callable[[StepRequest], str]],
        *,
        model_path: Path | None = None,
        max_model_len: int = 4096,
        delay_s: float = 0.0,
    ) -> None:
        super().__init__()
        self._outputs = list(outputs)
        self._model_path = model_path
        self._max_model_len = max_model_len
        self._delay_s = delay_s
        self.requests: list[StepRequest] = []
        """Every step request received, in order."""
        self._tokenizer: Any = None

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            kind="scripted",
            model_path=self._model_path or cache_dir() / DEFAULT_MODEL,
            max_model_len=self._max_model_len,
            push_back=False,
        )

    async def _start(self) -> None:
        if self._model_path is None:  # the bundled model's tokenizer; prepared once per machine
            self._model_path = await anyio.to_thread.run_sync(prepare_model)

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.check_open()
        if not self._outputs:
            raise UnconsumedScriptError("the script ran out: the code under test asked for one more step")
        started = time.perf_counter()
        await anyio.sleep(self._delay_s)
        self.requests.append(request)
        output = self._outputs.pop(0)
        text = output(request) if callable(output) else output
        token_ids = self._encode(text)
        yield TokenDelta(token_ids=token_ids, text=text)
        yield StepDone(
            token_ids=token_ids,
            text=text,
            finish_reason="stop",
            handle=None,
            timings=StepTimings(ttft_s=time.perf_counter() - started, computed_tokens=len(request.prompt_token_ids)),
        )

    def _encode(self, text: str) -> list[int]:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.info.model_path))
        tokenizer = self._tokenizer
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        return [*ids, int(tokenizer.eos_token_id)]

    def assert_complete(self) -> None:
        """Raise `UnconsumedScriptError` if scripted outputs were left unused."""
        if self._outputs:
            raise UnconsumedScriptError(f"{len(self._outputs)} scripted output(s) were never used")
