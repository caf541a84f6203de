"""A scripted engine that streams its output one token at a time (as a real engine does), and a tokenizer
folder for reasoning models: the bundled tokenizer with ``<think>``/``</think>`` tokens and a chat template
that drops earlier turns' reasoning (as Qwen3's and DeepSeek-R1's templates do)."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from agentkv import SessionPool
from agentkv._engines._system import free_port
from agentkv.engines import StepEvent, StepRequest, TokenDelta
from agentkv.serve import FrontDoor
from agentkv.testing import ScriptedEngine

THINK_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.role == 'assistant' %}{{ message.content.split('</think>')[-1].lstrip() }}\
{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
"""ChatML that renders an assistant message without its reasoning (everything up to ``</think>``)."""


class TokenByToken(ScriptedEngine):
    """`ScriptedEngine` whose outputs come as one `TokenDelta` per token (``respond``: the output of a request)."""

    def __init__(self, respond: Callable[[StepRequest], str], **options: Any) -> None:
        super().__init__([], **options)
        self._respond = respond

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.check_open()
        started = time.perf_counter()
        self.requests.append(request)
        text = self._respond(request)
        token_ids = self._encode(text)
        given = ""
        for end in range(1, len(token_ids) + 1):
            decoded = self._decode(token_ids[:end])
            yield TokenDelta(token_ids=token_ids[end - 1 : end], text=decoded[len(given) :])
            given = decoded
        yield self._done(request, token_ids, given, started)


@contextlib.contextmanager
def served(respond: Callable[[StepRequest], str], model_path: Path, **pool_options: Any) -> Iterator[str]:
    """The ``/v1`` URL of a front door on a pool (``pool_options``) of a `TokenByToken` engine (``respond``)."""
    with (
        TokenByToken(respond, model_path=model_path) as engine,
        SessionPool(engine=engine, **pool_options) as pool,
    ):
        front = FrontDoor(pool, model_name="smol", port=free_port())
        try:
            yield front.start().url + "/v1"
        finally:
            front.stop()


def thinking_model(model_path: Path, folder: Path) -> Path:
    """``folder``: the bundled tokenizer with ``<think>`` and ``</think>`` tokens and `THINK_TEMPLATE` (no weights:
    for scripted engines)."""
    from transformers import AutoTokenizer

    for name in ("config.json", "generation_config.json"):
        if (model_path / name).exists():
            shutil.copy(model_path / name, folder / name)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    return folder
