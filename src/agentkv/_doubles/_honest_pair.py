"""`HonestPairEngine`: a test double of a pair whose decode engine D holds KV honestly, checks every pin given
back to it against the push-back rule, and plays injected faults (`Fault`, `Malformation`:
src/agentkv/_doubles/_honest_faults.py). Public as `agentkv.testing.HonestPairEngine` (src/agentkv/testing.py)."""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal, get_args

import anyio
import anyio.lowlevel

from .._engines import Placement, StepDone, StepEvent, StepRequest, StepTimings, TokenDelta
from .._engines._base import Pin, ReleaseGuard, SavedPin
from .._engines._handle import KVHandle, handle_of, parse_handle, pin_of
from .._errors import EngineDeadError, EngineError, UserError
from ._honest_faults import Fault, Malformation, malformed
from ._scripted import ModelFolderDouble, cut_at_stop, refuse_unhonoured

__all__ = ["HonestPairEngine", "PushBackViolationError", "StepRecord"]


class PushBackViolationError(AssertionError):
    """`HonestPairEngine.assert_honest` found handles pushed back against the rule (a test failure)."""


BLOCK_SIZE = 16
"""Tokens per KV block of the double's P cache (``prefill_cache``)."""


@dataclasses.dataclass
class StepRecord:
    """What `HonestPairEngine` saw and answered for one step request."""

    request_id: str
    prompt_tokens: int
    faults: list[Fault]
    placement: Placement = "prefill"
    """Where the request asked to be prefilled (`StepRequest.placement`; the double computes alike everywhere)."""
    forwarded: bool = False
    """A pin came with the request."""
    declined: bool = False
    """The pin was not read (expired early, a ``decline`` fault, or a violation): the prompt was computed."""
    local_hit_tokens: int = 0
    """Prompt tokens P found in its own prefix cache (only with ``prefill_cache``; else 0)."""
    pulled_tokens: int = 0
    computed_tokens: int = 0
    output_token_ids: list[int] = dataclasses.field(default_factory=list[int])
    outcome: Literal["running", "done", "error", "died", "cancelled"] = "running"


@dataclasses.dataclass
class _Pin:
    tokens: list[int]
    """The tokens whose KV D holds for this handle (the prompt and all output tokens but the last)."""
    issued: dict[str, Any]
    """The valid handle D meant to return (a malformed one differs from it)."""
    freed_at: float
    """When D frees the blocks (``time.perf_counter``); may precede the advertised deadline."""
    malformation: Malformation | None = None
    delivered: bool = True
    """Whether the session got a handle for it (a malformed one is dropped by the engine's parser)."""
    spent: bool = False
    """Read by P, or released."""


@dataclasses.dataclass
class _Decode:
    """D: the pins it issued, by request id (several doubles may drive one D: `HonestPairEngine`'s ``decode_of``)."""

    engine_id: str = dataclasses.field(default_factory=lambda: f"honest-decode-{uuid.uuid4().hex[:8]}")
    pins: dict[str, _Pin] = dataclasses.field(default_factory=dict)
    issued: int = 0


class HonestPairEngine(ModelFolderDouble):
    """A test double of a pair whose decode engine D holds KV honestly and checks every pin given back.

    Each step answers with ``respond(request)`` (tokenized by its model folder's tokenizer, an end-of-sequence
    token appended, cut at ``max_tokens`` and at the first stop string), issues a `Pin` for the prompt
    and output (a D handle inside, as a real pair's; none when a stop string ended it, as on a real pair),
    and remembers the tokens that pin holds. A pin given back must be one it issued, unaltered, unspent
    (single use), valid, not expired nor within ``forward_margin_s`` of expiry, and hold a strict prefix
    of the new prompt; anything else is recorded in `violations` (and the prompt is recomputed, as P would).
    The prompt split it reports is exact: a read pin's tokens are pulled, the rest computed.

    Deterministic: the output depends only on the request (and ``respond``), faults only on `inject`.

    Args:
        respond: the output text for a request (default: a short text derived from the prompt).
        model_path: the HF folder whose tokenizer sessions use (default: the doubles' byte-level test model, which
            needs nothing prepared; ``agentkv.prepare_model()`` gives the bundled model's, for its real template).
        max_model_len: the context length to report.
        pin_ttl_s: how long an issued pin says D keeps its blocks.
        forward_margin_s: a pin given back with less than this left before its deadline is a violation.
        stall_s: how long a ``stall`` fault hangs.
        prefill_cache: model P's prefix cache too: P keeps the whole blocks (`BLOCK_SIZE`) of every prompt it
            prefilled (computed or pulled), a step hits them locally, and a pin given back pulls only what P lacks
            (the pin's tokens past P's hits, as vLLM's P pulls ``remote_num_tokens - num_computed_tokens``).
            Off by default: a read pin's tokens are all pulled.
        decode_of: another double whose D this one drives too (two doors on one decode server): pins travel
            between them (`saved_pin`, `adopt_pin`), and each checks every pin given back against D's record.
    """

    push_back = True

    def __init__(
        self,
        respond: Callable[[StepRequest], str] | None = None,
        *,
        model_path: Path | None = None,
        max_model_len: int = 4096,
        pin_ttl_s: float = 3600.0,
        forward_margin_s: float = 0.0,
        stall_s: float = 60.0,
        decode_of: HonestPairEngine | None = None,
        prefill_cache: bool = False,
    ) -> None:
        super().__init__(model_path=model_path, max_model_len=max_model_len)
        self._respond = respond or _default_response
        self._pin_ttl_s = pin_ttl_s
        self._forward_margin_s = forward_margin_s
        self._stall_s = stall_s
        self._p_cache: set[tuple[str | None, tuple[int, ...]]] | None = set() if prefill_cache else None
        """P's prefix cache (``prefill_cache``): the whole-block prefixes it holds, by cache salt."""
        self._d: _Decode = decode_of._d if decode_of is not None else _Decode()
        self._pins = self._d.pins
        self._guard: ReleaseGuard | None = None
        self._pending: list[Fault] = []
        self._malformation: Malformation = "missing_key"
        self.steps: list[StepRecord] = []
        """Every step request received, in order, with what was done with it."""
        self.violations: list[str] = []
        """Every breach of the push-back rule seen, in words."""
        self.stopped = False
        """Whether `_stop` ran to its end (the engine's processes would be gone)."""
        self.released = 0
        """How many pins sessions released before reading or expiry."""

    # ----------------------------------------------------------------- control

    def inject(self, fault: Fault, *, malformation: Malformation = "missing_key") -> None:
        """Play ``fault`` on the next step (several faults may be injected for one step)."""
        if fault not in get_args(Fault):
            raise UserError(f"unknown fault {fault!r}; the faults are {', '.join(get_args(Fault))}")
        self._pending.append(fault)
        if fault == "malformed_handle":
            self._malformation = malformation

    def clear_faults(self) -> None:
        """Drop faults injected but not played (the step they were meant for never reached the engine)."""
        self._pending.clear()

    def assert_honest(self) -> None:
        """Raise `PushBackViolationError` listing every violation of the push-back rule seen so far."""
        if self.violations:
            raise PushBackViolationError("; ".join(self.violations))

    @property
    def live_pins(self) -> int:
        """Pins whose handle a session got that D still holds now: neither read, released nor expired."""
        now = time.perf_counter()
        return sum(1 for pin in self._pins.values() if pin.delivered and not pin.spent and pin.freed_at > now)

    # ----------------------------------------------------------------- engine

    async def _stop(self) -> None:
        await anyio.lowlevel.checkpoint()  # a real engine awaits its processes here; cancellation must not skip it
        self.stopped = True

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.check_open()
        refuse_unhonoured(request)  # refused before the engine: no record, the faults wait for the next step
        faults, self._pending = self._pending, []
        record = StepRecord(
            request_id=request.request_id,
            prompt_tokens=len(request.prompt_token_ids),
            faults=faults,
            placement=request.placement,
        )
        self.steps.append(record)
        try:
            async for event in self._step(request, record):
                yield event
        except EngineDeadError:
            record.outcome = "died"
            raise
        except EngineError:
            record.outcome = "error"
            raise
        except BaseException:
            record.outcome = "cancelled"
            raise
        record.outcome = "done"

    async def _step(self, request: StepRequest, record: StepRecord) -> AsyncIterator[StepEvent]:
        started = time.perf_counter()
        faults = record.faults
        prompt = list(request.prompt_token_ids)
        if len(prompt) >= self._max_model_len:
            self.violations.append(f"{request.request_id}: a prompt of {len(prompt)} tokens reached the engine")
        if "die" in faults:
            await self._die()
        if request.pin is not None:
            record.forwarded = True
            read = self._read(request.pin, prompt, request.request_id, decline="decline" in faults)
            record.declined = not read
            record.pulled_tokens = request.pin.tokens if read else 0
        if self._p_cache is not None and request.placement != "decode":
            self._through_p_cache(request, prompt, record)
        record.computed_tokens = len(prompt) - record.local_hit_tokens - record.pulled_tokens
        if "error" in faults:
            raise EngineError("injected: the engine failed the step")
        token_ids, text, finish_reason, stopped = self._output(request)
        record.output_token_ids = token_ids
        half = max(1, len(token_ids) // 2)
        first_text = self._decode(token_ids[:half])[: len(text)]  # never a piece of a stop string
        yield TokenDelta(token_ids=token_ids[:half], text=first_text)
        if "stall" in faults:
            await anyio.sleep(self._stall_s)
        if "error_mid_stream" in faults:
            raise EngineError("injected: the engine failed mid-stream")
        if "die_mid_stream" in faults:
            await self._die()
        if len(token_ids) > half:
            yield TokenDelta(token_ids=token_ids[half:], text=text[len(first_text) :])
        timings = StepTimings(
            ttft_s=time.perf_counter() - started,
            pulled_tokens=record.pulled_tokens,
            computed_tokens=record.computed_tokens,
            local_hit_tokens=record.local_hit_tokens,
            handoff_tokens=len(prompt),
            kv_bytes=0,
            kv_transfer_s=0.0,
            pin_declined=record.declined,
        )
        pin, pin_error = (None, None) if stopped else self._issue(prompt + token_ids[:-1], faults)
        yield StepDone(
            token_ids=token_ids,
            text=text,
            finish_reason=finish_reason,
            pin=pin,
            timings=timings,
            pin_error=pin_error,
            stopped_by_string=stopped,
        )

    def _through_p_cache(self, request: StepRequest, prompt: list[int], record: StepRecord) -> None:
        """P's share of a step with its prefix cache: hits on its whole blocks (at most the prompt but one token),
        a pull of the pin's tokens past them, and the prompt's whole blocks kept."""
        assert self._p_cache is not None
        salt, hit = request.cache_salt, 0
        while hit + BLOCK_SIZE < len(prompt) and (salt, tuple(prompt[: hit + BLOCK_SIZE])) in self._p_cache:
            hit += BLOCK_SIZE
        record.local_hit_tokens = hit
        if record.pulled_tokens:
            record.pulled_tokens = max(0, record.pulled_tokens - hit)
        for end in range(BLOCK_SIZE, len(prompt) + 1, BLOCK_SIZE):
            self._p_cache.add((salt, tuple(prompt[:end])))

    def saved_pin(self, pin: Pin) -> SavedPin | None:
        """The pin as a double on the same D (``decode_of``) takes it back: D's handle, its deadline in wall time."""
        handle = handle_of(pin)
        expires_unix = time.time() + (pin.expires_at - time.perf_counter())
        ref = handle.model_dump()
        return SavedPin(
            id=handle.remote_request_id, server=self._d.engine_id, tokens=pin.tokens, expires_unix=expires_unix, ref=ref
        )

    def adopt_pin(self, saved: SavedPin) -> Pin | None:
        """A saved pin of this double's D, as it was issued (one process: D's clock is this one's)."""
        handle, _ = parse_handle(saved.ref)
        if saved.server != self._d.engine_id or handle is None:
            return None
        return pin_of(handle)

    def guard_releases(self, guard: ReleaseGuard | None) -> None:
        self._guard = guard

    def cut_pin(self, pin: Pin, tokens: int) -> Pin | None:
        """The pin's handle cut to its first whole blocks (`BLOCK_SIZE`) within ``tokens``, as a pair cuts it."""
        cut = handle_of(pin).cut(tokens, block_size=BLOCK_SIZE)
        return None if cut is None else Pin(tokens=cut.remote_num_tokens, expires_at=pin.expires_at, ref=cut)

    async def release(self, pin: Pin) -> None:
        """Free ``pin``'s blocks (a session gave it up, its guard agreeing); releasing one this engine never issued,
        or one already read or released, is a violation."""
        handle = pin.ref
        if isinstance(handle, KVHandle) and self._guard is not None and not await self._guard(handle.remote_request_id):
            return
        if isinstance(handle, KVHandle):
            held = self._pins.get(handle.remote_request_id)
            if held is not None and handle.model_dump() == held.issued and pin == pin_of(handle):
                if held.spent:
                    self.violations.append(
                        f"asked to release a handle already read or released: {handle.remote_request_id}"
                    )
                held.spent = True
                self.released += 1
                return
        name = handle.remote_request_id if isinstance(handle, KVHandle) else repr(handle)
        self.violations.append(f"asked to release a handle this engine never issued: {name}")

    async def _die(self) -> None:
        self._dead = EngineDeadError("injected: the engine died")
        await self.aclose()
        raise EngineDeadError("injected: the engine died")

    def _read(self, given: Pin, prompt: list[int], request_id: str, *, decline: bool) -> bool:
        """Check a pin given back; whether P read it (False: recomputed)."""
        now = time.perf_counter()
        handle = given.ref
        if not isinstance(handle, KVHandle):
            self.violations.append(f"{request_id} was sent a pin this engine never issued")
            return False
        pin = self._pins.get(handle.remote_request_id)
        problems: list[str] = []
        if pin is None:
            problems.append("a handle this engine never issued")
        else:
            issued = KVHandle.model_validate(pin.issued) if pin.malformation is None else None
            cut = issued.cut(given.tokens, block_size=BLOCK_SIZE) if issued is not None else None
            if handle.model_dump() not in (pin.issued, None if cut is None else cut.model_dump()) or (
                given.tokens != handle.remote_num_tokens
                or given.expires_at != (issued or handle).remote_blocks_expiry_time
            ):
                what = f"a malformed handle ({pin.malformation})" if pin.malformation else "an altered handle"
                problems.append(what)
            if pin.spent:
                problems.append("a spent handle (handles are single-use)")
            held = given.tokens
            if held > len(pin.tokens) or len(prompt) <= held or prompt[:held] != pin.tokens[:held]:
                problems.append("a prompt that does not strictly extend the tokens the handle holds")
            pin.spent = True
        deadline = given.expires_at
        if not math.isfinite(deadline) or now + self._forward_margin_s >= deadline:
            problems.append(f"a handle expired or within {self._forward_margin_s} s of expiry")
        if problems:
            self.violations.append(f"{request_id} was sent " + " and ".join(problems))
            return False
        assert pin is not None
        return not decline and pin.freed_at > now

    def _issue(self, held: list[int], faults: list[Fault]) -> tuple[Pin | None, str | None]:
        """D's pin for a step (or, with a ``malformed_handle`` fault, what a real engine makes of a broken
        handle), and why it was dropped."""
        self._d.issued += 1
        issued_count = self._d.issued
        now = time.perf_counter()
        deadline = now + self._pin_ttl_s
        if "expired_handle" in faults:
            deadline = now - 1.0
        elif "near_expiry_handle" in faults:
            deadline = now + self._forward_margin_s / 2
        handle = KVHandle(
            do_remote_decode=True,
            do_remote_prefill=False,
            remote_block_ids=[list(range(issued_count * 64, issued_count * 64 + max(1, -(-len(held) // 16))))],
            remote_engine_id=self._d.engine_id,
            remote_request_id=f"honest-{issued_count}",
            remote_host="127.0.0.1",
            remote_port=5600,
            remote_num_tokens=len(held),
            tp_size=1,
            remote_blocks_expiry_time=deadline,
        )
        issued = handle.model_dump()
        freed_at = now if "expire_early" in faults else deadline
        if "malformed_handle" not in faults:
            self._pins[handle.remote_request_id] = _Pin(held, issued, freed_at)
            return pin_of(handle), None
        parsed, problem = parse_handle(malformed(issued, self._malformation))  # what a real engine does with it
        pin = _Pin(held, issued, freed_at, malformation=self._malformation, delivered=parsed is not None)
        self._pins[handle.remote_request_id] = pin
        return pin_of(parsed), problem

    def _output(self, request: StepRequest) -> tuple[list[int], str, str, bool]:
        """(token ids, text, finish reason, whether a stop string ended it)."""
        tokenizer = self._tokenizer()
        text = self._respond(request)
        token_ids = [*tokenizer.encode(text, add_special_tokens=False), int(tokenizer.eos_token_id)]
        finish_reason = "stop"
        if len(token_ids) > request.sampling.max_tokens:
            token_ids = token_ids[: request.sampling.max_tokens]
            text, finish_reason = self._decode(token_ids), "length"
        cut = cut_at_stop(token_ids, request.sampling, self._decode)
        if cut is not None:
            return *cut, "stop", True
        return token_ids, text, finish_reason, False

    def _decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer().decode(token_ids, skip_special_tokens=True))


def _default_response(request: StepRequest) -> str:
    return f"answer {sum(request.prompt_token_ids) % 997}"
