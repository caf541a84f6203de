"""The session's pin steps between turns on the suite's real pair (src/agentkv/_session/_pin_upkeep.py): the repin
after a stop string and the early transfer into P. Both are off in the other tests (tests/conftest.py); these are
marked ``upkeep`` to keep them on. The honest-pair tests of the same steps: tests/test_pin_upkeep.py.
"""

from __future__ import annotations

import time
import uuid

import pytest

from agentkv import EmbeddedPair, Session

pytestmark = [pytest.mark.pair, pytest.mark.upkeep]

_QUESTION = {"role": "user", "content": "Name three primary colours, in one sentence."}
_FOLLOW_UP = {"role": "user", "content": "And three secondary colours?"}


def _session(pair: EmbeddedPair, **options: object) -> Session:
    return Session(engine=pair, max_tokens=24, cache_salt=f"upkeep-{uuid.uuid4().hex[:8]}", **options)  # type: ignore[arg-type]


def test_a_turn_a_stop_string_ended_is_pinned_again_and_the_next_turn_pulls(pair: EmbeddedPair) -> None:
    with _session(pair) as session:
        first = session.step_sync([_QUESTION], stop=" ")  # greedy: ends at the answer's first space
        assert first.finish_reason == "stop" and " " not in first.text and session.stats.turns[-1].repins == 0
        time.sleep(0.5)  # the caller's pause: the repin (one token on D) runs now
        assert session.pinned_tokens == len(session.token_ids)  # D pins the whole conversation again
        second = session.step_sync([_QUESTION, {"role": "assistant", "content": first.text}, _FOLLOW_UP])
        turn = session.stats.turns[-1]
        stats = second.stats
        assert turn.repins == 1 and stats.handle_forwarded and stats.miss_reason in (None, "below_threshold"), stats
        assert stats.pulled_tokens > 0 or stats.miss_reason == "below_threshold", stats


def test_the_early_transfer_moves_the_kv_before_the_next_turn_and_changes_no_answer(pair: EmbeddedPair) -> None:
    answers: dict[bool, list[str]] = {}
    pulled: dict[bool, int] = {}
    for early in (False, True):
        with _session(pair, early_transfer=early) as session:
            first = session.step_sync([_QUESTION])
            time.sleep(0.5)  # the pause: the early transfer runs now
            messages = [_QUESTION, {"role": "assistant", "content": first.text}, _FOLLOW_UP]
            second = session.step_sync(messages)
            turn = session.stats.turns[-1]
            assert turn.early_transfers == int(early) and second.stats.handle_forwarded, turn
            answers[early] = [first.text, second.text]
            pulled[early] = second.stats.pulled_tokens
    assert answers[True] == answers[False]  # greedy: the same answers with and without
    # P caches whole blocks only: after the early transfer the step still pulls the conversation's last partial block
    # (here the whole of this short conversation); what it saves, the whole blocks since P's last prefill, is measured
    # by docs/benchmarks.md's steps after a pause
    assert all(count > 0 for count in pulled.values()), pulled
