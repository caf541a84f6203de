"""A renewed pin travels between doors on the real pair (tests/test_pins_travel.py has the logic on doubles).

Two pools stand for two doors: each drives the suite's launched pair (tests/conftest.py) through a `RemotePair` of
its own, with a `PostgresSessionStore` of its own on one real server (tests/postgres_server.py). A session gives
its pin back only while it is more than ``expiry_margin_s`` from its expiry; a margin of 100 s on the launched
pair's 120 s pins has the renewal due about 18 s after a step, so a pause of 26 s needs it. Door A's renewal
takes its offered pin back off the conversation's row and offers the new one; door B, taking the conversation's
lease after the pause, pushes that one back and P pulls the KV from D. The answers are one door's.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any

import pytest

from agentkv import LaunchedPair, PostgresSessionStore, RemotePair, SessionPool, StepReply
from test_pins_travel import offered, pulled

pytestmark = pytest.mark.pair

MARGIN_S = 100.0
PAUSE_S = 26.0


RENEWAL_WAIT_S = 60.0
"""How long past the pause the test waits for door A's renewal to be offered. The renewal starts about 18 s after
the step; on a busy machine its one-token step on the launched pair took longer than the pause's last 8 s (a CI run
found the old pin still offered at 26 s). The renewed pin lives ``pin_ttl_s`` from its own step, so door B, stepping
as soon as it is offered, finds it well outside the margin however long the wait was."""


def renewal(url: str, conversation: str, first: str | None) -> str | None:
    """The pin the conversation's row offers once door A's renewal replaced ``first`` (``first`` or None when
    none came within `RENEWAL_WAIT_S`)."""
    deadline = time.monotonic() + RENEWAL_WAIT_S
    found = offered(url, conversation)
    while found in (None, first) and time.monotonic() < deadline:
        time.sleep(0.2)
        found = offered(url, conversation)
    return found


def test_a_pin_renewed_on_one_door_is_pulled_on_the_other(launched: LaunchedPair, postgres_url: str) -> None:
    assert launched.config.pin_ttl_s - MARGIN_S < PAUSE_S  # without a renewal the pin is inside the margin
    options: dict[str, Any] = {"system": "Be brief.", "max_tokens": 8, "temperature": 0, "expiry_margin_s": MARGIN_S}
    messages: list[dict[str, Any]] = []

    def ask(pool: SessionPool, text: str) -> StepReply:
        messages.append({"role": "user", "content": text})
        reply = pool.step_sync(messages, conversation_id="c1")
        messages.append({"role": "assistant", "content": reply.text})
        return reply

    with ExitStack() as stack:
        doors = [
            stack.enter_context(
                SessionPool(
                    engine=RemotePair(*launched.urls, warmup=False),
                    store=stack.enter_context(PostgresSessionStore(postgres_url)),
                    **options,
                )
            )
            for _ in range(2)
        ]
        ask(doors[0], "Name a colour.")
        assert pulled(ask(doors[0], "Another one?"))
        first = offered(postgres_url, "c1")
        time.sleep(PAUSE_S)  # the first pin is inside the margin now: door B could not push it back
        renewed = renewal(postgres_url, "c1", first)
        assert renewed not in (None, first)  # door A renewed its pin and offered the new one
        moved = ask(doors[1], "And a third?")
        assert pulled(moved), moved.stats
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    alone: list[dict[str, Any]] = []
    with SessionPool(engine=launched, **options) as pool:
        for question in [m["content"] for m in messages if m["role"] == "user"]:
            alone.append({"role": "user", "content": question})
            alone.append({"role": "assistant", "content": pool.step_sync(alone, conversation_id="c1").text})
    assert [m["content"] for m in alone if m["role"] == "assistant"] == answers
