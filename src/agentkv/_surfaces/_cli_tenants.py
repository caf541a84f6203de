"""``agentkv serve``'s options for many users: the API keys and their tenants, the gateway's tenant header, each
tenant's quotas, how long conversations are kept and whether responses are (docs/serve.md, "Serving many users").
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ._cli_options import positive_int, positive_seconds
from ._tenants import Tenants, read_keys_file

__all__ = ["DEFAULT_RETENTION_S", "add_tenant_arguments", "door_options", "pool_quotas", "retention"]

DEFAULT_RETENTION_S = 7 * 24 * 3600.0
"""How long ``agentkv serve`` keeps a saved conversation or response after its last write, by default."""


def _keys_of(variable: str) -> list[str]:
    """The keys in an environment variable, separated by commas."""
    return [key.strip() for key in os.environ.get(variable, "").split(",") if key.strip()]


def add_tenant_arguments(serve: argparse.ArgumentParser) -> None:
    """The options of tenants, quotas and retention."""
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY'; repeat it for several keys, each a tenant of its own whose "
        "conversations no other key reaches (default: $AGENTKV_API_KEY, keys separated by commas; none: no key "
        "needed)",
    )
    serve.add_argument(
        "--api-keys-file",
        default=os.environ.get("AGENTKV_API_KEYS_FILE"),
        metavar="PATH",
        help="a file of 'TENANT KEY' lines: keys that name their tenant (several keys may share one) "
        "(default: $AGENTKV_API_KEYS_FILE)",
    )
    serve.add_argument(
        "--tenant-header",
        default=None,
        metavar="NAME",
        help="take each request's tenant (under its key's) from this header, which a trusted gateway in front "
        "of the door sets (default: none read)",
    )
    serve.add_argument(
        "--tenant-max-sessions",
        type=positive_int,
        default=None,
        help="most sessions one tenant keeps; its least recently used idle one closed past it (default: "
        "--max-sessions; past it in all, the tenant holding the most loses one first)",
    )
    serve.add_argument(
        "--tenant-max-in-flight",
        type=positive_int,
        default=None,
        help="most steps of one tenant running at once; one more gets a 429 (default: --max-in-flight)",
    )
    serve.add_argument(
        "--tenant-max-pinned-tokens",
        type=positive_int,
        default=None,
        help="most tokens of one tenant's conversations pinned on D between steps; past it its least recently "
        "used idle sessions' pins are dropped (default: no bound of its own)",
    )
    serve.add_argument(
        "--retention-s",
        type=float,
        default=DEFAULT_RETENTION_S,
        help="how long a saved conversation or response is kept after its last write; 0: until the store's row "
        f"bound drops it (default {DEFAULT_RETENTION_S:g}: 7 days)",
    )
    serve.add_argument(
        "--no-store-responses",
        dest="store_responses",
        action="store_false",
        help="keep no Responses-API response (as vLLM by default): 'store' is taken as false, and "
        "previous_response_id finds none",
    )
    serve.add_argument(
        "--write-timeout-s",
        type=positive_seconds,
        default=30.0,
        help="the most a stream's write waits for a client that does not read; then its connection is dropped "
        "(default 30)",
    )


def retention(args: argparse.Namespace) -> float | None:
    """The stores' ``max_age_s`` of ``--retention-s`` (None: 0, no bound)."""
    if args.retention_s < 0:
        raise SystemExit("agentkv serve: --retention-s is a number of seconds, 0 or more")
    return args.retention_s or None


def pool_quotas(args: argparse.Namespace) -> dict[str, Any]:
    """The `SessionPool` arguments of the tenants' quotas."""
    return {"tenant_max_sessions": args.tenant_max_sessions, "tenant_max_pinned_tokens": args.tenant_max_pinned_tokens}


def door_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `FrontDoor` arguments of the keys, the tenant header, a tenant's steps, streams and responses."""
    keys = args.api_key if args.api_key is not None else _keys_of("AGENTKV_API_KEY")
    named = read_keys_file(args.api_keys_file) if args.api_keys_file else None
    Tenants.of(keys, named=named, header=args.tenant_header)  # checked before anything starts
    return {
        "api_key": keys or None,
        "api_keys": named,
        "tenant_header": args.tenant_header,
        "tenant_max_in_flight": args.tenant_max_in_flight,
        "write_timeout_s": args.write_timeout_s,
        "keep_responses": args.store_responses,
    }
