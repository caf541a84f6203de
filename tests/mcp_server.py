"""An MCP server written with the ``mcp`` package's server API, for the tests: over stdio (``python
tests/mcp_server.py``) or streamable HTTP (``python tests/mcp_server.py --http PORT``); `build` makes it in process.

Its tools: `owner_of` (text from a small workspace), `add` (a structured result), `fail` (an error result),
`get-weather` (a name that is no identifier), `grow` (adds the tool `extra` and announces the changed list)."""

import argparse
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

WORKSPACE = {"release": "Dana", "docs": "Ravi"}


def build(only: set[str] | None = None) -> Any:
    """The server (``only``: the names of the tools it keeps)."""
    server: Any = MCPServer("agentkv-test", log_level="ERROR")

    def owner_of(project: Literal["release", "docs"]) -> str:
        """Who owns a project."""
        return WORKSPACE.get(project, f"no project named {project}")

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    def fail(why: str) -> str:
        """Always fails."""
        raise ToolError(f"failed: {why}")

    def weather(city: str) -> dict[str, str]:
        """The weather in a city."""
        return {"city": city, "sky": "sunny"}

    async def grow(ctx: Context) -> str:
        """Add the tool extra."""

        def extra(x: int) -> int:
            """Return x."""
            return x

        server.add_tool(extra)
        await ctx.notify_tools_changed()
        return "grown"

    tools = {"owner_of": owner_of, "add": add, "fail": fail, "get-weather": weather, "grow": grow}
    for name, function in tools.items():
        if only is None or name in only:
            server.add_tool(function, name=name)
    return server


@contextmanager
def http_process(*options: str, script: str = __file__) -> Iterator[str]:
    """This server (or another ``script`` that takes ``--http PORT``) in a process of its own over streamable HTTP;
    yields its URL, and stops it after."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    process = subprocess.Popen([sys.executable, script, "--http", str(port), *options], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the MCP server did not start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on this port (default: stdio)")
    parser.add_argument("--only", help="the tools to keep, comma-separated (default: all)")
    args = parser.parse_args()
    server = build(set(args.only.split(",")) if args.only else None)
    if args.http is None:
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
