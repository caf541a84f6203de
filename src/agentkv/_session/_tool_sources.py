"""The MCP servers among a session's (or a pool's) tools, and the tools it takes from them.

A server given unopened is opened with its session or pool, and closes with it; one given open is shared. Their
tools join the configuration when the session opens (`ToolSources.open`); a server that announced a changed list
(its `MCPServer.version` grew) has its new tools taken only where the session asks (`ToolSources.newer`: at the
start of a turn or a step, src/agentkv/_session/_session_core.py says what that costs).
"""

from __future__ import annotations

from .._conversation._mcp import MCPServer, close_sources, open_sources, source_tools
from .._home import EventLoopHome
from ._session_config import SessionConfig

__all__ = ["ToolSources"]


class ToolSources:
    """The servers a session or a pool opened, and the versions of the tool lists its configuration holds."""

    def __init__(self) -> None:
        self._own: list[MCPServer] = []
        self._versions: tuple[int, ...] = ()

    async def open(self, config: SessionConfig, home: EventLoopHome) -> SessionConfig:
        """Open (or join) ``config``'s servers: ``config`` with their tools."""
        if not config.tool_sources:
            return config
        self._own = await open_sources(config.tool_sources, home)
        return self._taken(config)

    def newer(self, config: SessionConfig) -> SessionConfig | None:
        """``config`` with its servers' tools as they list them now, if one announced a change since (else None).
        A `UserError` or `SessionClosedError` when they cannot be taken (a clash of names, a closed server)."""
        sources = config.tool_sources
        if not sources or tuple(server.version for server in sources) == self._versions:
            return None
        return self._taken(config)

    def _taken(self, config: SessionConfig) -> SessionConfig:
        listed, versions = source_tools(config.tool_sources)
        taken = config.with_source_tools(listed)
        self._versions = versions
        return taken

    async def close(self) -> None:
        """Close the servers opened here."""
        own, self._own = self._own, []
        await close_sources(own)
