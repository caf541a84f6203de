"""``agentkv serve`` on the real pair: the real `openai` client and openai-agents' own OpenAI model."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from agentkv import EmbeddedPair, SessionPool, SqliteSessionStore
from agentkv._engines._system import free_port
from agentkv.serve import FrontDoor

pytestmark = pytest.mark.pair

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
RECORD = {
    "type": "function",
    "function": {
        "name": "record",
        "description": "Record numbers.",
        "parameters": {
            "type": "object",
            "properties": {
                "numbers": {"type": "array", "items": {"type": "integer", "minimum": 100000}, "minItems": 300}
            },
            "required": ["numbers"],
        },
    },
}
QUESTIONS = ("What is 12 + 30?", "And 5 + 6?", "And 100 + 1?", "And 7 + 8?")


@pytest.fixture(scope="module")
def urls(pair: EmbeddedPair) -> Iterator[tuple[str, str]]:
    """Two servers on the pair, each with its own cache salt: one's P cache never serves the other's prompts,
    so both must pull back from D."""
    with (
        SessionPool(engine=pair, max_tokens=128, cache_salt="serve-pair-a") as a,
        SessionPool(engine=pair, max_tokens=128, cache_salt="serve-pair-b") as b,
        FrontDoor(a, model_name="smol", port=free_port()) as door_a,
        FrontDoor(b, model_name="smol", port=free_port()) as door_b,
    ):
        yield door_a.url + "/v1", door_b.url + "/v1"


def conversation(
    client: openai.OpenAI,
    session: str,
    *,
    stream: bool,
    questions: tuple[str, ...] = QUESTIONS,
    messages: list[Any] | None = None,
) -> tuple[list[Any], list[dict[str, Any]]]:
    """A turn per question (four by default); each turn a forced `add` call, its result, then an answer.
    Returns the messages (``messages`` extended, if given) and each step's agentkv stats (from the usage chunk
    when streaming)."""
    messages = messages if messages is not None else [{"role": "system", "content": "You add numbers."}]
    stats: list[dict[str, Any]] = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        for choice in ("required", "none"):
            options: dict[str, Any] = {
                "model": "smol",
                "messages": messages,
                "tools": [ADD],
                "tool_choice": choice,
                "extra_headers": {"x-session-id": session},
            }
            if stream:
                message, step = _streamed(client, options)
            else:
                reply = client.chat.completions.create(**options)
                message = reply.choices[0].message.model_dump(exclude_none=True)
                step = reply.model_extra["agentkv"]["stats"]  # type: ignore[index]
            messages.append(message)
            stats.append(step)
            if not message.get("tool_calls"):
                break
            for call in message.get("tool_calls") or []:
                arguments = json.loads(call["function"]["arguments"])
                result = int(arguments.get("a", 0)) + int(arguments.get("b", 0))
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(result)})
    return messages, stats


def _said(messages: list[Any]) -> list[tuple[str, str | None, list[tuple[str, str]]]]:
    """What each message says, without the call ids (new for every request)."""
    return [
        (
            m["role"],
            m.get("content"),
            [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])],
        )
        for m in messages
    ]


def _streamed(client: openai.OpenAI, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The streamed message, each call's pieces joined by their index (its id and name come first, then its
    arguments piece by piece), and the stats of the usage chunk."""
    text, calls, stats = "", dict[int, dict[str, Any]](), {}
    for part in client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True}):
        if not part.choices:
            stats = part.model_extra["agentkv"]["stats"]  # type: ignore[index]
            continue
        delta = part.choices[0].delta
        text += delta.content or ""
        for piece in delta.tool_calls or []:
            assert piece.function is not None
            if piece.index not in calls:
                assert piece.id and piece.function.name, piece  # the first piece names the call
                calls[piece.index] = {"id": piece.id, "type": "function", "function": {"name": piece.function.name}}
                calls[piece.index]["function"]["arguments"] = ""
            calls[piece.index]["function"]["arguments"] += piece.function.arguments or ""
    joined = [calls[index] for index in sorted(calls)]
    return {"role": "assistant", "content": text or None, **({"tool_calls": joined} if joined else {})}, stats


def test_four_tool_turns_pull_back_and_streaming_changes_nothing(urls: tuple[str, str]) -> None:
    with (
        openai.OpenAI(base_url=urls[0], api_key="none", max_retries=0) as client_a,
        openai.OpenAI(base_url=urls[1], api_key="none", max_retries=0) as client_b,
    ):
        plain, plain_stats = conversation(client_a, "plain", stream=False)
        streamed, streamed_stats = conversation(client_b, "streamed", stream=True)
    assert _said(streamed) == _said(plain)  # greedy, float32: the streamed text is the plain text, call for call
    assert [m.get("tool_calls", [{}])[0].get("function", {}).get("name") for m in plain if m["role"] == "assistant"][
        ::2
    ] == ["add"] * 4
    for stats in (plain_stats, streamed_stats):
        assert not stats[0]["handle_forwarded"]
        # every later step forwarded D's handle and reused most of its prompt; it pulled from D unless P's own
        # cache (blocks pulled by earlier steps) left less than the pair's threshold to pull
        assert all(s["handle_forwarded"] for s in stats[1:])
        missed = [(s["turn"], s["step"], s["miss_reason"]) for s in stats[1:] if not s["pulled_tokens"]]
        assert all(reason == "below_threshold" for *_, reason in missed) and len(missed) <= 2, missed
        assert all(s["computed_tokens"] < s["prompt_tokens"] // 2 for s in stats[1:])


def test_openai_agents_own_chat_model_runs_a_tool_agent_on_the_server(urls: tuple[str, str]) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    results: list[int] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        results.append(a + b)
        return a + b

    async def run() -> str:
        async with openai.AsyncOpenAI(base_url=urls[0], api_key="none", max_retries=0) as client:
            agent = Agent(
                name="adder",
                instructions="You add numbers.",
                tools=[add],
                model=OpenAIChatCompletionsModel(model="smol", openai_client=client),
                model_settings=ModelSettings(tool_choice="required", max_tokens=128),
                tool_use_behavior="stop_on_first_tool",  # the tool's result is the answer: one call, deterministic
            )
            result = await Runner.run(agent, "What is 2 + 3?")
            return str(result.final_output)

    answer = asyncio.run(run())
    assert results and answer == str(results[0])  # the framework ran the call the model made through the server


def test_a_conversation_resumes_token_for_token_after_a_server_restart(pair: EmbeddedPair, tmp_path: Path) -> None:
    """Two turns, the pool and door restart on the same store file, two more turns: the first step after the
    restart resumes the saved tokens (the model's answers not re-tokenized) and the next ones push back."""
    messages: list[Any] | None = None
    saved: list[int] = []
    with SqliteSessionStore(tmp_path / "serve.sqlite3") as store:
        for questions in (QUESTIONS[:2], QUESTIONS[2:]):
            with (
                SessionPool(engine=pair, max_tokens=128, cache_salt="serve-pair-resume", store=store) as pool,
                FrontDoor(pool, model_name="smol", port=free_port()) as door,
                openai.OpenAI(base_url=door.url + "/v1", api_key="none", max_retries=0) as client,
            ):
                messages, stats = conversation(client, "c", stream=False, questions=questions, messages=messages)
                session = pool.session_for("c")
                assert session is not None
                if not saved:
                    saved = session.token_ids
                    assert all(s["handle_forwarded"] for s in stats[1:])
                else:
                    assert stats[0]["miss_reason"] == "resumed" and stats[0]["turn"] == 3
                    assert session.token_ids[: len(saved)] == saved
                    assert all(s["handle_forwarded"] for s in stats[1:])
                    assert [t.turn for t in session.stats.turns] == [1, 2, 3, 4]


def _busy_cores(pids: set[int], seconds: float) -> float:
    """The cores ``pids`` kept busy (user + system CPU time) over ``seconds``."""
    processes = [psutil.Process(pid) for pid in pids]

    def spent() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in processes)

    before = spent()
    time.sleep(seconds)
    return (spent() - before) / seconds


def test_a_client_that_leaves_mid_decode_stops_the_decode_on_both_engines(pair: EmbeddedPair) -> None:
    """A streamed and a plain request, each dropped while D decodes a long answer: both engines' requests end at
    once (agentkv's count and vLLM's), the pair's cores go idle, and the conversation's next request works."""
    engines = (pair._p, pair._d)
    assert all(engine is not None for engine in engines)
    with (
        SessionPool(engine=pair, cache_salt="serve-pair-leaves") as pool,
        FrontDoor(pool, model_name="smol", port=free_port()) as door,
    ):
        port = int(door.url.rsplit(":", 1)[1])
        for stream in (True, False):
            body = json.dumps(
                {
                    "model": "smol",
                    "messages": [{"role": "user", "content": "Record some numbers."}],
                    "tools": [RECORD],  # a call the grammar makes long: D decodes until max_tokens
                    "tool_choice": "required",
                    "max_tokens": 1024,
                    "stream": stream,
                }
            ).encode()
            head = f"POST /v1/chat/completions HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\nx-session-id: leaves\r\ncontent-length: {len(body)}\r\n\r\n"
            with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
                connection.sendall(head.encode() + body)
                deadline = time.monotonic() + 120
                while not (pair._d.in_flight and pair._d.llm.output_processor.get_num_unfinished_requests()):
                    assert time.monotonic() < deadline, "D never started decoding"
                    time.sleep(0.05)
                time.sleep(1.0)  # D decodes
            deadline = time.monotonic() + 10
            while any(e.in_flight or e.llm.output_processor.get_num_unfinished_requests() for e in engines):
                assert time.monotonic() < deadline, "a request of the dropped step still runs"
                time.sleep(0.05)
            assert _busy_cores(pair.pids, 2.0) < 0.5  # idle (a decode keeps about a core busy)
        with openai.OpenAI(base_url=door.url + "/v1", api_key="none", max_retries=0) as client:
            reply = client.chat.completions.create(
                model="smol",
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=8,
                extra_headers={"x-session-id": "leaves"},
            )
        assert reply.model_extra["agentkv"]["stats"]["turn"] == 1  # type: ignore[index]  # the dropped steps kept nothing
