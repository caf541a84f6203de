"""The scripted test doubles' common ground and `ScriptedEngine`: an engine that answers each step with the next
scripted text, as vLLM would end it at a stop string, and refuses the sampling options a script cannot honour.
`agentkv.testing` (src/agentkv/testing.py) is their public home; `HonestPairEngine` (src/agentkv/_doubles/_honest_pair.py)
builds on the same ground."""

from __future__ import annotations

import contextlib
import time
import unittest.mock
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio

from .._engines import Engine, EngineInfo, StepDone, StepEvent, StepRequest, StepTimings, TokenDelta
from .._engines._base import Sampling
from .._engines._server_process import ServerProcess
from .._engines._vllm import AsyncLLMRunner
from .._errors import AgentKVError, UserError

__all__ = [
    "TEST_MODEL",
    "ModelFolderDouble",
    "ScriptedEngine",
    "UnconsumedScriptError",
    "block_real_engines",
    "cut_at_stop",
    "refuse_unhonoured",
]


@contextlib.contextmanager
def block_real_engines() -> Iterator[None]:
    """Within this block, starting a real vLLM engine raises `UserError` (use it around unit tests).

    It replaces the two ways agentkv starts vLLM, an in-process engine's start and a server
    process's start, for the whole process until the block ends.
    """

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise UserError(
            "real engines are blocked here (agentkv.testing.block_real_engines); "
            "use agentkv.testing.ScriptedEngine or mark the test as needing the pair"
        )

    with (
        unittest.mock.patch.object(AsyncLLMRunner, "start", refuse),
        unittest.mock.patch.object(ServerProcess, "start", refuse),
    ):
        yield


class UnconsumedScriptError(AgentKVError):
    """`ScriptedEngine.assert_complete` found outputs the code under test never asked for."""


TEST_MODEL = Path(__file__).resolve().parent / "test_model"
"""The doubles' model folder: a byte-level tokenizer and a ChatML template, no weights, shipped with agentkv (written
by scripts/make_test_model.py). Sessions read it without transformers (`agentkv._conversation._light_tokenizer`), so
agent code runs on the doubles on a machine with nothing prepared."""


class ModelFolderDouble(Engine):
    """A test double serving no model: it reports a model folder for its tokenizer and chat template, by default
    `TEST_MODEL` (``model_path``: another, such as the bundled model's prepared folder, for its real template)."""

    push_back = False
    """Whether the double issues pins that sessions give back (`EngineInfo.pins`)."""

    def __init__(self, *, model_path: Path | None, max_model_len: int) -> None:
        super().__init__()
        self._model_path = model_path
        self._max_model_len = max_model_len

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            model_path=self._model_path or TEST_MODEL,
            max_model_len=self._max_model_len,
            pins=self.push_back,
            disaggregated=None,  # it stands in for a pair and for a single engine: sessions run it in any mode
            places_steps=True,
        )

    async def _start(self) -> None:
        pass

    def _tokenizer(self) -> Any:
        from .._session._session import load_tokenizer

        return load_tokenizer(str(self.info.model_path))


class ScriptedEngine(ModelFolderDouble):
    """Answers each step with the next scripted output, tokenized by its model folder's tokenizer.

    Args:
        outputs: texts (or callables taking the request and returning text), one per step.
        model_path: the HF folder whose tokenizer the session uses (default: `TEST_MODEL`, which needs nothing
            prepared; ``agentkv.prepare_model()`` gives the bundled model's folder, for its real template).
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
        super().__init__(model_path=model_path, max_model_len=max_model_len)
        self._outputs = list(outputs)
        self._delay_s = delay_s
        self.requests: list[StepRequest] = []
        """Every step request received, in order."""

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.check_open()
        refuse_unhonoured(request)  # as an engine refuses a value: the step never reaches the script
        if not self._outputs:
            raise UnconsumedScriptError("the script ran out: the code under test asked for one more step")
        started = time.perf_counter()
        await anyio.sleep(self._delay_s)
        self.requests.append(request)
        output = self._outputs.pop(0)
        text = output(request) if callable(output) else output
        token_ids = self._encode(text)
        cut = cut_at_stop(token_ids, request.sampling, self._decode)
        if cut is not None:
            token_ids, text = cut
        yield TokenDelta(token_ids=token_ids, text=text)
        yield self._done(request, token_ids, text, started, stopped_by_string=cut is not None)

    @staticmethod
    def _done(
        request: StepRequest, token_ids: list[int], text: str, started: float, *, stopped_by_string: bool = False
    ) -> StepDone:
        """The `StepDone` of an output ``text`` (``token_ids``) of ``request``, begun at ``started``."""
        return StepDone(
            token_ids=token_ids,
            text=text,
            finish_reason="stop",
            timings=StepTimings(ttft_s=time.perf_counter() - started, computed_tokens=len(request.prompt_token_ids)),
            stopped_by_string=stopped_by_string,
        )

    def _encode(self, text: str) -> list[int]:
        tokenizer = self._tokenizer()
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        return [*ids, int(tokenizer.eos_token_id)]

    def _decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer().decode(token_ids, skip_special_tokens=True))

    def assert_complete(self) -> None:
        """Raise `UnconsumedScriptError` if scripted outputs were left unused."""
        if self._outputs:
            raise UnconsumedScriptError(f"{len(self._outputs)} scripted output(s) were never used")


def cut_at_stop(
    token_ids: Sequence[int], sampling: Sampling, decode: Callable[[list[int]], str]
) -> tuple[list[int], str] | None:
    """Where vLLM ends an output at a stop string: the token ids up to the one that completes the first
    stop string, and the text before that string (through it with ``include_stop_str_in_output``); None
    when no stop string occurs."""
    stop = sampling.stop
    for end in range(1, len(token_ids) + 1) if stop else ():
        text = decode(list(token_ids[:end]))
        found = [(at, at + len(string)) for string in stop if (at := text.find(string)) >= 0]
        if found:
            at, through = min(found)
            return list(token_ids[:end]), text[: through if sampling.options.include_stop_str_in_output else at]
    return None


_UNHONOURED = (
    "logprobs",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)
"""The `SamplingOptions` whose effect on an output a scripted double cannot honour. Structured outputs are taken, as
`Sampling.json_schema` is: a script stands for the constrained output (its author writes what the grammar allows)."""


def refuse_unhonoured(request: StepRequest) -> None:
    """`UserError` naming the first option of ``request`` set away from its default that a double cannot honour."""
    options = request.sampling.options
    defaults = type(options)()
    for name in _UNHONOURED:
        if getattr(options, name) != getattr(defaults, name):
            raise UserError(f"{name}: the scripted test doubles cannot honour it (use a real engine)")
