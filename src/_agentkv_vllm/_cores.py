"""Elastic cores: when an engine may compute on cores it does not own, decided for the whole host.

P and D each own half the cores. In one conversation only one of them computes at a time
(P prefills while D waits; D decodes while P idles), so with ``core_policy="split"`` every
step runs on half the machine. With ``"elastic"`` each engine's thread team is bound to its
own cores first and its partner's after them, and before each forward pass its worker (a
patch, `_agentkv_vllm._elastic_worker`) uses all of them when **no other busy engine on the
host owns any of them**, its own otherwise. Two thread teams that share cores for good
thrash (D decoded 30x slower, docs/engines.md); this way they share a core for at most
one forward pass, the one running when the other engine got work.

"Busy" is known host-wide: every engine agentkv starts in this user's processes holds a slot
in one small shared file (`CoreTable`), with its pid, its own cores and how many requests it
has in flight. So several pairs on the same cores (``agentkv serve --pairs 2`` on two cores,
a notebook with two pairs, a colocated engine beside a pair) never borrow into each other's
busy cores; a slot whose process died is ignored and reused.

The table is a part of agentkv's vLLM plugin (`_agentkv_vllm`) because the workers read it: agentkv's
engines write it (``src/agentkv/_engines/_pair.py``, ``_colocated.py``, ``_vllm.py``), and this module imports
only the standard library.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import tempfile
from collections.abc import Iterable, Sequence

__all__ = ["CoreSlot", "CoreTable", "busy_sharers", "core_mask", "elastic_bind_order", "owned_cores"]

logger = logging.getLogger("agentkv")

SLOTS = 64
"""Engines one host's table holds at once (each embedded engine takes one while it runs)."""
MAX_CORES = 1024
_HEADER = struct.Struct("<iI")  # pid (0: free), requests in flight
_MASK_BYTES = MAX_CORES // 8
SLOT_BYTES = _HEADER.size + _MASK_BYTES
TABLE_BYTES = SLOTS * SLOT_BYTES


def elastic_bind_order(own: Sequence[int], other: Sequence[int]) -> list[int]:
    """An engine's thread binding: its own cores first (its threads at its own count), then the other's."""
    return [*own, *[core for core in other if core not in own]]


def core_mask(cores: Iterable[int]) -> int:
    """``[0, 2]`` -> ``0b101``."""
    mask = 0
    for core in cores:
        if not 0 <= core < MAX_CORES:
            raise ValueError(f"core {core} is outside the table's range (0-{MAX_CORES - 1})")
        mask |= 1 << core
    return mask


def default_table_path() -> str:
    """One table per user and host: in ``/dev/shm`` where there is one (memory, not disk)."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(directory, f"agentkv-cores-{os.getuid()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process with our uid's pid number: alive, not ours
        return True
    return True


def busy_sharers(table: bytes, *, cores: int, me: int) -> list[int]:
    """The slots, other than ``me``, of live engines with requests in flight that own any of ``cores`` (a mask)."""
    found: list[int] = []
    for index in range(min(SLOTS, len(table) // SLOT_BYTES)):
        offset = index * SLOT_BYTES
        pid, in_flight = _HEADER.unpack_from(table, offset)
        if index == me or not pid or not in_flight:
            continue
        owned = int.from_bytes(table[offset + _HEADER.size : offset + SLOT_BYTES], "little")
        if owned & cores and _alive(pid):
            found.append(index)
    return found


def owned_cores(table: bytes, index: int) -> set[int]:
    """The cores slot ``index`` owns."""
    offset = index * SLOT_BYTES + _HEADER.size
    mask = int.from_bytes(table[offset : offset + _MASK_BYTES], "little")
    return {core for core in range(MAX_CORES) if mask >> core & 1}


class CoreTable:
    """The host's table of engines: who owns which cores and who is busy (one file, `SLOTS` fixed-size slots)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or default_table_path()

    def claim(self, cores: Sequence[int]) -> CoreSlot | None:
        """A free slot for an engine owning ``cores`` (None when the table is full or cannot be opened)."""
        mask = core_mask(cores).to_bytes(_MASK_BYTES, "little")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            logger.warning("agentkv: cannot open the core table %s (%s); engines will not borrow cores", self.path, exc)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                index = self._take_free_slot(fd, mask)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            index, problem = None, f"failed ({exc})"
        else:
            problem = f"is full ({SLOTS} engines)"
        if index is None:
            os.close(fd)
            logger.warning("agentkv: the core table %s %s; this engine will not borrow cores", self.path, problem)
            return None
        return CoreSlot(fd, self.path, index, list(cores))

    @staticmethod
    def _take_free_slot(fd: int, mask: bytes) -> int | None:
        if os.fstat(fd).st_size < TABLE_BYTES:
            os.ftruncate(fd, TABLE_BYTES)
        table = os.pread(fd, TABLE_BYTES, 0)
        for index in range(SLOTS):
            pid, _ = _HEADER.unpack_from(table, index * SLOT_BYTES)
            if pid == 0 or not _alive(pid):  # free, or its process died without releasing it
                os.pwrite(fd, _HEADER.pack(os.getpid(), 0) + mask, index * SLOT_BYTES)
                return index
        return None


class CoreSlot:
    """One engine's slot in the `CoreTable`: its runner writes how many requests it has in flight."""

    def __init__(self, fd: int, path: str, index: int, cores: list[int]) -> None:
        self._fd: int | None = fd
        self.path = path
        self.index = index
        self.cores = cores

    def set_in_flight(self, requests: int) -> None:
        """The engine has ``requests`` in flight (0: idle, its cores may be borrowed)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):  # one aligned 4-byte write: readers see the old or the new count
                os.pwrite(self._fd, struct.pack("<I", requests), self.index * SLOT_BYTES + _HEADER.size - 4)

    def release(self) -> None:
        """Free the slot (the engine has stopped); later counts are dropped."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.pwrite(fd, bytes(SLOT_BYTES), self.index * SLOT_BYTES)
        with contextlib.suppress(OSError):
            os.close(fd)
