"""Per-step placement without engines: the cost model, the pair's choice, and session mode "auto" on the doubles.

A step is prefilled on P with push-back or on D alone from D's cache of the pinned conversation
(`PlacementCosts` compares the two estimates; under an objective, tests/test_placement_slo.py). Mode "auto"
asks the pair to choose; every other mode asks for P. The doubles do not place steps; a wrapper below reports a step as D's, as the
pair does, to check what the session makes of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pydantic
import pytest

from agentkv import Mode, Session, StepStats, UserError
from agentkv._engines import Placement
from agentkv._engines._compute import ComputeCost, ComputeModel
from agentkv._engines._handle import KVHandle, pin_of
from agentkv._engines._pair_layer import PairLayer
from agentkv._engines._pinning import miss_after_step
from agentkv._engines._placement import PlacementChoice, PlacementCosts
from agentkv._engines._vllm import first_token_of_prefill
from agentkv._session._modes import modes_of, natural_mode
from agentkv.engines import EngineInfo, Pin, Sampling, StepDone, StepEvent, StepRequest
from agentkv.testing import HonestPairEngine, ScriptedEngine

BLOCK = 128

# ----------------------------------------------------------------- the cost model


def _costs(prefill: float, decode: float, *, per_token: float = 1e-3, per_attended: float = 0.0) -> PlacementCosts:
    """Costs with overheads ``prefill`` and ``decode`` and a compute model fixed at the given rates."""
    compute = ComputeModel(ComputeCost(pass_s=0.0, per_token_s=per_token, per_attended_s=per_attended))
    return PlacementCosts(overhead_s={"prefill": prefill, "decode": decode}, compute=compute)


def test_the_overhead_is_what_the_first_token_took_beyond_the_compute_first_replacing_the_prior() -> None:
    costs = PlacementCosts()
    costs.observe("prefill", computed_tokens=100, context_tokens=0, ttft_s=0.5, prefill_s=0.2)
    assert costs.compute_s(100, 0) == pytest.approx(0.2)  # one prefill: a cost per token alone
    assert costs.overhead_s["prefill"] == pytest.approx(0.3)  # the rest of the TTFT
    costs.observe("prefill", computed_tokens=100, context_tokens=0, ttft_s=0.6, prefill_s=0.2)
    assert costs.overhead_s["prefill"] == pytest.approx(0.7 * 0.3 + 0.3 * 0.4)
    assert costs.estimate("prefill", 50, 0) == pytest.approx(costs.overhead_s["prefill"] + 0.1)
    assert costs.overhead_s["decode"] == PlacementCosts().overhead_s["decode"]  # D's overhead is its own


def test_a_step_on_one_engine_teaches_the_compute_of_both() -> None:
    """P and D run the same model: a pair that placed every step on D still knows what P would compute."""
    costs = PlacementCosts()
    costs.observe("decode", computed_tokens=400, context_tokens=512, ttft_s=0.9, prefill_s=0.8)
    assert costs.estimate("prefill", 400, 512) - costs.overhead_s["prefill"] == pytest.approx(0.8)


def test_the_rate_is_learned_net_of_the_pass_s_fixed_cost() -> None:
    """The warm-up's short prefills are mostly a forward pass's own cost: spread over their tokens it made P's
    rate 2.46 ms a token where real steps cost 1.7 (docs/benchmarks.md, "Results under load")."""
    costs = PlacementCosts()
    pass_s, rate = 0.06, 1.4e-3
    for tokens in (45, 89):
        costs.observe(
            "prefill", computed_tokens=tokens, context_tokens=256, ttft_s=1.0, prefill_s=pass_s + rate * tokens
        )
    assert costs.compute.cost.per_token_s == pytest.approx(rate)
    assert costs.compute_s(521, 768) == pytest.approx(pass_s + rate * 521)


def test_a_crowded_prefill_teaches_its_overhead_but_not_the_compute() -> None:
    costs = PlacementCosts()
    costs.observe("decode", computed_tokens=500, context_tokens=0, ttft_s=2.0, prefill_s=1.9, alone=False)
    assert len(costs.compute) == 0 and costs.compute_s(500, 0) == pytest.approx(1.0)  # the prior's 2 ms
    assert costs.overhead_s["decode"] == pytest.approx(1.0)
    costs.observe("decode", computed_tokens=500, context_tokens=0, ttft_s=0.2, prefill_s=None)  # no engine timing
    assert len(costs.compute) == 0


def test_the_overhead_is_never_negative() -> None:
    costs = PlacementCosts()
    costs.observe("prefill", computed_tokens=400, context_tokens=0, ttft_s=0.5, prefill_s=0.8)  # compute past TTFT
    assert costs.overhead_s["prefill"] == 0.0


def _choose(costs: PlacementCosts, **changes: int) -> PlacementChoice:
    arguments = {"prompt_tokens": 1000, "held_tokens": 900, "block_size": BLOCK}
    arguments |= {"decode_in_flight": 0, "prefill_in_flight": 0} | changes
    return costs.choose(**arguments)


def test_a_busy_decode_engine_sends_the_step_to_prefill() -> None:
    costs = _costs(5.0, 0.0)  # D far cheaper, but busy
    choice = _choose(costs, decode_in_flight=3, prefill_in_flight=2)
    assert choice.engine == "prefill"
    assert "D busy" in choice.reason and "3" in choice.reason


def test_a_busy_prefill_engine_sends_the_step_to_an_idle_decode_engine() -> None:
    costs = _costs(0.0, 5.0)  # P far cheaper, but busy
    choice = _choose(costs, prefill_in_flight=1)
    assert choice.engine == "decode"
    assert "P busy" in choice.reason and "104 tokens on D" in choice.reason  # 1000 - 7 whole blocks of 900


@pytest.mark.parametrize(
    ("prompt", "held", "on_decode"),
    [
        (1000, 900, 1000 - 7 * BLOCK),
        (300, 256, 300 - 256),  # the pin ends on a block boundary: nothing recomputed
        (300, 255, 300 - BLOCK),  # one token short of it: a whole block recomputed
        (100, 90, 100),  # less than a block pinned: the whole prompt
    ],
)
def test_the_choice_compares_the_two_estimates(prompt: int, held: int, on_decode: int) -> None:
    on_prefill = prompt - held
    cheap_decode = _costs(0.5, 0.0)
    choice = _choose(cheap_decode, prompt_tokens=prompt, held_tokens=held)
    assert choice.engine == "decode"
    via_prefill, via_decode = 0.5 + on_prefill * 1e-3, on_decode * 1e-3
    assert choice.reason == (
        f"estimated D {via_decode:.3f} s ({on_decode} tokens), P {via_prefill:.3f} s ({on_prefill} tokens)"
    )
    cheap_prefill = _costs(0.0, 0.5)
    choice = _choose(cheap_prefill, prompt_tokens=prompt, held_tokens=held)
    assert choice.engine == "prefill"
    assert f"D {0.5 + via_decode:.3f} s ({on_decode} tokens)" in choice.reason
    assert f"P {on_prefill * 1e-3:.3f} s ({on_prefill} tokens)" in choice.reason


def test_the_recomputed_partial_block_can_tip_the_choice() -> None:
    """Same compute either side and a hop on P: D wins only when its recomputed tail is short."""
    costs = _costs(0.05, 0.0)
    assert _choose(costs, prompt_tokens=276, held_tokens=256).engine == "decode"  # 20 on D vs 20 on P + hop
    assert _choose(costs, prompt_tokens=383, held_tokens=383 - 20).engine == "prefill"  # 127 on D vs 20 on P


def test_the_recomputed_tail_costs_more_late_in_a_conversation() -> None:
    """D recomputes the pin's partial block at the end of the history, where each token attends to all of it: the
    same 30 tokens that D recomputes cheaper than P's hop early on cost more than the hop 4,000 tokens in."""
    costs = _costs(0.05, 0.0, per_attended=1e-6)
    early = 2 * BLOCK + 30
    assert _choose(costs, prompt_tokens=early + 20, held_tokens=early).engine == "decode"  # 30 x 1.3 ms < 50 ms
    late = 32 * BLOCK + 30
    assert _choose(costs, prompt_tokens=late + 20, held_tokens=late).engine == "prefill"  # 30 x 5.1 ms > 50 ms


# ----------------------------------------------------------------- the pair's choice


def _pin(tokens: int) -> Pin:
    """A pair's pin: D's handle inside."""
    handle = KVHandle(
        do_remote_decode=True,
        do_remote_prefill=False,
        remote_block_ids=[[1, 2, 3]],
        remote_engine_id="agentkv-decode-test",
        remote_request_id="r-d-test",
        remote_host="127.0.0.1",
        remote_port=5701,
        tp_size=1,
        dcp_size=1,
        pp_size=1,
        transfer_mode="pull",
        remote_num_tokens=tokens,
        remote_blocks_expiry_time=1e9,
    )
    pin = pin_of(handle)
    assert pin is not None
    return pin


class _PlacingPair(PairLayer):
    """The pair layer (every pair kind's placement) over stand-in engines: what it reads of them is the requests
    in flight on P and D and D's block size. Scripted: it runs no step."""

    def __init__(self) -> None:
        super().__init__(max_pinned_blocks=None)
        self._placement_off = None
        self.in_flight = SimpleNamespace(p=0, d=0)

    def _capacity(self) -> tuple[int | None, int]:
        return 1000, BLOCK

    def _requests_in_flight(self) -> tuple[int, int]:
        return self.in_flight.p, self.in_flight.d

    @property
    def info(self) -> Any:
        raise NotImplementedError

    def step(self, request: StepRequest) -> Any:
        raise NotImplementedError

    _step_via_prefill = _step_on_decode = step  # type: ignore[assignment]

    async def _send_release(self, handle: KVHandle) -> None:
        raise NotImplementedError

    async def _start(self) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError


@pytest.fixture
def unstarted_pair() -> Any:
    return _PlacingPair()


def _request(placement: Placement, *, pin: Pin | None, prompt: int = 300) -> StepRequest:
    return StepRequest(
        request_id="r", prompt_token_ids=list(range(prompt)), sampling=Sampling(), pin=pin, placement=placement
    )


def test_the_pair_places_as_asked_and_auto_only_with_a_pin(unstarted_pair: Any) -> None:
    assert unstarted_pair._place(_request("prefill", pin=_pin(256))).engine == "prefill"
    assert unstarted_pair._place(_request("decode", pin=_pin(256))) == PlacementChoice("decode", "asked")
    # D alone with no pin, as asked: a session's repin prefills from D's own prefix cache
    assert unstarted_pair._place(_request("decode", pin=None)) == PlacementChoice("decode", "asked")
    choice = unstarted_pair._place(_request("auto", pin=None))  # nothing pinned on D to extend: P
    assert choice == PlacementChoice("prefill", "no pin to extend on D")


def test_without_an_slo_the_pair_passes_what_is_in_flight_to_its_choice(unstarted_pair: Any) -> None:
    unstarted_pair.slo = None  # the rule before objectives (tests/test_placement_slo.py: with one)
    in_flight = unstarted_pair.in_flight
    request = _request("auto", pin=_pin(256), prompt=300)
    unstarted_pair.costs = _costs(0.0, 5.0)
    assert unstarted_pair._place(request).engine == "prefill"  # estimated
    in_flight.p = 1
    choice = unstarted_pair._place(request)
    assert choice.engine == "decode" and "P busy (1 in flight)" in choice.reason
    in_flight.d = 1
    assert unstarted_pair._place(request).engine == "prefill"  # D busy wins over P busy


def test_without_an_slo_auto_never_places_a_second_step_on_d_beside_one_not_finished(unstarted_pair: Any) -> None:
    unstarted_pair.slo = None
    request = _request("auto", pin=_pin(256), prompt=300)
    unstarted_pair.costs = _costs(5.0, 0.0)
    assert unstarted_pair._place(request).engine == "decode"
    unstarted_pair._steps_on_decode = 1  # chosen, its request not yet on D
    choice = unstarted_pair._place(request)
    assert choice.engine == "prefill" and "D busy (1 in flight)" in choice.reason


# ----------------------------------------------------------------- P's token as the first


def _p_out(token_ids: list[int], text: str, finish_reason: str = "length") -> Any:
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids, text=text, finish_reason=finish_reason)])


def test_prefills_token_is_streamed_as_the_first_when_it_can_be() -> None:
    request = StepRequest(request_id="r", prompt_token_ids=list(range(300)), sampling=Sampling(max_tokens=8))
    first = first_token_of_prefill(request, _p_out([42], "Hi"), BLOCK)
    assert first is not None and first.token_ids == [42] and first.text == "Hi"


@pytest.mark.parametrize(
    ("sampling", "prompt", "p_out", "why"),
    [
        ({"max_tokens": 8, "json_schema": {"type": "object"}}, 300, _p_out([42], "{"), "P sampled without the grammar"),
        ({"max_tokens": 1}, 300, _p_out([42], "Hi"), "the answer is one token: D must still run"),
        ({"max_tokens": 8}, 256, _p_out([42], "Hi"), "the prompt fills its last block"),
        ({"max_tokens": 8}, 300, _p_out([2], "", "stop"), "the token ended the answer"),
        ({"max_tokens": 8}, 300, _p_out([42], "\ufffd"), "half a character"),
        ({"max_tokens": 8}, 300, _p_out([42], ""), "no text"),
    ],
)
def test_prefills_token_is_not_used_when_it_cannot_serve(
    sampling: dict[str, Any], prompt: int, p_out: Any, why: str
) -> None:
    request = StepRequest(request_id="r", prompt_token_ids=list(range(prompt)), sampling=Sampling(**sampling))
    assert first_token_of_prefill(request, p_out, BLOCK) is None, why


# ----------------------------------------------------------------- mode "auto" in sessions


def _info(**flags: Any) -> EngineInfo:
    return EngineInfo(model_path=Path("/m"), max_model_len=2048, **flags)


def test_pair_modes_offer_auto_only_with_push_back_and_placement() -> None:
    assert "auto" in modes_of(_info(disaggregated=True, pins=True, places_steps=True))
    assert "auto" not in modes_of(_info(disaggregated=True, pins=True))
    assert modes_of(_info(disaggregated=True, places_steps=True)) == {"disaggregated"}


def test_a_plain_engine_info_is_a_single_engine_and_a_double_serves_every_mode() -> None:
    assert modes_of(_info()) == {"colocated"} and natural_mode(_info()) == "colocated"
    assert modes_of(_info(pins=True, places_steps=True)) == {"colocated"}  # no mode pushes back to one engine
    pair = _info(disaggregated=True, pins=True)
    assert modes_of(pair) == {"bidirectional", "disaggregated"} and natural_mode(pair) == "bidirectional"
    double = _info(disaggregated=None, pins=True, places_steps=True)
    assert modes_of(double) == {"auto", "bidirectional", "colocated", "disaggregated"}
    assert natural_mode(_info(disaggregated=None)) == "disaggregated"


class _Recorder:
    """A `respond` for `HonestPairEngine` that records each request it answers."""

    def __init__(self) -> None:
        self.requests: list[StepRequest] = []

    def __call__(self, request: StepRequest) -> str:
        self.requests.append(request)
        return f"Answer {len(self.requests)}."


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("mode", "placement", "forwarded"),
    [("auto", "auto", True), ("bidirectional", "prefill", True), ("disaggregated", "prefill", False)],
)
async def test_the_session_asks_for_its_modes_placement(mode: Mode, placement: str, forwarded: bool) -> None:
    recorder = _Recorder()
    async with HonestPairEngine(recorder) as engine, Session(engine=engine, mode=mode) as session:
        assert session.mode == mode
        for question in ("One?", "Two?", "Three?"):
            await session.run(question)
    assert [request.placement for request in recorder.requests] == [placement] * 3
    assert [request.pin is not None for request in recorder.requests] == [False, forwarded, forwarded]
    assert [step.handle_forwarded for step in session.stats.steps] == [False, forwarded, forwarded]
    engine.assert_honest()


@pytest.mark.anyio
async def test_auto_on_an_engine_without_push_back_is_a_user_error() -> None:
    async with ScriptedEngine(["unused"]) as engine:
        with pytest.raises(UserError, match="mode='auto' needs an engine with push-back"):
            async with Session(engine=engine, mode="auto"):
                pass
        assert engine.requests == []


class _DecodePlacedPair(HonestPairEngine):
    """The honest double, except that steps with a pin are reported as the pair reports a step on D:
    D's cache hit is the pin's whole blocks, the rest computed on D, nothing pulled."""

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        async for event in super().step(request):
            if isinstance(event, StepDone) and request.pin is not None:
                prompt = len(request.prompt_token_ids)
                hit = request.pin.tokens // BLOCK * BLOCK
                timings = event.timings.model_copy(
                    update={
                        "local_hit_tokens": hit,
                        "pulled_tokens": 0,
                        "computed_tokens": prompt - hit,
                        "handoff_tokens": 0,
                        "prefill_engine": "decode",
                        "placement_reason": "estimated D (test)",
                    }
                )
                event = dataclasses.replace(event, timings=timings)
            yield event


@pytest.mark.anyio
async def test_a_step_placed_on_decode_reports_its_engine_and_no_miss() -> None:
    async with _DecodePlacedPair() as engine, Session(engine=engine, mode="auto") as session:
        await session.run("A question long enough to fill a block of the cache? " * 30)
        await session.run("And a second one?")
    first, second = session.stats.steps
    assert first.prefill_engine is None and first.miss_reason == "no_handle"
    assert second.handle_forwarded and second.prefill_engine == "decode"
    assert second.placement_reason == "estimated D (test)"
    assert second.pulled_tokens == 0 and second.local_hit_tokens > 0  # the whole blocks of the pin, on D
    assert second.miss_reason is None  # not "below_threshold": D reused its pin without a pull
    assert second.local_hit_tokens + second.computed_tokens == second.prompt_tokens
    rows = session.stats.rows()
    assert rows[1]["prefill_engine"] == "decode" and rows[1]["placement_reason"] == "estimated D (test)"


def _miss(pin: Pin | None, **changes: Any) -> Any:
    arguments = {"prompt_tokens": 300, "local_hit_tokens": 256, "pulled_tokens": 0, "declined": False} | changes
    return miss_after_step(pin, "no_handle" if pin is None else None, **arguments)


def test_a_forwarded_handle_placed_on_decode_is_no_miss() -> None:
    pin = _pin(280)
    assert _miss(pin) == "below_threshold"  # on P, with nothing pulled, 256 < 280 is a miss
    assert _miss(pin, placed_on_decode=True) is None
    assert _miss(pin, declined=True) == "declined"
    assert _miss(None, placed_on_decode=True) == "no_handle"  # no handle: the session's reason stands


def _stats(**changes: Any) -> StepStats:
    fields: dict[str, Any] = {"turn": 1, "step": 2, "ttft_s": 0.1, "prompt_tokens": 300, "output_tokens": 4}
    fields |= {"local_hit_tokens": 256, "pulled_tokens": 0, "computed_tokens": 44, "prefill_engine": "decode"}
    return StepStats(**(fields | changes))


def test_step_stats_on_decode_keep_the_token_invariant() -> None:
    stats = _stats(placement_reason="P busy (1 in flight), D idle: 44 tokens on D")
    assert stats.reuse_ratio == pytest.approx(256 / 300)
    assert StepStats.model_validate_json(stats.model_dump_json()) == stats
    with pytest.raises(pydantic.ValidationError, match="!= prompt 300"):
        _stats(computed_tokens=45)
    with pytest.raises(pydantic.ValidationError, match="!= prompt 300"):
        _stats(pulled_tokens=1)
    with pytest.raises(pydantic.ValidationError):
        _stats(prefill_engine="colocated")
