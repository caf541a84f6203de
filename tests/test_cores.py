"""Elastic cores without engines: the pair's `ThreadBudget` files and the worker's side that follows them.

The pair writes two bytes per engine (own thread count, lent count or 0) as requests start and
end; each worker reads them before a forward pass and sets its thread count. These tests check
both ends and that they agree, with a temp file for the file and recorders for torch's setter.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentkv._engines import _vllm_patches
from agentkv._engines._cores import ThreadBudget, elastic_bind_order
from agentkv._engines._pair_config import CorePolicy, Role
from agentkv._engines._vllm_patches import LENT_MIN_TOKENS, _bind_order, _ThreadBudgetFollower

ROLES: tuple[Role, Role] = ("prefill", "decode")
OTHER: dict[Role, Role] = {"prefill": "decode", "decode": "prefill"}


def _bytes(budget: ThreadBudget, role: Role) -> tuple[int, int]:
    data = Path(budget.path(role)).read_bytes()
    assert len(data) == 2, data
    return data[0], data[1]


@pytest.fixture
def two_cores() -> Iterator[ThreadBudget]:
    budget = ThreadBudget("elastic", {"prefill": [0], "decode": [1]})
    yield budget
    budget.close()


# ----------------------------------------------------------------- the pair's side


def test_elastic_budget_starts_idle_with_all_cores_lendable(two_cores: ThreadBudget) -> None:
    for role in ROLES:  # both idle: whichever gets work first may use both cores
        assert _bytes(two_cores, role) == (1, 2)
        assert two_cores.in_flight(role) == 0 and two_cores.lent(role)
    assert two_cores.path("prefill") != two_cores.path("decode")


def test_elastic_lends_all_cores_only_while_the_other_role_is_idle(two_cores: ThreadBudget) -> None:
    budget = two_cores
    budget.started("prefill")  # P prefills, D idle: P may use both cores
    assert _bytes(budget, "prefill") == (1, 2) and budget.lent("prefill")
    assert _bytes(budget, "decode") == (1, 0) and not budget.lent("decode")
    budget.started("decode")  # both busy: nobody borrows
    assert _bytes(budget, "prefill") == (1, 0) and _bytes(budget, "decode") == (1, 0)
    budget.ended("prefill")  # P done, D decodes: D may borrow P's core
    assert _bytes(budget, "prefill") == (1, 0) and _bytes(budget, "decode") == (1, 2)
    budget.started("decode")
    budget.ended("decode")  # one of D's two requests ended: D is still busy, so P gets nothing
    assert budget.in_flight("decode") == 1
    assert _bytes(budget, "prefill") == (1, 0) and _bytes(budget, "decode") == (1, 2)
    budget.ended("decode")  # both idle: each may take all cores for its next pass
    assert _bytes(budget, "prefill") == (1, 2) and _bytes(budget, "decode") == (1, 2)
    assert budget.in_flight("prefill") == budget.in_flight("decode") == 0


def test_more_ends_than_starts_never_count_below_zero(two_cores: ThreadBudget) -> None:
    two_cores.ended("decode")
    two_cores.ended("decode")
    assert two_cores.in_flight("decode") == 0
    two_cores.started("decode")  # one start after the extra ends: in flight, not still "owed"
    assert two_cores.in_flight("decode") == 1
    assert _bytes(two_cores, "prefill") == (1, 0) and _bytes(two_cores, "decode") == (1, 2)


@pytest.mark.parametrize("policy", ["elastic", "split"])
def test_random_request_traffic_keeps_the_lending_rule(policy: CorePolicy) -> None:
    cores: dict[Role, list[int]] = {"prefill": [0, 1], "decode": [2, 3]}
    budget = ThreadBudget(policy, cores)
    try:
        expected = dict.fromkeys(ROLES, 0)
        draw = random.Random(13)
        for _ in range(300):
            role: Role = draw.choice(ROLES)
            if draw.random() < 0.5:
                budget.started(role)
                expected[role] += 1
            else:
                budget.ended(role)
                expected[role] = max(0, expected[role] - 1)
            for each in ROLES:
                assert budget.in_flight(each) == expected[each]
                lend = policy == "elastic" and expected[OTHER[each]] == 0
                assert _bytes(budget, each) == (2, 4 if lend else 0), (policy, each, expected)
                assert budget.lent(each) is lend
    finally:
        budget.close()


def test_split_never_lends() -> None:
    budget = ThreadBudget("split", {"prefill": [0], "decode": [1]})
    try:
        for role in ROLES:  # every state the elastic budget lends in
            budget.started(role)
            budget.ended(role)
            assert all(_bytes(budget, each) == (1, 0) and not budget.lent(each) for each in ROLES)
    finally:
        budget.close()


def test_cores_the_other_engine_shares_are_not_lent() -> None:
    """Lent means more than one's own: with P's cores covering all of them, P is never lent any."""
    budget = ThreadBudget("elastic", {"prefill": [0, 1], "decode": [1]})
    try:
        budget.started("prefill")
        budget.ended("prefill")
        assert _bytes(budget, "prefill") == (2, 0) and not budget.lent("prefill")
        assert _bytes(budget, "decode") == (1, 2) and budget.lent("decode")
    finally:
        budget.close()


def test_close_removes_the_files_and_later_updates_do_not_raise() -> None:
    budget = ThreadBudget("elastic", {"prefill": [0], "decode": [1]})
    paths = [budget.path(role) for role in ROLES]
    assert all(os.path.exists(path) for path in paths)
    budget.close()
    assert not any(os.path.exists(path) for path in paths)
    budget.started("prefill")  # a request ending after the pair closed (engines shutting down)
    budget.ended("prefill")
    budget.ended("decode")
    assert budget.in_flight("prefill") == 0
    budget.close()  # twice: nothing left to remove
    assert not any(os.path.exists(path) for path in paths)


@pytest.mark.parametrize(
    ("own", "other", "order"),
    [
        ([0], [1], [0, 1]),
        ([1], [0], [1, 0]),
        ([0, 1], [2, 3], [0, 1, 2, 3]),
        ([2, 3], [0, 1], [2, 3, 0, 1]),
        ([1, 2], [2, 3], [1, 2, 3]),  # a shared core once, in its own place
    ],
)
def test_elastic_bind_order_puts_own_cores_first(own: list[int], other: list[int], order: list[int]) -> None:
    assert elastic_bind_order(own, other) == order


# ----------------------------------------------------------------- the worker's side


@pytest.mark.parametrize(
    ("bind", "order"),
    [
        ("1,0", [1, 0]),
        ("0-3", [0, 1, 2, 3]),
        ("2,3,0,1", [2, 3, 0, 1]),
        ("2-3,0-1", [2, 3, 0, 1]),
        ("0", [0]),
        ("", []),
        ("all", []),
    ],
)
def test_bind_order_keeps_the_variables_order(monkeypatch: pytest.MonkeyPatch, bind: str, order: list[int]) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    assert _bind_order() == order


def test_bind_order_without_the_variable_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert _bind_order() == []


class _Worker:
    """Records what a `_ThreadBudgetFollower` asks of torch and of the binding."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import torch

        self.threads: list[int] = []
        self.bindings: list[list[int]] = []
        monkeypatch.setattr(torch._C, "set_num_threads", self.threads.append)
        monkeypatch.setattr(_vllm_patches, "_bind_omp_threads_in_order", self.bindings.append)
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1,0")


def _follower(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, own: int, lent: int
) -> tuple[_Worker, Path, _ThreadBudgetFollower]:
    """A follower of a budget file holding (own, lent), and the fake worker it drives."""
    worker = _Worker(monkeypatch)
    path = tmp_path / "budget"
    path.write_bytes(bytes([own, lent]))
    return worker, path, _ThreadBudgetFollower(str(path))


def _write(path: Path, own: int, lent: int) -> None:
    with path.open("r+b") as file:  # in place, as the pair's pwrite: the worker keeps its descriptor
        file.write(bytes([own, lent]))


def test_follower_uses_lent_threads_for_prefill_passes_only_and_sets_on_change(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    worker, path, follower = _follower(monkeypatch, tmp_path, own=1, lent=0)
    follower.apply(500)  # nothing lent: own threads, bound on the first pass
    assert worker.threads == [1] and worker.bindings == [[1, 0]]
    follower.apply(1)
    assert worker.threads == [1]  # unchanged: not set again
    _write(path, 1, 2)
    follower.apply(1)  # a decode pass: own threads even while lent
    follower.apply(LENT_MIN_TOKENS - 1)
    assert worker.threads == [1]
    follower.apply(LENT_MIN_TOKENS)  # a prefill pass while lent: all the cores
    assert worker.threads == [1, 2]
    follower.apply(700)
    assert worker.threads == [1, 2]
    follower.apply(1)  # back to its own for a decode pass
    assert worker.threads == [1, 2, 1]
    _write(path, 1, 0)  # the other engine got work: a prefill pass stays on its own cores
    follower.apply(700)
    assert worker.threads == [1, 2, 1]
    assert worker.bindings == [[1, 0]]  # bound once, whatever the changes


def test_follower_binds_before_its_first_setting_even_when_lent(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    worker, _, follower = _follower(monkeypatch, tmp_path, own=1, lent=2)
    follower.apply(300)
    follower.apply(1)
    assert worker.bindings == [[1, 0]] and worker.threads == [2, 1]


def test_follower_reads_what_the_pairs_budget_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ends of the protocol together: the byte order the pair writes is the one the worker reads."""
    worker = _Worker(monkeypatch)
    budget = ThreadBudget("elastic", {"prefill": [0, 1], "decode": [2, 3]})
    try:
        prefill = _ThreadBudgetFollower(budget.path("prefill"))
        decode = _ThreadBudgetFollower(budget.path("decode"))
        budget.started("prefill")
        prefill.apply(400)
        assert worker.threads == [4]  # P prefills on all four cores while D is idle
        budget.started("decode")
        prefill.apply(400)
        decode.apply(400)
        assert worker.threads == [4, 2, 2]  # both busy: each on its own two
        budget.ended("prefill")
        decode.apply(1)
        decode.apply(400)
        assert worker.threads == [4, 2, 2, 4]  # D's decode passes stay on its own; a prefill pass borrows
    finally:
        budget.close()


# ----------------------------------------------------------------- binding the OMP team

_BIND_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading
    from agentkv._engines._vllm_patches import _bind_omp_threads_in_order

    order = json.loads(sys.argv[1])
    os.sched_setaffinity(0, {0, 1})  # threads started now inherit both cores
    ready, done = threading.Barrier(3), threading.Event()
    tids = {}

    def helper(name, cores):
        if cores is not None:
            os.sched_setaffinity(0, set(cores))  # as vLLM binds an OMP thread: one core
        tids[name] = threading.get_native_id()
        ready.wait()
        done.wait()

    threads = [
        threading.Thread(target=helper, args=("bound", [0])),
        threading.Thread(target=helper, args=("free", None)),
    ]
    for thread in threads:
        thread.start()
    ready.wait()
    _bind_omp_threads_in_order(order)
    result = {name: sorted(os.sched_getaffinity(tid)) for name, tid in tids.items()}
    result["main"] = sorted(os.sched_getaffinity(0))
    done.set()
    for thread in threads:
        thread.join()
    print(json.dumps(result))
    """
)


@pytest.mark.skipif(
    not {0, 1} <= os.sched_getaffinity(0), reason="binding is checked on cores 0 and 1; this process lacks one"
)
@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ([1, 0], {"bound": [1], "free": [0, 1], "main": [1]}),  # D's elastic order: rank 0 moves to core 1
        ([0, 1], {"bound": [0], "free": [0, 1], "main": [0]}),  # P's: vLLM's binding already fits
    ],
)
def test_binding_moves_single_core_threads_to_the_core_of_their_rank(
    order: list[int], expected: dict[str, list[int]]
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _BIND_SCRIPT, json.dumps(order)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert json.loads(out.strip().splitlines()[-1]) == expected


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ([2, 3, 0, 1], [(101, {2}), (102, {3}), (103, {0}), (104, {1})]),
        ([2, 0, 1, 3], [(101, {2}), (102, {0}), (103, {1})]),  # the thread on core 3 is where its rank wants it
    ],
)
def test_binding_on_four_cores_maps_each_rank(
    monkeypatch: pytest.MonkeyPatch, order: list[int], expected: list[tuple[int, set[int]]]
) -> None:
    """The mapping on more cores than this machine has: the kernel calls are recorded, not made.

    vLLM put the thread of rank i on the i-th lowest core; it must end on ``order[i]``.
    """
    main = 100
    affinity: dict[int, set[int]] = {main: {3}, 101: {0}, 102: {1}, 103: {2}, 104: {3}, 105: {0, 1, 2, 3}, 106: {7}}
    moved: list[tuple[int, set[int]]] = []

    def getaffinity(tid: int) -> set[int]:
        if tid == 107:
            raise ProcessLookupError(tid)  # a thread that ended meanwhile
        return affinity[tid]

    def listdir(path: Any) -> list[str]:
        assert path == "/proc/self/task"
        return [str(tid) for tid in [*affinity, 107]]

    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(os, "sched_getaffinity", getaffinity)
    monkeypatch.setattr(os, "sched_setaffinity", lambda tid, cores: moved.append((tid, set(cores))))
    monkeypatch.setattr(_vllm_patches.threading, "get_native_id", lambda: main)
    _vllm_patches._bind_omp_threads_in_order(order)
    assert sorted(moved[:-1], key=lambda item: item[0]) == expected  # unbound (105), foreign (106): untouched
    assert moved[-1] == (0, {order[0]})  # the calling thread (the team's thread 0) last, to the order's first core


def test_binding_with_no_order_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    moved: list[Any] = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda *args: moved.append(args))
    _vllm_patches._bind_omp_threads_in_order([])
    assert moved == []
