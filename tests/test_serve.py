"""``agentkv serve``: the real `openai` client against the front door, on `HonestPairEngine` (no model runs here;
the real pair behind the same server is in test_serve_pair.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from agentkv import EngineGroup, SessionPool, SqliteSessionStore
from agentkv._engines._system import free_port
from agentkv._surfaces._metrics import ServeMetrics
from agentkv._surfaces._tenants import Tenants
from agentkv.engines import StepRequest
from agentkv.serve import FrontDoor
from agentkv.testing import HonestPairEngine

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


TENANT = Tenants.of(["k3y"]).names[0]
"""The tenant of the module's door's key."""


def gauge(url: str, name: str) -> float:
    """A gauge of the door's ``/metrics``."""
    page = httpx.get(url + "/metrics").text
    return float(next(line.split()[1] for line in page.splitlines() if line.startswith(f"agentkv_{name} ")))


def respond(request: StepRequest) -> str:
    """Calls the tool when tools are offered and the last message is the user's; answers otherwise."""
    if request.sampling.json_schema is None:
        return "A plain answer."
    if request.sampling.json_schema.get("required") == ["answer"]:
        return json.dumps({"answer": "It is sunny."})
    return json.dumps({"tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}]})


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, HonestPairEngine, SessionPool]]:
    with HonestPairEngine(respond) as engine, SessionPool(engine=engine, max_tokens=64) as pool:
        door = FrontDoor(pool, model_name="smol", api_key="k3y", max_request_bytes=64_000, port=free_port())
        url = door.start().url
        try:
            yield url, engine, pool
        finally:
            door.stop()
    assert engine.violations == []


@pytest.fixture
def client(server: tuple[str, HonestPairEngine, SessionPool]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server[0] + "/v1", api_key="k3y", max_retries=0) as opened:
        yield opened


def tool_loop(client: openai.OpenAI, session: str, *, stream: bool) -> list[Any]:
    """Two turns with a tool call each, as an OpenAI client app runs them; returns the answers' messages."""
    messages: list[Any] = [{"role": "system", "content": "Be brief."}]
    answers = []
    for question in ("Weather in Paris?", "And tomorrow?"):
        messages.append({"role": "user", "content": question})
        for choice in ("required", "none"):
            if stream:
                message = _streamed(client, messages, session, choice)
            else:
                reply = client.chat.completions.create(
                    model="smol",
                    messages=messages,
                    tools=[WEATHER],
                    tool_choice=choice,  # type: ignore[arg-type]
                    extra_headers={"x-session-id": session},
                )
                message = reply.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            for call in message.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "sunny"})
        answers.append(messages[-1])
    return answers


def _streamed(client: openai.OpenAI, messages: list[Any], session: str, choice: str) -> dict[str, Any]:
    text, calls = "", []
    for part in client.chat.completions.create(
        model="smol",
        messages=messages,
        tools=[WEATHER],
        tool_choice=choice,
        stream=True,  # type: ignore[arg-type]
        extra_headers={"x-session-id": session},
    ):
        delta = part.choices[0].delta
        text += delta.content or ""
        for piece in delta.tool_calls or []:  # a call's id and name come first, then its arguments piece by piece
            if piece.index == len(calls):
                calls.append(piece.model_dump(exclude_none=True, exclude={"index"}))
            else:
                assert piece.id is None and piece.function is not None and piece.function.name is None
                calls[piece.index]["function"]["arguments"] += piece.function.arguments or ""
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


def test_a_tool_conversation_pushes_back_every_step(server: Any, client: openai.OpenAI) -> None:
    _, engine, pool = server
    answers = tool_loop(client, "plain", stream=False)
    assert [a["content"] for a in answers] == ["It is sunny.", "It is sunny."]
    turns = pool.session_for("plain", tenant=TENANT).stats.turns  # type: ignore[union-attr]
    assert [[s.handle_forwarded for s in t.steps] for t in turns] == [[False, True], [True, True]]


def test_streamed_text_equals_the_plain_text(server: Any, client: openai.OpenAI) -> None:
    assert tool_loop(client, "streamed", stream=True) == tool_loop(client, "unstreamed", stream=False)


def test_usage_reports_cached_tokens_and_the_step_stats(server: Any, client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "Hello"}]
    first = client.chat.completions.create(model="smol", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again"}]
    second = client.chat.completions.create(model="smol", messages=messages)  # no id: matched by its history
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    stats = second.model_extra["agentkv"]["stats"]  # type: ignore[index]
    assert stats["handle_forwarded"] and stats["turn"] == 2


def test_stop_ends_the_answer_before_the_stop_string_streamed_or_not(server: Any, client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "Stop early"}]
    plain = client.chat.completions.create(
        model="smol", messages=messages, stop=["zzz", " answer"], extra_headers={"x-session-id": "stop-plain"}
    )
    assert (plain.choices[0].message.content, plain.choices[0].finish_reason) == ("A plain", "stop")
    pieces, finish = [], None
    for part in client.chat.completions.create(
        model="smol", messages=messages, stop=" answer", stream=True, extra_headers={"x-session-id": "stop-streamed"}
    ):
        pieces.append(part.choices[0].delta.content or "")
        finish = part.choices[0].finish_reason or finish
    assert ("".join(pieces), finish) == ("A plain", "stop")  # the stop string is never sent
    assert not any("answer" in piece for piece in pieces)
    messages += [plain.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on"}]
    after = client.chat.completions.create(
        model="smol", messages=messages, extra_headers={"x-session-id": "stop-plain"}
    )
    assert after.choices[0].message.content == "A plain answer."
    stats = after.model_extra["agentkv"]["stats"]  # type: ignore[index]
    assert stats["turn"] == 2 and stats["miss_reason"] == "no_handle"  # the same session; D pinned nothing


def test_the_async_client_streams_with_usage(server: Any) -> None:
    async def run() -> tuple[str, Any]:
        text, usage = "", None
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="k3y", max_retries=0) as client:
            stream = await client.chat.completions.create(
                model="smol",
                messages=[{"role": "user", "content": "Hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            async for part in stream:
                text += part.choices[0].delta.content or "" if part.choices else ""
                usage = part.usage or usage
        return text, usage

    text, usage = asyncio.run(run())
    assert text == "A plain answer." and usage.completion_tokens > 0


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"messages": []}, 400, "non-empty"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n is not supported: one choice"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["x", ""]}, 400, "stop string must not be empty"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": list("abcde")}, 400, "at most 4"),
        ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "nope"}, 400, "tool_choice"),
        ({"messages": [{"role": "user", "content": "word " * 6000}]}, 400, "context"),
        ({"messages": "hi"}, 400, "messages"),
    ],
)
def test_bad_requests_get_clear_errors(server: Any, body: dict[str, Any], status: int, needle: str) -> None:
    answer = httpx.post(server[0] + "/v1/chat/completions", json=body, headers={"authorization": "Bearer k3y"})
    assert answer.status_code == status
    assert needle in answer.json()["error"]["message"]


def test_keys_sizes_and_busy_sessions(server: Any) -> None:
    url = server[0] + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(url, json=body).status_code == 401
    assert httpx.post(url, json=body, headers={"authorization": "Bearer wrong"}).status_code == 401
    big = {"messages": [{"role": "user", "content": "x" * 70_000}]}
    assert httpx.post(url, json=big, headers={"authorization": "Bearer k3y"}).status_code == 413
    assert httpx.get(server[0] + "/health").json()["status"] == "ok"
    models = httpx.get(server[0] + "/v1/models", headers={"authorization": "Bearer k3y"}).json()
    assert [m["id"] for m in models["data"]] == ["smol"]

    server[1].inject("stall")
    headers = {"authorization": "Bearer k3y", "x-session-id": "busy"}

    async def two_at_once() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as http:
            slow = asyncio.ensure_future(http.post(url, json=body, headers=headers))
            await asyncio.sleep(0.5)
            second = await http.post(url, json=body, headers=headers)
            slow.cancel()
            return [second.status_code]

    assert asyncio.run(two_at_once()) == [409]


def test_metrics_count_tokens_by_source(server: Any, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "count me"}])
    text = httpx.get(server[0] + "/metrics", headers={"authorization": "Bearer k3y"}).text
    assert "# TYPE agentkv_ttft_seconds histogram" in text
    assert 'agentkv_prompt_tokens_total{source="pulled"}' in text and "agentkv_sessions " in text
    assert 'agentkv_errors_total{kind="' in text  # the bad requests above were counted


def echo_of(tokenizer: Any) -> Callable[[StepRequest], str]:
    """A `respond` that answers "echo N.T" to the last "question N.T" of the prompt."""

    def echo(request: StepRequest) -> str:
        prompt = tokenizer.decode(list(request.prompt_token_ids))
        return "echo " + prompt.rsplit("question ", 1)[1].split("<", 1)[0].strip()

    return echo


def clients_at_once(url: str, clients: int, turns: range, histories: dict[int, list[Any]]) -> list[list[str]]:
    """``clients`` OpenAI clients asking "question N.T" for each turn T at once (odd ones named by x-session-id,
    even ones matched by history); their conversations are kept in ``histories``; returns the answers."""

    def client_run(number: int) -> list[str]:
        headers = {"x-session-id": f"client-{number}"} if number % 2 else {}
        messages = histories.setdefault(number, [])
        answers = []
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
            for turn in turns:
                messages.append({"role": "user", "content": f"question {number}.{turn}"})
                reply = client.chat.completions.create(model="m", messages=messages, extra_headers=headers)
                messages.append(reply.choices[0].message.model_dump(exclude_none=True))
                answers.append(reply.choices[0].message.content or "")
        return answers

    async def all_clients() -> list[list[str]]:
        return await asyncio.gather(*(asyncio.to_thread(client_run, n) for n in range(clients)))

    return asyncio.run(all_clients())


def test_eight_concurrent_clients_each_get_their_own_answers(tokenizer: Any) -> None:
    """8 clients x 4 turns at once, named and unnamed: every answer echoes its own client's question."""
    with HonestPairEngine(echo_of(tokenizer)) as engine, SessionPool(engine=engine) as pool:
        with FrontDoor(pool, port=free_port()) as door:
            answers = clients_at_once(door.url, 8, range(4), {})
            assert answers == [[f"echo {n}.{t}" for t in range(4)] for n in range(8)]
            assert len(pool.sessions) == 8 and engine.live_pins == 8
            steps = [s for session in pool.sessions for t in session.stats.turns for s in t.steps]
            assert sum(s.handle_forwarded for s in steps) == 8 * 3  # turns 2-4 of every client pushed back
    assert engine.violations == [] and engine.live_pins == 0


def test_two_pairs_behind_one_door_keep_serving_when_one_dies(tokenizer: Any) -> None:
    """`EngineGroup` behind the door: 8 clients spread over two pairs; one pair dies; every client goes on."""
    pairs = [HonestPairEngine(echo_of(tokenizer)), HonestPairEngine(echo_of(tokenizer))]
    with SessionPool(engine=EngineGroup(pairs)) as pool, FrontDoor(pool, port=free_port()) as door:
        histories: dict[int, list[Any]] = {}
        answers = clients_at_once(door.url, 8, range(2), histories)
        assert answers == [[f"echo {n}.{t}" for t in range(2)] for n in range(8)]
        assert all(pair.steps for pair in pairs)
        assert httpx.get(door.url + "/health").json() == {"status": "ok"}
        assert (gauge(door.url, "engines"), gauge(door.url, "engines_live")) == (2, 2)
        assert len(httpx.get(door.url + "/v1/sessions").json()["data"]) == 4  # the odd clients' named conversations
        pairs[0].inject("die")
        answers = clients_at_once(door.url, 8, range(2, 4), histories)
        assert answers == [[f"echo {n}.{t}" for t in range(2, 4)] for n in range(8)]
        assert pairs[0].is_dead and gauge(door.url, "engines_live") == 1
        last_steps = [session.stats.turns[-1].steps[-1] for session in pool.sessions]
        assert len(last_steps) == 8 and all(step.handle_forwarded for step in last_steps)  # all push back on pair 1
    pairs[1].assert_honest()


def test_sessions_lists_the_named_conversations_the_door_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """``GET /v1/sessions``: the named conversations live in the pool, the most recently used first, their ids
    bounded and their count whole; an unnamed one is not listed, a closed one no longer. ``GET /health`` says
    nothing of them (liveness only), nor ``GET /ready`` (a bare 200)."""
    monkeypatch.setattr("agentkv._surfaces._serve_admin.SESSIONS_LISTED", 3)
    with (
        HonestPairEngine(respond) as engine,
        SessionPool(engine=engine, max_sessions=5) as pool,
        FrontDoor(pool, port=free_port()) as door,
    ):
        listed = door.url + "/v1/sessions"
        assert httpx.get(listed).json() == {"object": "list", "data": [], "total": 0}
        url = door.url + "/v1/chat/completions"
        for name in ("c1", "c2", "c3", "c4", None, "c2"):
            headers = {"x-session-id": name} if name else {}
            body = {"messages": [{"role": "user", "content": f"Hello from {name}"}]}
            assert httpx.post(url, json=body, headers=headers).status_code == 200
        found = httpx.get(listed).json()
        assert [item["id"] for item in found["data"]] == ["c2", "c4", "c3"] and found["total"] == 4
        body = {"messages": [{"role": "user", "content": "Hello from c5"}]}
        assert httpx.post(url, json=body, headers={"x-session-id": "c5"}).status_code == 200  # c1 closed: max 5
        assert [item["id"] for item in httpx.get(listed).json()["data"]] == ["c5", "c2", "c4"]
        assert "c1" not in pool.conversations and len(pool.conversations) == 4
        assert httpx.get(door.url + "/health").json() == {"status": "ok"}
        ready = httpx.get(door.url + "/ready")
        assert ready.status_code == 200 and ready.content == b""


def test_a_restarted_server_resumes_its_conversations_from_the_store(tmp_path: Path) -> None:
    """Two turns, then the server (engine, pool, door) restarts on the same SQLite file: turn 3 resumes."""
    conversations: dict[str, list[Any]] = {"named": [], "unnamed": []}

    def turn(url: str, question: str) -> dict[str, dict[str, Any]]:
        stats = {}
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
            for name, messages in conversations.items():
                headers = {"x-session-id": "s1"} if name == "named" else {}
                messages.append({"role": "user", "content": question})
                reply = client.chat.completions.create(model="m", messages=messages, extra_headers=headers)
                messages.append(reply.choices[0].message.model_dump(exclude_none=True))
                stats[name] = reply.model_extra["agentkv"]["stats"]  # type: ignore[index]
        return stats

    with SqliteSessionStore(tmp_path / "serve.sqlite3") as store:
        for server in ("first", "restarted"):
            with HonestPairEngine(respond) as engine, SessionPool(engine=engine, store=store) as pool:
                with FrontDoor(pool, port=free_port()) as door:
                    if server == "first":
                        turn(door.url, "One?")
                        assert all(s["handle_forwarded"] for s in turn(door.url, "Two?").values())
                    else:
                        assert {s["miss_reason"] for s in turn(door.url, "Three?").values()} == {"resumed"}
                        assert all(s["handle_forwarded"] for s in turn(door.url, "Four?").values())
                        assert [s["turn"] for s in turn(door.url, "Five?").values()] == [5, 5]
            engine.assert_honest()


def _pools_made(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The options of every pool `agentkv serve` makes from now on; each is interrupted as its engines start."""
    made: list[dict[str, Any]] = []

    class NoPool:
        def __init__(self, **options: Any) -> None:
            made.append(options)

        def __enter__(self) -> NoPool:
            raise KeyboardInterrupt  # stands for a Ctrl-C as the engines start

        def __exit__(self, *exc_info: object) -> None:
            pass

    monkeypatch.setattr("agentkv._session._pool.SessionPool", NoPool)
    return made


def test_serve_gives_its_engines_the_context_length_asked_for(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from agentkv._surfaces._cli import main

    made = _pools_made(monkeypatch)
    assert main(["serve", "--store", "memory", "--max-model-len", "2048"]) == 130  # the shell's code for SIGINT
    assert made[0]["engine_options"] == {"max_model_len": 2048}
    assert main(["serve", "--max-model-len", "2048", "--remote", "http://p:1", "http://d:2"]) == 2
    assert "--remote take their vLLM arguments and devices where they start" in capsys.readouterr().err


def test_serve_gives_its_pairs_the_objective_asked_for(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from agentkv._surfaces._cli import main
    from agentkv.engines import Slo

    made = _pools_made(monkeypatch)
    assert main(["serve", "--store", "memory", "--mode", "auto", "--slo-ttft-s", "3"]) == 130
    context = {"max_model_len": 8192}  # the bundled model's own (it fits the CPU's KV cache)
    assert made[-1]["engine_options"] == {**context, "slo": Slo(ttft_s=3.0, itl_s=0.2)}  # the default's ITL
    assert main(["serve", "--store", "memory", "--slo-itl-s", "0.5", "--remote", "http://p:1", "http://d:2"]) == 130
    assert made[-1]["engine"].slo == Slo(ttft_s=2.0, itl_s=0.5)
    assert main(["serve", "--store", "memory", "--engine", "launched", "--slo-ttft-s", "1.5"]) == 130
    assert made[-1]["engine"].slo == Slo(ttft_s=1.5, itl_s=0.2)
    assert main(["serve", "--store", "memory"]) == 130
    assert made[-1]["engine_options"] == context  # no objective asked: the pair's default
    assert main(["serve", "--store", "memory", "--slo-itl-s", "0"]) == 2
    assert "itl_s must be a positive number of seconds" in capsys.readouterr().err
    assert main(["serve", "--store", "memory", "--mode", "colocated", "--slo-ttft-s", "1"]) == 2
    assert "colocated is one engine" in capsys.readouterr().err


def test_each_door_counts_in_its_own_registry() -> None:
    first, second = ServeMetrics(gauges=lambda: {"sessions": 3}), ServeMetrics(gauges=dict)
    first.error("rate_limit_exceeded")
    first.error("rate_limit_exceeded")
    assert 'agentkv_errors_total{kind="rate_limit_exceeded"} 2.0' in first.text()
    assert 'agentkv_requests_total{outcome="error"} 2.0' in first.text() and "agentkv_sessions 3.0" in first.text()
    assert "rate_limit_exceeded" not in second.text() and 'agentkv_requests_total{outcome="error"} 0.0' in second.text()
