"""Stop sequences (`Session.step`'s ``stop``, `Sampling.stop`): the answer ends before the first stop string.

On the test doubles, which cut an output where vLLM does (the token that completes the stop string
is the last; the text ends before the stop string). The real pair runs one such step in test_pair.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentkv import Session, SessionPool, ToolSpec, UserError
from agentkv._engines._base import Sampling
from agentkv._engines._http_transport import completion_body
from agentkv._engines._vllm import could_stop, vllm_sampling
from agentkv.engines import StepRequest
from agentkv.testing import HonestPairEngine, ScriptedEngine

WEATHER = ToolSpec(
    name="weather",
    description="The weather in a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
USER = [{"role": "user", "content": "Count to three."}]


class Counting:
    """Always the same answer; keeps the requests."""

    def __init__(self) -> None:
        self.requests: list[StepRequest] = []

    def __call__(self, request: StepRequest) -> str:
        self.requests.append(request)
        return "One, two, three. Done."


counting = Counting()


def test_the_answer_ends_before_the_stop_string_and_the_history_keeps_its_tokens(tokenizer: Any) -> None:
    with HonestPairEngine(counting) as pair, Session(engine=pair) as session:
        pieces: list[str] = []
        reply = session.step_sync(USER, stop=[" three", "Done"], on_text=pieces.append)
        assert (reply.text, reply.finish_reason) == ("One, two,", "stop")
        assert "".join(pieces) == "One, two,"  # the stop string is never streamed
        generated = pair.steps[0].output_token_ids
        assert tokenizer.decode(generated).endswith(" three")  # kept up to the token that completed it
        assert session.token_ids[-len(generated) :] == generated
    assert pair.violations == []


@pytest.mark.upkeep
def test_the_step_after_a_stop_extends_the_history_exactly_and_pulls_the_repinned_conversation() -> None:
    """A real pair's D pins nothing for a request a stop string ended: the session repins the conversation from
    D's prefix cache (one token, no pin given), so the next step pushes back and pulls, as does the one after it
    (the output ended normally). Before the repin (src/agentkv/_session/_pin_upkeep.py) the next step recomputed."""
    respond = Counting()
    with HonestPairEngine(respond) as pair, Session(engine=pair, early_transfer=False) as session:
        history: list[dict[str, Any]] = [*USER]
        stopped = session.step_sync(history, stop="two")
        history += [{"role": "assistant", "content": stopped.text}, {"role": "user", "content": "Go on."}]
        second = session.step_sync(history)
        history += [{"role": "assistant", "content": second.text}, {"role": "user", "content": "Again."}]
        third = session.step_sync(history)
        steps = [s for t in session.stats.turns for s in t.steps]
    assert (stopped.text, second.text, third.text) == ("One, ", "One, two, three. Done.", "One, two, three. Done.")
    repin = pair.steps[1]
    assert repin.request_id.startswith("agentkv-repin-") and not repin.forwarded and len(repin.output_token_ids) == 1
    records = [r for i, r in enumerate(pair.steps) if i != 1]
    assert [r.forwarded for r in records] == [False, True, True]
    assert [s.miss_reason for s in steps] == ["no_handle", None, None] and steps[1].pulled_tokens > 0
    assert [t.repins for t in session.stats.turns] == [0, 1, 0]
    assert [s.turn for s in steps] == [1, 2, 3]  # the session kept the conversation: no rebuild
    prompts = [list(r.prompt_token_ids) for i, r in enumerate(respond.requests) if i != 1]
    for before, step, after in zip(prompts, records, prompts[1:], strict=False):  # token-exact history
        assert after[: len(before) + len(step.output_token_ids)] == before + step.output_token_ids
    assert pair.violations == []


def test_stop_does_not_cut_the_forced_json_of_schema_tools_and_does_cut_native_output() -> None:
    outputs = [json.dumps({"answer": "Sunny. Warm."}), "Sunny. Warm."]
    with ScriptedEngine(outputs) as engine, Session(engine=engine) as session:
        forced = session.step_sync(USER, tools=[WEATHER], stop=".")
        assert forced.text == "Sunny. Warm." and engine.requests[0].sampling.stop == ()
        plain = session.step_sync(USER, stop=".")
        assert plain.text == "Sunny" and engine.requests[1].sampling.stop == (".",)
    with (
        ScriptedEngine(["Sunny. Warm."]) as engine,
        Session(engine=engine, tools=[], tool_format="native") as session,
    ):
        native = session.step_sync(USER, tools=[WEATHER], stop=".")
        assert native.text == "Sunny" and engine.requests[0].sampling.stop == (".",)


@pytest.mark.parametrize(
    ("stop", "error"),
    [("", "empty"), (["a", ""], "empty"), (["a", "b", "c", "d", "e"], "at most 4"), ([1], "string"), (3, "string")],
)
def test_bad_stop_strings_are_user_errors_and_change_nothing(stop: Any, error: str) -> None:
    with ScriptedEngine(["fine"]) as engine, Session(engine=engine) as session:
        with pytest.raises(UserError, match=error):
            session.step_sync(USER, stop=stop)
        assert session.token_ids == []
        assert session.step_sync(USER, stop=["x", "y", "z", "w"]).text == "fine"


def test_the_pool_passes_stop_through() -> None:
    with HonestPairEngine(counting) as pair, SessionPool(engine=pair) as pool:
        reply = pool.step_sync(USER, conversation_id="c", stop=",")
    assert reply.text == "One" and reply.finish_reason == "stop"


def test_a_stop_string_that_never_occurs_changes_nothing(tokenizer: Any) -> None:
    with HonestPairEngine(counting) as pair, Session(engine=pair) as session:
        reply = session.step_sync(USER, stop="zebra")
        second = session.step_sync([*USER, reply.message, {"role": "user", "content": "Again."}])
    assert reply.text == "One, two, three. Done." and pair.steps[0].output_token_ids[-1] == tokenizer.eos_token_id
    assert second.stats.handle_forwarded


@pytest.mark.parametrize(
    ("text", "stop", "could"),
    [
        ("Hello", ("\n",), False),
        ("Hello", ("ll",), True),  # inside P's token
        ("Hello", ("lo wor",), True),  # begins in P's token, ends in D's output
        ("Hello", ("Hello world",), True),
        ("Hello", ("world", "o!"), True),
        ("Hello", ("world",), False),
        ("Hello", (), False),
    ],
)
def test_could_stop_finds_stop_strings_that_involve_a_text(text: str, stop: tuple[str, ...], could: bool) -> None:
    assert could_stop(text, stop) is could


def test_the_engines_pass_stop_to_vllm_and_to_the_decode_server() -> None:
    sampling = Sampling(max_tokens=8, stop=("\n\n", "END"))
    assert vllm_sampling(sampling, kv_transfer_params=None, stream=True).stop == ["\n\n", "END"]
    assert not vllm_sampling(Sampling(max_tokens=8), kv_transfer_params=None, stream=True).stop
    decode = completion_body(model="m", prompt_token_ids=[1], max_tokens=8, sampling=sampling, kv_transfer_params={})
    prefill = completion_body(model="m", prompt_token_ids=[1], max_tokens=1, sampling=sampling, kv_transfer_params={})
    assert decode["stop"] == ["\n\n", "END"] and "stop" not in prefill
