"""``POST /v1/completions`` on the door, over `HonestPairEngine` (no model runs here; the real pair against stock
``vllm serve``: tests/test_differential.py, the copilot run on the real pair: tests/test_completions_pair.py), and
the cut rule a growing prompt's pin goes by (`KVHandle.cut`, `cut_to_prompt`)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from agentkv import SessionPool
from agentkv._engines._base import Pin
from agentkv._engines._handle import KVHandle, pin_of
from agentkv._engines._pinning import HeldPin, choose_pin, cut_to_prompt
from agentkv._engines._system import free_port
from agentkv._surfaces._openai_completions import COMPLETIONS_FIELDS
from agentkv.engines import StepRequest
from agentkv.serve import FrontDoor
from agentkv.testing import HonestPairEngine
from tenants import ALICE, BOB, KEYS, stats

BLOCK = 16
"""The double's block size (its D's, and the cut's)."""


def respond(request: StepRequest) -> str:
    """A completion that depends on the prompt (so a wrong pin would show), never in the next prompt."""
    return f" // line {len(request.prompt_token_ids)} done"


Door = tuple[str, HonestPairEngine, SessionPool]


@pytest.fixture(scope="module")
def door() -> Iterator[Door]:
    with HonestPairEngine(respond, max_model_len=2048) as engine, SessionPool(engine=engine, max_tokens=64) as pool:
        with FrontDoor(pool, model_name="smol", api_keys=KEYS, port=free_port()) as opened:
            yield opened.url, engine, pool
    assert engine.violations == []


@pytest.fixture
def client(door: Door) -> Iterator[openai.OpenAI]:
    key = next(iter(KEYS))
    with openai.OpenAI(base_url=door[0] + "/v1", api_key=key, max_retries=0) as opened:
        yield opened


def _post(door: Door, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(door[0] + "/v1/completions", json={"model": "smol", **body}, headers={**ALICE, **(headers or {})})


def test_a_text_prompt_is_completed_in_vllms_shape(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="smol", prompt="def add(a, b):\n", max_tokens=64)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-") and reply.model == "smol"
    choice = reply.choices[0]
    assert choice.index == 0 and choice.text.startswith(" // line ") and choice.finish_reason == "stop"
    assert choice.logprobs is None
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_token_ids_and_a_list_of_one_prompt_are_the_same_prompt(client: openai.OpenAI, door: Door) -> None:
    tokens = [72, 101, 108, 108, 111]
    by_ids = client.completions.create(model="smol", prompt=tokens, max_tokens=64)
    by_list = client.completions.create(model="smol", prompt=[tokens], max_tokens=64)
    assert by_ids.choices[0].text == by_list.choices[0].text == respond_for(len(tokens))
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(tokens)
    assert door[1].steps[-1].prompt_tokens == len(tokens)


def respond_for(prompt_tokens: int) -> str:
    return f" // line {prompt_tokens} done"


def test_max_tokens_defaults_to_16_and_ends_with_length(door: Door) -> None:
    answer = _post(door, {"prompt": "x", "max_tokens": 3})
    assert answer.json()["choices"][0]["finish_reason"] == "length"
    assert answer.json()["usage"]["completion_tokens"] == 3
    assert door[1].steps[-1].output_token_ids.__len__() == 3
    _post(door, {"prompt": "y"})
    assert len(door[1].steps[-1].output_token_ids) <= 16


def test_echo_puts_the_prompt_first(door: Door) -> None:
    answer = _post(door, {"prompt": "print(1)\n", "echo": True, "max_tokens": 64}).json()
    assert answer["choices"][0]["text"] == "print(1)\n" + respond_for(answer["usage"]["prompt_tokens"])


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [[1, 2], [3]]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "a", "n": 2}, "n"),
        ({"prompt": "a", "suffix": "}"}, "suffix"),
        ({"prompt": "a", "echo": True, "logprobs": 1}, "echo"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "a", "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 10**9]}, "vocabulary"),
    ],
)
def test_what_is_not_honoured_is_refused_by_name(door: Door, body: dict[str, Any], field: str) -> None:
    answer = _post(door, body)
    assert answer.status_code == 400, answer.text
    assert field in answer.json()["error"]["message"]


def test_a_prompt_past_the_context_is_refused_before_it_runs(door: Door) -> None:
    steps = len(door[1].steps)
    answer = _post(door, {"prompt": "word " * 20_000})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"
    assert _post(door, {"prompt": list(range(40, 50)) * 300}).status_code == 400
    assert len(door[1].steps) == steps


def test_the_stream_is_the_completion_in_chunks_then_usage_and_done(door: Door) -> None:
    body = {"prompt": "import os\n", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 64}
    plain = _post(door, {"prompt": "import os\n", "max_tokens": 64}).json()
    with httpx.stream("POST", door[0] + "/v1/completions", json=body, headers=ALICE) as answer:
        assert answer.status_code == 200
        events = [line[len("data: ") :] for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == plain["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


def test_a_copilot_growing_file_pulls_its_shared_blocks_back(door: Door) -> None:
    """An editor re-sends a file prefix grown by a line, without the last completion: each request after the first
    pulls the whole blocks it shares with the pin, computes the rest, and answers as a request without a key."""
    _, engine, pool = door
    lines = [f"    total += values[{n}] * {n}  # step {n}\n" for n in range(8)]
    previous = 0
    for count in range(1, len(lines) + 1):
        prompt = "def total(values):\n" + "".join(lines[:count])
        keyed = _post(door, {"prompt": prompt, "max_tokens": 64}, {"x-session-id": "copilot-1"})
        step = stats(keyed)
        assert step["local_hit_tokens"] + step["pulled_tokens"] + step["computed_tokens"] == step["prompt_tokens"]
        if count > 1:
            assert step["pulled_tokens"] > 0 and step["pulled_tokens"] % BLOCK == 0
            # the new line, the partial block before it, and a token or two a BPE merges across the line's start
            assert step["computed_tokens"] < step["prompt_tokens"] - previous + 2 * BLOCK
        previous = step["prompt_tokens"]
        keyless = _post(door, {"prompt": prompt, "max_tokens": 64})
        assert stats(keyless)["pulled_tokens"] == 0
        assert keyed.json()["choices"][0]["text"] == keyless.json()["choices"][0]["text"]
    assert keyed.headers["x-session-id"] == "copilot-1"
    assert engine.violations == []
    assert pool.session_for("copilot-1", tenant="alice") is None  # a completions session, apart from a chat's
    assert "copilot-1" in pool.conversations_of("alice")


def test_keyless_completions_keep_no_session(door: Door) -> None:
    _, engine, pool = door
    before = len(pool.sessions)
    for _ in range(3):
        assert stats(_post(door, {"prompt": "same prompt " * 4}))["pulled_tokens"] == 0
    assert len(pool.sessions) == before


def test_another_tenants_key_is_a_conversation_of_its_own(door: Door) -> None:
    prompt = "class Shape:\n    def area(self):\n        return 0\n" * 5
    assert stats(_post(door, {"prompt": prompt}, {"x-session-id": "shared-name"}))["pulled_tokens"] == 0
    bob = httpx.post(
        door[0] + "/v1/completions",
        json={"prompt": prompt + "x", "session_id": "shared-name"},
        headers=BOB,
    )
    assert stats(bob)["pulled_tokens"] == 0  # alice's pin is alice's alone
    again = _post(door, {"prompt": prompt + "x"}, {"x-session-id": "shared-name"})
    assert stats(again)["pulled_tokens"] > 0


def test_every_completions_field_of_vllm_is_ruled_and_a_refused_one_takes_vllms_default() -> None:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    assert set(CompletionRequest.model_fields) <= set(COMPLETIONS_FIELDS)
    for name, field in CompletionRequest.model_fields.items():
        rule = COMPLETIONS_FIELDS[name]
        default = field.get_default(call_default_factory=True)
        if rule.status == "refused":
            assert any(default == accepted and type(default) is type(accepted) for accepted in rule.accepts), name


_ROW = re.compile(r"^\| `([a-z_]+)` \| [^|]* \| (\*\*refused\*\* \(400\)|honoured|no effect): ", re.MULTILINE)


def test_the_docs_table_lists_exactly_the_completions_fields() -> None:
    page = (Path(__file__).parent.parent / "docs" / "serve.md").read_text()
    section = page[page.index("### Text completions") :]
    body = section[: section.index("\n#")]
    rows = {name: status.replace("**refused** (400)", "refused") for name, status in _ROW.findall(body)}
    assert rows == {name: rule.status for name, rule in COMPLETIONS_FIELDS.items()}


# ----------------------------------------------------------------- the cut rule


def _handle(tokens: int) -> KVHandle:
    blocks = -(-tokens // BLOCK)
    return KVHandle(
        do_remote_decode=True,
        do_remote_prefill=False,
        remote_block_ids=[list(range(100, 100 + blocks))],
        remote_engine_id="d",
        remote_request_id="r",
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_num_tokens=tokens,
        tp_size=1,
        remote_blocks_expiry_time=1e12,
    )


def _cut(pin: Pin, tokens: int) -> Pin | None:
    assert isinstance(pin.ref, KVHandle)
    cut = pin.ref.cut(tokens, block_size=BLOCK)
    return None if cut is None else pin_of(cut)


def _forwarded(pinned: list[int], prompt: list[int]) -> Pin | None:
    held = HeldPin(pin_of(_handle(len(pinned) - 1)), pinned)  # D keeps all but the last output token
    cut = cut_to_prompt(held, prompt, _cut)
    if cut is None:
        return None
    pin, reason = choose_pin(cut, prompt, push_back=True, expiry_margin_s=0.0, now=0.0)
    assert reason is None  # a cut pin always passes the token-exact rule
    return pin


PINNED = list(range(1000, 1070))  # 70 tokens: prompt and answer; D keeps 69 (4 whole blocks and 5)


@pytest.mark.parametrize(
    ("prompt", "kept"),
    [
        (PINNED[:40] + [1, 2, 3], 32),  # diverges mid-block (at 40): the whole blocks before it
        (PINNED[:48] + [1, 2, 3], 48),  # diverges exactly at a block boundary: every block before it
        (PINNED[:48], 32),  # the prompt is the first 48 tokens: P computes its last, so 47 are shared
        (PINNED[:10] + [1, 2, 3], None),  # shares less than one block: nothing forwarded
        ([1, *PINNED], None),  # shares nothing
        (PINNED[:66] + [7, 8, 9], 64),  # diverges in the pin's last, partial block: the whole blocks before it
        (PINNED[:69] + [7], 69),  # extends the pin exactly: the whole pin, uncut
    ],
)
def test_a_pin_is_cut_to_the_whole_blocks_the_prompt_shares(prompt: list[int], kept: int | None) -> None:
    pin = _forwarded(PINNED, prompt)
    if kept is None:
        assert pin is None
        return
    assert pin is not None and pin.tokens == kept
    assert isinstance(pin.ref, KVHandle)
    assert pin.ref.remote_num_tokens == kept and pin.ref.remote_block_ids == [list(range(100, 100 - -kept // BLOCK))]
    assert prompt[:kept] == PINNED[:kept] and len(prompt) > kept


def test_a_handle_is_never_cut_past_itself_nor_with_groups_it_lists_short() -> None:
    handle = _handle(40)
    assert handle.cut(64, block_size=BLOCK) is handle
    assert handle.cut(15, block_size=BLOCK) is None
    short = handle.model_copy(update={"remote_block_ids": [[1, 2, 3], [4]]})  # a sliding-window group: not cut
    assert short.cut(32, block_size=BLOCK) is None


@pytest.mark.parametrize("prefill_cache", [False, True], ids=["p-cache-off", "p-cache-on"])
def test_a_cut_pins_stats_say_where_each_prompt_token_came_from(prefill_cache: bool) -> None:
    """`Session.complete` on the honest double: a prompt sharing 40 tokens with the pin pulls the 32 of its whole
    blocks (or finds them in P's own cache), computes the rest; one sharing less than a block forwards nothing and
    the pin is released; every split sums to the prompt, and D checks every pin it is given."""
    import anyio

    from agentkv import Session

    async def run() -> list[Any]:
        engine = HonestPairEngine(respond, prefill_cache=prefill_cache)
        async with engine, Session(engine=engine) as session:
            first = await session.complete(list(range(300, 350)), max_tokens=8)
            cut = await session.complete([*range(300, 340), 7, 8, 9], max_tokens=8)
            short = await session.complete([*range(300, 310), 7], max_tokens=8)
        assert engine.violations == [] and engine.live_pins == 0
        return [first.stats, cut.stats, short.stats]

    first, cut, short = anyio.run(run)
    for step in (first, cut, short):
        assert step.local_hit_tokens + step.pulled_tokens + step.computed_tokens == step.prompt_tokens
    assert (first.pulled_tokens, first.computed_tokens + first.local_hit_tokens) == (0, 50)
    assert cut.handle_forwarded and cut.miss_reason is None and cut.computed_tokens == 43 - 32
    assert (cut.local_hit_tokens, cut.pulled_tokens) == ((32, 0) if prefill_cache else (0, 32))
    assert not short.handle_forwarded and short.miss_reason == "prefix_mismatch" and short.pulled_tokens == 0
