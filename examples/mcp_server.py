"""A small MCP server, written with the ``mcp`` package's server API: a release workspace's files.

examples/mcp_agent.py starts it over stdio (``python examples/mcp_server.py``); ``--http PORT`` serves the same
tools over streamable HTTP (``http://127.0.0.1:PORT/mcp``) for ``MCPServer.http``.
"""

import argparse
from typing import Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

WORKSPACE = {
    "notes.txt": "Release 2.4 ships on Friday. The release owner is Dana. Freeze starts Wednesday.",
    "todo.txt": "1. Fix test_login (401). 2. Update the changelog. 3. Tag the release.",
}

server = MCPServer("release-workspace", log_level="ERROR")


@server.tool()
def list_files() -> list[str]:
    """List the files in the workspace."""
    return sorted(WORKSPACE)


@server.tool()
def read_file(path: Literal["notes.txt", "todo.txt"]) -> str:
    """Return the text of a file in the workspace."""
    if path not in WORKSPACE:
        raise ToolError(f"no file {path!r}; the files are {', '.join(sorted(WORKSPACE))}")
    return WORKSPACE[path]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on this port (default: stdio)")
    args = parser.parse_args()
    if args.http is None:
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http)
