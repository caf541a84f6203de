"""Two real doors behind vLLM's router on one launched pair (docs/scale-out.md): ``agentkv serve --store
postgresql://... --remote P D`` twice, both on the suite's launched pair (tests/conftest.py), one PostgreSQL store
(tests/postgres_server.py), ``vllm-router`` hashing ``x-session-id`` onto them (tests/scale_out.py).

8 conversations x 4 turns, streamed and greedy. Each turn of a conversation lands on the door that owns it, and
turns 2+ pull the KV back. One door is killed (SIGKILL) after turn 2: its conversations go on, on the other
door, which resumes each from the store **and pulls its KV back** with the pin the dead door saved (the handle
travels with the snapshot: src/agentkv/_session/_pool.py); no turn lost or answered twice; each conversation's
answers are those of a single door on the same pair (checked for the moved ones; the others never left
theirs).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from agentkv import LaunchedPair, SessionPool
from agentkv._engines._system import free_port
from agentkv._model import model_name
from agentkv.serve import FrontDoor
from scale_out import Chat, ScaleOut, placement

pytestmark = pytest.mark.pair

if shutil.which("vllm-router", path=str(Path(sys.executable).parent)) is None and not shutil.which("vllm-router"):
    pytest.skip("vllm-router is not installed here: pip install 'agentkv-vllm[dev]'", allow_module_level=True)

NAMED = [f"conversation-{n}" for n in range(8)]
TURNS = 4
KILLED_AFTER = 2
MAX_TOKENS = 8


def talk(url: str, turns: range, chats: list[Chat]) -> None:
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        for number in turns:
            for chat in chats:
                chat.turn(client, number)


def brief(chat: Chat) -> list[tuple[Any, ...]]:
    """Each turn in short, for a failure's message: turn, forwarded, pulled, computed, miss reason, paused (s)."""
    keys = ("turn", "handle_forwarded", "pulled_tokens", "computed_tokens", "miss_reason")
    return [
        (*(stats.get(key) for key in keys), round(paused, 1))
        for stats, paused in zip(chat.stats, chat.paused_s, strict=True)
    ]


def pulled(stats: dict[str, Any]) -> bool:
    return bool(stats["handle_forwarded"]) and stats["pulled_tokens"] > 0 and stats["miss_reason"] is None


def test_a_door_killed_behind_the_router_hands_its_conversations_kv_and_all_to_the_other(
    launched: LaunchedPair, postgres_url: str, tmp_path: Path
) -> None:
    prefill_url, decode_url = launched.urls
    model = model_name(launched.info.model_path)  # what `agentkv serve` serves by default

    def remote_door(port: int, store_url: str) -> list[str]:
        agentkv = str(Path(sys.executable).with_name("agentkv"))
        return [agentkv, "serve", "--port", str(port), "--store", store_url, "--remote", prefill_url, decode_url]

    chats = [Chat(name, model, {"temperature": 0, "max_tokens": MAX_TOKENS}) for name in NAMED]
    with ScaleOut(tmp_path) as fleet:
        doors = fleet.start_doors(2, postgres_url, remote_door)
        router = fleet.start_router([door.url for door in doors])
        talk(router.url, range(1, KILLED_AFTER + 1), chats)
        owners = placement(doors)
        assert sorted(owners) == NAMED
        victim = max(doors, key=lambda d: sum(owner == d.name for owner in owners.values()))
        moved = {name for name, owner in owners.items() if owner == victim.name}
        survivor = next(d for d in doors if d is not victim)
        victim.kill()
        talk(router.url, range(KILLED_AFTER + 1, TURNS + 1), chats)
        assert set(placement([survivor])) == set(NAMED)

    # the moved conversations again on one door (the others never left theirs): greedy, the same answers
    expected = [Chat(chat.name, model, chat.params) for chat in chats if chat.name in moved]
    with SessionPool(engine=launched) as pool, FrontDoor(pool, port=free_port()) as door:
        talk(door.url, range(1, TURNS + 1), expected)
    alone = {chat.name: chat.answers for chat in expected}
    for chat in chats:
        assert chat.name not in alone or chat.answers == alone[chat.name], chat.name
        assert [stats["turn"] for stats in chat.stats] == list(range(1, TURNS + 1)), chat.name
        # doors sharing a store do not renew pins: each turn within the pin's TTL less the sessions' margin (10 s)
        assert max(chat.paused_s) < launched.config.pin_ttl_s - 10, ("paused past the pin", chat.name, brief(chat))
        assert all(pulled(stats) for stats in chat.stats[1:]), (chat.name, chat.name in moved, brief(chat))  # moved too
        if chat.name not in moved:
            assert chat.failures == [], chat.name
        else:
            assert {turn for turn, _ in chat.failures} <= {KILLED_AFTER + 1}, chat.name
    longest = max(max(chat.paused_s) for chat in chats)
    retried = sum(len(c.failures) for c in chats)
    print(f"{len(moved)} conversations moved with their KV; {retried} requests retried; longest pause {longest:.1f} s")
