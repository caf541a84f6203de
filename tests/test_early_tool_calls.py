"""Tool calls start as soon as their arguments are complete in the stream (src/agentkv/_session/_tool_calls.py), on
doubles: the honest pair streams its output in two halves, with a stall between them on request."""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import pytest

from agentkv import Session, ToolCallEvent, tool
from agentkv._conversation._parsers import CallPiece
from agentkv._session._tool_calls import ToolRunner
from agentkv.testing import HonestPairEngine
from scripted import Script, answer
from spans import recording

STARTED: list[tuple[str, float]] = []


@tool
def look_up(key: str) -> str:
    """Look a key up."""
    STARTED.append((key, time.perf_counter()))
    return f"value of {key}"


def test_a_complete_call_starts_while_the_model_still_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    STARTED.clear()
    long_key = "k" * 400  # the second call's arguments fill the output's second half
    output = json.dumps(
        {
            "tool_calls": [
                {"name": "look_up", "arguments": {"key": "a"}},
                {"name": "look_up", "arguments": {"key": long_key}},
            ]
        }
    )
    seen: list[tuple[Any, float]] = []
    with recording() as recorded:
        with HonestPairEngine(Script(output, answer("Done.")), stall_s=1.0) as engine:
            with Session(engine=engine, tools=[look_up], max_tokens=512) as session:
                engine.inject("stall")  # between the halves of the first step's output
                result = session.run_sync("Look up a.", on_event=lambda e: seen.append((e, time.perf_counter())))
    calls = [(e, at) for e, at in seen if isinstance(e, ToolCallEvent)]
    assert [e.call.arguments["key"] for e, _ in calls] == ["a", long_key]
    assert [key for key, _ in STARTED] == ["a", long_key]  # each ran once
    halves = [at for e, at in seen if getattr(e, "kind", "") == "text_delta" and e.turn == 1 and e.step == 1]
    assert len(halves) == 2  # the double's two deltas, the stall between them
    assert STARTED[0][1] < halves[1]  # the first call ran while the model was still writing the second
    assert STARTED[1][1] > halves[1]  # the second could start only once it was written
    assert [r.content for r in result.steps[0].tool_results] == ["value of a", f"value of {long_key}"]
    spans = {dict(s.attributes or {})["gen_ai.tool.call.id"]: s for s in recorded.named("execute_tool")}
    early = {call_id: dict(s.attributes or {})["agentkv.tool.started_early"] for call_id, s in spans.items()}
    ids = [c.id for c in result.steps[0].tool_calls]
    assert early[ids[0]] is True  # started in the stall, before the second half came
    assert result.steps[0].stats.tool_s > 0


@tool
async def wait_forever(key: str) -> str:
    """Never returns."""
    await anyio.sleep_forever()
    return key


@pytest.mark.anyio
async def test_an_early_call_the_whole_output_does_not_hold_is_cancelled() -> None:
    runner = ToolRunner({"wait_forever": wait_forever, "look_up": look_up}, parent=None, early=True)
    runner.feed([CallPiece(0, "c-0", name="wait_forever"), CallPiece(0, "c-0", arguments='{"key": "x"')])
    assert runner.first_start is None  # not complete yet
    runner.feed([CallPiece(0, "c-0", arguments="}")])
    await anyio.sleep(0.05)
    assert runner.first_start is not None  # started
    with anyio.fail_after(10):
        assert await runner.results([]) == []  # the output held no call after all: cancelled, not awaited


@pytest.mark.anyio
async def test_calls_are_not_started_early_when_the_step_may_not_call() -> None:
    runner = ToolRunner({"look_up": look_up}, parent=None, early=False)
    runner.feed([CallPiece(0, "c-0", name="look_up", arguments='{"key": "x"}')])
    await anyio.sleep(0.05)
    assert runner.first_start is None
    unknown = ToolRunner({"look_up": look_up}, parent=None, early=True)
    unknown.feed([CallPiece(0, "c-0", name="nope", arguments="{}")])
    await anyio.sleep(0.05)
    assert unknown.first_start is None  # an unknown tool's error comes with the step's results
