"""P and D on two "hosts": two network namespaces, so the KV crosses a network link (NIXL over UCX/TCP).

On a landing, the launched push pair runs this way (push and push-back across the link, and a
RemotePair on its servers); the nightly tier also runs a pull pair across it. Both need root and
iproute2's ``ip`` (``.ci/run`` installs it where it is missing); a machine without them fails here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from agentkv import EmbeddedPair, LaunchedPair, RemotePair, Session, TurnResult
from agentkv.testing import NamespacesUnavailableError, TwoHosts, two_hosts
from test_pair import MAX_TOKENS, QUESTIONS, SYSTEM, _assert_invariant, _first_difference

pytestmark = pytest.mark.pair


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    try:
        with two_hosts() as made:
            yield made
    except NamespacesUnavailableError as exc:
        pytest.fail(f"this machine does not allow network namespaces (root and iproute2 are needed): {exc}")


def _net_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def _run(session: Session) -> list[TurnResult]:
    return [session.run_sync(question) for question in QUESTIONS]


@pytest.mark.nightly
def test_a_launched_push_pair_across_the_link_and_a_remote_one_on_its_servers_push_back_and_agree(
    hosts: TwoHosts, pair: EmbeddedPair
) -> None:
    """Push over HTTP, P and D on two "hosts": P and D get each step under one X-Request-Id, P writes into D's
    blocks across the link, D pins, P pulls back. A RemotePair on the same servers learns P's NIXL coordinates
    from its first step's reply, then sends both at once. Answers equal the embedded pull pair's (float32)."""
    with LaunchedPair(
        max_model_len=2048,
        pin_ttl_s=30,
        dtype="float32",
        transfer="push",
        hosts=hosts.addresses,
        launch_prefixes=hosts.launch_prefixes,
        server_env={"UCX_TLS": "tcp"},  # no shared-memory shortcut between the "hosts"
    ) as pushing:
        assert pushing.info.details["transfer"] == "push"
        answers: dict[str, list[list[int]]] = {}
        with Session(engine=pushing, system=SYSTEM, max_tokens=MAX_TOKENS, cache_salt="launched-push") as session:
            on_the_link = hosts.link_bytes()
            results = _run(session)
            on_the_link = hosts.link_bytes() - on_the_link
        answers["launched push"] = [result.steps[0].token_ids for result in results]
        with (
            RemotePair(*pushing.urls, transfer="push", warmup=False) as remote,
            Session(engine=remote, system=SYSTEM, max_tokens=MAX_TOKENS, cache_salt="remote-push") as session,
        ):
            remote_results = _run(session)
        answers["remote push"] = [result.steps[0].token_ids for result in remote_results]
        for later in [*results[1:], *remote_results[1:]]:
            step = later.steps[0].stats
            _assert_invariant(step)
            assert step.handle_forwarded and step.miss_reason is None and step.pulled_tokens > 0
        moved = sum(result.steps[0].stats.kv_bytes or 0 for result in results)
        assert moved > 0 and on_the_link >= moved  # the KV went over the veths
    with Session(engine=pair, system=SYSTEM, max_tokens=MAX_TOKENS, cache_salt="launched-push-reference") as session:
        answers["embedded pull"] = [result.steps[0].token_ids for result in _run(session)]
    for name in ("remote push", "embedded pull"):
        for turn, (a, b) in enumerate(zip(answers["launched push"], answers[name], strict=True), start=1):
            assert a == b, f"{name}, turn {turn}: {_first_difference(a, b)}"


@pytest.mark.nightly
def test_kv_crosses_the_link_between_two_namespaces(hosts: TwoHosts) -> None:
    with LaunchedPair(
        max_model_len=2048,
        pin_ttl_s=30,
        hosts=hosts.addresses,
        launch_prefixes=hosts.launch_prefixes,
        server_env={"UCX_TLS": "tcp"},  # no shared-memory shortcut between the "hosts"
    ) as pair:
        namespaces = {role: {_net_namespace(pid) for pid in pids} for role, pids in pair.pids_by_role.items()}
        assert len(namespaces["prefill"] | namespaces["decode"]) == 2
        assert _net_namespace(os.getpid()) not in namespaces["prefill"] | namespaces["decode"]
        with Session(engine=pair, system=SYSTEM, max_tokens=MAX_TOKENS) as session:
            first = session.run_sync(QUESTIONS[0])
            on_the_link = hosts.link_bytes()
            second = session.run_sync(QUESTIONS[1])
            on_the_link = hosts.link_bytes() - on_the_link
    step = second.steps[0].stats
    _assert_invariant(step)
    assert first.steps[0].stats.miss_reason == "no_handle"
    assert step.handle_forwarded and step.miss_reason is None and step.pulled_tokens > 0
    assert step.kv_bytes is not None and step.kv_bytes > 0
    assert on_the_link >= step.kv_bytes  # the KV P pulled back from D (and D from P) went over the veths
