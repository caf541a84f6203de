"""`agentkv serve`'s command line with its pool and door replaced by doubles: what it would build, kept.

For tests of the command's wiring (flags to settings, stores opened and closed) that start no engine and no server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from agentkv._surfaces._tenants import Tenants


def serve_with_doubles(
    monkeypatch: pytest.MonkeyPatch,
    argv: Sequence[str],
    *,
    while_serving: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Run ``agentkv <argv>`` with `SessionPool` and `FrontDoor` replaced: its exit status, the options the pool
    was made with and those the door was made with. ``while_serving`` gets the door's options while it "serves"
    (the stores are open then)."""
    from agentkv._surfaces._cli import main

    pool_options: dict[str, Any] = {}
    door_options: dict[str, Any] = {}

    class NoPool:
        engine = None

        def __init__(self, **options: Any) -> None:
            pool_options.update(options)

        def __enter__(self) -> NoPool:
            return self

        def __exit__(self, *exc_info: object) -> None:
            pass

    class NoDoor:
        url = "http://127.0.0.1:8000"
        settings = type("Settings", (), {"tenants": Tenants(), "model_name": "m"})()

        def __init__(self, pool: NoPool, **options: Any) -> None:
            door_options.update(options)

        def run(self, *args: Any, **options: Any) -> None:
            if while_serving is not None:
                while_serving(door_options)

    monkeypatch.setattr("agentkv._session._pool.SessionPool", NoPool)
    monkeypatch.setattr("agentkv._surfaces._serve.FrontDoor", NoDoor)
    return main(list(argv)), pool_options, door_options
