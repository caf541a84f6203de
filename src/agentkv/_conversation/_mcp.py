"""MCP servers as tool sources: `MCPServer` connects to one through the official ``mcp`` client (stdio or streamable
HTTP) and gives its tools as `Tool` objects a `Session` or a `SessionPool` offers the model beside ``@tool`` functions.

The connection lives in a task of its own on the event loop the server was opened on (the ``mcp`` client's
transports hold task groups, which must close in the task that opened them); calls from another loop are sent to
it. The tools are listed when the server opens. A server that announces a changed list (``notifications/tools/
list_changed``, or the 2026-07-28 protocol's ``subscriptions/listen``) is listed again in that task, off any step,
and its `version` grows; a session takes the new list only at the start of its next turn or step (see
`agentkv._session._session_core`). Results map to the text the model reads (`tool_output`). ``mcp`` is imported when
a server opens (the ``mcp`` extra).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any

import anyio

from .._errors import SessionClosedError, UserError
from .._home import EventLoopHome
from .._lifecycle import Lifecycle, LifecycleState
from ._tools import Tool, ToolOutput, ToolSpec

__all__ = ["MCPServer", "close_sources", "open_sources", "source_tools", "tool_output"]

logger = logging.getLogger("agentkv")

_MAX_TOOLS = 256
"""The most tools one server may list (its pages are read until then; more is refused at open)."""
_MAX_PAGES = 100
_NAME_CHAR = re.compile(r"[^A-Za-z0-9_]")


class MCPServer(Lifecycle):
    """An MCP server whose tools a `Session` or a `SessionPool` offers the model (``tools=[server, my_function]``).

    Make one with `stdio` (a command the session starts, over its stdin and stdout) or `http` (a streamable HTTP
    endpoint), or from anything the ``mcp`` package's ``Client`` connects to (``MCPServer(target)``).

    Who closes it, as for engines: a server given unopened is opened by the session (or pool) when it opens, and
    closes with it; one given open (``with MCPServer.stdio(...) as server:``, ``async with``) is shared: sessions
    use it and its opener closes it. Its tools are listed when it opens.

    Args:
        target: what ``mcp.Client`` connects to: a URL (streamable HTTP), an ``mcp.StdioServerParameters``, an
            ``mcp`` transport, or an ``mcp`` server object in this process.
        prefix: prepended to each tool's name as the model sees it (``prefix_name``): for two servers whose tools
            share names. Names are made identifiers (``get-weather`` -> ``get_weather``); the server is called
            with its own.
        timeout_s: the most one tool call may take (its result is then an error the model reads, ``timeout``).
        open_timeout_s: the most connecting and listing the tools may take.
    """

    def __init__(
        self, target: Any, *, prefix: str | None = None, timeout_s: float = 60.0, open_timeout_s: float = 30.0
    ) -> None:
        super().__init__()
        if prefix is not None and (not prefix or _NAME_CHAR.search(prefix)):
            raise UserError(f"prefix {prefix!r} must be letters, digits and underscores")
        if not timeout_s > 0 or not open_timeout_s > 0:
            raise UserError("timeout_s and open_timeout_s must be positive")
        self._target = target
        self._headers: dict[str, str] | None = None
        self._prefix = prefix
        self._timeout_s = timeout_s
        self._open_timeout_s = open_timeout_s
        self._client: Any = None
        self._tools: dict[str, Tool] = {}
        self._remote: dict[str, str] = {}
        """Each tool's name on the server, by the name the model sees."""
        self.version = 0
        """How many times the server's tool list was taken (1 once open; more after announced changes)."""
        self._changed: anyio.Event | None = None
        self._stop: anyio.Event | None = None
        self._ended: anyio.Event | None = None

    @classmethod
    def stdio(
        cls,
        command: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        **options: Any,
    ) -> MCPServer:
        """A server the session starts as a process (``command args...``), spoken to over its stdin and stdout.
        Its stderr is this process's. It stops when the server closes. ``options``: those of `MCPServer`."""
        from mcp import StdioServerParameters

        return cls(
            StdioServerParameters(command=command, args=list(args), env=dict(env) if env else None, cwd=cwd), **options
        )

    @classmethod
    def http(cls, url: str, *, headers: Mapping[str, str] | None = None, **options: Any) -> MCPServer:
        """A server at a streamable HTTP endpoint (``http://host:port/mcp``); ``headers`` go with every request
        (``Authorization``...). ``options``: those of `MCPServer`."""
        server = cls(url, **options)
        server._headers = dict(headers) if headers else None
        return server

    def __repr__(self) -> str:
        return f"MCPServer({self._target!r})"

    # ----------------------------------------------------------------- what it serves

    @property
    def tools(self) -> list[Tool]:
        """Its tools as the model sees them (listed at open; again after the server announced a change)."""
        self._require_open()
        return list(self._tools.values())

    async def call(self, name: str, arguments: Mapping[str, Any]) -> ToolOutput:
        """Call a tool by the name the model sees; its result as the model reads it (`tool_output`). From any
        event loop: the call runs on the server's."""
        home = self._home
        if home is None or not home.is_current():
            if home is None or self._state is not LifecycleState.OPEN:
                raise SessionClosedError(f"{self!r} is {self._state.value}, not open")
            return await home.call_async(self.call, name, arguments)
        client = self._client
        if client is None:
            raise SessionClosedError(f"{self!r} is not connected (closed, or its connection ended)")
        remote = self._remote.get(name, name)
        result = await client.call_tool(remote, dict(arguments), read_timeout_seconds=self._timeout_s)
        return tool_output(result)

    def call_sync(self, name: str, arguments: Mapping[str, Any]) -> ToolOutput:
        """Blocking `call`, for a server on an event loop of its own (opened with ``with``, or by a session or a
        pool opened with ``with``)."""
        if self._home is None:
            raise SessionClosedError(f"{self!r} is not open")
        return self._home.call(self.call, name, arguments)

    # ----------------------------------------------------------------- lifecycle

    async def _open_resources(self) -> None:
        assert self._home is not None
        ready = anyio.Event()
        self._changed, self._stop, self._ended = anyio.Event(), anyio.Event(), anyio.Event()
        failure: list[BaseException] = []
        self._home.spawn(self._serve, ready, failure)
        try:
            with anyio.fail_after(self._open_timeout_s):
                await ready.wait()
        except TimeoutError:
            raise UserError(f"{self!r} did not answer within {self._open_timeout_s} s") from None
        if failure:
            raise UserError(f"{self!r} could not be opened: {_describe(failure[0])}") from failure[0]

    async def _close_resources(self) -> None:
        if self._stop is None or self._ended is None:
            return
        self._stop.set()
        with anyio.move_on_after(self._open_timeout_s):
            await self._ended.wait()

    async def _serve(self, ready: anyio.Event, failure: list[BaseException]) -> None:
        """The connection's task: connect, list, then watch for changes until the server closes."""
        try:
            async with AsyncExitStack() as stack:
                client = await stack.enter_async_context(self._client_of(stack))
                self._tools, self._remote = await _listed(client, self)
                self._client, self.version = client, 1
                async with anyio.create_task_group() as group:
                    group.start_soon(self._relist_on_change, client)
                    group.start_soon(self._listen, client)
                    ready.set()
                    assert self._stop is not None
                    await self._stop.wait()
                    group.cancel_scope.cancel()
        except Exception as exc:
            if not ready.is_set():
                failure.append(exc)
            else:
                logger.warning("agentkv: the connection to %r ended: %s", self, _describe(exc))
        finally:
            self._client = None
            ready.set()
            if self._ended is not None:
                self._ended.set()

    def _client_of(self, stack: AsyncExitStack) -> AbstractAsyncContextManager[Any]:
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        target = self._target
        if self._headers is not None:
            import httpx2

            http = httpx2.AsyncClient(headers=self._headers, timeout=httpx2.Timeout(30.0, read=300.0))
            stack.push_async_callback(http.aclose)
            target = streamable_http_client(target, http_client=http)
        return Client(target, message_handler=self._on_message)  # type: ignore[no-any-return]

    async def _on_message(self, message: Any) -> None:
        from mcp.types import ToolListChangedNotification

        if isinstance(message, ToolListChangedNotification) and self._changed is not None:
            self._changed.set()

    async def _listen(self, client: Any) -> None:
        """On 2026-07-28 connections a server announces changes to those who listen (older ones notify anyway)."""
        tools = client.server_capabilities.tools
        if tools is None or not tools.list_changed:
            return
        with contextlib.suppress(Exception):  # not offered: the notifications say it, if anything does
            async with client.listen(tools_list_changed=True) as subscription:
                async for _ in subscription:
                    if self._changed is not None:
                        self._changed.set()

    async def _relist_on_change(self, client: Any) -> None:
        while True:
            assert self._changed is not None
            await self._changed.wait()
            self._changed = anyio.Event()
            try:
                self._tools, self._remote = await _listed(client, self)
                self.version += 1
            except Exception as exc:  # the old list stays; calls to a gone tool come back as errors
                logger.warning("agentkv: %r announced new tools but listing them failed: %s", self, _describe(exc))

    # ----------------------------------------------------------------- making tools

    def _tool(self, listed: Any) -> Tool:
        name = _model_name(listed.name, self._prefix)
        parameters = {k: v for k, v in (listed.input_schema or {}).items() if k != "$schema"}
        parameters.setdefault("type", "object")
        description = listed.description or getattr(listed, "title", None) or f"The MCP tool {listed.name}."
        spec = ToolSpec(name=name, description=" ".join(description.split()), parameters=parameters)

        async def call(arguments: dict[str, Any]) -> ToolOutput:
            return await self.call(name, arguments)

        return Tool.of_schema(spec, call, timeout_s=self._timeout_s, source=self)


async def _listed(client: Any, server: MCPServer) -> tuple[dict[str, Tool], dict[str, str]]:
    """Every tool the server lists, page by page, as `Tool` objects by the name the model sees (and the names on
    the server, by the names the model sees)."""
    listed: list[Any] = []
    cursor: str | None = None
    for _ in range(_MAX_PAGES):
        page = await client.list_tools(cursor=cursor, cache_mode="refresh")
        listed += page.tools
        cursor = page.next_cursor
        if cursor is None or len(listed) > _MAX_TOOLS:
            break
    if len(listed) > _MAX_TOOLS:
        raise UserError(f"{server!r} lists more than {_MAX_TOOLS} tools")
    tools: dict[str, Tool] = {}
    remote: dict[str, str] = {}
    for item in listed:
        tool = server._tool(item)
        if tool.name in tools:
            raise UserError(f"{server!r}: two tools are named {tool.name!r} as the model sees them")
        tools[tool.name], remote[tool.name] = tool, item.name
    return tools, remote


def _model_name(name: str, prefix: str | None) -> str:
    """An MCP tool's name as the model sees it: an identifier, prefixed if asked."""
    made = _NAME_CHAR.sub("_", f"{prefix}_{name}" if prefix else name)
    if made[:1].isdigit():
        made = "_" + made
    if len(made) > 64:
        raise UserError(f"the MCP tool {name!r} has a name too long for a model (over 64 characters as {made!r})")
    return made


def _describe(exc: BaseException) -> str:
    """An error, the first of a group (the ``mcp`` client's task groups raise them)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


def tool_output(result: Any) -> ToolOutput:
    """An MCP ``CallToolResult`` as the text the model reads: its text blocks (a text resource's text), or, when it
    has none, its structured content as JSON; a binary block is named, not shown (the model reads text only). The
    result's ``isError`` makes it an error result (`ToolResult.error` ``error_result``)."""
    parts: list[str] = []
    for block in result.content:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource":
            resource = block.resource
            text = getattr(resource, "text", None)
            parts.append(text if isinstance(text, str) else f"[binary resource {resource.uri}, not shown]")
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
        else:
            parts.append(f"[{kind} content ({getattr(block, 'mime_type', 'unknown type')}), not shown]")
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured))
    return ToolOutput("\n".join(parts), error=bool(result.is_error))


# ----------------------------------------------------------------- sessions and pools


async def open_sources(sources: Sequence[MCPServer], home: EventLoopHome) -> list[MCPServer]:
    """Open the servers given unopened, on ``home`` (they are the caller's to close: returned); join the open ones.
    On failure the ones opened here are closed again."""
    opened: list[MCPServer] = []
    try:
        for server in sources:
            if server.state is LifecycleState.UNOPENED:
                await server.open(home=home)
                opened.append(server)
            elif server.state is LifecycleState.CLOSED:
                raise SessionClosedError(f"{server!r} is closed; give an open or a new one")
    except BaseException:
        with anyio.CancelScope(shield=True):
            await close_sources(opened)
        raise
    return opened


async def close_sources(servers: Sequence[MCPServer]) -> None:
    """Close the servers a session or a pool opened."""
    for server in servers:
        await server.aclose()


def source_tools(sources: Sequence[MCPServer]) -> tuple[dict[str, Tool], tuple[int, ...]]:
    """The tools of every server as they list them now, by the name the model sees, and the lists' versions."""
    tools: dict[str, Tool] = {}
    for server in sources:
        for tool in server.tools:
            if tool.name in tools:
                raise UserError(
                    f"two MCP servers serve a tool named {tool.name!r}; give one a prefix (MCPServer(..., prefix=...))"
                )
            tools[tool.name] = tool
    return tools, tuple(server.version for server in sources)
