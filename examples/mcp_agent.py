"""An agent whose tools come from an MCP server: two turns on the embedded pair.

The session starts examples/mcp_server.py (an MCP server written with the ``mcp`` package) over stdio, lists its
tools once, and the model calls them; each step prints its TTFT and where its prompt's KV came from. Turn 2 pulls
the KV of turn 1 back from D. With ``--http URL`` the tools come from a server over streamable HTTP instead
(``python examples/mcp_server.py --http 8765`` serves the same ones at ``http://127.0.0.1:8765/mcp``).

Run: .venv/bin/python examples/mcp_agent.py   (needs the ``mcp`` extra: pip install "agentkv-vllm[mcp]")
"""

import argparse
import sys
from pathlib import Path

from agentkv import Session, TurnResult
from agentkv.engines import Engine
from agentkv.mcp import MCPServer

SERVER = Path(__file__).with_name("mcp_server.py")


def main(engine: Engine | None = None, *, url: str | None = None, cache_salt: str | None = None) -> list[TurnResult]:
    """Run two turns; with ``engine=`` on an open engine (the tests pass theirs, and a ``cache_salt`` per run so
    that a run's KV does not serve the next one's), else on a new pair."""
    server = MCPServer.http(url) if url else MCPServer.stdio(sys.executable, [str(SERVER)])
    with Session(
        engine=engine,
        system="You are a release assistant. Answer from the files, in one short sentence.",
        tools=[server],  # opened with the session, closed with it (its process ends)
        tool_choice="read_file",  # each turn's first step reads a file; the second answers
        max_steps=2,
        max_tokens=96,
        cache_salt=cache_salt,
    ) as session:
        results = [
            session.run_sync("Who is the release owner, according to notes.txt?"),
            session.run_sync("What is the first item of todo.txt?"),
        ]
    for number, result in enumerate(results, start=1):
        calls = [f"{call.name}({call.arguments})" for step in result.steps for call in step.tool_calls]
        pulled = sum(step.stats.pulled_tokens for step in result.steps)
        ttfts = ", ".join(f"{step.stats.ttft_s:.3f}" for step in result.steps)
        print(
            f"turn {number}: tools {', '.join(calls) or '-'}; TTFT per step {ttfts} s; KV pulled back {pulled} tokens"
        )
        print(f"turn {number} answer: {result.text}")
    return results


if __name__ == "__main__":  # vLLM spawns processes that re-import this module
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--http", metavar="URL", help="an MCP server's streamable HTTP endpoint (default: stdio)")
    main(url=parser.parse_args().http)
