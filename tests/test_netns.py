"""P and D on two "hosts": two network namespaces, so the KV crosses a network link (NIXL over UCX/TCP)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from agentkv import LaunchedPair, Session
from agentkv.testing import NamespacesUnavailableError, TwoHosts, two_hosts
from test_pair import MAX_TOKENS, QUESTIONS, SYSTEM, _assert_invariant

pytestmark = pytest.mark.pair


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    try:
        with two_hosts() as made:
            yield made
    except NamespacesUnavailableError as exc:
        pytest.skip(f"this machine does not allow network namespaces: {exc}")


def _net_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


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
