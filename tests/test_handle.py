"""The KV dicts between P and D: what is accepted, what is refused, and what is sent on."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest

from agentkv import EngineError
from agentkv._engines._handle import (
    KVHandle,
    parse_handle,
    parse_prefill_result,
    prefill_params,
    release_params,
)

pytestmark = pytest.mark.compat  # also the compatibility tier's (make compat: scripts/compat.py)


def d_reply(**changes: Any) -> dict[str, Any]:
    """A dict as vLLM 0.32's D returns it after a step (NixlPullConnectorScheduler.request_finished)."""
    reply: dict[str, Any] = {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [[7, 8, 9]],
        "remote_engine_id": "agentkv-decode-1234",
        "remote_request_id": "agentkv-abc-d-0f1e2d3c",
        "remote_host": "127.0.0.1",
        "remote_port": 41000,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 300,
        "remote_blocks_expiry_time": 12345.5,
        "transfer_mode": "pull",
    }
    reply.update(changes)
    return {key: value for key, value in reply.items() if value is not ...}


def p_reply(**changes: Any) -> dict[str, Any]:
    """A dict as P returns it after a prefill, with the cached count vLLM's scheduler adds."""
    return d_reply(
        do_remote_prefill=True,
        do_remote_decode=False,
        remote_blocks_expiry_time=None,
        remote_prefill_cached_tokens=256,
        **changes,
    )


def test_a_good_handle_is_kept_and_sent_back_whole() -> None:
    handle, problem = parse_handle(d_reply())
    assert problem is None and isinstance(handle, KVHandle)
    assert prefill_params(handle) == d_reply()


def test_a_push_pairs_handle_is_kept_with_its_transfer_mode() -> None:
    handle, problem = parse_handle(d_reply(transfer_mode="push"))
    assert problem is None and handle is not None and handle.transfer_mode == "push"
    assert prefill_params(handle) == d_reply(transfer_mode="push")


def test_no_handle_is_not_a_problem() -> None:
    assert parse_handle(None) == (None, None)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"remote_blocks_expiry_time": math.nan}, "remote_blocks_expiry_time"),
        ({"remote_blocks_expiry_time": math.inf}, "remote_blocks_expiry_time"),
        ({"remote_blocks_expiry_time": -math.inf}, "remote_blocks_expiry_time"),
        ({"remote_block_ids": []}, "remote_block_ids"),
        ({"remote_block_ids": [[]]}, "remote_block_ids"),
        ({"remote_block_ids": [[3, -1]]}, "remote_block_ids"),
        ({"remote_host": ""}, "remote_host"),
        ({"remote_host": "   "}, "remote_host"),
        ({"remote_host": "10.0.0.1 "}, "remote_host"),
        ({"remote_engine_id": " "}, "remote_engine_id"),
        ({"remote_request_id": ...}, "remote_request_id"),
        ({"remote_port": 0}, "remote_port"),
        ({"remote_num_tokens": 0}, "remote_num_tokens"),
        ({"transfer_mode": "teleport"}, "transfer_mode"),
        ({"do_remote_decode": False}, "do_remote_decode"),
    ],
)
def test_a_malformed_handle_is_dropped_with_a_reason(
    changes: dict[str, Any], field: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="agentkv"):
        handle, problem = parse_handle(d_reply(**changes))
    assert handle is None and problem is not None and field in problem
    assert "malformed KV handle" in caplog.text


def test_a_dict_that_is_no_dict_is_dropped() -> None:
    handle, problem = parse_handle("not a dict")
    assert handle is None and problem


def test_unknown_keys_are_never_sent_on() -> None:
    """extra="ignore": a key agentkv does not know is neither refused nor forwarded."""
    handle, problem = parse_handle(d_reply(agentkv_unexpected="x", _remote_blocks_processed=True))
    assert handle is not None and problem is None
    assert prefill_params(handle) == d_reply()
    result = parse_prefill_result(p_reply(agentkv_unexpected="x"))
    assert "agentkv_unexpected" not in result.as_decode_params()


def test_what_d_gets_from_p_is_ps_dict_without_empty_fields() -> None:
    params = parse_prefill_result(p_reply()).as_decode_params()
    assert params == {key: value for key, value in p_reply().items() if value is not None}
    assert params["remote_prefill_cached_tokens"] == 256  # D reports P's cache hit with it


def test_a_malformed_prefill_result_fails_the_step() -> None:
    with pytest.raises(EngineError, match="malformed transfer params"):
        parse_prefill_result(p_reply(remote_block_ids=[[-2]]))
    with pytest.raises(EngineError):
        parse_prefill_result(None)


def test_a_release_asks_p_to_read_nothing() -> None:
    handle, _ = parse_handle(d_reply())
    assert handle is not None
    params = release_params(handle)
    assert params["remote_num_tokens"] == 0  # P's connector then finds nothing to pull and only notifies D
    assert {key: value for key, value in params.items() if key != "remote_num_tokens"} == {
        key: value for key, value in d_reply().items() if key != "remote_num_tokens"
    }
