"""The KV transfer dicts that travel between the engines of a pair, validated.

vLLM's NIXL connector trusts whatever ``kv_transfer_params`` it is given: a dict missing
one key killed a decode engine on this machine (DESIGN.md section 4). So every dict that
agentkv receives from an engine is parsed here before it is kept or forwarded, and every
dict agentkv sends is built from a parsed one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .._errors import EngineError

__all__ = ["SERVER_EXTRAS_FIELD", "KVHandle", "PrefillResult", "parse_handle", "parse_prefill_result", "prefill_params"]


SERVER_EXTRAS_FIELD = "agentkv"
"""The field of a ``/v1/completions`` response where agentkv's server puts what vLLM does not return."""


class _RemoteBlocks(BaseModel):
    """Coordinates of blocks held by one engine, as its connector reports them."""

    model_config = ConfigDict(extra="allow", frozen=True)

    remote_block_ids: list[list[int]] = Field(min_length=1)
    remote_engine_id: str = Field(min_length=1)
    remote_request_id: str = Field(min_length=1)
    remote_host: str = Field(min_length=1)
    remote_port: int = Field(gt=0, lt=65536)
    remote_num_tokens: int = Field(ge=1)
    tp_size: int = Field(ge=1)
    transfer_mode: Literal["pull"] = "pull"


class KVHandle(_RemoteBlocks):
    """D's handle on a conversation's KV after a step: D pins these blocks until expiry.

    Single use: the first read by P frees them on D.
    """

    do_remote_decode: Literal[True]
    do_remote_prefill: Literal[False]
    remote_blocks_expiry_time: float
    """Deadline of the pin, in D's ``time.perf_counter()`` clock."""

    def as_prefill_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` that ask P to prefill and to pull these blocks back."""
        return self.model_dump()


class PrefillResult(_RemoteBlocks):
    """P's dict after a prefill: the blocks D must pull, leased on P for a short time."""

    do_remote_prefill: Literal[True]
    do_remote_decode: Literal[False]


def prefill_params(handle: KVHandle | None) -> dict[str, Any]:
    """``kv_transfer_params`` for a P request, with D's handle pushed back when given."""
    if handle is None:
        return {"do_remote_decode": True, "do_remote_prefill": False}
    return handle.as_prefill_params()


def parse_handle(raw: object) -> KVHandle | None:
    """Parse D's returned dict; None when D returned none (bidirectional off, or aborted)."""
    if raw is None:
        return None
    try:
        return KVHandle.model_validate(raw)
    except ValidationError as exc:
        raise EngineError(f"the decode engine returned a malformed KV handle: {exc}") from exc


def parse_prefill_result(raw: object) -> PrefillResult:
    """Parse P's returned dict; a malformed one is never passed on to D."""
    try:
        return PrefillResult.model_validate(raw)
    except ValidationError as exc:
        raise EngineError(f"the prefill engine returned malformed transfer params: {exc}") from exc
