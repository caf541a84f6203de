"""The real pair with push transfer (``transfer="push"``): P writes each step's KV into D, D pins it, P pulls it back.

One push pair for this module, beside the session's pull pair (both float32, so greedy answers compare
token for token). docs/transfer.md describes the two transfer modes and agentkv's connector.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import pytest

from agentkv import EmbeddedPair, EngineError, Session
from agentkv._engines import Sampling, StepDone, StepRequest
from agentkv._engines._handle import handle_of, pin_of
from agentkv._session._modes import Mode, modes_of
from agentkv.engines import Pin
from conftest import EXACT_DTYPE, PIN_TTL_S
from test_leaks import footprint

pytestmark = pytest.mark.pair

SYSTEM = "You are a terse assistant for a Python project. " + " ".join(
    f"Fact {i}: module m{i} exports function f{i}." for i in range(30)
)
QUESTIONS = ("Which module exports f3?", "And f7?", "Name one more module.")


@pytest.fixture(scope="module")
def push_pair(pair: EmbeddedPair) -> Iterator[EmbeddedPair]:
    """The module's push pair. Opened and closed here, it is also the landing's check that a pair opened and
    closed leaks nothing (the nightly tier cycles three in tests/test_leaks.py): ``pair`` first, so that the
    process-wide helpers a first pair starts (the multiprocessing resource tracker) exist before the count."""
    before = footprint()
    with EmbeddedPair(max_model_len=2048, pin_ttl_s=PIN_TTL_S, dtype=EXACT_DTYPE, transfer="push") as engine:
        yield engine
    assert before.growth(footprint()) == []


def _conversation(engine: EmbeddedPair, mode: Mode, salt: str) -> list[Any]:
    with Session(engine=engine, mode=mode, system=SYSTEM, max_tokens=16, cache_salt=salt) as session:
        return [session.run_sync(question).steps[0] for question in QUESTIONS]


def test_push_with_push_back_reuses_as_pull_does_and_answers_the_same(
    push_pair: EmbeddedPair, pair: EmbeddedPair
) -> None:
    assert push_pair.info.details["transfer"] == "push" and "auto" not in modes_of(push_pair.info)
    pushed = _conversation(push_pair, "bidirectional", "push")
    pulled = _conversation(pair, "bidirectional", "pull-reference")
    plain = _conversation(push_pair, "disaggregated", "push-plain")
    assert [s.token_ids for s in pushed] == [s.token_ids for s in pulled] == [s.token_ids for s in plain]
    block = push_pair._capacity()[1]  # D's KV block, in tokens (vLLM's CPU default: 128)
    block_bytes = _block_bytes(push_pair, block)
    for turn, (push, pull, no_back) in enumerate(zip(pushed, pulled, plain, strict=True), start=1):
        st = push.stats
        assert st.local_hit_tokens + st.pulled_tokens + st.computed_tokens == st.prompt_tokens
        # the same reuse as the pull pair: P's own cache, then D's pin read back
        assert (st.local_hit_tokens, st.pulled_tokens) == (pull.stats.local_hit_tokens, pull.stats.pulled_tokens)
        assert no_back.stats.pulled_tokens == 0
        if turn > 1:
            assert st.handle_forwarded and st.miss_reason is None and st.pulled_tokens > 0
        # whole blocks, and only those the other side lacks: turn 1 writes the prompt's blocks and reads none;
        # later turns read the blocks holding the pulled tokens and write those holding what D received
        assert st.kv_bytes is not None and st.kv_bytes % block_bytes == 0
        if turn == 1:
            assert st.kv_bytes == block_bytes * _blocks(st.prompt_tokens, block)
        else:
            most = _blocks(st.pulled_tokens, block) + 1 + _blocks(st.handoff_tokens, block) + 1
            assert block_bytes <= st.kv_bytes <= block_bytes * most


def _blocks(tokens: int, block: int) -> int:
    return -(-tokens // block)


def _block_bytes(engine: EmbeddedPair, block: int) -> int:
    """Bytes of one KV block of the bundled model in float32 (layers x K,V x KV heads x head size x 4 bytes)."""
    config = json.loads((engine.info.model_path / "config.json").read_text())
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return block * config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_size * 4


def _request(prompt: Sequence[int], pin: Pin | None, salt: str) -> StepRequest:
    return StepRequest(
        request_id=f"test-{uuid.uuid4().hex}",
        prompt_token_ids=list(prompt),
        sampling=Sampling(max_tokens=12),
        pin=pin,
        cache_salt=salt,
    )


async def _run(engine: EmbeddedPair, request: StepRequest) -> StepDone:
    done: StepDone | None = None
    async for event in engine.step(request):
        if isinstance(event, StepDone):
            done = event
    assert done is not None
    return done


async def _d_holds_no_block(engine: EmbeddedPair) -> bool:
    """vLLM resets D's prefix cache only when no block is in use (no pin, no request waiting for a push)."""
    assert engine._d is not None
    for _ in range(50):
        if await engine._d.llm.reset_prefix_cache():
            return True
        await anyio.sleep(0.1)
    return False


PROMPT = [1] + [(i * 7919) % 20000 + 100 for i in range(300)]


def test_a_declined_read_recomputes_and_d_still_gets_its_push(push_pair: EmbeddedPair) -> None:
    """A pin within P's 5 s refusal window: P declines the read, agentkv prefills again under the id D waits
    on, and the step answers as one without a pin would."""
    assert push_pair.home is not None
    push_pair.home.call(_declined_read, push_pair)


async def _declined_read(engine: EmbeddedPair) -> None:
    first = await _run(engine, _request(PROMPT, None, "declined"))
    assert first.pin is not None
    longer = PROMPT + list(first.token_ids) + [7, 8, 9]
    handle = handle_of(first.pin).model_copy(update={"remote_blocks_expiry_time": time.perf_counter() + 2.0})
    declined = await _run(engine, _request(longer, pin_of(handle), "declined"))
    reference = await _run(engine, _request(longer, None, "declined-reference"))
    assert declined.timings.pin_declined and declined.timings.pulled_tokens == 0
    assert declined.token_ids == reference.token_ids
    for pin in (first.pin, declined.pin, reference.pin):
        assert pin is not None
        await engine.release(pin)
    assert await _d_holds_no_block(engine)


def test_a_prefill_that_fails_leaves_d_clean_and_the_pair_usable(
    push_pair: EmbeddedPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P fails after D registered for its push: the step raises `EngineError`, D is not left waiting with its
    blocks held (a plain prefill under the same id completes the push before D is closed), and the next step
    works."""
    original = push_pair._prefill_or_recompute

    async def failing(*args: Any, **kwargs: Any) -> Any:
        raise EngineError("the prefill engine failed the request (test)")

    monkeypatch.setattr(push_pair, "_prefill_or_recompute", failing)
    assert push_pair.home is not None
    with pytest.raises(EngineError, match="test"):
        push_pair.home.call(_run, push_pair, _request(PROMPT, None, "failed"))
    monkeypatch.setattr(push_pair, "_prefill_or_recompute", original)
    assert push_pair.home.call(_d_holds_no_block, push_pair)
    after = push_pair.home.call(_run, push_pair, _request(PROMPT, None, "failed"))
    assert after.pin is not None and after.token_ids
    push_pair.home.call(push_pair.release, after.pin)
