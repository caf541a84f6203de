"""`sampling=`: a session's and a step's `SamplingOptions` reach the engine, field by field; mistakes name
``sampling.<field>``; log probabilities come back with the step and with its streamed text."""

from __future__ import annotations

from typing import Any

import pytest

from agentkv import SamplingOptions, Session, SessionPool, TextPiece, TokenLogprob, UserError, tool
from agentkv.testing import ScriptedEngine
from scripted import with_logprobs

LogprobEngine = with_logprobs(ScriptedEngine)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_a_sessions_options_reach_the_engine_and_a_steps_go_over_them_field_by_field() -> None:
    engine = ScriptedEngine(["One.", "Two."])
    with engine, Session(engine=engine, sampling={"top_p": 0.5, "top_k": 4}) as session:
        session.step_sync([{"role": "user", "content": "hi"}])
        session.step_sync([{"role": "user", "content": "again"}], sampling=SamplingOptions(top_k=8, min_p=0.1))
    first, second = (request.sampling.options for request in engine.requests)
    assert (first.top_p, first.top_k, first.min_p) == (0.5, 4, 0.0)
    assert (second.top_p, second.top_k, second.min_p) == (0.5, 8, 0.1)


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"presence_penalty": 3}, "sampling.presence_penalty"),
        ({"logprobs": 21}, "sampling.logprobs"),
        ({"temperatur": 1.0}, "sampling.temperatur"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "sampling.structured_outputs"),
    ],
)
def test_bad_options_are_user_errors_naming_the_field(options: dict[str, Any], needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        Session(sampling=options)
    engine = ScriptedEngine([])
    with engine, Session(engine=engine) as session, pytest.raises(UserError, match=needle):
        session.step_sync([{"role": "user", "content": "hi"}], sampling=options)


def test_sampling_of_another_type_is_a_user_error() -> None:
    with pytest.raises(UserError, match="sampling"):
        Session(sampling="greedy")  # type: ignore[arg-type]


def test_structured_outputs_and_schema_forced_tool_calls_are_refused_by_name() -> None:
    json_object = {"structured_outputs": {"json_object": True}}
    with pytest.raises(UserError, match="sampling.structured_outputs.*tool_format='schema'"):
        Session(tools=[add], sampling=json_object)
    Session(tools=[add], tool_format="native", sampling=json_object)  # native tools leave the output free
    engine = LogprobEngine(["{}"])  # records what it is asked (engine.asked); the double refuses what it cannot honour
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with engine, Session(engine=engine) as session:
        with pytest.raises(UserError, match="sampling.structured_outputs"):
            session.step_sync([{"role": "user", "content": "hi"}], tools=tools, sampling=json_object)
        session.step_sync([{"role": "user", "content": "hi"}], sampling=json_object)  # without tools: to the engine
    assert engine.asked[0].sampling.structured == {"json_object": True}


def test_a_step_reports_logprobs_and_gives_them_with_its_text() -> None:
    pieces: list[str] = []
    engine = LogprobEngine(["Paris is sunny."])
    with engine, SessionPool(engine=engine, sampling={"logprobs": 2}) as pool:
        session_reply = pool.step_sync([{"role": "user", "content": "hi"}], on_text=pieces.append)
    logprobs = session_reply.step.logprobs
    assert logprobs is not None and len(logprobs) == len(session_reply.step.token_ids)
    assert all(isinstance(p, TokenLogprob) and len(p.top) == 2 for p in logprobs)
    assert pieces and all(isinstance(piece, TextPiece) for piece in pieces)
    streamed = [p for piece in pieces for p in piece.logprobs]  # type: ignore[attr-defined]
    assert streamed == logprobs[: len(streamed)]  # in order; the tokens after the last text (EOS) are the reply's


def test_without_logprobs_a_step_reports_none() -> None:
    engine = LogprobEngine(["Paris."])
    with engine, SessionPool(engine=engine) as pool:
        reply = pool.step_sync([{"role": "user", "content": "hi"}], sampling={"top_k": 3})
    assert reply.step.logprobs is None
    assert engine.requests[0].sampling.options.top_k == 3
