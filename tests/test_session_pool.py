"""`SessionPool` and the adapters' shared `PooledModel`: whole conversations routed to their sessions.

Routing logic on `HonestPairEngine`, which checks every pushed-back handle; no model runs here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import agentkv
from agentkv import EngineError, Message, SessionPool, StepReply, UserError
from agentkv.integrations import PooledModel
from agentkv.testing import HonestPairEngine


def answer(request: Any) -> str:
    return "An answer of a few words."


@pytest.fixture
def pair() -> Iterator[HonestPairEngine]:
    with HonestPairEngine(answer) as engine:
        yield engine  # type: ignore[misc]
    assert engine.violations == []


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_interleaved_conversations_each_find_their_session(pair: HonestPairEngine) -> None:
    with SessionPool(engine=pair) as pool:
        a = [user("About apples?")]
        b = [user("About boats?")]
        a.append({"role": "assistant", "content": pool.step_sync(a).text})
        b.append({"role": "assistant", "content": pool.step_sync(b).text})
        a.append(user("More on apples?"))
        b.append(user("More on boats?"))
        second_a, second_b = pool.step_sync(a), pool.step_sync(b)
        assert len(pool.sessions) == 2
        assert second_a.stats.turn == second_b.stats.turn == 2
    assert second_a.stats.handle_forwarded and second_b.stats.handle_forwarded
    assert pair.live_pins == 0  # closing the pool released every pin


def test_a_named_conversation_keeps_its_session_and_refuses_a_second_step(pair: HonestPairEngine) -> None:
    with SessionPool(engine=pair) as pool:
        pool.step_sync([user("Hi")], conversation_id="c1")
        first = pool.session_for("c1")
        pool.step_sync([user("Hi")], conversation_id="c2")  # same text, another conversation
        assert pool.session_for("c2") is not first and len(pool.sessions) == 2
        pool.step_sync([user("Hi"), {"role": "assistant", "content": "x"}, user("Again")], conversation_id="c1")
        assert pool.session_for("c1") is first  # rebuilt (the history differs), on its own session

        async def two_at_once() -> None:
            async with asyncio.TaskGroup() as group:
                group.create_task(pool.step([user("slow")], conversation_id="c3"))
                await asyncio.sleep(0)
                group.create_task(pool.step([user("slow")], conversation_id="c3"))

        pair.inject("stall")
        with pytest.raises(ExceptionGroup) as info:
            asyncio.run(asyncio.wait_for(two_at_once(), timeout=30))
        assert info.group_contains(UserError, match="already running")


def test_sessions_beyond_the_limit_are_closed_least_recently_used_first(pair: HonestPairEngine) -> None:
    with SessionPool(engine=pair, max_sessions=2) as pool:
        for name in ("one", "two", "three"):
            pool.step_sync([user(name)], conversation_id=name)
        assert [pool.session_for(n) is not None for n in ("one", "two", "three")] == [False, True, True]
        assert pair.live_pins == 2  # the closed session's pin was released


def test_the_adapter_base_streams_the_answer_then_the_reply(pair: HonestPairEngine) -> None:
    model = PooledModel(engine=pair)

    async def collect() -> list[str | StepReply]:
        return [item async for item in model.stream([Message(role="user", content="Hi")])]

    try:
        items = asyncio.run(collect())
        assert isinstance(items[-1], StepReply) and "".join(str(i) for i in items[:-1]) == items[-1].text
        assert model.last_reply is items[-1] and len(model.stats) == 1
    finally:
        model.close()
    assert pair.is_open  # an engine given open is its owner's to close


async def _stream_left_early_then_failed(pool: SessionPool, pair: HonestPairEngine) -> None:
    await pool.step([user("Warm up")])  # the tokenizer loads
    pair.inject("stall")  # the step hangs after its first piece
    with anyio.fail_after(30):  # far below the stall: leaving cancels the step
        async with contextlib.aclosing(pool.stream([user("Hi")])) as items:
            assert isinstance(await anext(items), str)
    assert pair.steps[-1].outcome == "cancelled"  # unwound before the consumer went on
    assert len(pool.sessions) == 1  # the warm-up's: a cancelled first step keeps no session
    pair.inject("error_mid_stream")
    pieces: list[object] = []
    with pytest.raises(EngineError, match="mid-stream"):
        async for piece in pool.stream([user("Hi")]):
            pieces.append(piece)
    assert len(pieces) == 1 and isinstance(pieces[0], str)  # the text before the error came first
    assert isinstance([piece async for piece in pool.stream([user("Hi")])][-1], StepReply)  # the pool serves on


@pytest.mark.parametrize("where", ["on the pool's loop", "from another loop"])
def test_a_stream_left_early_cancels_its_step_and_one_that_fails_raises(where: str) -> None:
    async def on_the_pools_loop() -> None:
        async with HonestPairEngine(answer) as pair, SessionPool(engine=pair) as pool:
            await _stream_left_early_then_failed(pool, pair)
            assert pair.violations == []

    if where == "on the pool's loop":
        asyncio.run(on_the_pools_loop())
        return
    with HonestPairEngine(answer) as pair, SessionPool(engine=pair) as pool:
        asyncio.run(_stream_left_early_then_failed(pool, pair))
    assert pair.violations == []


def test_pool_arguments_are_checked_at_once() -> None:
    with pytest.raises(UserError):
        SessionPool(max_sessions=0)
    with pytest.raises(UserError):
        SessionPool(temperature=-1.0)
    with pytest.raises(UserError):
        PooledModel(pool=SessionPool(), max_tokens=3)
    with pytest.raises(UserError):
        PooledModel(temperature=-1.0)


@pytest.mark.parametrize("name", ["bogus", "stop", "engine_option"])
def test_a_name_that_is_no_session_option_is_refused_like_an_unknown_keyword(name: str) -> None:
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
        SessionPool(**{name: 1})
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
        PooledModel(**{name: 1})


def test_the_session_options_the_config_takes_are_the_session_s_keyword_arguments() -> None:
    import inspect

    from agentkv import Session
    from agentkv._session._session_config import SESSION_OPTIONS

    assert set(inspect.signature(Session).parameters) - {"engine"} == SESSION_OPTIONS


def test_import_agentkv_imports_no_framework() -> None:
    import subprocess
    import sys

    code = "import sys, agentkv, agentkv.integrations; print(json.dumps([m for m in ('agents', 'pydantic_ai', 'langchain_core') if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
    assert agentkv.SessionPool is SessionPool


def test_idle_sessions_are_closed_on_their_own_and_release_their_pins(pair: HonestPairEngine) -> None:
    with SessionPool(engine=pair, idle_ttl_s=0.4) as pool:
        pool.step_sync([user("Hi")])
        assert pair.live_pins == 1
        for _ in range(50):  # no request comes: the pool's reaper closes the session
            if not pool.sessions:
                break
            time.sleep(0.1)
        assert pool.sessions == [] and pair.live_pins == 0
