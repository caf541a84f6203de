"""Elastic cores without engines: the host's `CoreTable` and the worker's side that follows it.

Every embedded engine holds a slot (its pid, its own cores, its requests in flight); a worker
reads the table before each forward pass and uses all the cores of its binding while no other
busy, live engine owns any of them. These tests check both ends with a temp file for the table
and recorders for torch's setter; one checks two processes sharing a table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from _agentkv_vllm import _elastic_worker
from _agentkv_vllm._cores import (
    SLOT_BYTES,
    SLOTS,
    TABLE_BYTES,
    CoreSlot,
    CoreTable,
    busy_sharers,
    core_mask,
    elastic_bind_order,
    owned_cores,
)
from _agentkv_vllm._elastic_worker import (
    RECHECK_MIN_TOKENS,
    CoreTableFollower,
    bind_order,
    hands_off_kv,
    kv_handed_off,
)


@pytest.fixture
def table(tmp_path: Path) -> CoreTable:
    return CoreTable(str(tmp_path / "cores"))


def _claim(table: CoreTable, cores: list[int]) -> CoreSlot:
    slot = table.claim(cores)
    assert slot is not None
    return slot


def _read(table: CoreTable) -> bytes:
    return Path(table.path).read_bytes()


# ----------------------------------------------------------------- the table


def test_slots_hold_their_cores_and_counts_and_free_on_release(table: CoreTable) -> None:
    p, d = _claim(table, [0]), _claim(table, [1])
    assert (p.index, d.index) == (0, 1) and os.path.getsize(table.path) == TABLE_BYTES
    data = _read(table)
    assert owned_cores(data, p.index) == {0} and owned_cores(data, d.index) == {1}
    assert busy_sharers(data, cores=core_mask([0, 1]), me=p.index) == []  # both idle
    d.set_in_flight(2)
    assert busy_sharers(_read(table), cores=core_mask([0, 1]), me=p.index) == [d.index]
    assert busy_sharers(_read(table), cores=core_mask([1]), me=d.index) == []  # never itself
    d.set_in_flight(0)
    assert busy_sharers(_read(table), cores=core_mask([0, 1]), me=p.index) == []
    d.release()
    assert _read(table)[d.index * SLOT_BYTES : (d.index + 1) * SLOT_BYTES] == bytes(SLOT_BYTES)
    d.set_in_flight(3)  # a count after release (a request ending as the engine stops) writes nothing
    d.release()
    assert _claim(table, [5]).index == d.index  # a freed slot is taken again


def test_busy_engines_on_other_cores_do_not_count(table: CoreTable) -> None:
    mine, elsewhere = _claim(table, [0]), _claim(table, [2, 3])
    elsewhere.set_in_flight(1)
    assert busy_sharers(_read(table), cores=core_mask([0, 1]), me=mine.index) == []


def test_a_dead_processs_slot_is_ignored_and_reused(table: CoreTable) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    slot = _claim(table, [1])
    slot.set_in_flight(1)
    with open(table.path, "r+b") as file:  # as if a process that was killed had left it busy
        file.seek(slot.index * SLOT_BYTES)
        file.write(dead_pid.to_bytes(4, "little", signed=True))
    assert busy_sharers(_read(table), cores=core_mask([0, 1]), me=-1) == []
    assert _claim(table, [0]).index == slot.index


def test_a_full_table_gives_no_slot(table: CoreTable, caplog: pytest.LogCaptureFixture) -> None:
    slots = [_claim(table, [0]) for _ in range(SLOTS)]
    assert table.claim([0]) is None and "full" in caplog.text
    slots[7].release()
    assert _claim(table, [0]).index == 7


def test_an_unusable_table_gives_no_slot(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert CoreTable(str(tmp_path / "missing-dir" / "cores")).claim([0]) is None
    assert "cannot open" in caplog.text


def test_cores_beyond_the_table_are_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        core_mask([4096])


def test_two_processes_share_one_table(table: CoreTable) -> None:
    """Another process's busy engine on our partner's cores is seen; its slot is never handed out twice."""
    script = textwrap.dedent(
        """
        import sys, time
        from _agentkv_vllm._cores import CoreTable
        slot = CoreTable(sys.argv[1]).claim([1])
        slot.set_in_flight(1)
        print(slot.index, flush=True)
        sys.stdin.read()  # until the test is done
        """
    )
    other = subprocess.Popen(
        [sys.executable, "-c", script, table.path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout is not None
        theirs = int(other.stdout.readline())
        mine = _claim(table, [0])
        assert mine.index != theirs
        assert busy_sharers(_read(table), cores=core_mask([0, 1]), me=mine.index) == [theirs]
    finally:
        other.communicate("", timeout=60)
    assert busy_sharers(_read(table), cores=core_mask([0, 1]), me=mine.index) == []  # exited: its slot is dead


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
    assert bind_order() == order


def test_bind_order_without_the_variable_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert bind_order() == []


class _Worker:
    """Records what a `CoreTableFollower` asks of torch and of the binding."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, bind: str) -> None:
        import torch

        self.threads: list[int] = []
        self.bindings: list[list[int]] = []
        monkeypatch.setattr(torch._C, "set_num_threads", self.threads.append)
        monkeypatch.setattr(_elastic_worker, "bind_omp_threads_in_order", self.bindings.append)
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)


def test_follower_borrows_only_while_no_sharer_is_busy_and_sets_on_change(
    monkeypatch: pytest.MonkeyPatch, table: CoreTable
) -> None:
    worker = _Worker(monkeypatch, "1,0")  # D of a two-core pair
    p, d = _claim(table, [0]), _claim(table, [1])
    follower = CoreTableFollower(table.path, d.index)
    d.set_in_flight(1)  # its own count never stops it
    follower.apply()
    assert worker.threads == [2] and worker.bindings == [[1, 0]]  # P idle: both cores, bound on the first pass
    follower.apply()
    assert worker.threads == [2]  # unchanged: not set again
    p.set_in_flight(1)
    follower.apply()
    assert worker.threads == [2, 1]  # P busy: D's own core only
    p.set_in_flight(0)
    follower.apply()
    assert worker.threads == [2, 1, 2]
    assert worker.bindings == [[1, 0]]  # bound once, whatever the changes


def test_a_pass_after_a_hand_off_keeps_to_its_own_cores(monkeypatch: pytest.MonkeyPatch, table: CoreTable) -> None:
    """P's pass right after it finished a prefill: D takes that request now, before the table says D is busy."""
    worker = _Worker(monkeypatch, "0,1")  # P of a two-core pair
    p, _d = _claim(table, [0]), _claim(table, [1])
    follower = CoreTableFollower(table.path, p.index)
    follower.apply()
    follower.apply(handing_off=True)
    follower.apply()  # D's request never came (or is done): both cores again
    assert worker.threads == [2, 1, 2]


def test_a_hand_off_pass_follows_the_table_once_the_partner_shows_busy(
    monkeypatch: pytest.MonkeyPatch, table: CoreTable
) -> None:
    worker = _Worker(monkeypatch, "0,1")
    p, d = _claim(table, [0]), _claim(table, [1])
    follower = CoreTableFollower(table.path, p.index, replan=list)
    follower.apply(tokens=2048, handing_off=True)
    follower.before_layer()  # D's request is not in the table yet: still its own core
    d.set_in_flight(1)
    follower.before_layer()
    d.set_in_flight(0)
    follower.before_layer()  # D was busy and is done: its core comes back within the pass
    assert worker.threads == [1, 2]


def test_a_long_pass_changes_threads_between_layers_and_replans_its_attention(
    monkeypatch: pytest.MonkeyPatch, table: CoreTable
) -> None:
    import torch

    worker = _Worker(monkeypatch, "0,1")  # P of a two-core pair
    p, d = _claim(table, [0]), _claim(table, [1])
    replanned: list[int] = []
    follower = CoreTableFollower(table.path, p.index, replan=lambda: [lambda: replanned.append(worker.threads[-1])])
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Identity() for _ in range(3)])
    follower.watch_layers(_eager_worker(model))
    d.set_in_flight(1)
    follower.apply(tokens=RECHECK_MIN_TOKENS)  # a prefill while D decodes: P's own core
    model.layers[0](torch.zeros(1))
    d.set_in_flight(0)
    for layer in model.layers[1:]:
        layer(torch.zeros(1))  # D is done: the next layer takes its core back, planned for two threads
    assert worker.threads == [1, 2] and replanned == [2]
    d.set_in_flight(1)
    follower.apply(tokens=RECHECK_MIN_TOKENS - 1)  # a short pass reads the table once
    d.set_in_flight(0)
    model.layers[0](torch.zeros(1))
    assert worker.threads == [1, 2, 1] and replanned == [2]


def test_a_pass_whose_attention_cannot_be_replanned_keeps_its_threads(
    monkeypatch: pytest.MonkeyPatch, table: CoreTable
) -> None:
    worker = _Worker(monkeypatch, "0,1")
    p, d = _claim(table, [0]), _claim(table, [1])
    follower = CoreTableFollower(table.path, p.index, replan=lambda: None)
    d.set_in_flight(1)
    follower.apply(tokens=2048)
    d.set_in_flight(0)
    follower.before_layer()
    assert worker.threads == [1]


def test_a_compiled_model_gets_no_layer_hooks(table: CoreTable) -> None:
    import torch

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Identity()])
    follower = CoreTableFollower(table.path, _claim(table, [0]).index)
    follower.watch_layers(_eager_worker(model, eager=False))
    assert follower.watching_layers and not model.layers[0]._forward_pre_hooks


def _eager_worker(model: Any, *, eager: bool = True) -> Any:
    return SimpleNamespace(
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(enforce_eager=eager)),
        model_runner=SimpleNamespace(get_model=lambda: model),
    )


def test_cpu_attention_metadata_is_replanned_with_the_arguments_of_its_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapped builder records how vLLM planned a pass's attention; a re-plan repeats that call (vLLM's own
    functions replaced here by doubles that count, so the test needs no engine)."""
    import vllm.forward_context
    from vllm import _custom_ops
    from vllm.v1.attention.backends import cpu_attn

    plans: list[dict[str, Any]] = []

    def plan(**arguments: Any) -> str:
        plans.append(arguments)
        return f"plan {len(plans)}"

    def build(self: Any, common_prefix_len: int, common: Any, fast_build: bool = False) -> Any:
        return SimpleNamespace(scheduler_metadata=cpu_attn.ops.cpu_attn_get_scheduler_metadata(num_reqs=common))

    monkeypatch.setattr(_custom_ops, "cpu_attn_get_scheduler_metadata", plan)
    monkeypatch.setattr(cpu_attn.CPUAttentionMetadataBuilder, "build", build)
    _elastic_worker._make_cpu_attention_replannable()
    first = cpu_attn.CPUAttentionMetadataBuilder.build(object(), 0, 3)
    second = cpu_attn.CPUAttentionMetadataBuilder.build(object(), 0, 5)
    unrecorded = SimpleNamespace(scheduler_metadata="vLLM's")
    assert (first.scheduler_metadata, second.scheduler_metadata) == ("plan 1", "plan 2")

    context: dict[str, Any] = {}
    monkeypatch.setattr(vllm.forward_context, "is_forward_context_available", lambda: bool(context))
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: SimpleNamespace(**context))
    assert _elastic_worker._attention_replans() is None  # outside a forward pass
    context["attn_metadata"] = {"layers.0": first, "layers.1": first}  # layers share their group's metadata
    replans = _elastic_worker._attention_replans()
    assert replans is not None and len(replans) == 1
    replans[0]()
    assert first.scheduler_metadata == "plan 3" and plans[2] == {"num_reqs": 3}  # the same call, made again
    context["attn_metadata"] = [{"layers.0": first}, {"layers.0": second}]  # micro-batches
    assert len(_elastic_worker._attention_replans() or []) == 2
    context["attn_metadata"] = {"layers.0": first, "layers.1": unrecorded}
    assert _elastic_worker._attention_replans() is None  # one it cannot re-plan: the count stays


def test_a_hand_off_is_a_prefill_whose_kv_nixl_sends_not_any_finished_request() -> None:
    def output(**metadata: Any) -> Any:
        return SimpleNamespace(finished_req_ids={"r"}, kv_connector_metadata=SimpleNamespace(**metadata))

    assert kv_handed_off(output(reqs_to_send={"r": 1.0}))  # pull: D reads P's blocks
    assert kv_handed_off(output(push_finished_blocks={"r": [[1]]}))  # push: P writes them into D
    assert not kv_handed_off(output(reqs_to_send={}))  # e.g. a pin's release, aborted: nothing for D
    assert not kv_handed_off(SimpleNamespace(finished_req_ids={"r"}, kv_connector_metadata=None))


def test_the_worker_knows_whether_it_hands_off_kv() -> None:
    def worker(role: str | None) -> Any:
        transfer = None if role is None else SimpleNamespace(kv_role=role)
        return SimpleNamespace(vllm_config=SimpleNamespace(kv_transfer_config=transfer))

    assert hands_off_kv(worker("kv_producer"))
    assert not hands_off_kv(worker("kv_consumer")) and not hands_off_kv(worker(None))


def test_a_second_pair_on_the_same_cores_stops_borrowing(monkeypatch: pytest.MonkeyPatch, table: CoreTable) -> None:
    """Two pairs split the same two cores: one pair's P may not borrow while the other's P or D computes."""
    worker = _Worker(monkeypatch, "0,1")
    p1, _d1 = _claim(table, [0]), _claim(table, [1])
    p2, d2 = _claim(table, [0]), _claim(table, [1])
    follower = CoreTableFollower(table.path, p1.index)
    follower.apply()
    assert worker.threads == [2]
    d2.set_in_flight(1)
    follower.apply()
    p2.set_in_flight(1)
    d2.set_in_flight(0)
    follower.apply()  # the other P owns P1's own core: P1 keeps to its own, one thread
    assert worker.threads == [2, 1]
    p2.set_in_flight(0)
    follower.apply()
    assert worker.threads == [2, 1, 2]


def test_follower_on_four_cores_counts_its_own(monkeypatch: pytest.MonkeyPatch, table: CoreTable) -> None:
    worker = _Worker(monkeypatch, "2,3,0,1")
    p, d = _claim(table, [0, 1]), _claim(table, [2, 3])
    follower = CoreTableFollower(table.path, d.index)
    p.set_in_flight(1)
    follower.apply()
    p.set_in_flight(0)
    follower.apply()
    assert worker.threads == [2, 4]


# ----------------------------------------------------------------- binding the OMP team

_BIND_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading
    from _agentkv_vllm._elastic_worker import bind_omp_threads_in_order

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
    bind_omp_threads_in_order(order)
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
    monkeypatch.setattr(_elastic_worker.threading, "get_native_id", lambda: main)
    _elastic_worker.bind_omp_threads_in_order(order)
    assert sorted(moved[:-1], key=lambda item: item[0]) == expected  # unbound (105), foreign (106): untouched
    assert moved[-1] == (0, {order[0]})  # the calling thread (the team's thread 0) last, to the order's first core


def test_binding_with_no_order_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    moved: list[Any] = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda *args: moved.append(args))
    _elastic_worker.bind_omp_threads_in_order([])
    assert moved == []
