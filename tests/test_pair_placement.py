"""The real pair's performance levers: steps placed on D alone, P's first token, elastic cores (docs/performance.md)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from agentkv import EmbeddedPair, Session
from agentkv._engines import Engine, Placement, Sampling, StepDone, StepRequest, TokenDelta
from agentkv._engines._pair_layer import PairLayer
from agentkv.engines import Pin

pytestmark = pytest.mark.pair

SYSTEM = "You are a terse assistant for a Python project. " + " ".join(
    f"Fact {i}: module m{i} exports function f{i}." for i in range(30)
)
QUESTIONS = ("Which module exports f3?", "And f7?", "Name one more module.")
MAX_TOKENS = 12


async def _step(
    pair: Engine, prompt: Sequence[int], pin: Pin | None, placement: Placement, salt: str
) -> tuple[StepDone, list[int]]:
    request = StepRequest(
        request_id=f"test-{uuid.uuid4().hex}",
        prompt_token_ids=list(prompt),
        sampling=Sampling(max_tokens=MAX_TOKENS),
        pin=pin,
        cache_salt=salt,
        placement=placement,
    )
    streamed: list[int] = []
    done: StepDone | None = None
    async for event in pair.step(request):
        if isinstance(event, TokenDelta):
            streamed.extend(event.token_ids)
        else:
            done = event
    assert done is not None
    return done, streamed


def test_auto_mode_answers_as_bidirectional_and_says_where_each_step_ran(pair: EmbeddedPair) -> None:
    answers: dict[str, list[list[int]]] = {}
    for mode in ("bidirectional", "auto"):
        with Session(engine=pair, mode=mode, system=SYSTEM, max_tokens=MAX_TOKENS, cache_salt=mode) as session:
            results = [session.run_sync(question) for question in QUESTIONS]
        answers[mode] = [result.steps[0].token_ids for result in results]
        for turn, result in enumerate(results, start=1):
            stats = result.steps[0].stats
            assert stats.prefill_engine in ("prefill", "decode") and stats.placement_reason
            if mode == "bidirectional":
                assert stats.prefill_engine == "prefill"
            if turn > 1:
                assert stats.handle_forwarded and stats.miss_reason is None
            if stats.prefill_engine == "decode":  # D's own cache served the pinned conversation's whole blocks
                assert stats.pulled_tokens == 0 and stats.handoff_tokens == 0
                assert stats.local_hit_tokens >= pair._capacity()[1]  # at least one of D's blocks
    assert answers["auto"] == answers["bidirectional"]


def test_a_step_on_d_alone_matches_p_and_pins_the_longer_conversation(pair: EmbeddedPair) -> None:
    """Placed on D, a step reuses D's whole blocks of the pin, computes the rest, answers as P would, and
    returns a pin that the next step (on P) pulls from."""
    assert pair.home is not None
    pair.home.call(steps_on_d_and_p, pair)


async def steps_on_d_and_p(pair: Engine) -> None:
    """A step on D alone, the same prompt on P for reference, and a step on P that pulls what D pinned; every pin
    released at the end. For any pair kind (tests/test_launched.py runs it on the launched servers)."""
    base_prompt = [1] + [(i * 7919) % 20000 + 100 for i in range(300)]
    first, _ = await _step(pair, base_prompt, None, "prefill", "on-d")
    assert first.pin is not None
    held = first.pin.tokens
    prompt = base_prompt + list(first.token_ids) + [(i * 104729) % 20000 + 100 for i in range(40)]

    on_d, streamed = await _step(pair, prompt, first.pin, "decode", "on-d")
    reference, _ = await _step(pair, prompt, None, "prefill", "reference")

    assert list(on_d.token_ids) == list(reference.token_ids) == streamed
    timings = on_d.timings
    assert timings.prefill_engine == "decode" and timings.pulled_tokens == 0 and timings.handoff_tokens == 0
    assert isinstance(pair, PairLayer)
    block = pair._capacity()[1]  # D's KV block, in tokens (vLLM's CPU default: 128)
    assert timings.local_hit_tokens == held // block * block
    assert timings.local_hit_tokens + timings.computed_tokens == len(prompt)
    assert on_d.pin is not None and on_d.pin.tokens == len(prompt) + len(on_d.token_ids) - 1

    longer = prompt + list(on_d.token_ids) + [7, 8, 9]
    after, _ = await _step(pair, longer, on_d.pin, "prefill", "on-d")
    assert after.timings.prefill_engine == "prefill" and after.timings.pulled_tokens > 0
    assert after.pin is not None and reference.pin is not None
    await pair.release(after.pin)
    await pair.release(reference.pin)
    if isinstance(pair, EmbeddedPair):
        assert await _d_holds_no_block(pair)  # every pin freed: the steps on D included


async def _d_holds_no_block(pair: EmbeddedPair) -> bool:
    """vLLM resets D's prefix cache only when no block is in use (no pin left)."""
    assert pair._d is not None
    for _ in range(50):
        if await pair._d.llm.reset_prefix_cache():
            return True
        await anyio.sleep(0.1)  # D frees a released pin on its next poll
    return False


def test_each_worker_computes_from_its_own_first_core(pair: EmbeddedPair) -> None:
    """Elastic cores: an engine's thread team starts on its own cores (vLLM's NIXL worker moves the main
    thread to the last core; the budget follower moves it back), so P's and D's teams of their own size
    never share a core."""
    if pair.info.details["core_policy"] != "elastic":
        pytest.skip("the pair runs with split cores (one core only?)")
    own = {"prefill": pair.info.details["prefill_cores"], "decode": pair.info.details["decode_cores"]}
    for role, engine in (("prefill", pair._p), ("decode", pair._d)):
        assert engine is not None
        workers = [pid for pid in engine.pids if _comm(pid).startswith("VLLM::Worker")]
        assert workers, f"no worker process found for {role}"
        for pid in workers:
            assert os.sched_getaffinity(pid) == {own[role][0]}, role


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as file:
            return file.read().strip()
    except OSError:
        return ""


def _cpu_on(pids: set[int], cores: set[int]) -> float:
    """CPU seconds so far of the threads of ``pids`` bound inside ``cores``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                if not os.sched_getaffinity(int(tid)) <= cores:
                    continue
                with open(f"/proc/{pid}/task/{tid}/stat") as file:
                    fields = file.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def test_a_decode_borrows_the_idle_prefill_engines_cores(pair: EmbeddedPair, tokenizer: Any) -> None:
    """Elastic cores for decodes too: while P has nothing in flight, D's thread team runs on P's cores as well
    (its helper threads, bound to P's cores, do work)."""
    if pair.info.details["core_policy"] != "elastic":
        pytest.skip("the pair runs with split cores (one core only?)")
    assert pair.home is not None
    pair.home.call(_decode_on_both, pair, tokenizer)


async def _decode_on_both(pair: EmbeddedPair, tokenizer: Any) -> None:
    assert pair._d is not None
    p_cores = set(pair.info.details["prefill_cores"])
    d_workers = {pid for pid in pair._d.pids if _comm(pid).startswith("VLLM::Worker")}
    before = _cpu_on(d_workers, p_cores)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Count from 1 to 100, one number per line."}], add_generation_prompt=True
    )
    request = StepRequest(
        request_id=f"test-{uuid.uuid4().hex}",
        prompt_token_ids=list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt),
        sampling=Sampling(max_tokens=48),
        cache_salt=uuid.uuid4().hex,
    )
    done: StepDone | None = None
    async for event in pair.step(request):
        if isinstance(event, StepDone):
            done = event
    assert done is not None and len(done.token_ids) >= 24, done
    if done.pin is not None:
        await pair.release(done.pin)
    borrowed = _cpu_on(d_workers, p_cores) - before
    assert borrowed > 0.05, f"D's threads on P's cores used {borrowed:.3f} s of CPU over {len(done.token_ids)} tokens"
