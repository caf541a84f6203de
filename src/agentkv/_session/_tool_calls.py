"""The tool calls of one step of `Session.run`, each started as soon as its arguments are complete in the stream.

The model writes a step's calls one after the other, and the turn loop reads them while they stream (the schema
format's JSON, or a vLLM tool parser's deltas: `agentkv._session._answer_text.StepStream`). A call whose name is one
of the session's tools and whose arguments' text already parses as a whole JSON object cannot change any more: it
starts then, while the model still writes the next call or closes its output, instead of after the step. When the
step ends, its calls as read from the whole output take the result of the call started for them (the same id, name
and arguments); any other call runs then. A call started early that the whole output does not hold (the output was
cut by ``max_tokens`` into malformed JSON) has run, but its result is dropped. Every call runs in an
``execute_tool`` span (src/agentkv/_session/_tracing.py) when the application configured OpenTelemetry.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import anyio
from opentelemetry.context import Context

from .._conversation._parsers import CallPiece
from .._conversation._tools import Tool, ToolCall, ToolResult, run_tool_call
from .._stats._telemetry import sdk_configured
from ._tracing import tool_result, tool_span

__all__ = ["ToolRunner"]


@dataclass
class _Written:
    """A call as written so far."""

    id: str
    name: str | None = None
    arguments: str = ""
    started: bool = False


class ToolRunner:
    """One step's tool calls: `feed` it the call pieces as they stream (it starts the complete ones when ``early``),
    then `results` gives the step's results in call order. `close` cancels what still runs."""

    def __init__(self, tools: Mapping[str, Tool], *, parent: Context | None, early: bool) -> None:
        self._tools = tools
        self._parent = parent
        self._early = early
        self._written: dict[int, _Written] = {}
        self._started: dict[str, tuple[ToolCall, asyncio.Task[ToolResult]]] = {}
        self.first_start: float | None = None
        """When the step's first call started (``time.perf_counter``)."""

    def feed(self, pieces: Sequence[CallPiece]) -> None:
        """Call pieces the stream made certain; a call complete with them starts now."""
        if not self._early:
            return
        for piece in pieces:
            written = self._written.setdefault(piece.index, _Written(piece.id))
            if piece.name is not None:
                written.name = piece.name
            written.arguments += piece.arguments
            if not written.started and written.name in self._tools and written.arguments.rstrip().endswith("}"):
                self._start_if_complete(written)

    def _start_if_complete(self, written: _Written) -> None:
        try:
            arguments = json.loads(written.arguments)
        except json.JSONDecodeError:
            return  # a "}" inside the arguments: more to come
        if not isinstance(arguments, dict) or written.name is None:
            return
        written.started = True
        call = ToolCall(id=written.id, name=written.name, arguments=arguments, raw_arguments=written.arguments)
        task = asyncio.get_running_loop().create_task(self._run(call, early=True))
        self._started[call.id] = (call, task)

    async def _run(self, call: ToolCall, *, early: bool) -> ToolResult:
        if self.first_start is None:
            self.first_start = time.perf_counter()
        found = self._tools.get(call.name)
        kind = "extension" if found is not None and found.source is not None else "function"
        if not sdk_configured():  # no span: nothing would record it
            return await run_tool_call(call, self._tools)
        with tool_span(call, kind=kind, parent=self._parent, early=early) as span:
            result = await run_tool_call(call, self._tools)
            tool_result(span, result)
        return result

    async def results(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """The results of the step's calls, in order: a call started early gives its result, the others run now
        (concurrently). Early calls the step does not hold are cancelled."""
        results: list[ToolResult | None] = [None] * len(calls)
        kept: set[str] = set()

        async def one(index: int, call: ToolCall) -> None:
            started = self._started.get(call.id)
            if started is not None and started[0] == call:
                kept.add(call.id)
                results[index] = await started[1]
            else:
                results[index] = await self._run(call, early=False)

        async with anyio.create_task_group() as group:
            for index, call in enumerate(calls):
                group.start_soon(one, index, call)
        await self.close(keep=kept)
        return [result for result in results if result is not None]

    async def close(self, *, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """Cancel the calls started early that are not in ``keep`` and wait for them to end."""
        tasks = [task for call_id, (_, task) in self._started.items() if call_id not in keep and not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)
