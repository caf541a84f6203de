"""A line per vLLM engine that agentkv starts, in the file ``AGENTKV_ENGINE_LOG`` names (off when unset).

Starting engines is the slow part of every program that uses agentkv (tens of seconds each on a
CPU). To see how many a program started, and where: ``AGENTKV_ENGINE_LOG=/tmp/engines.jsonl``.
The variable is inherited, so engines started by child processes (``agentkv serve``, a launched
pair's servers, a Jupyter kernel) are logged too. The test suite prints the count per test file
from it (``tests/conftest.py``).
"""

from __future__ import annotations

import json
import os
import time

__all__ = ["ENGINE_LOG_VARIABLE", "record_engine_start"]

ENGINE_LOG_VARIABLE = "AGENTKV_ENGINE_LOG"


def record_engine_start(*, kind: str, role: str) -> None:
    """Append one line (``kind``: ``in-process`` or ``server``; ``role``: prefill, decode or colocated)."""
    path = os.environ.get(ENGINE_LOG_VARIABLE)
    if not path:
        return
    line = {
        "time": time.time(),
        "pid": os.getpid(),
        "kind": kind,
        "role": role,
        "test": os.environ.get("PYTEST_CURRENT_TEST"),  # pytest sets it; children inherit it
    }
    with open(path, "a", encoding="utf-8") as log:  # one short write: lines from several processes stay whole
        log.write(json.dumps(line) + "\n")
