"""Two "hosts" on one machine: network namespaces for running P and D of a launched pair apart.

`two_hosts` gives each server of a `LaunchedPair` a namespace of its own (its own address, a
veth link to a bridge), so NIXL's KV transfers cross a real network path (UCX over TCP) even
on one machine. It needs root and iproute2's ``ip``.

It stays in the product, not in tests/, because the bench a user runs needs it: ``agentkv bench
--modes netns`` (src/agentkv/_bench/_modes.py; docs/benchmarks.md) measures the pair across that
network path. It is public as ``agentkv.testing.two_hosts`` (src/agentkv/testing.py) for tests of
pairs across hosts (tests/test_netns.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

from .._errors import AgentKVError

__all__ = ["NamespacesUnavailableError", "TwoHosts", "two_hosts"]


class NamespacesUnavailableError(AgentKVError):
    """This machine does not let agentkv create network namespaces (not root, no ``ip``, ...)."""


@dataclasses.dataclass(frozen=True)
class TwoHosts:
    """Two network namespaces joined by a bridge in this one: two "hosts" on one machine.

    Each namespace has its own address; this namespace reaches both through the bridge, and
    traffic between them crosses two veth links (NIXL over UCX/TCP sees a real network path).
    """

    namespaces: tuple[str, str]
    addresses: tuple[str, str]
    links: tuple[str, str]
    """The host-side ends of the veth links (their counters see every byte to or from a namespace)."""

    @property
    def launch_prefixes(self) -> tuple[list[str], list[str]]:
        """``LaunchedPair(launch_prefixes=...)``: run P in the first namespace, D in the second."""
        return (["ip", "netns", "exec", self.namespaces[0]], ["ip", "netns", "exec", self.namespaces[1]])

    def link_bytes(self) -> int:
        """Bytes sent and received so far on both links."""
        total = 0
        for link in self.links:
            for counter in ("rx_bytes", "tx_bytes"):
                total += int(Path(f"/sys/class/net/{link}/statistics/{counter}").read_text())
        return total


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """Create two network namespaces for a cross-"host" pair; remove them on the way out.

    Raises `NamespacesUnavailableError` (with the reason) where the machine does not allow it.
    """
    if shutil.which("ip") is None:
        raise NamespacesUnavailableError("the `ip` command (iproute2) is not installed")
    tag = uuid.uuid4().hex[:5]
    subnet = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
    bridge = f"akvbr{tag}"
    namespaces = (f"akv-{tag}-p", f"akv-{tag}-d")
    hosts = TwoHosts(namespaces, (f"{subnet}.1", f"{subnet}.2"), (f"akv{tag}h0", f"akv{tag}h1"))
    created: list[list[str]] = []  # undo commands, run in reverse
    try:
        _ip(["link", "add", bridge, "type", "bridge"], created, undo=["link", "del", bridge])
        _ip(["addr", "add", f"{subnet}.254/24", "dev", bridge], created)
        _ip(["link", "set", bridge, "up"], created)
        for index, namespace in enumerate(namespaces):
            host_end, inner_end = hosts.links[index], f"akv{tag}n{index}"
            _ip(["netns", "add", namespace], created, undo=["netns", "del", namespace])
            _ip(["link", "add", host_end, "type", "veth", "peer", "name", inner_end], created)
            _ip(["link", "set", inner_end, "netns", namespace], created)
            _ip(["link", "set", host_end, "master", bridge, "up"], created)
            _ip(["-n", namespace, "addr", "add", f"{hosts.addresses[index]}/24", "dev", inner_end], created)
            _ip(["-n", namespace, "link", "set", inner_end, "up"], created)
            _ip(["-n", namespace, "link", "set", "lo", "up"], created)
        yield hosts
    finally:
        for undo in reversed(created):
            subprocess.run(["ip", *undo], capture_output=True, check=False)


def _ip(args: list[str], created: list[list[str]], *, undo: list[str] | None = None) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NamespacesUnavailableError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    if undo is not None:
        created.append(undo)
