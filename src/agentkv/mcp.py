"""MCP servers as tool sources of a `Session` or a `SessionPool`, beside ``@tool`` functions (the ``mcp`` extra).

    from agentkv import Session
    from agentkv.mcp import MCPServer

    with Session(tools=[MCPServer.stdio("python", ["my_server.py"])]) as s:
        s.run_sync("...")

See docs/mcp.md: the transports (stdio, streamable HTTP), who closes a server, the tool list kept fixed for a
session, how results read to the model.
"""

from ._conversation._mcp import MCPServer
from ._conversation._tools import ToolOutput

__all__ = ["MCPServer", "ToolOutput"]

for _obj in (MCPServer, ToolOutput):
    _obj.__module__ = __name__  # documented (and shown) where users import them
