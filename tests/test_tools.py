"""Tools and the tool loop, on the scripted engine (loop logic only; the real pair is in test_pair_tools.py)."""

from __future__ import annotations

import json
from typing import Any, Literal

import anyio
import pytest
from pydantic import BaseModel

from agentkv import Session, Tool, UserError, tool
from agentkv._conversation._call_stream import parse_output
from agentkv._conversation._tools import output_schema
from agentkv.engines import StepRequest
from agentkv.testing import ScriptedEngine


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


@tool
def broken(path: str) -> str:
    """Always fails."""
    raise FileNotFoundError(path)


@tool(timeout_s=0.2)
async def hang() -> str:
    """Never returns in time."""
    await anyio.sleep(30)
    return "late"


@tool
def opaque() -> object:
    """Returns something that is not JSON."""
    return object()


TOOLS = [add, broken, hang, opaque]


def calls(*pairs: tuple[str, dict[str, Any]]) -> str:
    return json.dumps({"tool_calls": [{"name": name, "arguments": arguments} for name, arguments in pairs]})


def answer(text: str) -> str:
    return json.dumps({"answer": text})


def test_schema_and_description_come_from_the_signature_and_docstring() -> None:
    assert isinstance(add, Tool) and add.name == "add" and add.description == "Add two integers."
    assert add.parameters["required"] == ["a", "b"]
    assert add.parameters["properties"]["a"] == {"description": "the first number.", "title": "A", "type": "integer"}
    assert add(2, 3) == 5  # still callable


def test_definition_mistakes_raise_at_declaration() -> None:
    def untyped(x):  # type: ignore[no-untyped-def]
        """Identity."""
        return x

    with pytest.raises(UserError, match="type hint"):
        tool(untyped)

    def variadic(*args: int) -> int:
        """Sum."""
        return sum(args)

    with pytest.raises(UserError, match=r"\*args"):
        tool(variadic)

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(UserError, match="description"):
        tool(undocumented)
    assert tool(description="Identity.")(undocumented).description == "Identity."
    with pytest.raises(UserError, match="two tools"):
        Session(tools=[add, tool(name="add", description="Another.")(undocumented)])
    with pytest.raises(UserError, match="tool_choice"):
        Session(tools=[add], tool_choice="subtract")


def test_the_loop_runs_calls_and_feeds_results_back() -> None:
    with (
        ScriptedEngine([calls(("add", {"a": 1234, "b": 4321})), answer("5555")]) as engine,
        Session(engine=engine, tools=[add]) as session,
    ):
        result = session.run_sync("What is 1234 + 4321?")
    assert result.text == "5555" and result.stop_reason == "answer"
    first, second = result.steps
    assert [c.name for c in first.tool_calls] == ["add"] and first.tool_results[0].content == "5555"
    assert second.tool_calls == []
    # step 2's prompt extends step 1's prompt and output exactly, then the tool message
    prompt_1, prompt_2 = (list(r.prompt_token_ids) for r in engine.requests)
    assert prompt_2[: len(prompt_1) + len(first.token_ids)] == prompt_1 + first.token_ids
    assert [m.role for m in session.messages][-4:] == ["user", "assistant", "tool", "assistant"]
    assert json.loads(session.messages[-2].content) == {"name": "add", "result": "5555"}


def test_several_calls_in_one_step_run_concurrently() -> None:
    """Each call waits until all three are in flight: only concurrent calls can all get there."""
    in_flight: list[str] = []
    everyone: list[anyio.Event] = []

    @tool
    async def rendezvous(name: str) -> int:
        """Wait for the other calls."""
        if not everyone:
            everyone.append(anyio.Event())
        in_flight.append(name)
        if len(in_flight) == 3:
            everyone[0].set()
        with anyio.move_on_after(10):
            await everyone[0].wait()
        return len(in_flight)

    script = [calls(*[("rendezvous", {"name": n}) for n in "abc"]), answer("ok")]
    with ScriptedEngine(script) as engine, Session(engine=engine, tools=[rendezvous]) as session:
        result = session.run_sync("meet")
    assert [r.content for r in result.steps[0].tool_results] == ["3", "3", "3"]
    assert [r.call_id for r in result.steps[0].tool_results] == ["t1s1-0", "t1s1-1", "t1s1-2"]  # call order kept


def test_errors_go_back_to_the_model_and_the_turn_goes_on() -> None:
    script = [
        calls(
            ("add", {"a": 1, "b": "two"}),
            ("subtract", {"a": 1}),
            ("broken", {"path": "x"}),
            ("hang", {}),
            ("opaque", {}),
        ),
        "this is not JSON",
        answer("recovered"),
    ]
    with ScriptedEngine(script) as engine, Session(engine=engine, tools=TOOLS) as session:
        result = session.run_sync("try everything")
    assert result.text == "recovered"
    errors = [r.error for r in result.steps[0].tool_results]
    assert errors == ["invalid_arguments", "unknown_tool", "raised", "timeout", "unserializable"]
    assert "b: Input should be a valid integer" in result.steps[0].tool_results[0].content
    assert "FileNotFoundError" in result.steps[0].tool_results[2].content
    assert result.steps[1].tool_results[0].error == "malformed_output"


def test_the_step_bound_forces_an_answer() -> None:
    script = [calls(("add", {"a": 1, "b": 1})), calls(("add", {"a": 2, "b": 2})), answer("4")]
    with ScriptedEngine(script) as engine, Session(engine=engine, tools=[add], max_steps=3) as session:
        result = session.run_sync("keep adding")
        assert result.stop_reason == "max_steps" and result.text == "4" and len(result.steps) == 3
        last_schema = engine.requests[-1].sampling.json_schema
        assert last_schema is not None and "tool_calls" not in json.dumps(last_schema)
        assert session.messages[-1].role == "assistant"  # consistent: ready for the next user message


def test_tool_choice_shapes_the_first_step_only() -> None:
    def schema(request: StepRequest) -> dict[str, Any]:
        assert request.sampling.json_schema is not None
        return request.sampling.json_schema

    with (
        ScriptedEngine([calls(("add", {"a": 1, "b": 1})), answer("2")]) as engine,
        Session(engine=engine, tools=[add, opaque], tool_choice="add") as session,
    ):
        session.run_sync("add")
    forced, free = (schema(r) for r in engine.requests)
    assert "answer" not in json.dumps(forced) and '"const": "opaque"' not in json.dumps(forced)
    assert "anyOf" in free and "answer" in json.dumps(free)
    assert output_schema({"add": add.spec}, "required")["required"] == ["tool_calls"]
    assert output_schema({"add": add.spec}, "none")["required"] == ["answer"]


def test_parse_output_cases() -> None:
    assert parse_output(answer("hi"), call_prefix="c") == ([], "hi", None)
    parsed, _, error = parse_output(calls(("add", {"a": 1, "b": 2})), call_prefix="c")
    assert error is None and parsed[0].id == "c-0" and parsed[0].arguments == {"a": 1, "b": 2}
    assert parse_output("{", call_prefix="c")[2] is not None
    assert parse_output("{}", call_prefix="c")[2] is not None


def test_literal_arguments_become_an_enum() -> None:
    @tool
    def read(path: Literal["a.txt", "b.txt"]) -> str:
        """Read a file."""
        return path

    assert read.parameters["properties"]["path"]["enum"] == ["a.txt", "b.txt"]


def test_stream_events_name_the_tool_calls() -> None:
    kinds: list[str] = []
    with (
        ScriptedEngine([calls(("add", {"a": 1, "b": 2})), answer("3")]) as engine,
        Session(engine=engine, tools=[add]) as session,
    ):
        session.run_sync("add", on_event=lambda event: kinds.append(event.kind))
    called = ["tool_call_delta", "tool_call_delta", "tool_call"]  # the call's name, its arguments, then the call
    assert kinds == ["text_delta", *called, "tool_result", "step_end", "text_delta", "step_end", "turn_end"]


class Point(BaseModel):
    x: int
    y: int


def test_nested_argument_types_keep_their_definitions_at_the_root() -> None:
    """A pydantic argument type is a ``$ref`` into ``$defs``; the forced output schema must resolve it."""

    @tool
    def plot(point: Point) -> str:
        """Plot a point."""
        return "ok"

    import jsonschema

    schema = output_schema({"plot": plot.spec}, "auto")
    assert "Point" in schema["$defs"]

    valid = {"tool_calls": [{"name": "plot", "arguments": {"point": {"x": 1, "y": 2}}}]}
    jsonschema.validate(valid, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": [{"name": "plot", "arguments": {"point": {"x": "one"}}}]}, schema)
