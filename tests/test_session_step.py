"""`Session.step`: one model call over caller-made messages, tools run by the caller.

Loop logic on test doubles (`HonestPairEngine` checks every pushed-back handle against the
token-exact rule); the real pair runs the same loop in test_pair_step.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agentkv import InvalidMessageError, Message, Session, ToolSpec, UserError, tool
from agentkv.testing import HonestPairEngine, ScriptedEngine
from scripted import Script

WEATHER = ToolSpec(
    name="weather",
    description="The weather in a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
OPENAI_WEATHER = {"type": "function", "function": WEATHER.model_dump()}


SCRIPT = (
    json.dumps({"tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}]}),
    json.dumps({"answer": "It is sunny in Paris."}),
    json.dumps({"answer": "You are welcome."}),
)


@pytest.fixture
def script() -> Script:
    return Script(*SCRIPT)


@pytest.fixture
def pair(script: Script) -> Iterator[HonestPairEngine]:
    with HonestPairEngine(script) as engine:
        yield engine  # type: ignore[misc]
    assert engine.violations == []


def as_openai(message: Message) -> dict[str, Any]:
    """What an OpenAI client keeps for a message agentkv returned."""
    data: dict[str, Any] = {"role": message.role, "content": message.content or None}
    if message.tool_calls:
        data["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in message.tool_calls
        ]
    return data


def test_a_client_run_tool_loop_extends_the_history_and_pushes_back(pair: HonestPairEngine, script: Script) -> None:
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    with Session(engine=pair) as session:
        first = session.step_sync(history, tools=[OPENAI_WEATHER])
        assert first.finish_reason == "tool_calls" and first.text == ""
        (call,) = first.tool_calls
        assert (call.name, call.arguments) == ("weather", {"city": "Paris"})
        history += [as_openai(first.message), {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        second = session.step_sync(history, tools=[OPENAI_WEATHER])
        assert (second.finish_reason, second.text) == ("stop", "It is sunny in Paris.")
        history += [as_openai(second.message), {"role": "user", "content": "Thanks!"}]
        third = session.step_sync(history, tools=[OPENAI_WEATHER])
        assert third.text == "You are welcome."
        stats = session.stats
    assert [(s.turn, s.step) for t in stats.turns for s in t.steps] == [(1, 1), (1, 2), (2, 1)]
    assert [r.forwarded for r in pair.steps] == [False, True, True]
    assert [s.miss_reason for t in stats.turns for s in t.steps] == ["no_handle", None, None]
    # the model's outputs kept their generated ids: each prompt extends the last prompt + output exactly
    prompts = [list(r.prompt_token_ids) for r in script.requests]
    outputs = [r.output_token_ids for r in pair.steps]
    for before, output, after in zip(prompts, outputs, prompts[1:], strict=False):
        assert after[: len(before) + len(output)] == before + output


def test_the_tool_result_reads_as_session_run_gives_it(tokenizer: Any) -> None:
    """The same conversation through `run` (tools run by the session) and `step` (by the caller): same prompts."""

    @tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    outputs = [
        json.dumps({"tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}]}),
        json.dumps({"answer": "Sunny."}),
    ]
    with ScriptedEngine(list(outputs)) as engine, Session(engine=engine, system="Be brief.", tools=[weather]) as s:
        s.run_sync("Weather in Paris?")
        by_run = [list(r.prompt_token_ids) for r in engine.requests]
    with ScriptedEngine(list(outputs)) as engine, Session(engine=engine, system="Be brief.") as s:
        history: list[Any] = [Message(role="user", content="Weather in Paris?")]
        reply = s.step_sync(history, tools=[weather])
        history += [reply.message, Message(role="tool", tool_call_id=reply.tool_calls[0].id, content="sunny")]
        assert s.step_sync(history, tools=[weather]).text == "Sunny."
        by_step = [list(r.prompt_token_ids) for r in engine.requests]
    assert by_step == by_run


def test_history_that_does_not_extend_is_rebuilt_and_never_pushes_back(pair: HonestPairEngine) -> None:
    with Session(engine=pair) as session:
        first = session.step_sync([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER])
        call = first.tool_calls[0]
        edited = {"role": "user", "content": "Weather in Rome?"}  # the caller changed its first message
        session.step_sync(
            [edited, as_openai(first.message), {"role": "tool", "tool_call_id": call.id, "content": "rain"}],
            tools=[WEATHER],
        )
        steps = [s for t in session.stats.turns for s in t.steps]
    assert pair.violations == []
    assert steps[-1].miss_reason == "prefix_mismatch" and steps[-1].pulled_tokens == 0
    assert [(s.turn, s.step) for s in steps] == [(1, 1), (2, 1)]


def test_a_new_tool_list_re_renders_the_conversation(pair: HonestPairEngine) -> None:
    with Session(engine=pair) as session:
        first = session.step_sync([{"role": "user", "content": "Weather?"}], tools=[WEATHER])
        history = [
            {"role": "user", "content": "Weather?"},
            as_openai(first.message),
            {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny"},
        ]
        other = WEATHER.model_copy(update={"description": "Today's weather."})
        assert not session.extends(history, tools=[other]) and session.extends(history, tools=[WEATHER])
        session.step_sync(history, tools=[other])
        last = session.stats.turns[-1].steps[-1]
    assert last.miss_reason == "prefix_mismatch"


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "non-empty"),
        ([{"role": "wizard", "content": "hi"}], "role"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "text"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "model's"),
        ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "x", "content": "1"}], "answer"),
        ([{"role": "system", "content": "only"}], "no user"),
    ],
)
def test_malformed_messages_are_refused_and_nothing_is_lost(
    pair: HonestPairEngine, messages: list[Any], error: str
) -> None:
    with Session(engine=pair) as session:
        with pytest.raises(InvalidMessageError, match=error):
            session.step_sync(messages)
        assert session.token_ids == [] and session.stats.turns == []
        assert session.step_sync([{"role": "user", "content": "hi"}], tools=[WEATHER]).tool_calls


def bad_tool_result(first: Any) -> list[Any]:
    call = first.tool_calls[0]
    return [{"role": "tool", "tool_call_id": call.id, "content": "sunny \ud800"}]


def bad_arguments(first: Any) -> list[Any]:
    result = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny"}
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "\\udfff"}'}}
    return [result, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "?"}]


@pytest.mark.parametrize(
    ("bad", "where"),
    [
        (lambda first: [{"role": "user", "content": "More? \udc00"}], "message 3: its content"),
        (bad_tool_result, "message 3: its content"),
        (bad_arguments, "message 4: its tool call 'c1''s arguments"),
    ],
)
def test_text_no_tokenizer_takes_is_an_invalid_message_naming_it(
    pair: HonestPairEngine, bad: Callable[[Any], list[Any]], where: str
) -> None:
    history: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    with Session(engine=pair) as session:
        first = session.step_sync(history, tools=[WEATHER])
        history.append(as_openai(first.message))
        before = (session.token_ids, session.messages, session.stats)
        with pytest.raises(InvalidMessageError, match=re.escape(where) + " is not valid Unicode text"):
            session.step_sync([*history, *bad(first)], tools=[WEATHER])
        assert (session.token_ids, session.messages, session.stats) == before
        result = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny"}
        second = session.step_sync([*history, result], tools=[WEATHER])  # usable, and its pin was kept
        assert second.text == "It is sunny in Paris." and second.stats.handle_forwarded
        with pytest.raises(InvalidMessageError, match="message 0: its content"):
            session.step_sync([{"role": "system", "content": "\ud800"}, {"role": "user", "content": "hi"}])
        bad_tool = {"type": "function", "function": {"name": "w", "description": "\ud800"}}
        with pytest.raises(UserError, match="tool 'w': its description or parameters are not valid Unicode"):
            session.step_sync([{"role": "user", "content": "hi"}], tools=[bad_tool])
        with pytest.raises(UserError, match="tool 'w': its description"):
            Session(engine=pair, tools=[tool(name="w", description="\ud800")(lambda: "x")])
        assert session.stats.turns[-1].steps[-1] == second.stats


def test_bad_tools_and_settings_are_user_errors(pair: HonestPairEngine, script: Script) -> None:
    user = [{"role": "user", "content": "hi"}]
    with Session(engine=pair) as session:
        with pytest.raises(UserError, match="twice|two tools"):
            session.step_sync(user, tools=[WEATHER, WEATHER])
        with pytest.raises(UserError, match="tool_choice"):
            session.step_sync(user, tools=[WEATHER], tool_choice="nope")
        with pytest.raises(UserError, match="function tools"):
            session.step_sync(user, tools=[{"type": "web_search"}])
        with pytest.raises(UserError, match="max_tokens"):
            session.step_sync(user, max_tokens=0)
        with pytest.raises(UserError, match="temperature"):
            session.step_sync(user, temperature=-1.0)
        forced = session.step_sync(
            user, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}}
        )
    assert forced.tool_calls and script.requests[-1].sampling.json_schema is not None


def test_answers_stream_as_text_equal_to_the_reply() -> None:
    answer = 'Line one\nsays "hi" \u00e9 \U0001f600 done'
    with ScriptedEngine([json.dumps({"answer": answer}), "  plain  "]) as engine, Session(engine=engine) as session:
        pieces: list[str] = []
        reply = session.step_sync([{"role": "user", "content": "hi"}], tools=[WEATHER], on_text=pieces.append)
        assert "".join(pieces) == reply.text == answer
        plain: list[str] = []
        history = [{"role": "user", "content": "hi"}, as_openai(reply.message), {"role": "user", "content": "again"}]
        second = session.step_sync(history, tools=[], on_text=plain.append)
        assert "".join(plain) == second.text == "  plain  "  # as written: vLLM's server strips nothing


@pytest.mark.parametrize(
    ("shape", "raw", "answer"),
    [
        ("json", json.dumps({"answer": 'a "q" \\ \u00e9 \U0001f600\nb'}), 'a "q" \\ \u00e9 \U0001f600\nb'),
        ("json", json.dumps({"tool_calls": [{"name": "weather", "arguments": {}}]}), ""),
        ("plain", "  two words \n", "  two words \n"),  # as written: vLLM's server strips nothing
        ("native", "Sure.\n<tool_call>\n{}\n</tool_call>", "Sure.\n"),
        ("native", "a <tool_cal b", "a <tool_cal b"),
    ],
)
def test_answer_text_fed_a_character_at_a_time_gives_only_the_answer(shape: Any, raw: str, answer: str) -> None:
    from agentkv._session._answer_text import AnswerText

    reader = AnswerText(shape)
    given = "".join(reader.feed(char) for char in raw)
    assert answer.startswith(given) and (given == answer or shape == "native")
