"""Elastic cores inside a vLLM CPU worker: its thread count follows the host's core table (`CoreTable`).

Installed by `_agentkv_vllm._patches.install` in engines started with ``core_policy="elastic"``, once the
targets of the feature (``ELASTIC_CORES`` in `_agentkv_vllm._patches.FEATURES`) pass their probes
(docs/vllm-patches.md section 5, docs/performance.md, "Elastic cores"). Before each forward pass the worker
uses all the cores of its binding while no other busy engine owns any of them, its own otherwise. In a
long pass (a prefill of `RECHECK_MIN_TOKENS` or more) it reads the table again before every decoder
layer, and when the answer changes it changes its thread count there and re-plans the pass's CPU
attention for the new count (vLLM's kernel splits each pass's attention between a fixed number of
threads and refuses to run a layer with another).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from typing import Any

from ._cores import TABLE_BYTES, busy_sharers, core_mask, owned_cores

__all__ = ["RECHECK_MIN_TOKENS", "follow_core_table"]

RECHECK_MIN_TOKENS = 64
"""A forward pass of this many tokens or more re-reads the core table before each decoder layer (~20 us each)."""
_PATCHED_MARK = "_agentkv_elastic"
_PLAN = "agentkv_plan"
"""The attribute of a CPU attention metadata object that says how its thread split was planned."""


def follow_core_table(table: str) -> None:
    """Patch the CPU worker to follow the host's core table (``table``: "path:slot")."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    if getattr(CPUWorker, _PATCHED_MARK, None) is not None:
        return
    _make_cpu_attention_replannable()
    execute = CPUWorker.execute_model
    path, _, slot = table.rpartition(":")
    follower = CoreTableFollower(path, int(slot))

    def execute_within_budget(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if not follower.watching_layers:
            follower.watch_layers(self)
        follower.apply(
            tokens=scheduler_output.total_num_scheduled_tokens,
            handing_off=hands_off_kv(self) and kv_handed_off(scheduler_output),
        )
        return execute(self, scheduler_output, *args, **kwargs)

    execute_within_budget.__wrapped__ = execute  # type: ignore[attr-defined]  # a later probe sees vLLM's parameters
    CPUWorker.execute_model = execute_within_budget  # type: ignore[method-assign]
    setattr(CPUWorker, _PATCHED_MARK, table)


class CoreTableFollower:
    """The worker's side of the `CoreTable`: all the cores of its binding while no other busy engine owns any of
    them, its own otherwise; set before each forward pass and, in long passes, before each decoder layer."""

    def __init__(
        self, path: str, slot: int, *, replan: Callable[[], list[Callable[[], None]] | None] | None = None
    ) -> None:
        self._path = path
        self._slot = slot
        self._replan = replan or _attention_replans
        self._fd: int | None = None  # opened at the first pass: only a worker runs passes
        self._order: list[int] = []
        self._order_mask = 0
        self._own = 0
        self._threads = 0
        self._expect_sharer = False
        self._recheck = False
        self.watching_layers = False

    def apply(self, *, tokens: int = 0, handing_off: bool = False) -> None:
        """Set the thread count for a pass of ``tokens`` tokens. ``handing_off``: the last pass finished a prefill
        whose KV another engine now takes (a pair's P): that engine is about to be busy, though its request may
        not be in the table yet, so this pass keeps to its own cores until the table shows it busy (and then
        follows the table, layer by layer if the pass is long)."""
        self._expect_sharer = handing_off
        self._recheck = tokens >= RECHECK_MIN_TOKENS
        wanted = self._wanted()
        if wanted != self._threads:
            self._set_threads(wanted)

    def before_layer(self) -> None:
        """Between two decoder layers of a long pass: change the thread count if the table says so, re-planning the
        pass's attention for it; if some attention of the pass cannot be re-planned, keep the count."""
        if not self._recheck:
            return
        wanted = self._wanted()
        if wanted == self._threads:
            return
        replans = self._replan()
        if replans is None:
            return
        self._set_threads(wanted)
        for replan in replans:
            replan()

    def watch_layers(self, worker: Any) -> None:
        """Call `before_layer` before each decoder layer of the worker's model (eager models only: a compiled
        graph runs no Python hooks)."""
        self.watching_layers = True
        if not worker.vllm_config.model_config.enforce_eager:
            return
        for name, module in worker.model_runner.get_model().named_modules():
            if name.rpartition(".")[2] == "layers" and hasattr(module, "__len__"):
                for layer in module:
                    layer.register_forward_pre_hook(lambda _module, _args: self.before_layer())
                return

    def _wanted(self) -> int:
        if self._fd is None:
            self._start()
        assert self._fd is not None
        table = os.pread(self._fd, TABLE_BYTES, 0)
        if busy_sharers(table, cores=self._order_mask, me=self._slot):
            self._expect_sharer = False  # it is in the table now: the table says when it is done
            return self._own
        return self._own if self._expect_sharer else len(self._order)

    def _set_threads(self, count: int) -> None:
        if count:
            import torch

            torch._C.set_num_threads(count)  # vLLM replaces torch.set_num_threads with a warning
            self._threads = count

    def _start(self) -> None:
        self._fd = os.open(self._path, os.O_RDONLY)
        self._order = bind_order()
        self._order_mask = core_mask(self._order)
        table = os.pread(self._fd, TABLE_BYTES, 0)
        owned = owned_cores(table, self._slot)
        self._own = sum(1 for core in self._order if core in owned) or len(self._order)
        bind_omp_threads_in_order(self._order)


def hands_off_kv(worker: Any) -> bool:
    """Whether the worker's engine is a KV producer (a pair's P): its finished prefills go on to D."""
    transfer = worker.vllm_config.kv_transfer_config
    return transfer is not None and transfer.kv_role == "kv_producer"


def kv_handed_off(scheduler_output: Any) -> bool:
    """Whether the last pass finished a prefill whose KV D now takes: NIXL's metadata for this pass lists its
    blocks for D to read (pull, ``reqs_to_send``) or for P to write (push, ``push_finished_blocks``).

    Not ``finished_req_ids``: that also holds aborted requests, such as a pin's release, which D takes nothing from.
    """
    metadata = getattr(scheduler_output, "kv_connector_metadata", None)
    return bool(getattr(metadata, "reqs_to_send", None) or getattr(metadata, "push_finished_blocks", None))


# ----------------------------------------------------------------- re-planning a pass's attention


def _make_cpu_attention_replannable() -> None:
    """Record on each CPU attention metadata object how its thread split was planned (attribute `_PLAN`).

    vLLM's builder plans the split once per pass (``cpu_attn_get_scheduler_metadata``, for the current thread
    count); a re-plan calls the same function with the same arguments, which the wrapper records.
    """
    from vllm import _custom_ops
    from vllm.v1.attention.backends import cpu_attn

    plan = _custom_ops.cpu_attn_get_scheduler_metadata
    build = cpu_attn.CPUAttentionMetadataBuilder.build
    recorded: dict[str, Any] = {}

    def recording_plan(**arguments: Any) -> Any:
        recorded.update(arguments)
        return plan(**arguments)

    def replannable_build(self: Any, *args: Any, **kwargs: Any) -> Any:
        recorded.clear()
        metadata = build(self, *args, **kwargs)
        if recorded:
            setattr(metadata, _PLAN, (plan, dict(recorded)))
        return metadata

    recording_plan.__wrapped__ = plan  # type: ignore[attr-defined]  # a later probe sees vLLM's
    replannable_build.__wrapped__ = build  # type: ignore[attr-defined]
    _custom_ops.cpu_attn_get_scheduler_metadata = recording_plan
    cpu_attn.CPUAttentionMetadataBuilder.build = replannable_build  # type: ignore[method-assign]


def _attention_replans() -> list[Callable[[], None]] | None:
    """A re-plan for each attention metadata object of the pass running now; None if one was not recorded."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    groups = get_forward_context().attn_metadata
    by_layer = [groups] if isinstance(groups, dict) else list(groups or [])
    unique = {id(metadata): metadata for layers in by_layer for metadata in layers.values()}
    if not unique or any(not hasattr(metadata, _PLAN) for metadata in unique.values()):
        return None
    return [functools.partial(_replan, metadata) for metadata in unique.values()]


def _replan(metadata: Any) -> None:
    plan, arguments = getattr(metadata, _PLAN)
    metadata.scheduler_metadata = plan(**arguments)


# ----------------------------------------------------------------- binding


def bind_order() -> list[int]:
    """``VLLM_CPU_OMP_THREADS_BIND`` as a list, in its order (``"1,0"`` -> ``[1, 0]``; ranges ascend)."""
    cores: list[int] = []
    first_rank = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").split("|")[0]
    for part in first_rank.split(","):
        first, _, last = part.strip().partition("-")
        if first.isdigit() and (not last or last.isdigit()):
            cores.extend(range(int(first), int(last or first) + 1))
    return cores


def bind_omp_threads_in_order(order: list[int]) -> None:
    """Thread i of the OMP team on ``order[i]`` (called from the worker's main thread, the team's thread 0).

    vLLM binds thread i to the i-th *lowest* core of its list, whatever the list's order, and
    its NIXL worker then moves the main thread to the last core. An elastic engine needs its
    own cores first (a team of its own size stays on them), so the helper threads vLLM bound
    are moved to the cores of the same rank in ``order``, and the main thread to ``order[0]``.
    """
    if not order:
        return
    by_rank = dict(zip(sorted(order), order, strict=True))
    main = threading.get_native_id()
    bound: dict[int, int] = {}
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        with contextlib.suppress(OSError):
            cores = os.sched_getaffinity(tid)
            if tid != main and len(cores) == 1:
                bound[tid] = next(iter(cores))
    for tid, core in bound.items():
        if core in by_rank and by_rank[core] != core:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, {by_rank[core]})
    os.sched_setaffinity(0, {order[0]})
