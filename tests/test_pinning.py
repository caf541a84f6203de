"""The push-back rule, a pair's pins and handle validation (no engine needed)."""

from __future__ import annotations

from typing import Any

import pytest

from agentkv import EngineError, UserError
from agentkv._engines._handle import KVHandle, handle_of, parse_handle, parse_prefill_result, pin_of, prefill_params
from agentkv._engines._pinning import HeldPin, choose_pin, miss_after_step
from agentkv.engines import Pin

NOW = 1000.0


def _raw_handle(**changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "agentkv-decode-1",
        "remote_request_id": "r-d-0a1b2c3d",
        "remote_host": "127.0.0.1",
        "remote_port": 5701,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 5,
        "remote_blocks_expiry_time": NOW + 100,
        "transfer_mode": "pull",
    }
    raw.update(changes)
    return raw


def _pin(**changes: Any) -> HeldPin:
    handle, _ = parse_handle(_raw_handle(**changes))
    pin = pin_of(handle)
    assert pin is not None
    return HeldPin(pin, [1, 2, 3, 4, 5, 6])  # prompt + output; D computed the first 5


def test_forwards_when_the_prompt_extends_the_pinned_tokens() -> None:
    handle, reason = choose_pin(_pin(), [1, 2, 3, 4, 5, 6, 7, 8], push_back=True, expiry_margin_s=10, now=NOW)
    assert handle is not None and reason is None


@pytest.mark.parametrize(
    ("prompt", "why"),
    [
        ([1, 2, 9, 4, 5, 6, 7], "an edited token inside the pinned range"),
        ([1, 2, 3, 4], "a prompt shorter than the pinned range (rewound)"),
        ([1, 2, 3, 4, 5], "a prompt that ends where the pin ends: nothing new to prefill"),
    ],
)
def test_never_forwards_on_a_prefix_mismatch(prompt: list[int], why: str) -> None:
    handle, reason = choose_pin(_pin(), prompt, push_back=True, expiry_margin_s=10, now=NOW)
    assert handle is None and reason == "prefix_mismatch", why


def test_a_token_past_the_pinned_range_may_differ() -> None:
    # D computed KV for 5 tokens (prompt + output - 1): the 6th (last output token) is not pinned.
    handle, _ = choose_pin(_pin(), [1, 2, 3, 4, 5, 99, 7], push_back=True, expiry_margin_s=10, now=NOW)
    assert handle is not None


def test_expired_or_nearly_expired_pins_are_dropped() -> None:
    assert choose_pin(_pin(), [1, 2, 3, 4, 5, 6, 7], push_back=True, expiry_margin_s=10, now=NOW + 95) == (
        None,
        "expired",
    )
    assert choose_pin(_pin(), [1, 2, 3, 4, 5, 6, 7], push_back=True, expiry_margin_s=10, now=NOW + 200) == (
        None,
        "expired",
    )


def test_no_pin_and_push_back_off() -> None:
    assert choose_pin(None, [1, 2], push_back=True, expiry_margin_s=10, now=NOW) == (None, "no_handle")
    assert choose_pin(_pin(), [1, 2, 3, 4, 5, 6, 7], push_back=False, expiry_margin_s=10, now=NOW) == (
        None,
        "push_back_off",
    )


def test_miss_reason_after_the_engine_answered() -> None:
    handle = _pin().pin
    assert miss_after_step(handle, None, prompt_tokens=8, local_hit_tokens=0, pulled_tokens=5, declined=False) is None
    assert (
        miss_after_step(handle, None, prompt_tokens=8, local_hit_tokens=0, pulled_tokens=0, declined=True) == "declined"
    )
    assert (
        miss_after_step(handle, None, prompt_tokens=8, local_hit_tokens=0, pulled_tokens=0, declined=False)
        == "below_threshold"
    )
    assert (
        miss_after_step(handle, None, prompt_tokens=8, local_hit_tokens=5, pulled_tokens=0, declined=False) is None
    )  # P had it all: nothing to pull
    assert (
        miss_after_step(None, "expired", prompt_tokens=8, local_hit_tokens=0, pulled_tokens=0, declined=False)
        == "expired"
    )


@pytest.mark.parametrize(
    "missing",
    ["remote_request_id", "remote_block_ids", "remote_port", "remote_blocks_expiry_time", "remote_num_tokens"],
)
def test_a_malformed_handle_never_passes(missing: str) -> None:
    raw = _raw_handle()
    del raw[missing]
    handle, problem = parse_handle(raw)  # dropped with a reason, never forwarded (tests/test_handle.py)
    assert handle is None and problem and missing in problem


def test_wrong_direction_is_not_a_handle() -> None:
    assert parse_handle(_raw_handle(do_remote_decode=False, do_remote_prefill=True))[0] is None
    with pytest.raises(EngineError):
        parse_prefill_result(_raw_handle())  # D's handle is not P's hand-off


def test_prefill_params_carry_the_handle_unchanged() -> None:
    handle = KVHandle.model_validate(_raw_handle())
    params = prefill_params(handle)
    assert params == _raw_handle()
    assert prefill_params(None) == {"do_remote_decode": True, "do_remote_prefill": False}


def test_a_deadline_in_this_hosts_clock_wins_over_ds_clock() -> None:
    """D on another host: its expiry time is in its own clock; the pair's pin says ours (`Pin.expires_at`)."""
    handle = handle_of(_pin().pin)  # D's clock says it expires at NOW + 100
    later = HeldPin(pin_of(handle, deadline=NOW + 1000), [1, 2, 3, 4, 5, 6])
    sooner = HeldPin(pin_of(handle, deadline=NOW + 5), [1, 2, 3, 4, 5, 6])
    prompt = [1, 2, 3, 4, 5, 6, 7]
    assert choose_pin(later, prompt, push_back=True, expiry_margin_s=10, now=NOW + 500)[0] is later.pin
    assert choose_pin(sooner, prompt, push_back=True, expiry_margin_s=10, now=NOW) == (None, "expired")


def test_a_pairs_pin_carries_ds_handle_and_refuses_another_engines() -> None:
    handle = KVHandle.model_validate(_raw_handle())
    pin = pin_of(handle)
    assert pin == Pin(tokens=5, expires_at=NOW + 100, ref=handle) and handle_of(pin) is handle
    assert pin_of(None) is None and handle_of(None) is None
    with pytest.raises(UserError, match="only the pins it returned"):
        handle_of(Pin(tokens=5, expires_at=NOW + 100, ref="another engine's"))
