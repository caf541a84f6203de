"""Message order as the chat template allows it: several system messages, a system message mid-conversation, two
assistant messages in a row. agentkv renders what the model's template renders (the prompt is the template's full
rendering, token for token), keeps the push-back rule (tokens), and refuses by name only what the template refuses,
in `Session.step` and at the door (a 400 naming the template's own message)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv import InvalidMessageError, Session, SessionPool
from agentkv._conversation._light_tokenizer import LightTokenizer
from agentkv._doubles._scripted import TEST_MODEL
from agentkv._engines._system import free_port
from agentkv.serve import FrontDoor
from agentkv.testing import HonestPairEngine

ORDERS: dict[str, list[dict[str, Any]]] = {
    "two_system_messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Capital of Italy?"},
    ],
    "system_mid_conversation": [
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "system", "content": "From now on, answer in French."},
        {"role": "user", "content": "And of France?"},
    ],
    "two_assistant_messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "assistant", "content": "It has been since 1871."},
        {"role": "user", "content": "And of France?"},
    ],
    "an_assistant_message_first": [
        {"role": "assistant", "content": "Hello! Ask me about capitals."},
        {"role": "user", "content": "Capital of Italy?"},
    ],
}

REFUSING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System messages are only allowed at the beginning of the conversation') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A template (as Llama's and Mistral's do) that refuses a system message past the first."""


@pytest.fixture(scope="module")
def tokenizer_of_doubles() -> LightTokenizer:
    return LightTokenizer(TEST_MODEL)


@pytest.fixture
def refusing_model(tmp_path: Path) -> Path:
    folder = tmp_path / "refusing-model"
    shutil.copytree(TEST_MODEL, folder)
    (folder / "chat_template.jinja").write_text(REFUSING_TEMPLATE)
    return folder


def full_render(tokenizer: LightTokenizer, messages: list[dict[str, Any]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(str(text), add_special_tokens=False)


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_conversation_in_any_order_the_template_renders_is_prompted_as_the_template_renders_it(
    order: str, tokenizer_of_doubles: LightTokenizer
) -> None:
    messages = ORDERS[order]
    prompts: list[list[int]] = []

    def respond(request: Any) -> str:
        prompts.append(list(request.prompt_token_ids))
        return "Parigi."

    with HonestPairEngine(respond) as engine, Session(engine=engine) as session:
        reply = session.step_sync(messages)
    assert reply.text == "Parigi."
    assert prompts == [full_render(tokenizer_of_doubles, messages)]


def test_appending_in_those_orders_keeps_the_push_back(tokenizer_of_doubles: LightTokenizer) -> None:
    """Each call extends what the session answered (the model's own output keeps its token ids), whatever the roles
    appended: a second system message, a caller's assistant message after the model's, a system message mid-way."""
    prompts: list[list[int]] = []

    def respond(request: Any) -> str:
        prompts.append(list(request.prompt_token_ids))
        return "Noted."

    with HonestPairEngine(respond) as engine, Session(engine=engine) as session:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are terse."},
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Capital of Italy?"},
        ]
        messages.append(session.step_sync(messages).message.chat_dict())
        messages += [{"role": "assistant", "content": "(Rome.)"}, {"role": "user", "content": "And France?"}]
        second = session.step_sync(messages)
        messages += [
            second.message.chat_dict(),
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Thanks"},
        ]
        third = session.step_sync(messages)
    for reply in (second, third):
        assert reply.stats.handle_forwarded and reply.stats.miss_reason is None and reply.stats.pulled_tokens > 0
    engine.assert_honest()
    rendered = tokenizer_of_doubles.decode(prompts[-1])
    assert rendered.count("<|im_start|>system") == 3 and "<|im_start|>assistant\n(Rome.)<|im_end|>" in rendered


def test_what_the_template_refuses_is_refused_naming_the_templates_reason(refusing_model: Path) -> None:
    with (
        HonestPairEngine(lambda request: "Fine.", model_path=refusing_model) as engine,
        Session(engine=engine) as session,
    ):
        with pytest.raises(InvalidMessageError, match="chat template refuses.*only allowed at the beginning"):
            session.step_sync(ORDERS["system_mid_conversation"])
        assert session.step_sync(ORDERS["two_system_messages"][:1] + ORDERS["two_system_messages"][2:]).text == "Fine."
    assert engine.steps[-1].outcome == "done" and len(engine.steps) == 1  # the refused step never reached it


def test_the_door_answers_what_the_template_renders_and_400s_what_it_refuses(refusing_model: Path) -> None:
    def post(url: str, messages: list[dict[str, Any]]) -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": messages}, timeout=30)

    for model_path, refused in ((None, False), (refusing_model, True)):
        with (
            HonestPairEngine(lambda request: "Fine.", model_path=model_path) as engine,
            SessionPool(engine=engine, max_tokens=16) as pool,
        ):
            door = FrontDoor(pool, model_name="m", port=free_port()).start()
            try:
                mid = post(door.url, ORDERS["system_mid_conversation"])
                two = post(door.url, ORDERS["two_assistant_messages"])
            finally:
                door.stop()
        assert two.status_code == 200, two.text
        if refused:
            assert mid.status_code == 400
            error = json.loads(mid.text)["error"]
            assert "only allowed at the beginning" in error["message"] and error["type"] == "invalid_request_error"
        else:
            assert mid.status_code == 200 and mid.json()["choices"][0]["message"]["content"] == "Fine."
