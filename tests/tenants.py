"""What the two-tenant tests share (tests/test_serve_tenants.py on the double, tests/test_serve_tenants_pair.py on the
real pair): the two tenants' keys, and readers of the door's answers."""

from __future__ import annotations

from typing import Any

import httpx

__all__ = ["ALICE", "BOB", "KEYS", "cached", "not_found", "stats"]

KEYS = {"sk-alice-0123456789": "alice", "sk-bob-9876543210": "bob"}
"""Each key with the tenant it names (as a keys file names them)."""
ALICE, BOB = ({"authorization": f"Bearer {key}"} for key in KEYS)


def stats(answer: httpx.Response) -> dict[str, Any]:
    """A 200's step stats (the ``agentkv`` object)."""
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()["agentkv"]["stats"]
    return found


def cached(answer: httpx.Response) -> int:
    """A 200's ``cached_tokens`` (chat completions' or Responses')."""
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return int(details["cached_tokens"])


def not_found(answer: httpx.Response, code: str) -> dict[str, Any]:
    """A 404 in OpenAI's error shape with ``code``; its error object."""
    assert answer.status_code == 404, answer.text
    error: dict[str, Any] = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error
