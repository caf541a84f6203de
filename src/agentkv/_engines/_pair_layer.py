"""The pair layer: what every P/D pair does around its two engines, written once.

A pair is two engines joined by NIXL, in this process (`EmbeddedPair`) or behind two HTTP
servers (`LaunchedPair`, `RemotePair`). Whatever the engines are, the pair must

* keep D's pins within D's cache (`PinBudget`): before a step, room for it is made by
  releasing the least recently pinned conversations; a pin the pair released is not
  used (its blocks may hold another conversation now: ``miss_reason="evicted"``);
* place each step (`PlacementCosts`): on P with push-back (the protocol), or on D alone
  from D's own cache of the pinned conversation, where the costs the pair measured and what
  it has in flight on each engine (`StepLedger`) say more turns stay inside its objective
  (`Slo`, src/agentkv/_engines/_slo.py);
* release pins it no longer needs (a session's last, one a step on D alone replaced, a
  warm-up's), by a one-token request on P that carries the handle.

A pair's `Pin` carries D's `KVHandle` (``Pin.ref``, unwrapped by `handle_of`): its expiry
in this process's clock, and the tokens D holds. `PairLayer._pinned_step` does this for every pair kind. Under it each kind implements the
primitives: `_capacity` (D's blocks), `_requests_in_flight`, `_step_via_prefill`
(P then D), `_step_on_decode` (D alone) and `_send_release`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from abc import abstractmethod
from collections.abc import AsyncGenerator
from typing import Any

from _agentkv_vllm._patches import PIN_ON_DECODE

from .._errors import UserError
from ._base import Engine, Pin, ReleaseGuard, Sampling, StepDone, StepEvent, StepRequest
from ._handle import KVHandle, handle_of
from ._pin_budget import PinBudget
from ._pinning import HeldPin, choose_pin
from ._placement import Placement, PlacementChoice, PlacementCosts, PrefillEngine
from ._slo import DEFAULT_SLO, Slo, choose_within_slo
from ._step_ledger import StepLedger

__all__ = ["ON_DECODE_PARAMS", "RELEASE_MARGIN_S", "PairLayer", "run_warmup_steps"]

logger = logging.getLogger("agentkv")

ON_DECODE_PARAMS: dict[str, Any] = {"do_remote_prefill": False, "do_remote_decode": False, PIN_ON_DECODE: True}
"""A step on D alone: nothing to pull; D pins its blocks after it (a patch makes D's worker track that pin)."""

RELEASE_MARGIN_S = 10.0
"""A pin closer than this to its expiry is left to expire (P declines reads within 5 s of it)."""


class PairLayer(Engine):
    """A P/D pair: D's pin budget, per-step placement and pin release over two engines' primitives.

    Subclasses set `_placement_off` once both engines run (None: steps may run on D alone) and
    ``_max_pinned_blocks``, and implement the primitives below.
    """

    def __init__(self, *, max_pinned_blocks: int | None, slo: Slo | None = DEFAULT_SLO) -> None:
        super().__init__()
        self.costs = PlacementCosts()
        """What the pair has measured of its steps on P and on D (mode ``"auto"`` compares them)."""
        self.slo: Slo | None = slo
        """The objective mode ``"auto"`` places steps for (`Slo`; settable while the pair runs, the next step's
        placement reads it). None: a step goes to D alone only while nothing is in flight on D."""
        self._ledger = StepLedger()
        """The steps in flight: where each prefills, with how many tokens, and which decode on D."""
        self._max_pinned_blocks = max_pinned_blocks
        self._pins: PinBudget | None = None
        self._steps_on_decode = 0
        """Steps placed on D alone and not finished: counted from the choice, so that ``auto`` never places a
        second one beside the first (a prefill on D stalls every decode in its batch)."""
        self._releases: collections.Counter[str] = collections.Counter()
        """What became of the pins this pair let go (`_release`), by outcome: a stall's error reports it."""
        self._release_guard: ReleaseGuard | None = None
        """Asked before a pin is released (`guard_releases`): None, release every pin."""
        self._placement_off: str | None = "the pair is not open"
        """Why steps cannot run on D alone (a push pair, a stock decode server, a vLLM without the patch), or None."""

    # ----------------------------------------------------------------- primitives

    @abstractmethod
    def _capacity(self) -> tuple[int | None, int]:
        """D's KV cache in blocks (None: unknown, only ``max_pinned_blocks`` bounds the pins) and its block size."""

    @abstractmethod
    def _requests_in_flight(self) -> tuple[int, int]:
        """This pair's requests in flight on P and on D."""

    @abstractmethod
    def _step_via_prefill(
        self, request: StepRequest, started: float, choice: PlacementChoice
    ) -> AsyncGenerator[StepEvent, None]:
        """The protocol's step: P prefills (pulling the pin's KV back), D pulls P's and decodes."""

    @abstractmethod
    def _step_on_decode(
        self, request: StepRequest, started: float, choice: PlacementChoice
    ) -> AsyncGenerator[StepEvent, None]:
        """The whole step on D with `ON_DECODE_PARAMS`: D's cache holds the pin's whole blocks, D computes the rest."""

    @abstractmethod
    async def _send_release(self, handle: KVHandle) -> None:
        """P's one-token request that carries ``handle`` with nothing to read: P notifies D, D frees the blocks."""

    def _transfer_is_push(self) -> bool:
        """Whether P pushes into D (a step on D alone needs vLLM's pull connector on D)."""
        return False

    # ----------------------------------------------------------------- the layer

    def _pin_budget(self) -> PinBudget:
        """D's pins and the blocks reserved by steps in flight (made at the first step, once D's size is known)."""
        if self._pins is None:
            capacity, block_size = self._capacity()
            self._pins = PinBudget(capacity, block_size, max_pinned_blocks=self._max_pinned_blocks)
        return self._pins

    def _forget_pins(self) -> None:
        """D was replaced (a restarted server): none of its pins exist any more."""
        self._pins = None

    def _check_pin(self, request: StepRequest) -> None:
        """Before any work: a pin is taken only by a pair with push-back, and only one a pair made (`UserError`)."""
        if request.pin is not None and not self.info.pins:
            raise UserError("this pair runs without push-back: it takes no pin")
        handle_of(request.pin)

    async def _pinned_step(self, request: StepRequest) -> AsyncGenerator[StepEvent, None]:
        """One step within D's budget of pins, placed on P or D, teaching the placement its costs."""
        pins = self._pin_budget()
        handle = handle_of(request.pin)
        evicted = handle is not None and pins.was_evicted(handle)
        if evicted:
            request, handle = dataclasses.replace(request, pin=None), None
        # What the step needs to start on D: vLLM grows a running answer by preempting other running requests,
        # but it never preempts a pin, so only the prompt and the answer's first block must fit beside the pins.
        tokens = len(request.prompt_token_ids) + min(request.sampling.max_tokens, pins.block_size)
        for released, deadline in pins.reserve(request.request_id, tokens=tokens, reused=handle):
            logger.debug("agentkv: D's cache is full; releasing the least recently pinned conversation")
            self._spawn_release(released, deadline)
        try:
            started = time.perf_counter()
            choice = self._place(request)
            on_decode = choice.engine == "decode"
            self._steps_on_decode += on_decode
            # the compute queued ahead of it on its engine: not its own cost, which the pair learns without it
            queued_s = self._ledger.load(choice.engine).queued_s()
            key = self._ledger.started(choice.engine, self.costs.compute_s(*self._tokens_on(choice.engine, request)))
            try:
                placed = self._step_on_decode if on_decode else self._step_via_prefill
                async with contextlib.aclosing(placed(request, started, choice)) as events:
                    async for event in events:
                        self._ledger.token(key)  # the first ends the prefill (D decodes it now); each times a gap
                        if isinstance(event, StepDone):
                            self._learn(event, pins, queued_s, evicted=evicted, alone=self._ledger.prefilled_alone(key))
                            if on_decode and request.pin is not None and handle is not None:  # no P read frees it
                                self._spawn_release(handle, request.pin.expires_at)
                        yield event
            finally:
                self._steps_on_decode -= on_decode
                self._ledger.ended(key)
        finally:
            pins.finished(request.request_id)
            for released, deadline in pins.make_room():  # this step's pin may crowd out steps waiting on D
                logger.debug("agentkv: a new pin overfills D; releasing the least recently pinned conversation")
                self._spawn_release(released, deadline)

    def _learn(self, done: StepDone, pins: PinBudget, queued_s: float, *, evicted: bool, alone: bool) -> None:
        """What the step teaches: D's new pin, and its costs (less ``queued_s``, the compute ahead of it; its compute
        only when its prefill ran ``alone`` on its engine)."""
        timings = done.timings
        timings.pin_evicted = evicted
        if done.pin is not None:
            pins.pinned(handle_of(done.pin), deadline=done.pin.expires_at)
        self.costs.observe(
            timings.prefill_engine or "prefill",
            computed_tokens=timings.computed_tokens,
            context_tokens=timings.local_hit_tokens + timings.pulled_tokens,
            ttft_s=max(0.0, timings.ttft_s - queued_s),
            prefill_s=timings.prefill_s,
            alone=alone,
            decode_s=timings.decode_s,
            output_tokens=len(done.token_ids),
        )

    def _place(self, request: StepRequest) -> PlacementChoice:
        """Where to prefill ``request``: P unless asked for D (even with no pin: D's prefix cache may hold the
        conversation, `agentkv._session._pin_upkeep`'s repin), or ``auto`` finds D faster with a pin."""
        if self._transfer_is_push():
            if request.placement == "decode":
                raise UserError("a step on D alone needs a pull pair (transfer='pull'); this pair pushes")
            return PlacementChoice("prefill", "push pair: every step on P")
        if self._placement_off is not None:
            if request.placement == "decode":
                raise UserError(f"a step on D alone needs agentkv's auto placement: {self._placement_off}")
            return PlacementChoice("prefill", f"auto placement is off ({self._placement_off})")
        if request.placement == "decode":  # with no pin: a session's repin, from D's own prefix cache
            return PlacementChoice("decode", "asked")
        if request.pin is None or request.placement == "prefill":
            return PlacementChoice("prefill", "no pin to extend on D" if request.placement != "prefill" else "asked")
        if self.slo is None:
            on_prefill, on_decode = self._requests_in_flight()
            return self.costs.choose(
                prompt_tokens=len(request.prompt_token_ids),
                held_tokens=request.pin.tokens,
                block_size=self._pin_budget().block_size,
                decode_in_flight=on_decode + self._steps_on_decode,
                prefill_in_flight=on_prefill,
            )
        slo, costs = self.slo, self.costs
        on_prefill, prefill_context = self._tokens_on("prefill", request)
        on_decode, decode_context = self._tokens_on("decode", request)
        return choose_within_slo(
            costs,
            slo,
            on_prefill=on_prefill,
            on_decode=on_decode,
            prefill_context=prefill_context,
            decode_context=decode_context,
            prefill_load=self._ledger.load("prefill"),
            decode_load=self._ledger.load("decode"),
            at_stake=lambda within_s: self._ledger.at_stake(slo, costs, within_s=within_s),
            at_risk=lambda: self._ledger.at_stake(slo, costs, within_s=math.inf, earliest=True),
        )

    def _tokens_on(self, engine: PrefillEngine, request: StepRequest) -> tuple[int, int]:
        """The prompt tokens ``request`` computes on ``engine`` and the cached ones before them: on P, past the pin
        (P pulls the pinned ones); on D alone, past the pin's whole blocks (D's cache keeps whole blocks only)."""
        held = request.pin.tokens if request.pin is not None else 0
        if engine == "decode":
            block_size = self._pin_budget().block_size
            held = held // block_size * block_size
        held = min(held, len(request.prompt_token_ids))
        return len(request.prompt_token_ids) - held, held

    async def release(self, pin: Pin) -> None:
        """Have D free the blocks ``pin`` holds, now rather than at their expiry (a pin no pair made is ignored).

        vLLM 0.32 has no call that frees a pin. What frees one is P's notification after a
        read, and P also sends it when it finds nothing to read (a full local hit). So P gets
        a one-token request carrying the handle with ``remote_num_tokens=0`` (`_send_release`):
        P reads nothing, notifies D, and D frees the blocks. A pin within `RELEASE_MARGIN_S`
        of its expiry is left to expire (D counts a notification after expiry as an error).
        Best effort: a release that fails is logged, and the pin expires.
        """
        if isinstance(pin.ref, KVHandle):
            await self._release(pin.ref, pin.expires_at)

    def guard_releases(self, guard: ReleaseGuard | None) -> None:
        self._release_guard = guard

    def cut_pin(self, pin: Pin, tokens: int) -> Pin | None:
        """D's handle cut to its first whole blocks of D's block size within ``tokens`` (`KVHandle.cut`)."""
        handle = handle_of(pin)
        cut = handle.cut(tokens, block_size=self._pin_budget().block_size)
        if cut is None:
            return None
        return Pin(tokens=cut.remote_num_tokens, expires_at=pin.expires_at, ref=cut)

    async def _release(self, handle: KVHandle, deadline: float) -> None:
        """`release` of D's ``handle``, which expires at ``deadline`` in this process's clock (asking the guard
        first: a handle saved for other processes may be in another's hands)."""
        if self._pins is not None:
            self._pins.gone(handle)
        if not self.is_open or self.is_dead or not self.info.pins:
            return
        if time.perf_counter() + RELEASE_MARGIN_S >= deadline:
            self._releases["left to expire"] += 1
            return
        try:
            if self._release_guard is not None and not await self._release_guard(handle.remote_request_id):
                self._releases["kept for another process"] += 1
                return
            await self._send_release(handle)
            self._releases["released"] += 1
        except Exception as exc:  # best effort: a pin that is not released expires on D
            self._releases["failed"] += 1
            logger.debug("agentkv: releasing a pin failed: %s", exc)

    def describe_pins(self) -> str:
        """D's pins as this pair counts them, and what became of those it let go (for a stall's error)."""
        ledger = self._pins.describe() if self._pins is not None else "no pins yet"
        outcomes = ", ".join(f"{n} {outcome}" for outcome, n in sorted(self._releases.items())) or "none"
        return f"pins: {ledger}; pins let go: {outcomes}"

    def _spawn_release(self, handle: KVHandle, deadline: float) -> None:
        """`release` off the step's path, on the pair's event loop."""
        if self.home is not None:
            self.home.spawn(self._release, handle, deadline)

    async def _calibrate(self) -> None:
        """The warm-up: short steps run the kernels and NIXL handshakes once, then again from fresh costs, so
        that placement compares the warm costs of a step on P and on D (when steps can run on D)."""
        placements: tuple[Placement, ...] = ("prefill", "decode" if self._placement_off is None else "prefill")
        await run_warmup_steps(self, push_back=self.info.pins, placements=placements)  # first steps: cold
        if self._placement_off is None and self.info.pins:
            self.costs = PlacementCosts()
            await run_warmup_steps(self, push_back=True, placements=placements)


async def run_warmup_steps(
    engine: Engine, *, push_back: bool, placements: tuple[Placement, ...] = ("prefill", "prefill")
) -> None:
    """Short steps (each after the first giving the last one's pin back): kernels and NIXL handshakes
    run now. ``placements``: where each step is prefilled (without push-back, one step only).

    The second prompt extends exactly what D holds (the first prompt and its output), and the
    pin goes through `choose_pin`, the rule every session step obeys. The last pin is
    released: nothing of the warm-up stays parked on D.
    """
    prompt = [1] + [28] * 300  # two CPU blocks of one repeated token: shapes and handshakes only
    held: HeldPin | None = None
    for placement in placements if push_back else placements[:1]:
        pin, _reason = choose_pin(held, prompt, push_back=push_back, expiry_margin_s=RELEASE_MARGIN_S)
        request = StepRequest(
            request_id=f"agentkv-warmup-{uuid.uuid4().hex}",
            prompt_token_ids=prompt,
            sampling=Sampling(max_tokens=4),
            pin=pin,
            placement=placement,
        )
        done: StepDone | None = None
        async for event in engine.step(request):
            if isinstance(event, StepDone):
                done = event
        assert done is not None
        tokens = prompt + list(done.token_ids)
        held = HeldPin(done.pin, tokens) if done.pin is not None else None
        prompt = tokens + [28] * 40
    if held is not None:
        await engine.release(held.pin)
