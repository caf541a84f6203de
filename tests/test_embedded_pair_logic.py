"""`EmbeddedPair`'s step logic on a fake vLLM (no engine starts): errors, transfer ledgers, a
malformed handle, pin release, and the warm-up's push-back rule.

The same paths run on the real pair in test_pair.py; here each is forced on purpose.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from _agentkv_vllm._patches import stop_output_handler
from agentkv import EmbeddedPair, EngineError, PairConfig, UserError
from agentkv._engines import StepDone, StepRequest, TokenDelta
from agentkv._engines._base import Pin, Sampling
from agentkv._engines._engine_launch import engine_launch
from agentkv._engines._handle import handle_of
from agentkv._engines._pair_layer import run_warmup_steps
from agentkv._engines._vllm import AsyncLLMRunner, EngineRequest
from agentkv.testing import HonestPairEngine
from test_handle import d_reply, p_reply

pytestmark = pytest.mark.anyio


Script = Callable[[list[int], Any, str], AsyncIterator[Any]]


def _output(*, token_ids: list[int], finished: bool, params: dict[str, Any] | None = None) -> Any:
    completion = SimpleNamespace(token_ids=token_ids, text="x" * len(token_ids), finish_reason="length")
    return SimpleNamespace(
        outputs=[completion], finished=finished, kv_transfer_params=params, metrics=None, num_cached_tokens=0
    )


class FakeLLM:
    """The part of vLLM's ``AsyncLLM`` an embedded engine uses, run by a script per request."""

    errored = False
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=128, num_gpu_blocks=181))

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[tuple[list[int], Any, str]] = []
        self.priorities: dict[str, int] = {}
        self.closed: list[str] = []

    async def generate(self, prompt: Any, params: Any, request_id: str, *, priority: int = 0) -> AsyncIterator[Any]:
        self.requests.append((list(prompt["prompt_token_ids"]), params, request_id))
        self.priorities[request_id] = priority
        try:
            async for output in self.script(list(prompt["prompt_token_ids"]), params, request_id):
                yield output
        finally:
            self.closed.append(request_id)


def fake_engine(name: str, script: Script) -> tuple[AsyncLLMRunner, FakeLLM]:
    launch = engine_launch(name=name, model_path=Path("/fake"), cores=[0], max_model_len=4096, kv_cache_gib=1.0)
    engine, llm = AsyncLLMRunner(launch), FakeLLM(script)
    engine._llm = llm  # type: ignore[assignment]
    return engine, llm


def report_nixl(engine: AsyncLLMRunner, nbytes: int) -> None:
    """What vLLM's stat logger hands the engine during a step that moved ``nbytes``."""
    logger = engine._stat_logger_factory()(None)
    logger.record(
        SimpleNamespace(kv_connector_stats={"bytes_transferred": [nbytes], "transfer_duration": [0.01]}), None
    )


class FakePair(EmbeddedPair):
    """An embedded pair whose engines are fakes: the lifecycle and the step logic are the real ones."""

    def __init__(self, prefill: Script, decode: Script, **settings: Any) -> None:
        super().__init__(config=PairConfig(warmup=False, **settings))
        self.p, self.p_llm = fake_engine("prefill", prefill)
        self.d, self.d_llm = fake_engine("decode", decode)

    async def _start(self) -> None:
        self._p, self._d = self.p, self.d
        self._info = SimpleNamespace(pins=True)  # type: ignore[assignment]
        self._placement_off = None  # as `_know_started` finds it on a vLLM with auto placement's targets

    async def _stop(self) -> None:
        pass


async def prefill_ok(prompt: list[int], params: Any, request_id: str) -> AsyncIterator[Any]:
    yield _output(token_ids=[5], finished=True, params=p_reply(remote_num_tokens=len(prompt)))


def decode_with(handle: dict[str, Any] | None, nbytes: int = 0) -> Script:
    async def decode(prompt: list[int], params: Any, request_id: str) -> AsyncIterator[Any]:
        yield _output(token_ids=[11, 12], finished=False)
        yield _output(token_ids=[13], finished=True, params=handle)

    return decode


def request(prompt: list[int] | None = None, pin: Pin | None = None) -> StepRequest:
    return StepRequest(
        request_id=f"r{id(object())}",
        prompt_token_ids=prompt or [1] * 40,
        sampling=Sampling(max_tokens=3),
        pin=pin,
    )


async def run_step(pair: EmbeddedPair, req: StepRequest) -> StepDone:
    done = [event async for event in pair.step(req) if isinstance(event, StepDone)]
    return done[0]


async def test_a_stalled_prefill_is_an_engine_error_and_later_steps_still_count_bytes() -> None:
    calls = 0

    async def prefill(prompt: list[int], params: Any, request_id: str) -> AsyncIterator[Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            await anyio.sleep_forever()
        report_nixl(pair.p, 100)
        yield _output(token_ids=[5], finished=True, params=p_reply())

    async def decode(prompt: list[int], params: Any, request_id: str) -> AsyncIterator[Any]:
        report_nixl(pair.d, 7)
        yield _output(token_ids=[13], finished=True, params=d_reply())

    pair = FakePair(prefill, decode, step_timeout_s=0.2)
    async with pair:
        with pytest.raises(EngineError, match="did not finish") as caught:
            await run_step(pair, request())
        assert not isinstance(caught.value, TimeoutError)
        assert pair.p._readouts.in_flight == {}  # the stalled request's ledger is gone
        done = await run_step(pair, request())
    assert done.timings.kv_bytes == 107  # P's 100 and D's 7: the step was alone on both engines


async def test_a_step_left_midway_releases_its_ledgers() -> None:
    async def decode(prompt: list[int], params: Any, request_id: str) -> AsyncIterator[Any]:
        yield _output(token_ids=[11], finished=False)
        report_nixl(pair.d, 9)
        yield _output(token_ids=[13], finished=True, params=d_reply())

    pair = FakePair(prefill_ok, decode)
    async with pair:
        steps = pair.step(request())
        assert isinstance(await anext(steps), TokenDelta)  # P's token
        assert isinstance(await anext(steps), TokenDelta)  # D's first
        await steps.aclose()  # the caller leaves (a cancelled turn)
        assert pair.p._readouts.in_flight == {} and pair.d._readouts.in_flight == {}
        assert pair.d_llm.closed  # vLLM's generator was closed, which aborts the request
        done = await run_step(pair, request())
    assert done.timings.kv_bytes == 9


async def test_a_malformed_handle_keeps_the_answer_and_drops_push_back() -> None:
    pair = FakePair(prefill_ok, decode_with(d_reply(remote_host="  ")))
    async with pair:
        done = await run_step(pair, request())
    assert list(done.token_ids) == [5, 11, 12, 13] and done.finish_reason == "length"
    assert done.pin is None and done.pin_error and "remote_host" in done.pin_error


async def test_release_asks_p_for_a_notify_only_read_then_aborts_it() -> None:
    async def prefill(prompt: list[int], params: Any, request_id: str) -> AsyncIterator[Any]:
        if not request_id.startswith("agentkv-release"):
            async for output in prefill_ok(prompt, params, request_id):
                yield output
            return
        for _ in range(params.max_tokens):
            yield _output(token_ids=[5], finished=False)

    expiring = d_reply(remote_blocks_expiry_time=time.perf_counter() + 5)
    pair = FakePair(prefill, decode_with(expiring), pin_ttl_s=60)
    async with pair:
        pin = (await run_step(pair, request())).pin
        assert pin is not None
        await pair.release(pin)
        assert len(pair.p_llm.requests) == 1  # only the step's prefill: an expiring pin is left to expire
        live = handle_of(pin).model_copy(update={"remote_blocks_expiry_time": time.perf_counter() + 60})
        await pair.release(Pin(tokens=pin.tokens, expires_at=live.remote_blocks_expiry_time, ref=live))
    prompt, params, request_id = pair.p_llm.requests[-1]
    sent = params.extra_args["kv_transfer_params"]
    assert len(prompt) == 1 and sent["remote_num_tokens"] == 0 and sent["remote_request_id"] == live.remote_request_id
    assert params.max_tokens > 1 and params.ignore_eos  # it cannot finish (and lease P's block) before the abort
    assert request_id in pair.p_llm.closed and pair.p._readouts.in_flight == {}
    step_id = pair.p_llm.requests[0][2]
    assert pair.p_llm.priorities == {step_id: 0, request_id: -1}  # scheduled before P's queued prefills


async def test_a_release_the_guard_refuses_sends_nothing() -> None:
    """A pin saved for other doors is released only when the guard (the pool's store) says no door has it."""
    asked: list[str] = []

    async def guard(pin_id: str) -> bool:
        asked.append(pin_id)
        return len(asked) > 1  # the first: another door took it; the second: taken back off offer

    live = d_reply(remote_blocks_expiry_time=time.perf_counter() + 60)
    pair = FakePair(prefill_ok, decode_with(live), pin_ttl_s=60)
    async with pair:
        pair.guard_releases(guard)
        pin = (await run_step(pair, request())).pin
        assert pin is not None
        await pair.release(pin)
        assert len(pair.p_llm.requests) == 1  # only the step's prefill
        await pair.release(pin)
        assert len(pair.p_llm.requests) == 2 and asked == [handle_of(pin).remote_request_id] * 2
        said = pair.describe_pins()  # what a stall's error reports of D's pins
        assert said.endswith("pins let go: 1 kept for another process, 1 released")
        assert said.startswith("pins: 0 pins holding 0 blocks, 0 reserved by 0 steps in flight of D's ")


async def test_release_after_close_does_nothing() -> None:
    pair = FakePair(prefill_ok, decode_with(d_reply()))
    async with pair:
        pin = (await run_step(pair, request())).pin
    assert pin is not None
    await pair.release(pin)
    assert len(pair.p_llm.requests) == 1


async def test_the_warm_up_obeys_the_push_back_rule() -> None:
    async with HonestPairEngine() as engine:
        await run_warmup_steps(engine, push_back=True)
        engine.assert_honest()
        assert [step.forwarded for step in engine.steps] == [False, True]
        assert not any(step.declined for step in engine.steps)
        assert engine.released == 1 and engine.live_pins == 0  # nothing of the warm-up stays pinned


def test_pair_settings_build_one_config() -> None:
    pair = EmbeddedPair("some-model", max_model_len=2048, pin_ttl_s=60)
    assert pair.config == PairConfig(model="some-model", max_model_len=2048, pin_ttl_s=60)
    base = PairConfig(kv_cache_gib=2.0)
    assert EmbeddedPair(config=base, warmup=False).config == PairConfig(kv_cache_gib=2.0, warmup=False)
    with pytest.raises(UserError, match="unknown pair setting"):
        EmbeddedPair(max_model_length=2048)  # type: ignore[call-arg]


def test_the_output_handler_is_stopped_before_the_engine() -> None:
    """vLLM's shutdown queues an "engine dead" for its output handler; stopped first, the handler never reads it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()

    async def start_handler() -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(asyncio.sleep(3600))

    try:
        handler = asyncio.run_coroutine_threadsafe(start_handler(), loop).result()
        stop_output_handler(SimpleNamespace(output_handler=handler))
        assert handler.cancelled()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


async def test_the_prefill_token_starts_the_answer_and_decode_continues_after_it() -> None:
    pair = FakePair(prefill_ok, decode_with(d_reply()))
    async with pair:
        events = [event async for event in pair.step(request())]
    first, *_rest, done = events
    assert isinstance(first, TokenDelta) and list(first.token_ids) == [5]  # streamed before D starts
    assert isinstance(done, StepDone) and list(done.token_ids) == [5, 11, 12, 13]
    d_prompt, d_params, _ = pair.d_llm.requests[0]
    assert d_prompt == [1] * 40 + [5]  # D continues after P's token
    assert d_params.max_tokens == 2  # and generates one token fewer
    p_params = pair.p_llm.requests[0][1]
    assert p_params.max_tokens == 1 and p_params.temperature == 0.0  # P sampled it with the step's sampling


async def test_the_prefill_token_is_not_used_when_the_prompt_fills_its_last_block() -> None:
    pair = FakePair(prefill_ok, decode_with(d_reply()))
    async with pair:
        done = await run_step(pair, request([1] * 128))
    assert list(done.token_ids) == [11, 12, 13]
    assert pair.d_llm.requests[0][0] == [1] * 128


def _timed(output: Any, queued: float, scheduled: float) -> Any:
    output.metrics = SimpleNamespace(
        queued_ts=queued, scheduled_ts=scheduled, first_token_ts=scheduled + 0.05, last_token_ts=scheduled + 0.2
    )
    return output


async def _timed_prefill(prompt: list[int], params: Any, request_id: str) -> AsyncIterator[Any]:
    yield _timed(_output(token_ids=[5], finished=True, params=p_reply(remote_num_tokens=len(prompt))), 1.0, 1.004)


async def _timed_decode(prompt: list[int], params: Any, request_id: str) -> AsyncIterator[Any]:
    yield _output(token_ids=[11, 12], finished=False)
    yield _timed(_output(token_ids=[13], finished=True, params=d_reply()), 2.0, 2.010)


@pytest.mark.parametrize(("prompt", "handoff"), [([1] * 40, 0.010), ([1] * 128, 0.0)])
async def test_d_s_wait_after_the_prefill_token_is_the_hand_over_s_not_the_first_token_s(
    prompt: list[int], handoff: float
) -> None:
    pair = FakePair(_timed_prefill, _timed_decode)
    async with pair:
        done = await run_step(pair, request(prompt))
    # both engines' waits, as vLLM's request timestamps give them; D's comes after the first token only when P's
    # token was streamed as the first (not when the prompt fills its last block: then D samples the first)
    assert done.timings.kv_wait_s == pytest.approx(0.014)
    assert done.timings.handoff_wait_s == pytest.approx(handoff)


@pytest.mark.parametrize(
    ("stop", "first_used"),
    [(("\n",), True), (("x",), False), (("xy",), False)],  # P's token's text is "x"
)
async def test_stop_strings_go_to_d_and_the_prefill_token_is_used_only_when_no_stop_string_involves_it(
    stop: tuple[str, ...], first_used: bool
) -> None:
    pair = FakePair(prefill_ok, decode_with(d_reply()))
    async with pair:
        done = await run_step(pair, dataclasses.replace(request(), sampling=Sampling(max_tokens=3, stop=stop)))
    p_params, (d_prompt, d_params, _) = pair.p_llm.requests[0][1], pair.d_llm.requests[0]
    assert not p_params.stop  # P samples its one token without them: D would not see a string begun in it
    assert d_params.stop == list(stop)
    assert (d_prompt == [1] * 40 + [5]) is first_used
    assert list(done.token_ids) == ([5, 11, 12, 13] if first_used else [11, 12, 13])


async def test_a_step_on_d_alone_sends_d_the_prompt_marked_for_a_pin_and_releases_the_old_one() -> None:
    from _agentkv_vllm._patches import PIN_ON_DECODE
    from agentkv._engines._handle import parse_handle, pin_of

    old, _ = parse_handle(d_reply(remote_num_tokens=300, remote_blocks_expiry_time=time.perf_counter() + 300))
    assert old is not None
    pair = FakePair(prefill_ok, decode_with(d_reply()))
    async with pair:
        req = StepRequest(
            request_id="r-on-d",
            prompt_token_ids=[1] * 340,
            sampling=Sampling(max_tokens=3),
            pin=pin_of(old),
            placement="decode",
        )
        done = await run_step(pair, req)
        for _ in range(20):  # the old pin's release runs in the background
            if pair.p_llm.requests:
                break
            await anyio.sleep(0.05)
    d_prompt, d_params, d_id = pair.d_llm.requests[0]
    assert d_prompt == [1] * 340 and d_id.endswith("-dl")  # the whole prompt, no P hop
    assert d_params.extra_args["kv_transfer_params"][PIN_ON_DECODE] is True
    assert list(done.token_ids) == [11, 12, 13] and done.pin is not None
    assert done.timings.prefill_engine == "decode" and done.timings.placement_reason == "asked"
    assert done.timings.pulled_tokens == 0 and done.timings.handoff_tokens == 0
    released = pair.p_llm.requests[0][1].extra_args["kv_transfer_params"]
    assert released["remote_request_id"] == old.remote_request_id and released["remote_num_tokens"] == 0


async def test_a_pin_released_to_make_room_is_never_pushed_back() -> None:
    """D's pins may not fill its cache: past `max_pinned_blocks` the oldest pin is released (through P),
    and a step that brings that handle back runs without it (its blocks may hold another conversation)."""
    expiry = time.perf_counter() + 60
    pins = iter(
        d_reply(remote_request_id=name, remote_block_ids=[blocks], remote_blocks_expiry_time=expiry)
        for name, blocks in (("pin-a", [1, 2, 3]), ("pin-b", [4, 5, 6]), ("pin-c", [7]), ("pin-d", [8]))
    )

    a_released = anyio.Event()

    async def prefill(prompt: list[int], params: Any, request_id: str) -> AsyncIterator[Any]:
        if not request_id.startswith("agentkv-release"):
            async for output in prefill_ok(prompt, params, request_id):
                yield output
            return
        if params.extra_args["kv_transfer_params"]["remote_request_id"] == "pin-a":
            a_released.set()
        for _ in range(params.max_tokens):
            yield _output(token_ids=[5], finished=False)

    async def decode(prompt: list[int], params: Any, request_id: str) -> AsyncIterator[Any]:
        yield _output(token_ids=[13], finished=True, params=next(pins))

    def sent_to_p() -> list[dict[str, Any]]:
        return [params.extra_args["kv_transfer_params"] for _, params, _ in pair.p_llm.requests]

    pair = FakePair(prefill, decode, max_pinned_blocks=5, pin_ttl_s=60)
    async with pair:
        a = (await run_step(pair, request())).pin
        await run_step(pair, request())  # a (3 blocks) + this step's 1 fit under 5
        await run_step(pair, request())  # a + b = 6 do not: a is released
        with anyio.fail_after(5):
            await a_released.wait()
        assert sent_to_p()[-1]["remote_num_tokens"] == 0  # the notify-only read that frees a pin
        assert a is not None
        done = await run_step(pair, request(pin=a))
    assert done.timings.pin_evicted and not done.timings.stats_fields().get("pin_evicted")
    assert "remote_request_id" not in sent_to_p()[-1]  # the step's prefill went without the handle


async def test_a_request_waiting_for_a_push_counts_as_busy_only_from_its_first_output() -> None:
    """A push D computes nothing until P's write lands: until then P may use D's cores."""
    arrived = anyio.Event()
    seen: list[int] = []

    async def decode(prompt: list[int], params: Any, request_id: str) -> AsyncIterator[Any]:
        seen.append(engine.in_flight)  # submitted, waiting for the push
        await arrived.wait()
        yield _output(token_ids=[11], finished=False)
        seen.append(engine.in_flight)
        yield _output(token_ids=[12], finished=True)

    engine, _ = fake_engine("decode", decode)
    outputs = engine.generate(EngineRequest([1, 2], None, "r-x"), busy_from_first_output=True)
    first = asyncio.ensure_future(anext(outputs))
    await anyio.sleep(0.01)
    arrived.set()
    await first
    async for _ in outputs:
        pass
    assert seen == [0, 1] and engine.in_flight == 0
    plain = engine.generate(EngineRequest([1, 2], None, "r-d"))
    arrived = anyio.Event()
    arrived.set()
    async for _ in plain:
        pass
    assert seen[2:] == [1, 1] and engine.in_flight == 0
