"""examples/completions_engine.py against a scripted OpenAI-compatible completions server (no model runs).

`ScriptedCompletionsServer` streams one answer per request as vLLM's OpenAI server does with
``return_token_ids`` and ``stream_options.include_usage``, and reports as cached the whole blocks a
prompt shares with the one before it (a prefix cache). It proves what the example sends and how it
reads the replies; the docs test runs the example on a real vLLM server (docs/engines.md).
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
import runpy
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio.lowlevel
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentkv import EngineError, SamplingOptions, Session, UserError
from agentkv.engines import Sampling, StepRequest, TokenDelta
from test_http_client import ANSWER_IDS, ScriptedServer, _suspended_http_generators

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "completions_engine.py"
CompletionsEngine: Any = runpy.run_path(str(EXAMPLE), run_name="completions_engine")["CompletionsEngine"]
BLOCK = 16
"""The scripted prefix cache's block size: it reports cached tokens in whole blocks, as vLLM does."""


class ScriptedCompletionsServer(ScriptedServer):
    """A scripted vLLM OpenAI server with one model, ``served``, whose folder is ``model_path`` (the tokenizer's).

    Every request's body is kept in `bodies`; each is answered with `ANSWER_IDS` ("Par", "is", "."), one
    chunk a token (without ids when ``token_ids=False``), then a usage chunk: ``cached_tokens`` is what the
    prompt shares with the one before it, in whole blocks (absent when none, as vLLM leaves it out).
    """

    def __init__(self, model_path: Path, *, token_ids: bool = True) -> None:
        super().__init__("completions", agentkv=False, token_ids=token_ids)
        self.model_path = model_path
        self.cached: list[int] = []
        """The cached tokens reported to each request, in order."""

    async def _models(self, request: Request) -> Response:
        card = {"id": "served", "object": "model", "created": 0, "owned_by": "vllm", "root": str(self.model_path)}
        return JSONResponse({"object": "list", "data": [card | {"max_model_len": 2048}]})

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        if self.failures:
            return JSONResponse({"error": {"message": "scripted failure"}}, status_code=self.failures.pop(0))
        before = self.bodies[-2]["prompt"] if len(self.bodies) > 1 else []
        shared = next((i for i, (a, b) in enumerate(zip(before, body["prompt"], strict=False)) if a != b), len(before))
        self.cached.append(min(shared, len(body["prompt"]) - 1) // BLOCK * BLOCK)
        return StreamingResponse(self._answer(len(body["prompt"]), self.cached[-1]), media_type="text/event-stream")

    async def _answer(self, prompt: int, cached: int) -> AsyncIterator[str]:
        for index, text in enumerate(("Par", "is", ".")):
            last = index == len(ANSWER_IDS) - 1
            ids = [ANSWER_IDS[index]] if self.token_ids else None
            choice = {"index": 0, "text": text, "finish_reason": "stop" if last else None, "token_ids": ids}
            yield f"data: {json.dumps(self._completion([choice]))}\n\n"
        usage = {"prompt_tokens": prompt, "completion_tokens": len(ANSWER_IDS), "total_tokens": prompt + 3}
        details = {"prompt_tokens_details": {"cached_tokens": cached}} if cached else {}
        yield f"data: {json.dumps(self._completion([], usage=usage | details))}\n\n"
        yield "data: [DONE]\n\n"


@pytest.fixture
def server(model_path: Path) -> Iterator[ScriptedCompletionsServer]:
    with ScriptedCompletionsServer(model_path) as scripted:
        yield scripted


def test_a_two_turn_session_sends_its_tokens_and_reads_the_cached_split(server: ScriptedCompletionsServer) -> None:
    with CompletionsEngine(server.url) as engine, Session(engine=engine, max_tokens=8) as session:
        assert engine.info.model_path == server.model_path and engine.info.max_model_len == 2048
        first = session.run_sync("Capital of France?")
        second = session.run_sync("And of Italy?")
        assert session.mode == "colocated"
        assert session.token_ids == server.bodies[1]["prompt"] + ANSWER_IDS
    one, two = (body["prompt"] for body in server.bodies)
    assert two[: len(one) + len(ANSWER_IDS)] == one + ANSWER_IDS  # the session's tokens, exactly
    assert first.text == second.text == "Paris." and second.steps[0].token_ids == ANSWER_IDS
    assert server.cached[0] == 0 and server.cached[1] >= BLOCK
    for result, cached, prompt in zip((first, second), server.cached, (one, two), strict=True):
        stats = result.steps[0].stats
        assert (stats.local_hit_tokens, stats.computed_tokens, stats.pulled_tokens) == (
            cached,
            len(prompt) - cached,
            0,
        )
        assert stats.ttft_s > 0


@pytest.mark.anyio
async def test_the_sampling_and_the_cache_salt_are_sent(server: ScriptedCompletionsServer) -> None:
    options = SamplingOptions(top_p=0.9, top_k=5, repetition_penalty=1.1, stop_token_ids=(2,))
    sampling = Sampling(max_tokens=8, temperature=0.5, seed=7, stop=("\n\n",), options=options)
    request = StepRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=sampling, cache_salt="tenant-a")
    async with CompletionsEngine(server.url + "/v1/", model="served") as engine:
        events = [event async for event in engine.step(request)]
    assert [event.token_ids for event in events[:-1]] == [[token] for token in ANSWER_IDS]
    [body] = server.bodies
    sent = {name: body[name] for name in ("model", "prompt", "max_tokens", "temperature", "seed", "stop")}
    assert sent == {
        "model": "served",
        "prompt": [1, 2, 3],
        "max_tokens": 8,
        "temperature": 0.5,
        "seed": 7,
        "stop": ["\n\n"],
    }
    vllm = {name: body[name] for name in ("top_p", "top_k", "min_p", "repetition_penalty", "stop_token_ids")}
    assert vllm == {
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.0,
        "repetition_penalty": 1.1,
        "stop_token_ids": [2],
    }  # defaults too
    assert (body["cache_salt"], body["return_token_ids"], body["stream"]) == ("tenant-a", True, True)
    assert body["stream_options"] == {"include_usage": True}
    assert body["structured_outputs"] is None


def test_a_forced_tool_call_is_sent_as_structured_outputs(server: ScriptedCompletionsServer) -> None:
    """A session's schema-format tools force each step's output to a JSON schema: vLLM's ``structured_outputs``."""

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    with CompletionsEngine(server.url) as engine, Session(engine=engine, tools=[add], max_steps=2) as session:
        session.run_sync("What is 1 + 2?")  # the scripted "Paris." is no JSON: a malformed output, then the answer
    assert len(server.bodies) == 2
    assert all(set(body["structured_outputs"]) == {"json"} for body in server.bodies)


@pytest.mark.parametrize(
    ("sampling", "name"),
    [
        (Sampling(options=SamplingOptions(logprobs=1)), "logprobs"),
        (Sampling(options=SamplingOptions(bad_words=("no",), min_tokens=1)), "bad_words, min_tokens"),
        (Sampling(options=SamplingOptions(logit_bias={5: 1.0})), "logit_bias"),
    ],
)
@pytest.mark.anyio
async def test_what_it_cannot_honour_is_refused_by_name(
    server: ScriptedCompletionsServer, sampling: Sampling, name: str
) -> None:
    async with CompletionsEngine(server.url) as engine:
        request = StepRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=sampling)
        with pytest.raises(UserError, match=f"cannot honour {re.escape(name)}$"):
            async for _ in engine.step(request):
                pass
    assert not server.bodies  # refused before anything was sent


@pytest.mark.anyio
async def test_a_step_left_early_leaves_no_suspended_generator(server: ScriptedCompletionsServer) -> None:
    """The caller stops reading after the first token: the stream closes on the loop, with every generator
    under it (one left suspended is finalized by the garbage collector from any thread: tests/test_http_client.py)."""
    async with CompletionsEngine(server.url) as engine:
        gc.collect()
        before = _suspended_http_generators()
        request = StepRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=Sampling(max_tokens=3))
        async with contextlib.aclosing(engine.step(request)) as events:
            async for event in events:
                assert isinstance(event, TokenDelta)
                break
        for _ in range(50):  # each closed generator's finalizer closes the next one down on a later iteration
            await anyio.lowlevel.checkpoint()
        assert _suspended_http_generators() == before


def test_a_server_error_or_an_answer_without_token_ids_is_an_engine_error(model_path: Path) -> None:
    with ScriptedCompletionsServer(model_path, token_ids=False) as server:
        server.failures.append(400)
        with CompletionsEngine(server.url) as engine, Session(engine=engine, max_tokens=8) as session:
            with pytest.raises(EngineError, match="scripted failure"):
                session.run_sync("Capital of France?")
            with pytest.raises(EngineError, match="no token ids"):
                session.run_sync("Capital of France?")
            assert session.token_ids == []  # both turns rolled back


def test_the_docs_show_the_example_as_it_is() -> None:
    """docs/engines.md shows examples/completions_engine.py in full: the engine (a snippet the docs test runs),
    then its command line (not run there: the docs test runs its snippets as ``__main__``)."""
    blocks = re.findall(r"^```py(?:thon)?\n(.*?)^```", (ROOT / "docs" / "engines.md").read_text(), re.M | re.S)
    first = next(index for index, block in enumerate(blocks) if block.startswith('"""`CompletionsEngine`'))
    assert "\n\n".join(blocks[first : first + 2]) == EXAMPLE.read_text()
