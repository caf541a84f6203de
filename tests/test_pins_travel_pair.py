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
        time.sleep(PAUSE_S)
        renewed = offered(postgres_url, "c1")
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
