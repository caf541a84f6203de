"""The tool loop on the real pair: the KV of every step is pushed back, not only every turn."""

from __future__ import annotations

import json

import pytest

from agentkv import EmbeddedPair, Message, Session, tool
from example_module import load_example

pytestmark = pytest.mark.pair


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _assert_pulled_from_step_two(steps: list) -> None:  # type: ignore[type-arg]
    assert len(steps) >= 2
    for step in steps:
        stats = step.stats
        assert stats.local_hit_tokens + stats.pulled_tokens + stats.computed_tokens == stats.prompt_tokens
    for step in steps[1:]:
        assert step.stats.handle_forwarded and step.stats.pulled_tokens > 0, step.stats


def test_every_step_of_a_tool_turn_pulls_back_the_step_before(pair: EmbeddedPair) -> None:
    # A salt of its own: the docs' snippets run the same conversation on the shared pair (README.md), and P's
    # cache would then hold most of each step, leaving less than the recompute threshold to pull.
    with Session(
        engine=pair, tools=[add], tool_choice="required", max_steps=3, max_tokens=48, cache_salt="pair-tools-pull"
    ) as session:
        result = session.run_sync("What is 1234 + 4321?")
        after = session.run_sync("Thanks. And 1 + 1?")  # the next turn continues the pinned tokens
    first = result.steps[0]
    assert first.tool_calls and first.tool_calls[0].name == "add"
    assert isinstance(first.tool_calls[0].arguments.get("a"), int)  # schema-forced: a valid call
    _assert_pulled_from_step_two(result.steps)
    assert result.text
    assert after.steps[0].stats.pulled_tokens > 0


def test_the_tools_example_runs_end_to_end(pair: EmbeddedPair, capsys: pytest.CaptureFixture[str]) -> None:
    result = load_example("tools_agent").main(engine=pair)
    called = [step for step in result.steps if step.tool_calls]
    assert called and called[0].tool_calls[0].name == "read_file"  # forced: a call that parses, maybe after retries
    assert any("Dana" in r.content for step in called for r in step.tool_results)
    _assert_pulled_from_step_two(result.steps)
    assert "answer:" in capsys.readouterr().out


def test_a_tool_loop_the_caller_runs_equals_the_one_the_session_runs(pair: EmbeddedPair) -> None:
    """`Session.step` with the caller running `add` gives the answers `Session.run` gives, and pushes back."""
    question = "What is 1234 + 4321?"
    apart = "by-step"  # P's cache of the run must not serve the steps: they pull from D or compute
    with Session(engine=pair, tools=[add], tool_choice="required", max_steps=3, max_tokens=48) as session:
        by_run = session.run_sync(question)
    history: list[Message] = [Message(role="user", content=question)]
    replies = []
    with Session(engine=pair, max_tokens=48, cache_salt=apart) as session:
        for choice in ("required", "auto", "none"):  # what run does: forced once, then free, the last must answer
            reply = session.step_sync(history, tools=[add], tool_choice=choice)
            replies.append(reply)
            history.append(reply.message)
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                history.append(Message(role="tool", tool_call_id=call.id, content=json.dumps(add(**call.arguments))))
    assert [r.step.text for r in replies] == [s.text for s in by_run.steps]
    assert replies[-1].text == by_run.text
    _assert_pulled_from_step_two([r.step for r in replies])
