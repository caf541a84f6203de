"""The vLLM and NIXL each server of an HTTP pair runs, read when the pair opens, and whether P and D can handshake.

vLLM's NIXL connector refuses a peer whose handshake version differs from its own (``NIXL_CONNECTOR_VERSION`` in
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py``: 14 in vLLM 0.32, 15 in 0.33, 16 in 0.34), and
it finds out at the first transfer, a failed step. So a pair reads both servers' versions at open and refuses a P
and a D that cannot handshake, naming both. Every vLLM server answers ``GET /version`` (``{"version": "0.33.0"}``);
agentkv's server also puts its vLLM, NIXL and handshake versions in every reply's ``agentkv`` object
(``src/agentkv/_engines/_server.py``). A stock server's handshake version is known by its vLLM release series
(`NIXL_HANDSHAKES`).

The versions also say what a stock decode server streams: from vLLM 0.33 on, its last streamed chunk that has
choices carries the KV handle (`STREAMED_HANDLE_SINCE`); vLLM 0.32's streams carry none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx

from .._errors import UserError
from ._platforms import Role

__all__ = [
    "NIXL_HANDSHAKES",
    "STREAMED_HANDLE_SINCE",
    "ServerVersions",
    "check_handshake",
    "read_server_version",
    "stock_streams_handle",
]

logger = logging.getLogger("agentkv")

NIXL_HANDSHAKES: dict[str, int] = {"0.32": 14, "0.33": 15, "0.34": 16}
"""vLLM's NIXL handshake version (``NIXL_CONNECTOR_VERSION``) by release series, read from each release's wheel."""
STREAMED_HANDLE_SINCE = (0, 33)
"""The first vLLM release series whose stock server streams the KV handle (on the last chunk with choices)."""


def _series(version: str | None) -> tuple[int, int] | None:
    """``"0.33.0+cu130"`` -> ``(0, 33)``; None where it does not read as a release."""
    parts = (version or "").split("+")[0].split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


@dataclass(frozen=True)
class ServerVersions:
    """What one server runs: its vLLM (``/version``), and, from agentkv's servers, NIXL and the handshake version."""

    vllm: str | None = None
    nixl: str | None = None
    handshake: int | None = None
    """The NIXL connector's handshake version: the server's own word, else `NIXL_HANDSHAKES` by its vLLM series."""

    @classmethod
    def of(cls, vllm: str | None, extras: Any) -> ServerVersions:
        """From ``/version``'s answer and a reply's ``agentkv`` object (None from a stock server)."""
        said = extras.get("versions") if isinstance(extras, dict) else None
        said = said if isinstance(said, dict) else {}
        vllm = said.get("vllm") or vllm
        handshake = said.get("nixl_handshake")
        if not isinstance(handshake, int):
            series = _series(vllm)
            handshake = NIXL_HANDSHAKES.get(f"{series[0]}.{series[1]}") if series else None
        nixl = said.get("nixl")
        return cls(vllm=vllm, nixl=nixl if isinstance(nixl, str) else None, handshake=handshake)

    def words(self) -> str:
        """``"vLLM 0.33.0, NIXL 1.5.1, handshake 15"``, of what is known."""
        known = [("vLLM", self.vllm), ("NIXL", self.nixl), ("handshake", self.handshake)]
        return ", ".join(f"{name} {value}" for name, value in known if value is not None) or "versions unknown"

    def as_dict(self) -> dict[str, Any]:
        return {"vllm": self.vllm, "nixl": self.nixl, "nixl_handshake": self.handshake}


async def read_server_version(url: str, *, timeout_s: float = 10.0) -> str | None:
    """The vLLM version the server at ``url`` says it runs (``GET /version``); None when it does not say."""
    root = url.rstrip("/").removesuffix("/v1")
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(f"{root}/version")
            response.raise_for_status()
            version = response.json().get("version")
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        logger.debug("agentkv: reading %s/version failed: %s", root, exc)
        return None
    return version if isinstance(version, str) else None


def check_handshake(versions: dict[Role, ServerVersions], urls: tuple[str, str]) -> None:
    """Refuse (`UserError`) a P and a D whose NIXL handshake versions differ; warn when they cannot be told and the
    servers run different vLLM releases."""
    p, d = versions["prefill"], versions["decode"]
    if p.handshake is not None and d.handshake is not None:
        if p.handshake != d.handshake:
            raise UserError(
                f"the prefill server at {urls[0]} ({p.words()}) and the decode server at {urls[1]} ({d.words()}) "
                "cannot handshake: vLLM's NIXL connector refuses a peer of another handshake version, and the "
                "first KV transfer would fail. Run the same vLLM release on both (docs/engines.md)"
            )
        return
    if _series(p.vllm) != _series(d.vllm):
        logger.warning(
            "agentkv: the prefill server (%s) and the decode server (%s) run different vLLM releases, whose NIXL "
            "handshake versions agentkv cannot tell: if they differ, the first KV transfer fails",
            p.words(),
            d.words(),
        )


def stock_streams_handle(version: str | None) -> bool:
    """Whether a stock vLLM server of ``version`` ends its streamed completions with the KV handle."""
    series = _series(version)
    return series is not None and series >= STREAMED_HANDLE_SINCE
