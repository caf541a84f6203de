"""A NIXL connector for vLLM 0.32 that pushes P->D and pulls D's pinned conversation back (push-back).

P WRITEs its KV into the blocks D registered (vLLM's push mode). With ``bidirectional_kv_xfer``, D pins its
blocks when a decode ends and returns a handle, and on the next turn P READs the part it lacks from D
(pull mode's D->P path, with its ``kv_recompute_threshold`` and its refusal to read near expiry).

vLLM's ``NixlPushConnectorScheduler`` refuses the flag. The conflict: in push mode D's worker gets "P's WRITE
into this request is done" and "P has read this request's pin" as the same notification (``<D's request
id>:<n>``) and tells them apart only by whether it tracks the request for sending. Pull mode tracks D's request
for sending from allocation on, which would make P's WRITE release a pin that does not exist yet and leave D
waiting for its KV. Here D's request is tracked for sending only once it is pinned; everything else is vLLM's
push or pull code, picked per request.

P's read of D's pin reaches D's worker as a notification (``<D's request id>:<readers>``). vLLM 0.32's push worker
released a pin on it; from 0.33 on, the push worker routes every notification to the requests it receives and drops
the rest ("Unrecognized request ... notif (may have expired)"), which left every pin until its expiry.
`AgentKVPushWorker._get_new_notifs` takes the notifications of requests it tracks for sending (pinned) out of push's
queue and releases them as pull's worker does; the rest stay push's. `pin_release_problem` runs that path on a
worker built without an engine: the probe of push with push-back checks the behaviour, not only the names.

vLLM loads this module in its engine processes (``kv_connector="AgentKVPushConnector"``,
``kv_connector_module_path="_agentkv_vllm._push_connector"``); like the rest of `_agentkv_vllm`, it imports
nothing from agentkv. Every vLLM name, method and attribute it builds on is a target of the feature it serves
(``PUSH_BACK`` in `_agentkv_vllm._patches.FEATURES`): agentkv probes them before it chooses this connector and
refuses push with push-back by name where one is missing (tests/test_vllm_patches.py checks the list is whole).
"""

from __future__ import annotations

import copy
import queue
from collections import defaultdict
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPushConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.utils import BlockIds
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["AgentKVPushConnector", "pin_release_problem"]


class AgentKVPushScheduler(NixlPushConnectorScheduler, NixlPullConnectorScheduler):  # type: ignore[misc]  # vLLM is not type-checked here
    """Push's scheduler, with pull's read of D's handle on P and pull's pin at the end of a decode on D."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig) -> None:
        # push's __init__ raises on the flag and reads it nowhere else: hide it for that call only
        assert vllm_config.kv_transfer_config is not None
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        bidirectional = extra.pop("bidirectional_kv_xfer", None)
        try:
            super().__init__(vllm_config, engine_id, kv_cache_config)
        finally:
            if bidirectional is not None:
                extra["bidirectional_kv_xfer"] = bidirectional
        self.is_bidirectional_kv_xfer_enabled = bool(bidirectional)

    # Pull's count covers both D waiting for a push (the same as push's) and P holding a handle to D's pin.
    get_num_new_matched_tokens = NixlPullConnectorScheduler.get_num_new_matched_tokens

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """P: pull's (queue the read of D's pin, if any). D: push's (register the blocks it lacks with P).

        Pull's version on D would track the request for sending now; see the module docstring.
        """
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            NixlPullConnectorScheduler.update_state_after_alloc(self, request, blocks, num_external_tokens)
        else:
            NixlPushConnectorScheduler.update_state_after_alloc(self, request, blocks, num_external_tokens)

    def request_finished(self, request: Request, block_ids: BlockIds) -> tuple[bool, dict[str, Any] | None]:
        """P, and a D request never scheduled: push's. A D request that ran: pull's pin and handle.

        A pinned request is tracked for sending from here on, so the next notification for it is P's read.
        """
        params = request.kv_transfer_params
        finished: tuple[bool, dict[str, Any] | None]
        if not params or params.get("do_remote_decode") or params.get("do_remote_prefill"):
            finished = NixlPushConnectorScheduler.request_finished(self, request, block_ids)
            return finished
        self._push_registration_deadlines.pop(request.request_id, None)
        finished = NixlPullConnectorScheduler.request_finished(self, request, block_ids)
        if finished[0]:
            self._reqs_in_batch.add(request.request_id)
        return finished


class AgentKVPushWorker(NixlPushConnectorWorker, NixlPullConnectorWorker):  # type: ignore[misc]  # vLLM is not type-checked here
    """Push's writer thread and notification routing, with pull's READ for P's reads of D's pin."""

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        """A receive that names remote blocks is P reading D's pin (pull's path); the others wait for a push."""
        reads = NixlConnectorMetadata()
        reads.reqs_to_recv = {r: m for r, m in metadata.reqs_to_recv.items() if m.remote and m.remote.block_ids}
        pushed = copy.copy(metadata)
        pushed.reqs_to_recv = {r: m for r, m in metadata.reqs_to_recv.items() if r not in reads.reqs_to_recv}
        NixlPushConnectorWorker.start_load_kv(self, pushed)
        # also starts the reads whose handshake with D has just finished
        NixlPullConnectorWorker.start_load_kv(self, reads)

    def _get_new_notifs(self) -> set[str]:
        """D: the requests whose pin P has read (all its readers), released as pull's worker releases them.

        A notification for a request this worker tracks for sending is a read of its pin (a pinned request is
        tracked only from its pin on: see the module docstring); the others (heartbeats, P's WRITEs into
        requests D receives) go back to push's queue, for push's handling.
        """
        reads: list[tuple[str, int]] = []
        others: list[bytes] = []
        while True:
            try:
                notif = self._pending_completion_notifs.get_nowait()
            except queue.Empty:
                break
            req_id, _, readers = notif.decode("utf-8").rpartition(":")
            tracked = req_id in self._reqs_to_send or req_id in self._reqs_to_process
            if tracked and not notif.startswith(b"HB:") and readers.isdigit():
                reads.append((req_id, int(readers)))
            else:
                others.append(notif)
        for notif in others:
            self._pending_completion_notifs.put(notif)
        released: set[str] = NixlPushConnectorWorker._get_new_notifs(self)
        for req_id, readers in reads:
            self.expected_consumer_notifications_by_req[req_id] = readers
            self.consumer_notification_counts_by_req[req_id] += 1
            if self.consumer_notification_counts_by_req[req_id] >= readers:
                del self.consumer_notification_counts_by_req[req_id]
                del self.expected_consumer_notifications_by_req[req_id]
                self._reqs_to_process.discard(req_id)
                self._reqs_to_send.pop(req_id, None)
                released.add(req_id)
        return released


class AgentKVPushConnector(NixlPushConnector):  # type: ignore[misc]  # vLLM is not type-checked here
    """``NixlPushConnector`` with `AgentKVPushScheduler` and `AgentKVPushWorker`."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        # not NixlPushConnector.__init__: it builds vLLM's push scheduler, which refuses the flag
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise ValueError("AgentKVPushConnector does not support decode_context_parallel_size > 1.")
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = AgentKVPushScheduler(vllm_config, self.engine_id, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = AgentKVPushWorker(vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"Unsupported KVConnectorRole: {role}")


def pin_release_problem() -> str | None:
    """What is wrong with D's side of push-back's release on the installed vLLM; None: it releases.

    Runs `AgentKVPushWorker._get_new_notifs` on a worker made without an engine, holding what vLLM's push worker
    holds when P has read D's pinned request ``d-req-1`` (one reader) and has finished writing into ``d-push-2``,
    a request D receives: the pin must be released and no longer tracked, and the push must be done (push's own
    routing, vLLM's code). vLLM 0.33's push worker alone dropped the read (``set()``), leaving the pin until its
    expiry.
    """
    worker: Any = object.__new__(AgentKVPushWorker)
    expired: list[str] = []
    state: dict[str, Any] = {
        "_pending_completion_notifs": queue.Queue(),
        "_reqs_to_send": {"d-req-1": float("inf")},
        "_reqs_to_process": {"d-req-1"},
        "consumer_notification_counts_by_req": defaultdict(int),
        "expected_consumer_notifications_by_req": {},
        "_recving_metadata": {"d-push-2": SimpleNamespace(pp_size=1, tp_size=1)},
        "_recving_transfers": {},
        "world_size": 1,
        "transfer_topo": SimpleNamespace(tp_ratio=lambda _consumers: 1),
        "xfer_stats": SimpleNamespace(record_notification_after_expiry=lambda: expired.append("notif")),
    }
    vars(worker).update(state)
    for notif in (b"d-req-1:1", b"d-push-2:1"):
        worker._pending_completion_notifs.put(notif)
    try:
        released = worker._get_new_notifs()
    except Exception as exc:
        return f"D's worker failed on P's read notification ({exc!r})"
    if released != {"d-req-1"}:
        return f"P's read of a pin does not release it on D (released: {sorted(released) or 'none'})"
    if "d-req-1" in worker._reqs_to_send or "d-req-1" in worker._reqs_to_process:
        return "D still tracks a released pin for sending"
    if "d-push-2" not in worker._recving_transfers:
        return "P's finished push into D is no longer reported done"
    if expired:
        return "D counted one of P's notifications as one after expiry"
    return None
