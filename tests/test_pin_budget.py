"""D's pin budget: pins never fill D's cache; the least recently pinned conversation is released first."""

from __future__ import annotations

import time

from agentkv._engines._handle import KVHandle
from agentkv._engines._pin_budget import PinBudget


def handle(name: str, blocks: list[int], *, ttl_s: float = 60.0) -> KVHandle:
    return KVHandle.model_validate(
        {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_block_ids": [blocks],
            "remote_engine_id": "agentkv-decode-1",
            "remote_request_id": name,
            "remote_host": "127.0.0.1",
            "remote_port": 41000,
            "tp_size": 1,
            "remote_num_tokens": 128 * len(blocks),
            "remote_blocks_expiry_time": time.perf_counter() + ttl_s,
        }
    )


def names(released: list[tuple[KVHandle, float]]) -> list[str]:
    return [h.remote_request_id for h, _ in released]


def test_pins_that_fit_beside_a_step_are_kept() -> None:
    budget = PinBudget(10, 128)
    budget.pinned(handle("a", [1, 2, 3]))
    budget.pinned(handle("b", [4, 5, 6]))
    assert budget.reserve("s", tokens=4 * 128, reused=None) == []  # 6 pinned + 4 reserved = 10: fits
    assert budget.pinned_blocks == 6 and budget.reserved_blocks == 4


def test_the_ledger_in_words_says_pins_blocks_and_reservations() -> None:
    budget = PinBudget(10, 128)
    budget.pinned(handle("a", [1, 2, 3]))
    budget.reserve("s", tokens=2 * 128, reused=None)
    assert budget.describe() == "1 pins holding 3 blocks, 2 reserved by 1 steps in flight of D's 10"
    assert PinBudget(None, 128).describe() == "0 pins holding 0 blocks, 0 reserved by 0 steps in flight"


def test_a_new_pin_that_crowds_out_the_steps_in_flight_makes_room_for_them() -> None:
    """Seen at 16 sessions: steps that ended pinned more than they had reserved (their answers), the steps still
    waiting on D lost their room (181 of 182 blocks pinned, 27 reserved) and waited for blocks until pins expired."""
    budget = PinBudget(10, 128)
    budget.pinned(handle("a", [1, 2]))
    assert budget.reserve("s", tokens=3 * 128, reused=None) == []
    assert budget.reserve("t", tokens=3 * 128, reused=None) == []  # 2 pinned + 6 reserved
    budget.finished("s")
    budget.pinned(handle("s", [3, 4, 5, 6]))  # its answer grew it past its reservation: 6 pinned + 3 reserved
    assert names(budget.make_room()) == []  # 9 of 10: fits
    budget.pinned(handle("b", [7, 8]))  # 8 pinned + 3 reserved > 10
    assert names(budget.make_room()) == ["a"]
    assert budget.pinned_blocks + budget.reserved_blocks <= 10
    capped = PinBudget(10, 128, max_pinned_blocks=1)  # the cap is checked as a step starts, with its pin to come
    capped.pinned(handle("c", [1, 2, 3]))
    assert names(capped.make_room()) == []


def test_the_least_recently_pinned_conversation_is_released_first() -> None:
    budget = PinBudget(10, 128)
    for name, blocks in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [7, 8])):
        budget.pinned(handle(name, blocks))
    assert names(budget.reserve("s", tokens=3 * 128 + 1, reused=None)) == ["a"]  # 8 + 4 > 10; 5 + 4 fits
    assert budget.was_evicted(handle("a", [1])) and not budget.was_evicted(handle("b", [4]))
    assert budget.pinned_blocks == 5


def test_the_pin_a_step_extends_stays_counted_until_the_step_ends_and_is_never_evicted() -> None:
    budget = PinBudget(9, 128)
    own, other = handle("own", [1, 2, 3, 4, 5]), handle("other", [6, 7])
    budget.pinned(own)
    budget.pinned(other)
    # The step extends `own` (5 blocks, its prefix on D) to 7 blocks: 2 new ones are reserved.
    assert budget.reserve("s", tokens=7 * 128, reused=own) == []
    assert budget.pinned_blocks == 7 and budget.reserved_blocks == 2
    assert names(budget.reserve("t", tokens=128, reused=None)) == ["other"]  # 7 + 2 + 1 > 9; `own` is in use
    budget.pinned(handle("own-next", [1, 2, 3, 4, 5, 8, 9]))
    budget.finished("s")
    assert budget.pinned_blocks == 7 and not budget.was_evicted(own)


def test_conversations_sharing_a_prefix_share_its_blocks() -> None:
    budget = PinBudget(10, 128)
    budget.pinned(handle("a", [1, 2, 3, 4]))
    budget.pinned(handle("b", [1, 2, 3, 5]))  # the same system prompt and tools: three shared blocks
    assert budget.pinned_blocks == 5
    assert budget.reserve("s", tokens=5 * 128, reused=None) == []


def test_expired_and_released_pins_hold_nothing() -> None:
    budget = PinBudget(10, 128)
    budget.pinned(handle("old", [1, 2, 3], ttl_s=-1))
    budget.pinned(handle("gone", [4, 5]))
    budget.gone(handle("gone", [4, 5]))
    assert budget.pinned_blocks == 0


def test_a_step_in_flight_counts_until_it_finishes() -> None:
    budget = PinBudget(10, 128)
    budget.reserve("s", tokens=6 * 128, reused=None)
    budget.pinned(handle("a", [1, 2, 3]))
    budget.finished("s")
    assert budget.reserved_blocks == 0
    assert budget.reserve("t", tokens=7 * 128, reused=None) == []  # 3 + 7: fits now that `s` is done
    assert names(budget.reserve("u", tokens=128, reused=None)) == ["a"]  # 3 + 7 + 1 does not


def test_max_pinned_blocks_caps_the_pins_with_the_step_to_come() -> None:
    budget = PinBudget(100, 128, max_pinned_blocks=6)
    budget.pinned(handle("a", [1, 2, 3]))
    budget.pinned(handle("b", [4, 5]))
    # The step will pin 2 blocks: 5 + 2 > 6, so `a` goes (b + the step = 4).
    assert names(budget.reserve("s", tokens=2 * 128, reused=None)) == ["a"]


def test_nothing_to_evict_is_not_an_error() -> None:
    budget = PinBudget(2, 128)
    assert budget.reserve("s", tokens=10 * 128, reused=None) == []  # bigger than D: vLLM itself refuses it


def test_a_pin_expires_at_its_deadline_in_this_process_s_clock() -> None:
    """An HTTP pair's D may be another host: its handle's expiry is in D's clock, the step's deadline in ours."""
    budget = PinBudget(10, 128)
    far_in_d_s_clock = handle("a", [1, 2], ttl_s=600)
    budget.pinned(far_in_d_s_clock, deadline=time.perf_counter() - 1)  # already past here
    assert budget.pinned_blocks == 0
    remote, local_deadline = handle("b", [3, 4, 5], ttl_s=600), time.perf_counter() + 42.0
    budget.pinned(remote, deadline=local_deadline)
    shared = handle("c", [6, 7, 8])
    budget.pinned(shared)
    # released to make room, each comes with the deadline its release is timed by: ours, or D's when shared
    released = budget.reserve("s", tokens=9 * 128, reused=None)
    assert released == [(remote, local_deadline), (shared, shared.remote_blocks_expiry_time)]


def test_a_d_of_unknown_size_is_bounded_by_the_cap_alone() -> None:
    """A decode server that publishes no cache size: no reservation can overflow it, the cap still holds."""
    budget = PinBudget(None, 16)
    budget.pinned(handle("a", [1, 2, 3]))
    assert budget.reserve("s", tokens=10_000 * 16, reused=None) == []
    budget.finished("s")
    budget.max_pinned_blocks = 4
    assert names(budget.reserve("t", tokens=2 * 16, reused=None)) == ["a"]  # 3 pinned + 2 new > 4
