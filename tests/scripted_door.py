"""A front door on a scripted engine, run as its own process, as ``agentkv serve --store postgresql://...`` runs
one: `SessionPool` on `HonestPairEngine` (no model runs), both stores on the given database, `FrontDoor` until
SIGTERM. tests/scale_out.py starts several behind a router (``python tests/scripted_door.py --port P --store URL``);
`answer` is its engine's reply, which a test's own single door uses too, to compare.
"""

from __future__ import annotations

import argparse
import hashlib

from agentkv.engines import StepRequest

MODEL = "scripted"
"""The model id the scripted doors serve."""


def answer(request: StepRequest) -> str:
    """The reply to a prompt: its length and a digest of its token ids, so two doors answer a conversation alike
    only when they prompt the engine with the same tokens (a conversation resumed from the store, token for token)."""
    tokens = list(request.prompt_token_ids)
    digest = hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:12]
    return f"Seen {len(tokens)} tokens, digest {digest}."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--store", required=True, help="the postgresql:// URL every door shares")
    parser.add_argument("--lease-ttl-s", type=float, default=5.0)
    args = parser.parse_args()

    from agentkv import PostgresSessionStore, SessionPool
    from agentkv.serve import FrontDoor, PostgresResponseStore
    from agentkv.testing import HonestPairEngine

    with (
        PostgresResponseStore(args.store) as responses,
        PostgresSessionStore(args.store, lease_ttl_s=args.lease_ttl_s) as sessions,
        HonestPairEngine(answer) as engine,
        SessionPool(engine=engine, store=sessions, max_tokens=32) as pool,
    ):
        door = FrontDoor(pool, model_name=MODEL, port=args.port, store=responses)
        print(f"scripted door: {door.url}/v1 (owner {sessions.owner})", flush=True)
        door.run()  # until SIGTERM or SIGINT


if __name__ == "__main__":
    main()
