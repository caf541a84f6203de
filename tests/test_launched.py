"""The launched pair: two vLLM API-server processes that agentkv starts, driven over HTTP.

The suite's launched pair (``launched`` in tests/conftest.py: a start costs about a minute on two
cores) serves the module and the docs' snippets; its fixture checks on the way out that closing
it left no process and no port behind.
"""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Sequence
from pathlib import Path

import pytest

from agentkv import EmbeddedPair, EngineUnavailableError, LaunchedPair, RemotePair, Session, TextDelta, TurnResult
from agentkv._engines._system import alive
from agentkv._session._modes import modes_of
from test_pair import (
    MAX_TOKENS,
    QUESTIONS,
    SYSTEM,
    _assert_invariant,
    _first_difference,
    check_pin_budget_evicts_the_oldest,
)
from test_pair_placement import steps_on_d_and_p

pytestmark = pytest.mark.pair


def _run(session: Session, questions: Sequence[str] = QUESTIONS) -> list[TurnResult]:
    return [session.run_sync(question) for question in questions]


def test_the_launched_pair_streams_and_pushes_back(launched: LaunchedPair) -> None:
    deltas: list[TextDelta] = []
    with Session(engine=launched, system=SYSTEM, max_tokens=MAX_TOKENS) as session:
        first = session.run_sync(QUESTIONS[0])
        second = session.run_sync(
            QUESTIONS[1], on_event=lambda e: deltas.append(e) if isinstance(e, TextDelta) else None
        )
    assert launched.handle_in_stream is True and launched.server_kind == "agentkv"
    assert len(deltas) > 1 and "".join(d.text for d in deltas) == second.text  # tokens arrive as they are made
    one, two = first.steps[0].stats, second.steps[0].stats
    for step in (one, two):
        _assert_invariant(step)
        assert step.handoff_tokens > 0  # D pulled the prompt's KV from P
    assert one.miss_reason == "no_handle" and one.pulled_tokens == 0
    assert two.handle_forwarded and two.miss_reason is None and two.pulled_tokens > 0
    assert two.kv_bytes is not None and two.kv_bytes > 0 and two.kv_transfer_s is not None


def test_greedy_answers_agree_over_http_and_in_process(launched: LaunchedPair, pair: EmbeddedPair) -> None:
    """Push-back over HTTP changes no token: launched with and without it, and the embedded pair, agree."""
    answers: dict[str, list[list[int]]] = {}
    for name, engine, mode in (
        ("launched", launched, "bidirectional"),
        ("launched, no push-back", launched, "disaggregated"),
        ("embedded", pair, "bidirectional"),
    ):
        with Session(engine=engine, mode=mode, system=SYSTEM, max_tokens=MAX_TOKENS, cache_salt=name) as session:
            results = _run(session)
        answers[name] = [result.steps[0].token_ids for result in results]
        if mode == "bidirectional":
            assert results[1].steps[0].stats.pulled_tokens > 0
    for name in ("launched, no push-back", "embedded"):
        for turn, (a, b) in enumerate(zip(answers["launched"], answers[name], strict=True), start=1):
            assert a == b, f"{name}, turn {turn}: {_first_difference(a, b)}"


def test_a_remote_pair_drives_servers_it_did_not_start(launched: LaunchedPair) -> None:
    prefill_url, decode_url = launched.urls
    with (
        RemotePair(prefill_url, decode_url, warmup=False) as remote,
        Session(engine=remote, system=SYSTEM, max_tokens=MAX_TOKENS) as session,
    ):
        assert remote.server_kind == "agentkv" and remote.handle_in_stream is True  # probed at open
        assert remote._capacity() == launched._capacity()  # D's size, from its /metrics
        assert "auto" in modes_of(remote.info)  # D's server says it can pin a step it prefills alone
        results = _run(session)
        assert remote.info.pins
    for later in results[1:]:
        step = later.steps[0].stats
        assert step.pulled_tokens > 0 and step.miss_reason is None
        assert step.kv_bytes is None  # not exclusive: the servers' NIXL totals may include other clients'


def test_the_launched_pair_knows_d_s_size_and_bounds_its_pins(launched: LaunchedPair) -> None:
    """D's size comes from its server's /metrics (vLLM's cache_config_info); past the budget the oldest pin is
    released and its conversation recomputes, as on the embedded pair (the pair layer is the same)."""
    blocks, block_size = launched._capacity()
    assert blocks is not None and blocks > 0 and block_size == 128  # vLLM's CPU block
    assert launched.info.details["decode_kv_blocks"] == blocks
    check_pin_budget_evicts_the_oldest(launched)


def test_a_step_on_d_alone_over_http(launched: LaunchedPair) -> None:
    """Placed on D's server, a step reuses D's whole blocks of the pin and answers as P would; auto mode serves."""
    assert "auto" in modes_of(launched.info)
    assert launched.home is not None
    launched.home.call(steps_on_d_and_p, launched)


def ipc_sockets(launched: LaunchedPair) -> dict[str, list[str]]:
    """Each server's IPC folder and the socket files in it."""
    found = {}
    for server in launched._servers.values():
        assert server.ipc_folder is not None
        found[server.ipc_folder] = [e.name for e in os.scandir(server.ipc_folder) if stat.S_ISSOCK(e.stat().st_mode)]
    return found


def test_each_launched_server_keeps_its_ipc_sockets_in_a_folder_of_its_own(launched: LaunchedPair) -> None:
    """vLLM names its ZMQ IPC sockets ``ipc://$VLLM_RPC_BASE_PATH/<uuid>`` and ZMQ leaves their files behind: each
    server's go in a folder of its own (src/agentkv/_engines/_server_process.py), which its stop removes (the
    fixture checks that on the way out: tests/conftest.py)."""
    found = ipc_sockets(launched)
    assert sorted(Path(folder).name.rsplit("-", 1)[0] for folder in found) == [
        "agentkv-server-decode",
        "agentkv-server-prefill",
    ]
    assert all(found.values()), found  # vLLM bound its sockets there


@pytest.mark.nightly
def test_a_server_that_dies_mid_step_is_restarted_and_the_conversation_kept(launched: LaunchedPair) -> None:
    with Session(engine=launched, system=SYSTEM, max_tokens=48) as session:
        session.run_sync(QUESTIONS[0])
        before = session.messages
        dead = launched.pids_by_role["decode"]
        dead_sockets = launched._servers["decode"].ipc_folder

        def kill_decode(event: object) -> None:
            if isinstance(event, TextDelta):
                for pid in alive(dead):
                    os.kill(pid, signal.SIGKILL)

        with pytest.raises(EngineUnavailableError, match="decode server exited"):
            session.run_sync(QUESTIONS[1], on_event=kill_decode)
        assert session.messages == before  # the failed turn added nothing

        again = session.run_sync(QUESTIONS[1])  # D restarts first; the handle it pinned is not sent to P
        assert again.text and again.steps[0].stats.miss_reason == "no_handle"
        assert alive(dead) == set() and not dead & launched.pids
        assert dead_sockets is not None and not os.path.exists(dead_sockets)  # the dead server's folder went too
        assert all(ipc_sockets(launched).values())
        third = session.run_sync(QUESTIONS[2])
        assert third.steps[0].stats.pulled_tokens > 0  # push-back works with the new D
    assert [m.role for m in session.messages][-6:] == ["user", "assistant"] * 3
