"""Elastic cores: which of a pair's engines may compute on the other's cores, and when.

P and D each own half the cores. In one conversation only one of them computes at a time
(P prefills while D waits; D decodes while P idles), so with ``core_policy="split"`` every
step runs on half the machine. With ``"elastic"`` each engine's thread team is bound to its
own cores first and the other engine's cores after them, and its worker sets its thread
count before each forward pass (a patch, `agentkv._engines._vllm_patches`) from a
`ThreadBudget` the pair writes: its own cores, or all cores for a prefill pass while the
other engine has no request in flight. Two thread teams never share a core for longer
than one forward pass (the pass that was running when the other engine got work); two
teams that share cores for good thrash (D decoded 30x slower, DESIGN.md section 4).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence

from ._pair_config import CorePolicy, Role

__all__ = ["ThreadBudget", "elastic_bind_order"]

logger = logging.getLogger("agentkv")


def elastic_bind_order(own: Sequence[int], other: Sequence[int]) -> list[int]:
    """An engine's thread binding: its own cores first (its threads at its own budget), then the other's."""
    return [*own, *[core for core in other if core not in own]]


class ThreadBudget:
    """The thread counts of a pair's two workers, shared through one two-byte file per engine.

    Byte 0 is the engine's own thread count; byte 1 the count it may use for a prefill pass
    now (0: none lent). The pair calls `started` and `ended` around every request it sends an
    engine; the budget follows what is in flight.
    """

    def __init__(self, policy: CorePolicy, cores: Mapping[Role, Sequence[int]]) -> None:
        self.policy = policy
        self._own = {role: len(cores[role]) for role in cores}
        self._all = len({core for role_cores in cores.values() for core in role_cores})
        self._in_flight: dict[Role, int] = dict.fromkeys(cores, 0)
        self._lent: dict[Role, int] = dict.fromkeys(cores, 0)
        self._paths: dict[Role, str] = {}
        self._fds: dict[Role, int] = {}
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        for role in cores:
            fd, path = tempfile.mkstemp(prefix=f"agentkv-threads-{role}-", dir=directory)
            self._fds[role], self._paths[role] = fd, path
            os.pwrite(fd, bytes([self._own[role], 0]), 0)
        self._update()

    def path(self, role: Role) -> str:
        """The file the ``role`` engine's worker reads (``AGENTKV_THREAD_BUDGET``)."""
        return self._paths[role]

    def in_flight(self, role: Role) -> int:
        """Requests the pair has sent ``role`` that have not ended."""
        return self._in_flight[role]

    def lent(self, role: Role) -> bool:
        """Whether ``role`` may now prefill on the other engine's cores too."""
        return self._lent[role] > 0

    def started(self, role: Role) -> None:
        self._in_flight[role] += 1
        self._update()

    def ended(self, role: Role) -> None:
        self._in_flight[role] = max(0, self._in_flight[role] - 1)
        self._update()

    def _update(self) -> None:
        for role in self._fds:
            others_idle = all(count == 0 for other, count in self._in_flight.items() if other != role)
            lent = self._all if self.policy == "elastic" and others_idle and self._all > self._own[role] else 0
            if lent != self._lent[role]:
                self._lent[role] = lent
                with contextlib.suppress(OSError):  # closed: the engines are gone
                    os.pwrite(self._fds[role], bytes([self._own[role], lent]), 0)

    def close(self) -> None:
        """Remove the files (the workers keep what they opened until they exit)."""
        for role, fd in list(self._fds.items()):
            with contextlib.suppress(OSError):
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self._paths[role])
        self._fds.clear()
