"""Pins a session gives up are released on D (`Engine.release`), and a pin it still may use is kept.

Issue 12: D's cache filled with pins that waited 480 s for their expiry after a session closed,
rewound or was edited. These tests use a scripted engine that hands out pins of its own (no NIXL
handle inside: any engine's pins obey the same rule) and records what was released.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentkv import ContextLengthError, Event, Session
from agentkv._engines import StepEvent
from agentkv.engines import Pin, StepDone, StepRequest
from agentkv.testing import ScriptedEngine


class PinningEngine(ScriptedEngine):
    """A scripted engine that keeps KV: every step returns a pin; `release` is recorded."""

    def __init__(self, outputs: list[str], **options: Any) -> None:
        super().__init__(outputs, **options)
        self.issued: list[Pin] = []
        self.released: list[Pin] = []

    push_back = True

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        async for event in super().step(request):
            if isinstance(event, StepDone):
                held = len(request.prompt_token_ids) + len(event.token_ids) - 1
                pin = Pin(tokens=held, expires_at=time.perf_counter() + 3600, ref=request.request_id)
                self.issued.append(pin)
                event = dataclasses.replace(event, pin=pin)
            yield event

    async def release(self, pin: Pin) -> None:
        self.released.append(pin)


def _forwarded(engine: PinningEngine) -> list[Pin | None]:
    return [request.pin for request in engine.requests]


def test_a_forwarded_pin_is_not_released_and_the_last_one_is_released_at_close() -> None:
    engine = PinningEngine(["Paris.", "Rome."])
    with Session(engine=engine) as session:
        session.run_sync("Capital of France?")
        session.run_sync("And Italy?")
        assert _forwarded(engine) == [None, engine.issued[0]]
        assert engine.released == []  # the first pin went to P; the second is still the session's
    assert engine.released == [engine.issued[1]]


def test_closing_a_session_on_a_shared_engine_releases_its_pin() -> None:
    with PinningEngine(["Paris."]) as engine:
        with Session(engine=engine) as session:
            session.run_sync("Capital of France?")
        assert engine.is_open and engine.released == engine.issued


@pytest.mark.parametrize("edit", ["rewind", "replace"])
def test_an_edit_releases_the_pin_it_invalidates(edit: str) -> None:
    with PinningEngine(["Paris.", "Rome.", "Madrid."]) as engine, Session(engine=engine) as session:
        session.run_sync("Capital of France?")
        session.run_sync("And Italy?")
        if edit == "rewind":
            session.rewind()
        else:
            session.replace_message(0, "Capital of Spain?")
        session.run_sync("And Spain?")  # by now the release has run (it is also flushed before a turn)
        assert engine.issued[1] in engine.released
        assert _forwarded(engine)[2] is None  # nothing forwarded after the edit


def test_a_turn_that_is_not_kept_releases_its_new_pin() -> None:
    def stop_at_the_end(event: Event) -> None:
        if event.kind == "turn_end":
            raise RuntimeError("no")

    with PinningEngine(["Paris.", "Rome.", "Madrid."]) as engine, Session(engine=engine) as session:
        session.run_sync("Capital of France?")
        with pytest.raises(RuntimeError):
            session.run_sync("And Italy?", on_event=stop_at_the_end)
        session.run_sync("And Spain?")
        assert _forwarded(engine) == [None, engine.issued[0], None]  # the first pin was used once
        assert engine.issued[1] in engine.released


def test_a_turn_refused_before_any_step_keeps_the_pin() -> None:
    with PinningEngine(["Paris.", "Rome."], max_model_len=256) as engine, Session(engine=engine) as session:
        session.run_sync("Capital of France?")
        with pytest.raises(ContextLengthError):
            session.run_sync("word " * 300)
        session.run_sync("And Italy?")
        assert _forwarded(engine) == [None, engine.issued[0]] and engine.released == []
