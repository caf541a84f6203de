"""Tool calls streamed as the model writes them (issue #28): vLLM's tool parsers chosen by name, `ToolCallDelta`
events in `Session.step` / `Session.stream`, and the argument deltas at the front door (chat completions and
Responses). Scripted engines stream token by token; no model runs here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from agentkv import Session, SessionPool, ToolCallDelta, UserError, tool
from agentkv._conversation._call_stream import SchemaCallStream
from streamed import TokenByToken, served
from test_tools_native import hermes_model


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def note(text: str, tags: list[str]) -> str:
    """Keep a note."""
    return text


@pytest.fixture
def tool_model(model_path: Path, tmp_path: Path) -> Path:
    """The bundled tokenizer with a Hermes tool template (no weights: the engine is scripted)."""
    return hermes_model(model_path, tmp_path)


def hermes(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def joined(deltas: list[ToolCallDelta]) -> dict[int, tuple[str, str, str]]:
    """Each call's (id, name, arguments' text joined), checking the order: id and name first, once."""
    calls: dict[int, tuple[str, str, str]] = {}
    for delta in deltas:
        if delta.index not in calls:
            assert delta.name is not None and delta.arguments == ""
            calls[delta.index] = (delta.id, delta.name, "")
        else:
            assert delta.name is None and delta.id == calls[delta.index][0]
            call_id, name, text = calls[delta.index]
            calls[delta.index] = (call_id, name, text + delta.arguments)
    return calls


# ----------------------------------------------------------------- choosing the parser


def test_an_unknown_parser_is_refused_with_the_names_there_are() -> None:
    with pytest.raises(UserError, match=r"tool_call_parser 'nope' is not one of vLLM's: .*hermes.*llama3_json"):
        Session(tools=[add], tool_format="native", tool_call_parser="nope")
    with pytest.raises(UserError, match=r"reasoning_parser 'nope' is not one of vLLM's: .*deepseek_r1"):
        Session(reasoning_parser="nope")
    with pytest.raises(UserError, match="tool_format='native'"):
        Session(tools=[add], tool_call_parser="hermes")  # the schema format forces JSON: no parser reads it
    with pytest.raises(UserError, match="tool_call_parser"):
        SessionPool(tools=[add], tool_format="native", tool_call_parser="nope")


def test_the_named_parser_reads_the_calls(tool_model: Path) -> None:
    """``pythonic`` reads a Python-style call list, which ``hermes`` (the default) takes for an answer."""
    raw = "[add(a=1, b=2)]"
    messages = [{"role": "user", "content": "1 + 2?"}]
    replies = {}
    for parser in (None, "pythonic"):
        with (
            TokenByToken(lambda request: raw, model_path=tool_model) as engine,
            Session(engine=engine, tools=[add], tool_format="native", tool_call_parser=parser) as session,
        ):
            replies[parser] = session.step_sync(messages)
    assert replies[None].tool_calls == [] and replies[None].text == raw
    assert [(c.name, c.arguments) for c in replies["pythonic"].tool_calls] == [("add", {"a": 1, "b": 2})]


def test_a_parser_that_does_not_fit_the_tokenizer_is_refused_at_open(tool_model: Path) -> None:
    """``llama3_json`` needs Llama 3's ``<|python_tag|>`` token, which the bundled tokenizer lacks."""
    with (
        TokenByToken(lambda request: "", model_path=tool_model) as engine,
        pytest.raises(UserError, match="llama3_json.*does not fit this model's tokenizer"),
        Session(engine=engine, tools=[add], tool_format="native", tool_call_parser="llama3_json"),
    ):
        pass  # never reached: opening refuses it


# ----------------------------------------------------------------- Session.step and Session.stream


@pytest.mark.parametrize("tool_format", ["native", "schema"])
def test_step_streams_each_calls_arguments_as_written(tool_model: Path, tool_format: str) -> None:
    calls = [("add", {"a": 12, "b": 30}), ("note", {"text": 'say "hi" }', "tags": ["x", "y"]})]
    if tool_format == "native":
        raw = "Let me see.\n" + "\n".join(hermes(name, arguments) for name, arguments in calls)
    else:
        raw = json.dumps({"tool_calls": [{"name": name, "arguments": arguments} for name, arguments in calls]})
    deltas: list[ToolCallDelta] = []
    texts: list[str] = []
    with (
        TokenByToken(lambda request: raw, model_path=tool_model) as engine,
        Session(engine=engine, tools=[add, note], tool_format=tool_format) as session,  # type: ignore[arg-type]
    ):
        reply = session.step_sync(
            [{"role": "user", "content": "Add and note."}], on_tool_call=deltas.append, on_text=texts.append
        )
    assert reply.finish_reason == "tool_calls" and reply.error is None
    streamed = joined(deltas)
    assert len(deltas) > 2 * len(calls)  # the arguments came in pieces, not whole
    assert [(c.id, c.name) for c in reply.tool_calls] == [(i, n) for i, n, _ in streamed.values()]
    assert [json.loads(text) for _, _, text in streamed.values()] == [c.arguments for c in reply.tool_calls]
    assert "tool_call" not in "".join(texts) and '"a"' not in "".join(texts)  # a call is never answer text


def test_stream_yields_the_call_deltas_before_the_call_runs(tool_model: Path) -> None:
    outputs = iter([hermes("add", {"a": 1, "b": 2}), "3."])
    with (
        TokenByToken(lambda request: next(outputs), model_path=tool_model) as engine,
        Session(engine=engine, tools=[add], tool_format="native") as session,
    ):
        events: list[Any] = []
        result = session.run_sync("1 + 2?", on_event=events.append)
    kinds = [e.kind for e in events]
    assert result.text == "3." and kinds.index("tool_call_delta") < kinds.index("tool_call")
    deltas = [e for e in events if e.kind == "tool_call_delta"]
    call = next(e.call for e in events if e.kind == "tool_call")
    assert joined(deltas)[0][:2] == (call.id, "add") and json.loads(joined(deltas)[0][2]) == call.arguments


def test_the_schema_reader_follows_the_json_in_any_pieces() -> None:
    raw = json.dumps(
        {"tool_calls": [{"arguments": {"q": [1, {"k": '}]"'}]}, "name": "later"}, {"name": "n", "arguments": {}}]}
    )
    for size in (1, 2, 5, len(raw)):
        reader = SchemaCallStream("c")
        pieces = [piece for start in range(0, len(raw), size) for piece in reader.feed(raw[start : start + size])]
        names = [(p.index, p.id, p.name) for p in pieces if p.name]
        texts = {p.index: "" for p in pieces}
        for p in pieces:
            texts[p.index] += p.arguments
        assert names == [(0, "c-0", "later"), (1, "c-1", "n")]  # the name first, even when written last
        assert {i: json.loads(t) for i, t in texts.items()} == {0: {"q": [1, {"k": '}]"'}]}, 1: {}}
    assert SchemaCallStream("c").feed(json.dumps({"answer": "no calls"})) == []


# ----------------------------------------------------------------- the front door


SPACED_CALL = '{"tool_calls": [{"name": "add", "arguments": {\n  "a": 2,\n  "b":3\n}}]}'
"""A schema-format call written with other spacing than ``json.dumps``'s."""


@pytest.fixture(params=["native", "schema"])
def door(tool_model: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A door whose model calls ``add(2, 3)``: in Hermes' format, or in the schema format spaced its own way."""
    written = hermes("add", {"a": 2, "b": 3}) if request.param == "native" else SPACED_CALL
    with served(lambda _: written, tool_model, tool_format=request.param) as url:
        yield url


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


def test_chat_streams_the_arguments_and_they_join_to_the_calls(door: str) -> None:
    with openai.OpenAI(base_url=door, api_key="none", max_retries=0) as client:
        messages: list[Any] = [{"role": "user", "content": "2 + 3?"}]
        pieces = []
        finish = None
        for part in client.chat.completions.create(model="smol", messages=messages, tools=[ADD], stream=True):
            pieces += part.choices[0].delta.tool_calls or []
            finish = part.choices[0].finish_reason or finish
        plain = client.chat.completions.create(model="smol", messages=messages, tools=[ADD])
    first, rest = pieces[0], pieces[1:]
    assert finish == "tool_calls" and len(rest) > 1  # index, id and name first; then the arguments in pieces
    assert first.index == 0 and first.id and first.function is not None and first.function.name == "add"
    assert all(p.id is None and p.function is not None and p.function.name is None for p in rest)
    arguments = "".join((p.function.arguments or "") for p in pieces if p.function is not None)
    unstreamed = plain.choices[0].message.tool_calls
    assert unstreamed is not None and arguments == unstreamed[0].function.arguments  # type: ignore[union-attr]
    assert json.loads(arguments) == {"a": 2, "b": 3}  # the text as written, streamed or not


def test_responses_stream_the_arguments_then_done(door: str) -> None:
    with openai.OpenAI(base_url=door, api_key="none", max_retries=0) as client:
        tool = {"type": "function", **ADD["function"]}
        events = list(client.responses.create(model="smol", input="2 + 3?", tools=[tool], stream=True))  # type: ignore[list-item]
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) > 1 and "".join(deltas) == done.arguments and json.loads(done.arguments) == {"a": 2, "b": 3}
    added = kinds.index("response.output_item.added")
    assert added < kinds.index("response.function_call_arguments.delta") < kinds.index("response.output_item.done")
    completed = events[-1]
    assert completed.type == "response.completed"
    item = completed.response.output[-1]
    assert item.type == "function_call" and item.arguments == done.arguments and item.name == "add"


def test_serve_flags_name_the_parsers(monkeypatch: pytest.MonkeyPatch) -> None:
    from serve_cli import serve_with_doubles

    code, pool, _ = serve_with_doubles(monkeypatch, ["serve", "--store", "memory"])
    assert code == 0 and "tool_call_parser" not in pool and "reasoning_parser" not in pool  # schema-forced calls
    flags = ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    code, pool, _ = serve_with_doubles(monkeypatch, ["serve", "--store", "memory", *flags])
    assert code == 0
    assert (pool["tool_format"], pool["tool_call_parser"], pool["reasoning_parser"]) == ("native", "hermes", "qwen3")
