"""MCP servers as tool sources (src/agentkv/_conversation/_mcp.py), on test doubles of the model: a real MCP server
process (tests/mcp_server.py, written with the ``mcp`` package's server API) over stdio and over streamable HTTP,
and the same server in process for the logic. The real pair calling them: tests/test_pair_mcp.py."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

import mcp_server
from agentkv import Message, Session, SessionClosedError, SessionPool, UserError, tool
from agentkv._conversation._mcp import tool_output
from agentkv.mcp import MCPServer, ToolOutput
from agentkv.testing import HonestPairEngine, ScriptedEngine
from scripted import Script, answer
from spans import parent_of, recording

SERVER = str(Path(__file__).parent / "mcp_server.py")


def calls(*called: tuple[str, dict[str, Any]]) -> str:
    return json.dumps({"tool_calls": [{"name": name, "arguments": arguments} for name, arguments in called]})


def _children() -> set[int]:
    """This process's live MCP server processes (tests/mcp_server.py)."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "mcp_server.py" in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.Error:  # gone meanwhile
            continue
    return found


def test_a_stdio_server_s_tools_are_listed_called_and_its_process_ends_with_the_session() -> None:
    script = [
        calls(
            ("owner_of", {"project": "release"}),
            ("add", {"a": 1, "b": 2}),
            ("fail", {"why": "on purpose"}),
            ("get_weather", {"city": "Paris"}),
            ("nope", {}),
        ),
        answer("Dana owns it."),
    ]
    with ScriptedEngine(script) as engine:
        with Session(engine=engine, tools=[MCPServer.stdio(sys.executable, [SERVER])]) as session:
            assert _children()  # the server runs as the session's child
            result = session.run_sync("Who owns the release?")
            tools = engine.requests[0].sampling.json_schema
    assert not _children()  # closing the session ended it
    results = {r.name: r for r in result.steps[0].tool_results}
    assert (results["owner_of"].content, results["owner_of"].error) == ("Dana", None)
    assert results["add"].content == "3"  # its text block (the structured result, {"result": 3}, says the same)
    assert results["fail"].error == "error_result" and "failed: on purpose" in results["fail"].content
    assert json.loads(results["get_weather"].content) == {"city": "Paris", "sky": "sunny"}  # get-weather on the server
    assert results["nope"].error == "unknown_tool"
    assert result.text == "Dana owns it."
    offered = {
        v["properties"]["name"]["const"] for v in tools["anyOf"][0]["properties"]["tool_calls"]["items"]["anyOf"]
    }
    assert offered == {"owner_of", "add", "fail", "get_weather", "grow"}


@pytest.fixture(scope="module")
def http_server() -> Iterator[str]:
    with mcp_server.http_process() as url:
        yield url


def test_a_streamable_http_server_opened_by_the_caller_is_shared_and_left_open(http_server: str) -> None:
    script = [
        calls(("ws_owner_of", {"project": "docs"})),
        answer("Ravi."),
        calls(("ws_add", {"a": 2, "b": 2})),
        answer("4."),
    ]
    with MCPServer.http(http_server, headers={"x-test": "1"}, prefix="ws") as server, ScriptedEngine(script) as engine:
        assert sorted(t.name for t in server.tools) == ["ws_add", "ws_fail", "ws_get_weather", "ws_grow", "ws_owner_of"]
        contents = []
        for asked in ("Who owns the docs?", "2 + 2?"):
            with Session(engine=engine, tools=[server]) as session:
                contents.append(session.run_sync(asked).steps[0].tool_results[0].content)
            assert server.is_open  # the caller's: the session left it open
        assert contents == ["Ravi", "4"]
    assert not server.is_open


def test_the_same_server_in_process_and_the_results_as_the_model_reads_them() -> None:
    text = SimpleNamespace(type="text", text="a line")
    image = SimpleNamespace(type="image", mime_type="image/png", data="AAAA")
    resource = SimpleNamespace(type="resource", resource=SimpleNamespace(uri="file:///x", text="its text"))
    binary = SimpleNamespace(type="resource", resource=SimpleNamespace(uri="file:///y", blob="AAAA"))
    read = tool_output(
        SimpleNamespace(content=[text, image, resource, binary], structured_content=None, is_error=False)
    )
    assert read == ToolOutput(
        "a line\n[image content (image/png), not shown]\nits text\n[binary resource file:///y, not shown]"
    )
    structured = SimpleNamespace(content=[], structured_content={"city": "Rome"}, is_error=True)
    assert tool_output(structured) == ToolOutput('{"city": "Rome"}', error=True)


def test_names_that_collide_and_choices_that_name_no_tool_are_refused_at_open() -> None:
    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    for tools, choice, said in (
        ([MCPServer(mcp_server.build()), add], "auto", "both named 'add'"),
        ([MCPServer(mcp_server.build()), MCPServer(mcp_server.build())], "auto", "give one a prefix"),
        ([MCPServer(mcp_server.build())], "not_a_tool", "tool_choice 'not_a_tool'"),
    ):
        with ScriptedEngine([]) as engine, pytest.raises(UserError, match=said):
            Session(engine=engine, tools=tools, tool_choice=choice).start()
    server = MCPServer(mcp_server.build())
    with pytest.raises(UserError, match="given twice"):
        Session(tools=[server, server])
    with pytest.raises(SessionClosedError):
        MCPServer(mcp_server.build()).tools  # noqa: B018  # not open: no tools to read


def test_a_forced_mcp_tool_and_a_changed_list_taken_at_the_next_turn() -> None:
    """The tool list stays the session's until the server announces a change; the next turn takes it, and its
    prompt changes from the system message on (the schema format's tool instructions): no pin extends it."""
    script = Script(calls(("grow", {})), answer("Grown."), calls(("extra", {"x": 7})), answer("7."))
    with HonestPairEngine(script) as engine:
        with Session(engine=engine, tools=[MCPServer(mcp_server.build())], tool_choice="grow") as session:
            first = session.run_sync("Grow.")
            assert "extra(" not in session.messages[0].content  # not within the turn that grew it
            second = session.run_sync("Use extra with 7.")
            assert "extra(" in session.messages[0].content  # the system message's tool instructions
    assert first.steps[0].tool_results[0].content == "grown"
    assert second.steps[0].tool_results[0].content == "7"
    assert second.steps[0].stats.miss_reason == "prefix_mismatch"  # the tools are rendered at the prompt's head
    forced = script.requests[0].sampling.json_schema["properties"]["tool_calls"]["items"]["anyOf"]
    assert [call["properties"]["name"]["const"] for call in forced] == ["grow"]  # tool_choice named an MCP tool
    assert engine.violations == []


def test_a_pool_offers_a_servers_tools_and_its_caller_runs_them() -> None:
    script = Script(calls(("owner_of", {"project": "release"})), answer("Dana."))
    server = MCPServer(mcp_server.build())
    with HonestPairEngine(script) as engine, SessionPool(engine=engine, tools=[server]) as pool:
        history: list[Any] = [Message(role="user", content="Who owns the release?")]
        reply = pool.step_sync(history, conversation_id="c1")
        (call,) = reply.tool_calls
        output = server.call_sync(call.name, call.arguments)
        assert output == ToolOutput("Dana")
        history += [reply.message, Message(role="tool", tool_call_id=call.id, content=output.content)]
        assert pool.step_sync(history, conversation_id="c1").text == "Dana."
        assert server.is_open
    assert not server.is_open  # the pool opened it: it closed with the pool


@pytest.mark.anyio
async def test_tool_spans_of_an_mcp_call_and_the_servers_own_spans_under_them() -> None:
    script = Script(calls(("add", {"a": 20, "b": 22})), answer("42."))
    with recording() as recorded:
        async with (
            HonestPairEngine(script) as engine,
            Session(engine=engine, tools=[MCPServer(mcp_server.build())]) as s,
        ):
            result = await s.run("20 + 22?")
    assert result.steps[0].tool_results[0].content == "42"
    (tool_span,) = recorded.named("execute_tool")
    assert dict(tool_span.attributes or {})["gen_ai.tool.type"] == "extension"
    below = [span for span in recorded.spans if parent_of(span) == tool_span.context.span_id]
    assert below  # the mcp client's own span of the call hangs under agentkv's


def test_a_server_that_cannot_start_is_refused_at_open_and_one_that_dies_gives_error_results() -> None:
    with ScriptedEngine([]) as engine, pytest.raises(UserError, match="could not be opened"):
        Session(engine=engine, tools=[MCPServer.stdio("/nonexistent/mcp-server")]).start()
    script = [calls(("owner_of", {"project": "release"})), answer("It is gone.")]
    with ScriptedEngine(script) as engine:
        with Session(engine=engine, tools=[MCPServer.stdio(sys.executable, [SERVER], timeout_s=20)]) as session:
            for pid in _children():
                psutil.Process(pid).kill()
            result = session.run_sync("Who owns the release?")  # the turn goes on: the model reads the error
    (failed,) = result.steps[0].tool_results
    assert failed.error in ("raised", "timeout"), failed
    assert result.text == "It is gone."
    assert not _children()
