"""The KV transfer dicts that travel between the engines of a pair, validated.

vLLM's NIXL connector trusts whatever ``kv_transfer_params`` it is given: a dict missing
one key killed a decode engine on this machine (docs/transfer.md, "Failure handling"). So every dict that
agentkv receives from an engine is parsed here before it is kept or forwarded, and every
dict agentkv sends is built from the parsed fields only.

Unknown keys are ignored (``extra="ignore"``), not refused: a key that a vLLM 0.32.x
patch release adds to its reply must not turn every handle into a malformed one (that
would quietly switch push-back off), and since only the fields modelled here are ever
sent on, nothing unvalidated reaches the other engine either way.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, overload

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .._errors import EngineError, UserError
from ._base import Pin

__all__ = [
    "SERVER_EXTRAS_FIELD",
    "KVHandle",
    "PrefillResult",
    "PushSource",
    "handle_of",
    "parse_handle",
    "parse_prefill_result",
    "pin_of",
    "prefill_params",
    "release_params",
]

logger = logging.getLogger("agentkv")

SERVER_EXTRAS_FIELD = "agentkv"
"""The field of a ``/v1/completions`` response where agentkv's server puts what vLLM does not return."""

_Name = Annotated[str, Field(pattern=r"^\S+$")]
"""An engine id, request id or host: not empty, no whitespace."""
_BlockIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class _RemoteBlocks(BaseModel):
    """Coordinates of blocks held by one engine, as its connector reports them."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    remote_block_ids: list[_BlockIds] = Field(min_length=1)
    """One list of block ids per KV cache group."""
    remote_engine_id: _Name
    remote_request_id: _Name
    remote_host: _Name
    remote_port: int = Field(gt=0, lt=65536)
    remote_num_tokens: int = Field(ge=1)
    tp_size: int = Field(ge=1)
    dcp_size: int = Field(default=1, ge=1)
    pp_size: int = Field(default=1, ge=1)
    transfer_mode: Literal["pull", "push"] = "pull"


class KVHandle(_RemoteBlocks):
    """D's handle on a conversation's KV after a step: D pins these blocks until expiry.

    Single use: the first read by P frees them on D.
    """

    do_remote_decode: Literal[True]
    do_remote_prefill: Literal[False]
    remote_blocks_expiry_time: float = Field(gt=0)
    """Deadline of the pin, in D's ``time.perf_counter()`` clock (finite)."""

    def as_prefill_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` that ask P to prefill and to pull these blocks back."""
        return self.model_dump()

    def cut(self, tokens: int, *, block_size: int) -> KVHandle | None:
        """This handle keeping only its first whole blocks within ``tokens`` tokens, for a prompt that shares only
        those with the pinned tokens (None: not one whole block, or blocks this handle does not list in full).

        P pulls ``remote_num_tokens`` past its own cache hit, reading the end of ``remote_block_ids`` (vLLM 0.32
        ``NixlPullConnectorScheduler.get_num_new_matched_tokens`` and ``_apply_prefix_caching``, which keeps the
        last blocks of the list): the cut list ends at the last shared block, so P reads exactly the shared blocks
        it lacks. The cut handle is the same D request: its read frees all of the pin's blocks on D, as the whole
        handle's would (single use: the user forwards one of the two, never both)."""
        if block_size < 1:
            raise ValueError(f"block_size must be positive, not {block_size}")
        if tokens >= self.remote_num_tokens:
            return self
        blocks = max(0, tokens) // block_size
        listed = -(-self.remote_num_tokens // block_size)
        if blocks == 0 or any(len(group) != listed for group in self.remote_block_ids):
            return None
        cut = [group[:blocks] for group in self.remote_block_ids]
        return self.model_copy(update={"remote_block_ids": cut, "remote_num_tokens": blocks * block_size})


class PrefillResult(_RemoteBlocks):
    """P's dict after a prefill: the blocks D must pull, leased on P for a short time."""

    do_remote_prefill: Literal[True]
    do_remote_decode: Literal[False]
    remote_prefill_cached_tokens: int | None = Field(default=None, ge=0)
    """P's prefix-cache hit, which D reports as its ``num_cached_tokens`` (vLLM's scheduler adds it)."""

    def as_decode_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` that ask D to pull these blocks and decode."""
        return self.model_dump(exclude_none=True)


class PushSource(BaseModel):
    """What D needs to receive a step's KV by push: P's coordinates and the request P writes from.

    D registers the blocks it lacks with P under ``remote_request_id``; P, given the same external
    request id, writes into them when its prefill is done. All fields are required: D's engine died
    on push parameters missing ``remote_request_id`` (docs/transfer.md, "Failure handling").
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    remote_engine_id: _Name
    remote_host: _Name
    remote_port: int = Field(gt=0, lt=65536)
    remote_request_id: _Name
    tp_size: int = Field(default=1, ge=1)
    pp_size: int = Field(default=1, ge=1)

    def as_decode_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` that ask D to wait for P's push, then decode."""
        return {"do_remote_prefill": True, "do_remote_decode": False, **self.model_dump()}


def pin_of(handle: KVHandle | None, *, deadline: float | None = None) -> Pin | None:
    """D's handle as the `Pin` a pair returns: ``deadline`` is its expiry in this process's clock when D's clock is
    another host's (None: D shares this host's monotonic clock, and ``remote_blocks_expiry_time`` is in it)."""
    if handle is None:
        return None
    expires_at = deadline if deadline is not None else handle.remote_blocks_expiry_time
    return Pin(tokens=handle.remote_num_tokens, expires_at=expires_at, ref=handle)


@overload
def handle_of(pin: Pin) -> KVHandle: ...
@overload
def handle_of(pin: Pin | None) -> KVHandle | None: ...
def handle_of(pin: Pin | None) -> KVHandle | None:
    """The D handle a pair's `Pin` carries; `UserError` for a pin that no pair made."""
    if pin is None:
        return None
    if not isinstance(pin.ref, KVHandle):
        raise UserError(f"this pair takes back only the pins it returned, not one holding {type(pin.ref).__name__}")
    return pin.ref


def prefill_params(handle: KVHandle | None) -> dict[str, Any]:
    """``kv_transfer_params`` for a P request, with D's handle pushed back when given."""
    if handle is None:
        return {"do_remote_decode": True, "do_remote_prefill": False}
    return handle.as_prefill_params()


def release_params(handle: KVHandle) -> dict[str, Any]:
    """``kv_transfer_params`` that make P tell D to free ``handle``'s blocks, reading none of them.

    With ``remote_num_tokens=0`` P's connector finds nothing to pull (vLLM 0.32
    ``NixlPullConnectorScheduler.get_num_new_matched_tokens``), queues the notify-only
    receive that a full local hit uses, and D frees the pinned blocks on that notification.
    """
    return {**handle.as_prefill_params(), "remote_num_tokens": 0}


def parse_handle(raw: object) -> tuple[KVHandle | None, str | None]:
    """Parse D's returned dict: ``(handle, None)``, ``(None, None)`` when D returned none, or
    ``(None, why)`` when it is malformed.

    A malformed handle costs the next step its push-back, never the step that produced it:
    its answer is good. The problem is logged and returned for the caller to report.
    """
    if raw is None:
        return None, None
    try:
        return KVHandle.model_validate(raw), None
    except ValidationError as exc:
        problem = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'handle'}: {e['msg']}" for e in exc.errors())
        logger.warning("agentkv: the decode engine returned a malformed KV handle; not pushing it back (%s)", problem)
        return None, problem


def parse_prefill_result(raw: object) -> PrefillResult:
    """Parse P's returned dict; a malformed one is never passed on to D."""
    try:
        return PrefillResult.model_validate(raw)
    except ValidationError as exc:
        raise EngineError(f"the prefill engine returned malformed transfer params: {exc}") from exc
