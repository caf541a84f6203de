"""MCP servers' tools on the real pair: a 2-turn agent whose tools come from a real MCP server process
(tests/mcp_server.py) over stdio and one over streamable HTTP, turn 2 pulling the KV of turn 1 back from D; and
examples/mcp_agent.py. The logic on doubles: tests/test_mcp.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import mcp_server
from agentkv import EmbeddedPair, Session
from agentkv.mcp import MCPServer
from example_module import load_example

pytestmark = pytest.mark.pair

SERVER = str(Path(__file__).parent / "mcp_server.py")


def test_an_agent_calls_mcp_tools_over_stdio_and_http_on_the_pair(pair: EmbeddedPair) -> None:
    with mcp_server.http_process("--only", "add") as url:
        local = MCPServer.stdio(sys.executable, [SERVER, "--only", "owner_of"])
        remote = MCPServer.http(url)
        with Session(
            engine=pair,
            system="Answer from the tools' results, in one short sentence.",
            tools=[local, remote],
            tool_choice="required",
            max_steps=3,
            max_tokens=48,
            cache_salt="pair-mcp",
        ) as session:
            first = session.run_sync("Who owns the release project?")
            second = session.run_sync("What is 2 + 3?")
    steps = [*first.steps, *second.steps]
    results = [r for s in steps for r in s.tool_results]
    print([(c.name, c.arguments) for s in steps for c in s.tool_calls], [r.content for r in results])
    assert first.steps[0].tool_calls and second.steps[0].tool_calls  # each turn's first step called a tool
    assert {c.name for s in steps for c in s.tool_calls} <= {"owner_of", "add"}
    assert results and all(r.error is None for r in results)  # every call reached its server and came back
    assert {"owner_of", "add"} == {r.name for r in results}  # one server over stdio, the other over HTTP
    for step in steps[1:]:  # from step 2 on, each step pulls the KV of the step before back from D
        assert step.stats.handle_forwarded and step.stats.pulled_tokens > 0, step.stats
    assert second.steps[0].stats.pulled_tokens > 0  # turn 2 pulled turn 1's KV


def test_the_mcp_example_runs_on_the_pair(pair: EmbeddedPair, capsys: pytest.CaptureFixture[str]) -> None:
    results = load_example("mcp_agent").main(engine=pair)
    calls = [c for r in results for s in r.steps for c in s.tool_calls]
    assert [c.name for c in calls][:1] == ["read_file"]  # forced: the first step of each turn reads a file
    assert any("Dana" in t.content for r in results for s in r.steps for t in s.tool_results)
    assert results[1].steps[0].stats.pulled_tokens > 0
    assert "turn 2 answer:" in capsys.readouterr().out
