"""Two doors behind vLLM's router (docs/scale-out.md), each its own process on a scripted engine
(tests/scripted_door.py), sharing one real PostgreSQL store (tests/postgres_server.py); the router (``vllm-router``,
tests/scale_out.py) hashes ``x-session-id`` onto them. Conversations stick to a door; one door is killed (SIGKILL)
between turns and its conversations go on, on the other door, resumed from the store: no turn lost or answered
twice, each conversation's answers those of a single door. A conversation with no id goes through the router too.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import httpx
import openai
import pytest

from agentkv import PostgresSessionStore, SessionPool
from agentkv._engines._system import free_port
from agentkv._session._session_store import conversation_key
from agentkv.serve import FrontDoor
from agentkv.testing import HonestPairEngine
from scale_out import Chat, Process, ScaleOut, live_sessions, owner, placement
from scripted_door import MODEL, answer

if shutil.which("vllm-router", path=str(Path(sys.executable).parent)) is None and not shutil.which("vllm-router"):
    pytest.skip("vllm-router is not installed here: pip install 'agentkv-vllm[dev]'", allow_module_level=True)

NAMED = [f"conversation-{n}" for n in range(8)]
TURNS = 4
KILLED_AFTER = 2
"""The turn after which one door is killed."""


def conversations(url: str, turns: range, chats: dict[str | None, Chat]) -> None:
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        for number in turns:
            for chat in chats.values():
                chat.turn(client, number)


def single_door_answers() -> dict[str | None, list[str]]:
    """Every conversation's answers from one door (in this process, no store) on the doors' scripted engine."""
    chats: dict[str | None, Chat] = {name: Chat(name, MODEL) for name in [*NAMED, None]}
    with (
        HonestPairEngine(answer) as engine,
        SessionPool(engine=engine, max_tokens=32) as pool,
        FrontDoor(pool, model_name=MODEL, port=free_port()) as door,
    ):
        conversations(door.url, range(1, TURNS + 1), chats)
    engine.assert_honest()
    return {name: chat.answers for name, chat in chats.items()}


def responses_named(url: str) -> None:
    """A Responses conversation through the router: vllm-router hashes its ``x-session-id`` but does not pass the
    header on to the door for ``/v1/responses`` (it does for chat), so the body's ``session_id`` names it there."""
    headers = {"x-session-id": "responses-0"}
    body = {"model": MODEL, "input": "Hello?", "max_output_tokens": 8}
    first = httpx.post(url + "/v1/responses", json=body, headers=headers, timeout=120)
    assert first.status_code == 200 and first.headers.get("x-session-id") is None, first.text  # not passed on
    body |= {"session_id": "responses-0", "previous_response_id": first.json()["id"], "input": "Again?"}
    second = httpx.post(url + "/v1/responses", json=body, headers=headers, timeout=120)
    assert second.status_code == 200 and second.headers["x-session-id"] == "responses-0", second.text


def holds_the_unnamed(door: Process) -> bool:
    """Whether the door holds a session no name is given to (its sessions gauge counts more than its named ones)."""
    page = httpx.get(door.url + "/metrics", timeout=5).text
    sessions = next(int(float(line.split()[1])) for line in page.splitlines() if line.startswith("agentkv_sessions "))
    return sessions > len(live_sessions(door.url))


def test_conversations_stick_to_their_door_and_survive_its_death(postgres_url: str, tmp_path: Path) -> None:
    expected = single_door_answers()
    chats: dict[str | None, Chat] = {name: Chat(name, MODEL) for name in [*NAMED, None]}
    with ScaleOut(tmp_path) as fleet:
        doors = fleet.start_doors(2, postgres_url)
        owners = {owner(door) for door in doors}
        assert len(owners) == 2  # each door its own lease owner in the shared store
        router = fleet.start_router([door.url for door in doors])

        conversations(router.url, range(1, KILLED_AFTER + 1), chats)
        victim = next(door for door in doors if holds_the_unnamed(door))  # unnamed requests all go to one door
        responses_named(router.url)
        before = placement(doors)
        assert sorted(before) == sorted([*NAMED, "responses-0"])
        assert all(stats["miss_reason"] is None for chat in chats.values() for stats in chat.stats[1:])  # sticky
        survivor = next(door for door in doors if door is not victim)
        moved = {name for name, door in before.items() if door == victim.name}
        victim.kill()

        first = sorted(chats, key=lambda name: name is not None and name not in moved)  # the dead door's first
        conversations(router.url, range(KILLED_AFTER + 1, TURNS + 1), {name: chats[name] for name in first})
        after = placement([survivor])
        assert {name: after.get(name) for name in NAMED} == dict.fromkeys(NAMED, survivor.name)
        router_metrics = httpx.get(f"http://127.0.0.1:{router.ports[1]}/metrics", timeout=5).text

    for name, chat in chats.items():
        assert chat.answers == expected[name], name  # the same prompts, token for token, as on one door
        assert [stats["turn"] for stats in chat.stats] == list(range(1, TURNS + 1)), name  # none lost, none twice
        resumed = chat.stats[KILLED_AFTER]["miss_reason"] == "resumed"
        assert resumed == (name is None or name in moved), (name, chat.stats[KILLED_AFTER])
        assert all(turn == KILLED_AFTER + 1 for turn, _ in chat.failures), (name, chat.failures)
        if name not in moved and name is not None:
            assert chat.failures == [], name  # the survivor's own conversations never saw the death
    with PostgresSessionStore(postgres_url) as store:
        for name in NAMED:
            saved = store.get(conversation_key(name))
            assert saved is not None and len(saved.turns) == TURNS, name
    assert f'vllm_router_worker_health{{worker="{victim.url}"}} 0' in router_metrics
    failed = sum(len(chat.failures) for chat in chats.values())
    print(f"{len(moved)} conversations moved; {failed} requests failed and were asked again")
