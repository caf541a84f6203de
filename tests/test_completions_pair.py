"""A copilot's completions run on the real pair through the door: an editor re-sends a file prefix grown by one line
per request, 20 requests on one conversation key. The pair runs with P's prefix cache off, so every token a step
does not compute comes from D: requests 2+ pull the whole blocks they share with the pin back (the pin cut to them,
src/agentkv/_session/_completion_api.py), and greedy output equals a run of the same prompts without a key."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentkv import EmbeddedPair, SessionPool
from agentkv._engines._system import free_port
from agentkv.serve import FrontDoor
from conftest import EXACT_DTYPE, PIN_TTL_S

pytestmark = pytest.mark.pair

REQUESTS = 20


@pytest.fixture(scope="module")
def door() -> Iterator[str]:
    with (
        EmbeddedPair(max_model_len=2048, pin_ttl_s=PIN_TTL_S, dtype=EXACT_DTYPE, prefill_prefix_cache=False) as pair,
        SessionPool(engine=pair, max_tokens=16) as pool,
        FrontDoor(pool, model_name="smol", port=free_port()) as opened,
    ):
        yield opened.url


HEADER = '''"""Accumulate weighted values into seven running totals.

The weights and the values come from the sensor readings of one day, one reading a line; each total collects the
readings of one weekday, so that the weekly report can compare the days with each other and with last week's.

A reading whose weight is zero still counts as read: the report says how many readings each total holds, and a
day with fewer readings than the others is flagged there, never silently averaged away.
"""

from collections.abc import Sequence


def accumulate(totals: list[float], weights: Sequence[float], values: Sequence[float]) -> None:
'''
"""More than one of the CPU pair's 128-token blocks: the second request already shares a whole block."""

BLOCK_SIZE = 128
"""vLLM's KV block on the CPU (docs/transfer.md): a cut pin keeps whole blocks only."""


def _file(lines: int) -> str:
    return HEADER + "".join(f"    totals[{n % 7}] += weights[{n}] * values[{n}]\n" for n in range(lines))


def _complete(url: str, prompt: str, headers: dict[str, str]) -> dict[str, Any]:
    body = {"model": "smol", "prompt": prompt, "temperature": 0.0, "max_tokens": 12}
    answer = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=300)
    assert answer.status_code == 200, answer.text
    reply: dict[str, Any] = answer.json()
    return reply


def test_a_growing_file_pulls_its_shared_blocks_back_and_answers_as_without_a_key(door: str) -> None:
    keyed = [_complete(door, _file(n), {"x-session-id": "copilot"}) for n in range(1, REQUESTS + 1)]
    keyless = [_complete(door, _file(n), {}) for n in range(1, REQUESTS + 1)]
    steps = [reply["agentkv"]["stats"] for reply in keyed]
    for number, step in enumerate(steps, start=1):
        assert step["local_hit_tokens"] + step["pulled_tokens"] + step["computed_tokens"] == step["prompt_tokens"]
        if number > 1:
            assert step["pulled_tokens"] > 0, (number, step)
            grown = step["prompt_tokens"] - steps[number - 2]["prompt_tokens"]  # the new line
            assert step["computed_tokens"] < grown + BLOCK_SIZE + 8, step  # and what follows the last whole block
    assert all(reply["agentkv"]["stats"]["pulled_tokens"] == 0 for reply in keyless)
    assert [r["choices"][0]["text"] for r in keyed] == [r["choices"][0]["text"] for r in keyless]
    pulled = sum(step["pulled_tokens"] for step in steps)
    prompts = sum(step["prompt_tokens"] for step in steps)
    print(f"\ncopilot run: {pulled} of {prompts} prompt tokens pulled back from D over {REQUESTS} requests")
