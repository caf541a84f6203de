"""`EngineGroup`: several pairs as one engine, each conversation kept on the pair that holds its pin.

Logic on `HonestPairEngine`s (each checks every handle pushed back to it: a handle sent to a
pair that did not issue it is a violation); no model runs here.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from agentkv import EngineDeadError, EngineGroup, Session, SessionPool, UserError
from agentkv.engines import Engine
from agentkv.testing import HonestPairEngine


def answer(request: Any) -> str:
    return "A short answer."


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def two_turns(pool: SessionPool, name: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [user(f"About {name}?")]
    messages.append({"role": "assistant", "content": pool.step_sync(messages, conversation_id=name).text})
    messages.append(user("More?"))
    second = pool.step_sync(messages, conversation_id=name)
    assert second.stats.handle_forwarded
    messages.append({"role": "assistant", "content": second.text})
    return messages


def test_conversations_spread_over_the_pairs_and_stay_on_theirs() -> None:
    pairs = [HonestPairEngine(answer), HonestPairEngine(answer)]
    group = EngineGroup(pairs)
    with SessionPool(engine=group) as pool:
        assert group.live == 2 and group.info.details["engines"] == 2
        for name in ("a", "b", "c", "d"):
            two_turns(pool, name)
    assert all(len(pair.steps) == 4 for pair in pairs)  # sequential steps: in-flight ties go to the first
    for pair in pairs:
        pair.assert_honest()  # every handle came back to the pair that issued it
        assert pair.stopped and pair.live_pins == 0  # closed with the group, pins released first


def test_new_conversations_go_to_the_least_busy_pair() -> None:
    pairs = [HonestPairEngine(answer, stall_s=0.5), HonestPairEngine(answer)]
    with EngineGroup(pairs) as group, SessionPool(engine=group) as pool:
        import threading

        pairs[0].inject("stall")
        slow = threading.Thread(target=pool.step_sync, args=([user("slow")],), kwargs={"conversation_id": "slow"})
        slow.start()
        deadline = time.monotonic() + 10
        while not pairs[0].steps and time.monotonic() < deadline:
            time.sleep(0.01)
        pool.step_sync([user("quick")], conversation_id="quick")
        slow.join()
    assert [len(p.steps) for p in pairs] == [1, 1]


def test_a_dead_pair_s_conversations_move_to_a_live_one() -> None:
    pairs = [HonestPairEngine(answer), HonestPairEngine(answer)]
    group = EngineGroup(pairs)
    with SessionPool(engine=group) as pool:
        histories = {name: two_turns(pool, name) for name in ("a", "b")}  # a on pair 0, b on pair 1
        pairs[0].inject("die")  # the next step that reaches pair 0 dies before its first token
        replies = {}
        for name, messages in histories.items():
            messages.append(user("And now?"))
            replies[name] = pool.step_sync(messages, conversation_id=name)
        assert pairs[0].is_dead and group.live == 1 and not group.is_dead
        assert replies["a"].stats.miss_reason == "declined"  # its pair died: recomputed on pair 1
        assert replies["b"].stats.miss_reason is None and replies["b"].stats.handle_forwarded
        for name, messages in histories.items():  # and both push back again, on pair 1
            messages.append({"role": "assistant", "content": replies[name].text})
            messages.append(user("Last?"))
            assert pool.step_sync(messages, conversation_id=name).stats.handle_forwarded
    pairs[1].assert_honest()


def test_a_dead_pair_is_replaced_when_the_group_knows_how() -> None:
    made: list[HonestPairEngine] = []

    def replace(dead: Engine) -> Engine:
        made.append(HonestPairEngine(answer))
        return made[-1]

    pairs = [HonestPairEngine(answer), HonestPairEngine(answer)]
    with EngineGroup(pairs, replace=replace) as group, Session(engine=group) as session:
        pairs[0].inject("die")
        assert session.step_sync([user("Hi")]).text  # re-placed on pair 1 before its first token
        deadline = time.monotonic() + 10
        while group.live < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert group.live == 2 and group.engines == [made[0], pairs[1]]
    assert made[0].stopped


def test_every_pair_dead_is_an_engine_error() -> None:
    with EngineGroup([HonestPairEngine(answer)]) as group, Session(engine=group) as session:
        group.engines[0].inject("die")  # type: ignore[attr-defined]
        with pytest.raises(EngineDeadError):
            session.step_sync([user("Hi")])
        assert group.is_dead
        with pytest.raises(EngineDeadError, match="every engine"):
            session.step_sync([user("Hi")])


def test_a_group_takes_unopened_engines_once() -> None:
    with pytest.raises(UserError, match="non-empty"):
        EngineGroup([])
    pair = HonestPairEngine(answer)
    with pytest.raises(UserError, match="once"):
        EngineGroup([pair, pair])
    with pair, pytest.raises(UserError, match="unopened"):
        EngineGroup([pair])


def test_a_replacement_that_fails_leaves_the_others_serving(caplog: pytest.LogCaptureFixture) -> None:
    def replace(dead: Engine) -> Engine:
        raise RuntimeError("no cores left")

    pairs = [HonestPairEngine(answer), HonestPairEngine(answer)]
    with EngineGroup(pairs, replace=replace) as group, Session(engine=group) as session:
        pairs[0].inject("die")
        assert session.step_sync([user("Hi")]).text
        deadline = time.monotonic() + 10
        while "replacing a dead engine" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        assert group.live == 1 and not group.is_dead
        assert session.step_sync([user("Hi"), {"role": "assistant", "content": "x"}, user("Again")]).text
    assert "no cores left" in caplog.text and len(pairs[0].steps) == 1  # tried once, never again
