"""The session's configuration: validated once (every mistake a `UserError`), copied whole by `fork`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import test_tools_native
from agentkv import InvalidMessageError, Session, UserError, tool
from agentkv.testing import ScriptedEngine

tool_model = test_tools_native.tool_model  # the fixture: the bundled tokenizer with a tool template


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.mark.parametrize(
    "options",
    [
        {"max_tokens": "10"},
        {"max_tokens": 0},
        {"max_tokens": True},
        {"max_steps": 2.5},
        {"temperature": -0.5},
        {"temperature": float("nan")},
        {"expiry_margin_s": -1.0},
        {"expiry_margin_s": float("inf")},
        {"seed": "7"},
        {"cache_salt": 3},
        {"tools": "add"},
        {"tool_choice": "sub", "tools": [add]},
        {"mode": "fast"},
    ],
)
def test_argument_mistakes_are_user_errors(options: dict[str, Any]) -> None:
    with pytest.raises(UserError):
        Session(**options)


def test_valid_numbers_are_taken() -> None:
    config = Session(temperature=1, expiry_margin_s=0, max_tokens=1, max_steps=1)._config  # ints for floats
    assert (config.temperature, config.expiry_margin_s, config.max_tokens, config.max_steps) == (1.0, 0.0, 1, 1)


@pytest.mark.parametrize("text", ["bad \ud800 text", 42])
def test_text_that_no_tokenizer_takes_is_an_invalid_message(text: object) -> None:
    with pytest.raises(InvalidMessageError):
        Session(system=text)  # type: ignore[arg-type]
    with ScriptedEngine(["Paris.", "Rome."]) as engine, Session(engine=engine) as session:
        with pytest.raises(InvalidMessageError):
            session.run_sync(text)  # type: ignore[arg-type]
        session.run_sync("Capital of France?")
        with pytest.raises(InvalidMessageError):
            session.replace_message(0, text)  # type: ignore[arg-type]
        assert [m.content for m in session.messages] == ["Capital of France?", "Paris."]


def test_rewind_and_replace_take_whole_numbers_only() -> None:
    with ScriptedEngine(["Paris."]) as engine, Session(engine=engine) as session:
        session.run_sync("Capital of France?")
        for bad in ("1", 1.0, True, None):
            with pytest.raises(UserError):
                session.rewind(bad)  # type: ignore[arg-type]
            with pytest.raises(UserError):
                session.replace_message(bad, "x")  # type: ignore[arg-type]
        assert len(session.messages) == 2


def test_replacing_the_system_message_keeps_the_tool_instructions() -> None:
    answer = json.dumps({"answer": "3"})
    with ScriptedEngine([answer, answer]) as engine, Session(engine=engine, tools=[add], system="Old.") as session:
        original = session.messages[0].content
        instructions = original.removeprefix("Old.")
        assert "add" in instructions
        session.replace_message(0, "New.")
        assert session.messages[0].content == "New." + instructions
        session.replace_message(0, session.messages[0].content.replace("New.", "Newer."))  # not appended twice
        assert session.messages[0].content == "Newer." + instructions
        session.run_sync("1 + 2?")
        from transformers import AutoTokenizer

        prompt = AutoTokenizer.from_pretrained(str(engine.info.model_path)).decode(engine.requests[0].prompt_token_ids)
        assert prompt.count(instructions.strip()) == 1


def test_a_fork_keeps_the_whole_configuration(tool_model: Path) -> None:
    with (
        ScriptedEngine(["Hello.", "Hi again."], model_path=tool_model) as engine,
        Session(
            engine=engine, tools=[add], tool_format="native", max_tokens=7, temperature=0.5, seed=3, cache_salt="t"
        ) as session,
    ):
        session.run_sync("Hello?")
        fork = session.fork()
        fork.run_sync("Again?")
        parent_request, fork_request = engine.requests
        assert fork_request.sampling.json_schema is None  # native tools: no forced JSON in the fork either
        assert (fork_request.sampling.temperature, fork_request.sampling.seed) == (0.5, 3)
        assert fork_request.sampling.max_tokens == 7 and fork_request.cache_salt == "t"
        assert list(fork_request.prompt_token_ids[: len(parent_request.prompt_token_ids)]) == list(
            parent_request.prompt_token_ids
        )
        fork.close()


def test_stats_stay_aligned_with_the_turns_when_a_fork_rewinds_past_its_fork_point() -> None:
    with ScriptedEngine(["one", "two", "three", "four"]) as engine, Session(engine=engine) as session:
        session.run_sync("1")
        session.run_sync("2")
        fork = session.fork()
        assert [t.turn for t in fork.stats.turns] == [1, 2]  # the fork's conversation has two turns
        fork.run_sync("3")
        fork.rewind(2)  # back past the fork point
        assert [t.turn for t in fork.stats.turns] == [1]
        assert [m.content for m in fork.messages] == ["1", "one"]
        result = fork.run_sync("again")
        assert result.stats.turn == 2 and [t.turn for t in fork.stats.turns] == [1, 2]
        assert [t.turn for t in session.stats.turns] == [1, 2]  # the parent is untouched
        fork.close()
