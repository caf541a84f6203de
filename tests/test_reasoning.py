"""Reasoning models (issue #28): ``reasoning_parser=`` splits the thinking from the answer (vLLM's parsers), at the
session, at the front door, and in the push-back rule: the conversation keeps the output's tokens as generated,
reasoning included, although the chat template would drop earlier turns' reasoning. No model runs here: the
bundled tokenizer with ``<think>`` tokens and a reasoning-dropping template (tests/streamed.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from agentkv import ReasoningDelta, Session, UserError
from agentkv._engines._pinning import HeldPin, choose_pin
from agentkv.engines import Pin, StepRequest
from agentkv.testing import HonestPairEngine, ScriptedEngine
from streamed import TokenByToken, served, thinking_model

THOUGHT = "Two and three make five, so the sum is five."
OUTPUT = f"<think>{THOUGHT}</think>It is 5."


@pytest.fixture(scope="module")
def thinking(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return thinking_model(model_path, tmp_path_factory.mktemp("thinking"))


def test_step_and_stream_give_the_reasoning_apart(thinking: Path) -> None:
    reasoning: list[ReasoningDelta] = []
    texts: list[str] = []
    with (
        TokenByToken(lambda request: OUTPUT, model_path=thinking) as engine,
        Session(engine=engine, reasoning_parser="deepseek_r1") as session,
    ):
        reply = session.step_sync(
            [{"role": "user", "content": "2 + 3?"}], on_reasoning=reasoning.append, on_text=texts.append
        )
        result = session.run_sync("And 3 + 2?")
    assert reply.reasoning == THOUGHT and reply.text == "It is 5." and reply.message.content == "It is 5."
    assert len(reasoning) > 1 and "".join(r.text for r in reasoning) == THOUGHT  # streamed as written
    assert "".join(texts) == "It is 5."  # the reasoning is never answer text
    assert result.text == "It is 5." and "<think>" in result.steps[0].text  # the raw output keeps it


def test_without_a_reasoning_parser_the_reasoning_is_answer_text(thinking: Path) -> None:
    with ScriptedEngine([OUTPUT], model_path=thinking) as engine, Session(engine=engine) as session:
        reply = session.step_sync([{"role": "user", "content": "2 + 3?"}])
    assert reply.reasoning is None and reply.text == OUTPUT


def test_a_reasoning_parser_that_does_not_fit_the_tokenizer_is_refused(model_path: Path) -> None:
    """The bundled tokenizer has no ``<think>`` token: deepseek_r1 cannot find the reasoning's end in it."""
    with (
        ScriptedEngine([]) as engine,
        pytest.raises(UserError, match="deepseek_r1.*does not fit"),
        Session(engine=engine, reasoning_parser="deepseek_r1"),
    ):
        pass  # never reached: opening refuses it


# ----------------------------------------------------------------- reuse: the decided behaviour, measured both ways


def test_the_conversation_keeps_the_reasoning_tokens_and_pushes_back_all_of_them(thinking: Path) -> None:
    """agentkv keeps each output's tokens as generated, reasoning included: turn 2's prompt extends turn 1's
    tokens, so D's KV of all of them is pulled back (run, and the caller-run step whose messages carry the answer
    without its reasoning). Re-rendering the history as the template does (earlier reasoning dropped) would make
    a prompt that no longer extends the pin: nothing could be pushed back (the measured alternative)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(thinking))
    figures: dict[str, Any] = {}
    with (
        HonestPairEngine(lambda request: OUTPUT, model_path=thinking) as engine,
        Session(engine=engine, reasoning_parser="deepseek_r1") as session,
    ):
        history: list[Any] = [{"role": "user", "content": "2 + 3?"}]
        first = session.step_sync(history)
        pinned = session.token_ids  # turn 1's prompt and output: what D holds KV for (its last token aside)
        history += [first.message.model_dump(), {"role": "user", "content": "And 3 + 2?"}]
        second = session.step_sync(history)
        kept = second.stats
        figures["keep"] = (kept.pulled_tokens, kept.prompt_tokens, kept.computed_tokens)
        # the alternative: turn 2's prompt as the template renders the whole history (turn 1's reasoning dropped)
        rendered_history = [history[0], {"role": "assistant", "content": first.step.text}, history[2]]
        text = tokenizer.apply_chat_template(rendered_history, add_generation_prompt=True, tokenize=False)
        rendered = list(tokenizer.encode(text, add_special_tokens=False))
        common = next((i for i, (a, b) in enumerate(zip(rendered, pinned, strict=False)) if a != b), len(pinned))
        held = HeldPin(Pin(tokens=len(pinned) - 1, expires_at=time.perf_counter() + 3600.0, ref="r"), pinned)
        figures["drop"] = (choose_pin(held, rendered, push_back=True, expiry_margin_s=0.0)[1], common, len(rendered))
        ran = session.run_sync("And 4 + 1?")  # Session.run: the same rule
    assert first.reasoning == THOUGHT and "<think>" not in json.dumps(history)  # the caller never saw the tokens
    assert kept.handle_forwarded and kept.miss_reason is None
    assert kept.pulled_tokens == len(pinned) - 1  # every pinned token pulled back, reasoning included
    assert kept.computed_tokens == kept.prompt_tokens - kept.pulled_tokens < 20  # only the new user message
    assert ran.steps[0].stats.handle_forwarded and ran.steps[0].stats.pulled_tokens > kept.prompt_tokens
    reason, common, length = figures["drop"]
    assert reason == "prefix_mismatch" and common < len(pinned) - len(tokenizer.encode(THOUGHT)) < length
    print(  # the reuse figures, either way (pytest -s shows them)
        f"\nreasoning reuse on turn 2: kept tokens: pulled {kept.pulled_tokens} of {kept.prompt_tokens} prompt tokens, "
        f"computed {kept.computed_tokens}; template re-render: {reason}, pulled 0 of {length} "
        f"(only a {common}-token prefix in common, for a prefix cache)"
    )
    engine.assert_honest()


# ----------------------------------------------------------------- the front door


@pytest.fixture
def door(thinking: Path) -> Iterator[str]:
    def respond(request: StepRequest) -> str:
        return OUTPUT

    with served(respond, thinking, reasoning_parser="deepseek_r1") as url:
        yield url


def test_chat_completions_carry_reasoning_content(door: str) -> None:
    with openai.OpenAI(base_url=door, api_key="none", max_retries=0) as client:
        messages: list[Any] = [{"role": "user", "content": "2 + 3?"}]
        plain = client.chat.completions.create(model="smol", messages=messages).choices[0].message
        reasoning, content = "", ""
        for part in client.chat.completions.create(model="smol", messages=messages, stream=True):
            delta = part.choices[0].delta if part.choices else None
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += (delta.content if delta is not None else None) or ""
    assert plain.content == "It is 5." and getattr(plain, "reasoning_content", None) == THOUGHT
    assert reasoning == THOUGHT and content == "It is 5."


def test_responses_carry_a_reasoning_item(door: str) -> None:
    with openai.OpenAI(base_url=door, api_key="none", max_retries=0) as client:
        response = client.responses.create(model="smol", input="2 + 3?")
        events = list(client.responses.create(model="smol", input="2 + 3?", stream=True))
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == THOUGHT and response.output_text == "It is 5."  # type: ignore[union-attr, index]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert deltas == done.text == THOUGHT
    streamed = events[-1].response  # type: ignore[union-attr]
    assert [item.type for item in streamed.output] == ["reasoning", "message"] and streamed.output_text == "It is 5."
