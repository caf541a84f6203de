"""`CompletionsEngine`: an agentkv engine over a server's OpenAI ``/v1/completions`` endpoint.

The server must take a prompt of token ids and return the ids of the tokens it generates: vLLM's
OpenAI server does (``return_token_ids``), so ``vllm serve`` and ``agentkv engine`` do. Sessions on it
run in mode "colocated": each step sends the whole conversation, and the server's prefix cache spares
it recomputing the history (its ``cached_tokens`` are the step's ``local_hit_tokens``).

Run: python examples/completions_engine.py http://127.0.0.1:8000
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import openai

from agentkv import EngineError, Session, UserError
from agentkv.engines import Engine, EngineInfo, StepDone, StepEvent, StepRequest, StepTimings, TokenDelta

PASSED = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop_token_ids")
"""The `SamplingOptions` sent as they are (vLLM's names), every one, so that the server's defaults never replace
them; structured outputs go as `Sampling.structured` (a session's schema-forced tool calls too)."""


class CompletionsEngine(Engine):
    """Each step streamed from ``url`` (``http://host:port``); ``model``: the served model's id (default: the first)."""

    def __init__(self, url: str, *, model: str | None = None) -> None:
        super().__init__()
        self._url, self._model = url.rstrip("/").removesuffix("/v1") + "/v1", model
        self._client: openai.AsyncOpenAI | None = None
        self._info: EngineInfo | None = None

    @property
    def info(self) -> EngineInfo:
        return self._info_once_started(self._info)

    async def _start(self) -> None:
        self._client = openai.AsyncOpenAI(base_url=self._url, api_key=os.environ.get("OPENAI_API_KEY", "-"))
        cards = [card.model_dump() for card in (await self._client.models.list()).data]
        card = next((card for card in cards if self._model in (None, card["id"])), None)
        if card is None:
            raise UserError(f"{self._url} serves no model {self._model!r}")
        self._model = card["id"]  # vLLM's model card has the model's folder or hub id (the tokenizer's) and length
        path = Path(card.get("root") or card["id"])
        self._info = EngineInfo(model_path=path, max_model_len=card["max_model_len"])

    async def _stop(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.check_open()
        assert self._client is not None and self._model is not None
        sampling = request.sampling
        refused = sorted(sampling.options.model_dump(exclude_defaults=True).keys() - {*PASSED, "structured_outputs"})
        if refused:  # a sampling field is honoured or refused by name, never dropped
            raise UserError(f"CompletionsEngine cannot honour {', '.join(refused)}")
        vllm = {name: getattr(sampling.options, name) for name in PASSED}  # in vLLM's names, with its own fields
        vllm |= {"structured_outputs": sampling.structured, "return_token_ids": True, "cache_salt": request.cache_salt}
        started, first, cached = time.perf_counter(), 0.0, 0
        ids: list[int] = []
        text, finish = "", "length"
        try:
            stream = await self._client.completions.create(
                model=self._model,
                prompt=list(request.prompt_token_ids),
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                seed=sampling.seed,
                stop=list(sampling.stop),
                stream=True,
                stream_options={"include_usage": True},
                extra_body=vllm,
            )
            # the SDK's own generator, not aiter()'s wrapper: closed below, it closes httpx's under it on this
            # loop, even when the caller leaves early (why: `_events_of` in src/agentkv/_engines/_http_transport.py)
            chunks = stream._iterator
            try:
                async for chunk in chunks:
                    if chunk.usage and chunk.usage.prompt_tokens_details:  # the server's prefix-cache hits
                        cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
                    for choice in chunk.choices:
                        new = getattr(choice, "token_ids", None)
                        if new is None:
                            raise EngineError(f"{self._url} returns no token ids (vLLM's return_token_ids)")
                        first = first or time.perf_counter()
                        ids += new
                        text, finish = text + choice.text, choice.finish_reason or finish
                        if new or choice.text:
                            yield TokenDelta(token_ids=new, text=choice.text)
            finally:
                with anyio.CancelScope(shield=True):
                    await chunks.aclose()
                    await stream.close()
        except openai.APIError as exc:
            raise EngineError(f"{self._url}: {exc}") from exc
        prompt = len(request.prompt_token_ids)
        hits = min(cached, prompt)  # KV the server's prefix cache held; it computed the rest
        ttft = (first or time.perf_counter()) - started
        timings = StepTimings(ttft_s=ttft, local_hit_tokens=hits, computed_tokens=prompt - hits)
        yield StepDone(token_ids=ids, text=text, finish_reason=finish, timings=timings)


def main(url: str) -> None:
    """A two-turn session on the server at ``url``: each answer and its step's stats."""
    with CompletionsEngine(url) as engine, Session(engine=engine, system="You are terse.", max_tokens=24) as session:
        for question in ("What is the capital of France?", "And of Italy?"):
            result = session.run_sync(question)
            print(f"> {question}\n{result.text.strip()}\n  {result.steps[-1].stats.summary()}")


if __name__ == "__main__":
    main(sys.argv[1])
