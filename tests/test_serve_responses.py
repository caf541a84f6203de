"""``POST /v1/responses``: the real `openai` client and openai-agents' own Responses model against the front door,
on `HonestPairEngine` (no model runs here, except in the one test marked ``pair``)."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from agentkv import EmbeddedPair, Session, SessionPool
from agentkv._engines._system import free_port
from agentkv._surfaces._tenants import Tenants
from agentkv.engines import StepRequest
from agentkv.serve import FrontDoor, MemoryResponseStore, ResponseStore, SqliteResponseStore, StoredResponse
from agentkv.testing import HonestPairEngine
from scripted import Script, answer
from serve_cli import serve_with_doubles

WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def respond(request: StepRequest) -> str:
    """Calls the tool when a call is asked for; answers otherwise."""
    if request.sampling.json_schema is None:
        return "A plain answer."
    if request.sampling.json_schema.get("required") == ["answer"]:
        return json.dumps({"answer": "It is sunny."})
    return json.dumps({"tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}]})


Server = tuple[str, HonestPairEngine, SessionPool]
TENANT = Tenants.of(["k3y"]).names[0]
"""The tenant of the module's door's key."""


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with HonestPairEngine(respond) as engine, SessionPool(engine=engine, max_tokens=64) as pool:
        door = FrontDoor(pool, model_name="smol", api_key="k3y", port=free_port(), store=MemoryResponseStore())
        url = door.start().url
        try:
            yield url, engine, pool
        finally:
            door.stop()
    assert engine.violations == []


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server[0] + "/v1", api_key="k3y", max_retries=0) as opened:
        yield opened


def create(client: openai.OpenAI, **options: Any) -> Response:
    """``responses.create``, the answer checked against the openai package's own `Response` model."""
    raw = client.responses.with_raw_response.create(model="smol", **options)
    return Response.model_validate(raw.http_response.json())


def streamed(client: openai.OpenAI, **options: Any) -> Response:
    """``responses.create(stream=True)`` as the openai client reads it: the final response of its events."""
    events = list(client.responses.create(model="smol", stream=True, **options))
    assert events[-1].type == "response.completed"
    return Response.model_validate(events[-1].response.model_dump())


def chain(client: openai.OpenAI, *, stream: bool, session: str | None = None) -> list[Response]:
    """Three calls chained by previous_response_id: a forced call, its result answered, a new question's call."""
    call = streamed if stream else create
    headers = {"x-session-id": session} if session else {}
    first = call(
        client,
        input="Weather in Paris?",
        instructions="Be brief.",
        tools=[WEATHER],
        tool_choice="required",
        extra_headers=headers,
    )
    result = [{"type": "function_call_output", "call_id": first.output[0].call_id, "output": "sunny"}]  # type: ignore[union-attr]
    second = call(
        client,
        input=result,
        previous_response_id=first.id,
        instructions="Be brief.",
        tools=[WEATHER],
        tool_choice="none",
        extra_headers=headers,
    )
    third = call(
        client,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]}],
        previous_response_id=second.id,
        instructions="Be brief.",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "weather"},
        extra_headers=headers,
    )
    return [first, second, third]


def sessions_opened(pool: SessionPool, before: list[Session]) -> list[Session]:
    """The pool's sessions that were not among ``before``."""
    return [session for session in pool.sessions if all(session is not old for old in before)]


def forwarded(response: Response) -> bool:
    """Whether the response's step pushed D's KV handle back (the agentkv extension's stats say)."""
    return bool(response.model_extra["agentkv"]["stats"]["handle_forwarded"])  # type: ignore[index]


def said(response: Response) -> list[tuple[str, str, str]]:
    """What a response's output items say, without their ids (new for every response)."""
    return [
        (item.type, item.name, item.arguments)
        if item.type == "function_call"
        else (item.type, "", item.content[0].text)  # type: ignore[union-attr]
        for item in response.output
    ]


def test_a_tool_chain_by_previous_response_id_pushes_back_every_call(server: Server, client: openai.OpenAI) -> None:
    _, _, pool = server
    before = pool.sessions
    first, second, third = chain(client, stream=False)
    assert said(first) == [("function_call", "weather", '{"city": "Paris"}')]
    assert first.output[0].call_id.startswith("call_")  # type: ignore[union-attr]
    assert said(second) == [("message", "", "It is sunny.")] and second.output_text == "It is sunny."
    assert said(third) == [("function_call", "weather", '{"city": "Paris"}')]
    assert [r.previous_response_id for r in (first, second, third)] == [None, first.id, second.id]
    assert all(r.id.startswith("resp_") and r.status == "completed" for r in (first, second, third))
    [session] = sessions_opened(pool, before)  # an unnamed chain: its session is found by its history
    assert [[s.handle_forwarded for s in t.steps] for t in session.stats.turns] == [[False, True], [True]]


def test_streamed_output_equals_the_plain_output(client: openai.OpenAI) -> None:
    assert [said(r) for r in chain(client, stream=True)] == [said(r) for r in chain(client, stream=False)]


def test_usage_reports_cached_tokens_and_the_step_stats(client: openai.OpenAI) -> None:
    first = create(client, input="Hello")
    second = create(client, input="Again", previous_response_id=first.id)
    assert first.usage is not None and second.usage is not None
    assert first.usage.input_tokens_details.cached_tokens < first.usage.input_tokens
    assert 0 < second.usage.input_tokens_details.cached_tokens <= second.usage.input_tokens
    assert second.usage.total_tokens == second.usage.input_tokens + second.usage.output_tokens
    stats = second.model_extra["agentkv"]["stats"]  # type: ignore[index]
    assert stats["handle_forwarded"] and stats["turn"] == 2
    assert second.usage.input_tokens_details.cached_tokens == stats["prompt_tokens"] - stats["computed_tokens"]


def test_x_session_id_names_the_conversation(server: Server, client: openai.OpenAI) -> None:
    first = create(client, input="Hi", extra_headers={"x-session-id": "named"})
    second = create(client, input="More", previous_response_id=first.id)  # the chain keeps the header's name
    steps = [s for t in server[2].session_for("named", tenant=TENANT).stats.turns for s in t.steps]  # type: ignore[union-attr]
    assert [s.handle_forwarded for s in steps] == [False, True] and second.output_text == "A plain answer."


def test_an_unknown_or_unstored_previous_response_is_a_404(client: openai.OpenAI) -> None:
    """As vLLM answers it (OpenAI answers a 400)."""
    with pytest.raises(openai.NotFoundError) as raised:
        create(client, input="Hi", previous_response_id="resp_nope")
    assert raised.value.status_code == 404 and raised.value.code == "previous_response_not_found"
    assert raised.value.param == "previous_response_id" and "resp_nope" in raised.value.message
    unstored = create(client, input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        create(client, input="Again", previous_response_id=unstored.id)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format"),
        ({"input": "hi", "top_p": 0.0}, "top_p"),
        ({"input": "hi", "text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}}, "both"),
        ({"input": "hi", "priority": 3}, "priority"),
        ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, "web_search_preview"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "file_search"),
        ({"input": "hi", "tool_choice": "nope"}, "tool_choice"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "'reasoning' items"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
        ({"input": [{"role": "critic", "content": "hi"}]}, "critic"),
        ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}, "tool"),
        ({"input": "word " * 6000}, "context"),
        ({"model": "smol"}, "input"),
    ],
)
def test_refused_fields_get_clear_errors(server: Server, body: dict[str, Any], needle: str) -> None:
    answer = httpx.post(server[0] + "/v1/responses", json=body, headers={"authorization": "Bearer k3y"})
    assert answer.status_code == 400, answer.text
    assert needle in answer.json()["error"]["message"]


def raw_events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The server-sent events of a streamed request, each checked against the openai package's event models."""
    events = []
    headers = {"authorization": "Bearer k3y"}
    with httpx.stream("POST", url + "/v1/responses", json=body | {"stream": True}, headers=headers) as answer:
        assert answer.status_code == 200
        name = None
        for line in answer.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert event["type"] == name
                EVENTS.validate_python(event)
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_stream_events_follow_the_protocol(server: Server) -> None:
    answer = raw_events(server[0], {"input": "Hi"})
    assert [e["type"] for e in answer] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 2,  # the double engine writes its answer in two pieces
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e["delta"] for e in answer if e["type"] == "response.output_text.delta") == "A plain answer."
    assert answer[-1]["response"]["output"] == [answer[-2]["item"]]

    calls = raw_events(server[0], {"input": "Weather?", "tools": [WEATHER], "tool_choice": "required"})
    assert [e["type"] for e in calls][2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    item = calls[-1]["response"]["output"][0]
    assert item["type"] == "function_call" and json.loads(item["arguments"]) == {"city": "Paris"}
    assert calls[-2]["item"] == item and calls[-3]["arguments"] == item["arguments"]


def test_a_failure_mid_stream_is_an_error_event(server: Server) -> None:
    server[1].inject("error_mid_stream")
    events = raw_events(server[0], {"input": "Hi"})
    assert events[-1]["type"] == "error" and events[-1]["code"] == "EngineError"
    assert "response.completed" not in [e["type"] for e in events]


def test_an_answer_cut_at_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    cut = create(client, input="Hi", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens" and cut.output[0].status == "incomplete"  # type: ignore[union-attr]


@pytest.mark.parametrize("name", [None, "kept"])
def test_client_kept_history_without_previous_response_id(
    server: Server, client: openai.OpenAI, name: str | None
) -> None:
    """A client that keeps the conversation itself sends the earlier output items back as input: named or not,
    its requests land on one session (an unnamed one is found by its history) and push back."""
    pool, before = server[2], server[2].sessions
    headers = {"x-session-id": name} if name else {}
    options: dict[str, Any] = {"input": "Weather?", "tools": [WEATHER], "tool_choice": "required"}
    first = client.responses.with_raw_response.create(model="smol", extra_headers=headers, **options)
    assert first.headers.get("x-session-id") == name  # an unnamed conversation is answered without a name
    call = first.parse().output[0]
    history = [
        {"role": "user", "content": "Weather?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},  # type: ignore[union-attr]
    ]
    second = create(client, input=history, tools=[WEATHER], tool_choice="none", extra_headers=headers)
    assert second.output_text == "It is sunny." and forwarded(second)
    [session] = sessions_opened(pool, before)
    if name:
        assert pool.session_for(name, tenant=TENANT) is session
    assert [[s.handle_forwarded for s in t.steps] for t in session.stats.turns] == [[False, True]]


def test_the_sqlite_store_continues_a_chain_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"

    def one_life(call: Any) -> Any:
        """A server's whole life on the store file: a new engine, pool, door and store."""
        with (
            SqliteResponseStore(path) as store,
            HonestPairEngine(respond) as engine,
            SessionPool(engine=engine, max_tokens=64) as pool,
            FrontDoor(pool, model_name="smol", port=free_port(), store=store) as door,
            openai.OpenAI(base_url=door.url + "/v1", api_key="none", max_retries=0) as client,
        ):
            answer = call(client)
        assert engine.violations == []
        return answer

    first = one_life(lambda client: create(client, input="Hello", instructions="Be brief."))

    def continued(client: openai.OpenAI) -> list[Response]:
        second = create(client, input="Again", instructions="Be brief.", previous_response_id=first.id)
        third = create(client, input="Once more", instructions="Be brief.", previous_response_id=second.id)
        return [second, third]

    second, third = one_life(continued)
    forwarded = [r.model_extra["agentkv"]["stats"]["handle_forwarded"] for r in (second, third)]  # type: ignore[index]
    assert forwarded == [False, True]  # the first call after the restart recomputes; the next pushes back
    assert second.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]  # the whole conversation


def kept(response_id: str, conversation_id: str | None, text: str) -> StoredResponse:
    """A stored response of one user message (its response object: its id and text)."""
    return StoredResponse(
        response_id, conversation_id, ({"role": "user", "content": text},), {"id": response_id, "text": text}
    )


def test_the_stores_keep_what_they_are_given(tmp_path: Path) -> None:
    memory = MemoryResponseStore(max_responses=2)
    for number in range(3):
        memory.put(kept(f"r{number}", "c", str(number)))
    assert memory.get("r0") is None and len(memory) == 2
    assert memory.get("r2") == kept("r2", "c", "2")

    with SqliteResponseStore(tmp_path / "deep" / "store.sqlite3", max_responses=50) as sqlite:
        four_writers_on(sqlite)


def four_writers_on(store: ResponseStore) -> None:
    """Four threads keep 20 responses each in ``store`` (made with ``max_responses=50``): about the 50 newest stay
    (which ones depends on how the threads interleave), each reads back as it was given; then 50 written one after
    another push out every one of the 80."""

    def writer(number: int) -> None:
        for index in range(20):
            store.put(kept(f"w{number}-{index}", f"c{number}" if number % 2 else None, "x"))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    written = [(f"w{n}-{i}", f"c{n}" if n % 2 else None) for n in range(4) for i in range(20)]
    kept_now = [key for key, chain in written if (got := store.get(key)) is not None and got == kept(key, chain, "x")]
    held = [key for key, _ in written if store.get(key) is not None]
    assert kept_now == held  # whatever stayed reads back as it was given
    # A write drops the rows 50 or more behind its own number; a slower concurrent write can leave a few more.
    assert 50 <= len(held) <= 53, len(held)
    for index in range(50):
        store.put(kept(f"s-{index}", None, "y"))
    assert all(store.get(key) is None for key, _ in written)  # the oldest were dropped beyond max_responses
    assert all(store.get(f"s-{index}") == kept(f"s-{index}", None, "y") for index in range(50))
    assert store.get("missing") is None


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_deleted_response_is_gone_from_the_store(kind: str, tmp_path: Path) -> None:
    store: ResponseStore = MemoryResponseStore() if kind == "memory" else SqliteResponseStore(tmp_path / "s.sqlite3")
    with store:
        store.put(kept("a", None, "x"))
        store.put(kept("b", "named", "y"))
        assert store.delete("a") and store.get("a") is None
        assert not store.delete("a") and not store.delete("never")
        assert store.get("b") == kept("b", "named", "y")


def test_openai_agents_own_responses_model_runs_a_tool_agent(server: Server) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no network here
    cities: list[str] = []

    @function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"sunny in {city}"

    async def run() -> str:
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="k3y", max_retries=0) as client:
            agent = Agent(
                name="forecaster",
                instructions="Be brief.",
                tools=[weather],
                model=OpenAIResponsesModel(model="smol", openai_client=client),
                model_settings=ModelSettings(tool_choice="required"),
                tool_use_behavior="stop_on_first_tool",
            )
            result = await Runner.run(agent, "Weather in Paris?")
            return str(result.final_output)

    assert asyncio.run(run()) == "sunny in Paris" and cities == ["Paris"]


ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}


@pytest.mark.pair
def test_a_chain_on_the_real_pair_pulls_back_every_call(pair: EmbeddedPair) -> None:
    with (
        SessionPool(engine=pair, max_tokens=128, cache_salt="responses") as pool,
        FrontDoor(pool, model_name="smol", port=free_port()) as door,
        openai.OpenAI(base_url=door.url + "/v1", api_key="none", max_retries=0) as client,
    ):
        options: dict[str, Any] = {"instructions": "You add numbers.", "tools": [ADD]}
        first = create(client, input="What is 12 + 30?", tool_choice="required", **options)
        call = first.output[0]
        assert call.type == "function_call" and call.name == "add"
        total = sum(int(v) for v in json.loads(call.arguments).values())
        result = [{"type": "function_call_output", "call_id": call.call_id, "output": str(total)}]
        second = create(client, input=result, previous_response_id=first.id, tool_choice="none", **options)
        third = create(client, input="And 5 + 6?", previous_response_id=second.id, tool_choice="required", **options)
    stats = [r.model_extra["agentkv"]["stats"] for r in (first, second, third)]  # type: ignore[index]
    assert not stats[0]["handle_forwarded"]
    assert all(s["handle_forwarded"] for s in stats[1:])
    # calls 2+ pull from D, unless P's own cache left less than the pair's recompute threshold to pull (a short
    # answer before the new question): then nearly all of the prompt was still reused
    pulled = [(s["pulled_tokens"], s["miss_reason"]) for s in stats[1:]]
    assert stats[1]["pulled_tokens"] > 0, pulled
    assert all(n > 0 or reason == "below_threshold" for n, reason in pulled), pulled
    assert all(s["computed_tokens"] < s["prompt_tokens"] // 2 for s in stats[1:]), stats


@pytest.mark.parametrize("store", [None, "memory", "custom.sqlite3"])
def test_agentkv_serve_keeps_responses_where_told(
    store: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept: list[Any] = []
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path))
    argv = ["serve"] if store is None else ["serve", "--store", str(tmp_path / store) if "." in store else store]
    code, _, given = serve_with_doubles(
        monkeypatch, argv, while_serving=lambda door: kept.append(door["store"].get("anything"))
    )  # the store is open while the door serves
    assert code == 0
    if store == "memory":
        assert isinstance(given["store"], MemoryResponseStore)
    else:
        assert isinstance(given["store"], SqliteResponseStore)
        assert given["store"].path == tmp_path / (store or "serve.sqlite3")
    assert kept == [None]


def test_an_unstored_unnamed_request_goes_by_its_history(client: openai.OpenAI) -> None:
    """``store: false`` and no x-session-id: nothing can chain to it, so the pool matches it by its history."""
    first = create(client, input="Unstored question", store=False)
    history = [{"role": "user", "content": "Unstored question"}, first.output[0].model_dump(exclude_none=True)]
    second = create(client, input=[*history, {"role": "user", "content": "And?"}], store=False)
    assert second.model_extra["agentkv"]["stats"]["handle_forwarded"]  # type: ignore[index]


def test_a_kept_response_is_retrieved_as_it_was_returned(server: Server, client: openai.OpenAI) -> None:
    options: dict[str, Any] = {"input": "Hi", "tools": [WEATHER], "tool_choice": "required"}
    plain = client.responses.with_raw_response.create(model="smol", **options)
    returned = plain.http_response.json()
    assert client.responses.retrieve(returned["id"]).model_dump(exclude_unset=True) == returned
    raw = httpx.get(f"{server[0]}/v1/responses/{returned['id']}", headers={"authorization": "Bearer k3y"})
    assert raw.status_code == 200 and raw.json() == returned

    final = list(client.responses.create(model="smol", input="Hi", stream=True))[-1]
    assert final.type == "response.completed"
    assert client.responses.retrieve(final.response.id) == final.response  # the streamed items, ids and all


def test_a_deleted_response_can_be_neither_retrieved_nor_continued(server: Server, client: openai.OpenAI) -> None:
    first = create(client, input="Hi")
    second = create(client, input="Again", previous_response_id=first.id)
    client.responses.delete(first.id)  # the openai client reads no body from a delete: it raises on an error
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.retrieve(first.id)
    assert raised.value.status_code == 404 and raised.value.code == "response_not_found"
    assert first.id in raised.value.message
    with pytest.raises(openai.NotFoundError) as continued:
        create(client, input="More", previous_response_id=first.id)
    assert continued.value.code == "previous_response_not_found"
    assert forwarded(create(client, input="More", previous_response_id=second.id))  # the chain after it goes on

    url, key = f"{server[0]}/v1/responses/{second.id}", {"authorization": "Bearer k3y"}
    assert httpx.delete(url, headers=key).json() == {"id": second.id, "object": "response", "deleted": True}
    again = httpx.delete(url, headers=key)
    assert again.status_code == 404
    assert again.json() == {
        "error": {
            "message": f"Response with id {second.id!r} not found.",
            "type": "invalid_request_error",
            "param": None,
            "code": "response_not_found",
        }
    }


def test_unknown_and_unstored_responses_are_404s(server: Server, client: openai.OpenAI) -> None:
    unstored = create(client, input="Hi", store=False)
    for response_id in ("resp_nope", unstored.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(response_id)


def test_retrieve_options_that_ask_for_more_are_refused(server: Server, client: openai.OpenAI) -> None:
    first = create(client, input="Hi")
    key = {"authorization": "Bearer k3y"}
    for query in ({"stream": "true"}, {"include": "message.output_text.logprobs"}):
        answer = httpx.get(f"{server[0]}/v1/responses/{first.id}", params=query, headers=key)
        assert answer.status_code == 400 and next(iter(query)) in answer.json()["error"]["message"]
    assert httpx.get(f"{server[0]}/v1/responses/{first.id}", params={"stream": "false"}, headers=key).status_code == 200


def test_retrieve_and_delete_need_the_api_key(server: Server, client: openai.OpenAI) -> None:
    first = create(client, input="Hi")
    url = f"{server[0]}/v1/responses/{first.id}"
    for headers in ({}, {"authorization": "Bearer wrong"}):
        assert httpx.get(url, headers=headers).status_code == 401
        assert httpx.delete(url, headers=headers).status_code == 401
    assert client.responses.retrieve(first.id).id == first.id  # the refused delete kept it


def test_a_store_file_of_the_older_layout_is_replaced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A ``responses`` table from before responses were kept whole (and chains could be unnamed) does not stop the
    server: it is replaced by an empty one, other tables in the file are left alone, and chains work on it."""
    path = tmp_path / "serve.sqlite3"
    with sqlite3.connect(path) as old:
        old.execute(
            "CREATE TABLE responses (response_id TEXT PRIMARY KEY, conversation_id TEXT NOT NULL, messages TEXT NOT NULL)"
        )
        old.execute("INSERT INTO responses VALUES ('resp_old', 'resp_old', '[]')")
        old.execute("CREATE TABLE sessions (id TEXT)")
        old.execute("INSERT INTO sessions VALUES ('s1')")
    old.close()
    with caplog.at_level(logging.WARNING, logger="agentkv"), SqliteResponseStore(path) as store:
        assert "older layout" in caplog.text and "1 rows are dropped" in caplog.text
        assert store.get("resp_old") is None
        with (
            HonestPairEngine(respond) as engine,
            SessionPool(engine=engine, max_tokens=64) as pool,
            FrontDoor(pool, model_name="smol", port=free_port(), store=store) as door,
            openai.OpenAI(base_url=door.url + "/v1", api_key="none", max_retries=0) as client,
        ):
            first = create(client, input="Hello")
            second = create(client, input="Again", previous_response_id=first.id)
            assert forwarded(second) and client.responses.retrieve(second.id).id == second.id
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agentkv"), SqliteResponseStore(path) as reopened:
        assert reopened.get(second.id) is not None and caplog.text == ""  # the new layout is kept as it is
    with sqlite3.connect(path) as check:
        assert check.execute("SELECT id FROM sessions").fetchall() == [("s1",)]
    check.close()


def test_openai_agents_responses_model_without_previous_response_id_pushes_back() -> None:
    """openai-agents' own Responses model, unchained (it sends the whole history every call, no
    ``previous_response_id``, no session name): the call after the tool result lands on the first call's
    session, found by its history, and pushes its KV back."""
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no network here
    script = Script(json.dumps({"tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}]}), answer("Sunny."))

    @function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    async def run(url: str) -> tuple[str, list[Response]]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
            model = OpenAIResponsesModel(model="smol", openai_client=client)
            agent = Agent(name="forecaster", instructions="Be brief.", tools=[weather], model=model)
            result = await Runner.run(agent, "Weather in Paris?")
            kept = [await client.responses.retrieve(r.response_id or "") for r in result.raw_responses]
            return str(result.final_output), kept

    with (
        HonestPairEngine(script) as engine,
        SessionPool(engine=engine, max_tokens=64) as pool,
        FrontDoor(pool, model_name="smol", port=free_port()) as door,
    ):
        final, responses = asyncio.run(run(door.url))
        assert len(pool.sessions) == 1
    assert engine.violations == []
    assert final == "Sunny." and [r.previous_response_id for r in responses] == [None, None]
    assert [forwarded(r) for r in responses] == [False, True]
