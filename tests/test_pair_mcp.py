"""MCP servers' tools on the real pair: examples/mcp_agent.py, a 2-turn agent whose tools come from a real MCP
server process (examples/mcp_server.py, written with the ``mcp`` package's server API), over stdio and over
streamable HTTP; each turn calls the server's tool, and turn 2 pulls the KV of turn 1 back from D. The logic on
doubles, with tests/mcp_server.py: tests/test_mcp.py."""

from __future__ import annotations

import contextlib

import pytest

import mcp_server
from agentkv import EmbeddedPair
from example_module import EXAMPLES, load_example

pytestmark = pytest.mark.pair


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_the_mcp_agent_calls_its_servers_tools_on_the_pair(
    pair: EmbeddedPair, transport: str, capsys: pytest.CaptureFixture[str]
) -> None:
    served = mcp_server.http_process(script=str(EXAMPLES / "mcp_server.py"))
    with served if transport == "http" else contextlib.nullcontext() as url:
        results = load_example("mcp_agent").main(engine=pair, url=url, cache_salt=f"mcp-{transport}")
    for result in results:  # each turn's first step called the server's tool (maybe twice), which answered
        calls = result.steps[0].tool_calls
        assert calls and all(c.name == "read_file" and c.arguments["path"] in ("notes.txt", "todo.txt") for c in calls)
        answered = result.steps[0].tool_results
        assert len(answered) == len(calls) and all(r.error is None and r.content for r in answered)
    assert any("Dana" in r.steps[0].tool_results[0].content for r in results)
    steps = [step for result in results for step in result.steps]
    for step in steps[1:]:  # from step 2 on, each step pulls the KV of the step before back from D
        assert step.stats.handle_forwarded and step.stats.pulled_tokens > 0, step.stats
    assert results[1].steps[0].stats.pulled_tokens > 0  # turn 2 pulled turn 1's KV
    assert "turn 2 answer:" in capsys.readouterr().out
