"""A request's ``chat_template_kwargs``: passed to the chat template as vLLM passes them (those it reads), bounded,
and part of what decides whether D's pinned KV is still the conversation's prefix: the rendered tokens decide
(DESIGN.md section 6). On the honest pair double, with a copy of the doubles' model whose template reads
``enable_thinking``."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv import SessionPool
from agentkv._conversation._light_tokenizer import LightTokenizer
from agentkv._conversation._template_kwargs import template_arguments, template_kwargs_key
from agentkv._doubles._scripted import TEST_MODEL
from agentkv._engines._system import free_port
from agentkv._errors import UserError
from agentkv._surfaces._bounds import BoundError, check_template_kwargs
from agentkv.engines import StepRequest
from agentkv.serve import FrontDoor
from agentkv.testing import HonestPairEngine

NO_THINK = "/no_think "
"""What the test template writes first when ``enable_thinking`` is false."""


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(TEST_MODEL, folder)
    template = (folder / "chat_template.jinja").read_text()
    switch = "{% if enable_thinking is defined and not enable_thinking %}" + NO_THINK + "{% endif %}"
    (folder / "chat_template.jinja").write_text(switch + template)
    return folder


def test_the_template_gets_only_the_arguments_it_reads(thinking_model: Path) -> None:
    tokenizer = LightTokenizer(thinking_model)
    given = {"enable_thinking": False, "unread": 1, "tools": [], "add_generation_prompt": False}
    assert template_arguments(tokenizer, given) == {"enable_thinking": False}
    assert template_arguments(LightTokenizer(TEST_MODEL), given) == {}


def test_the_key_is_canonical_and_refuses_what_vllm_refuses() -> None:
    assert template_kwargs_key({"b": 1, "a": [1, {"c": None}]}) == template_kwargs_key({"a": [1, {"c": None}], "b": 1})
    assert template_kwargs_key({}) is None and template_kwargs_key(None) is None
    assert template_kwargs_key({"add_generation_prompt": False}) is None  # agentkv's own: no effect, as in vLLM
    for name in ("chat_template", "tokenize"):
        with pytest.raises(UserError, match="Found unexpected chat template kwargs from request"):
            template_kwargs_key({name: "x"})


def test_the_arguments_are_bounded() -> None:
    check_template_kwargs({"enable_thinking": False, "nested": {"a": [1, 2, {"b": "c"}]}})
    with pytest.raises(BoundError, match="at most 16 KiB of JSON"):
        check_template_kwargs({"big": "x" * 20_000})
    deep: Any = 1
    for _ in range(10):
        deep = [deep]
    with pytest.raises(BoundError, match="nested at most 8 levels deep"):
        check_template_kwargs({"deep": deep})
    with pytest.raises(BoundError, match="an object"):
        check_template_kwargs(["enable_thinking"])


def _turn(pool: SessionPool, history: list[dict[str, Any]], question: str, kwargs: dict[str, Any] | None) -> Any:
    history.append({"role": "user", "content": question})
    reply = pool.step_sync(history, conversation_id="c", chat_template_kwargs=kwargs)
    history.append({"role": "assistant", "content": reply.text})
    return reply


def _recording(model: Path) -> tuple[list[str], Callable[[StepRequest], str]]:
    """A double's answer ("Fine.") that records each prompt it is given, as text."""
    prompts: list[str] = []
    tokenizer = LightTokenizer(model)

    def respond(request: StepRequest) -> str:
        prompts.append(tokenizer.decode(list(request.prompt_token_ids)))
        return "Fine."

    return prompts, respond


def test_the_rendered_tokens_decide_whether_the_pin_still_extends(thinking_model: Path) -> None:
    prompts, respond = _recording(thinking_model)
    with HonestPairEngine(respond, model_path=thinking_model) as engine, SessionPool(engine=engine) as pool:
        history: list[dict[str, Any]] = []
        off = {"enable_thinking": False}
        assert not _turn(pool, history, "One?", off).stats.handle_forwarded
        assert prompts[-1].startswith(NO_THINK)
        assert _turn(pool, history, "Two?", off).stats.handle_forwarded  # the same rendering: the pin extends
        assert _turn(pool, history, "Three?", {**off, "unread": [1]}).stats.handle_forwarded  # no token changed
        changed = _turn(pool, history, "Four?", {"enable_thinking": True})  # the prefix renders otherwise
        assert not changed.stats.handle_forwarded and not prompts[-1].startswith(NO_THINK)
        assert _turn(pool, history, "Five?", {"enable_thinking": True}).stats.handle_forwarded
        assert _turn(pool, history, "Six?", None).stats.handle_forwarded  # none: rendered as enable_thinking true
    assert engine.violations == []


@pytest.fixture(scope="module")
def door(thinking_model: Path) -> Iterator[tuple[str, list[str]]]:
    prompts, respond = _recording(thinking_model)
    with HonestPairEngine(respond, model_path=thinking_model) as engine, SessionPool(engine=engine) as pool:
        with FrontDoor(pool, model_name="m", port=free_port()) as front:
            yield front.url, prompts


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_the_door_passes_them_to_the_template(door: tuple[str, list[str]], path: str) -> None:
    url, prompts = door
    said: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"input": "Hi"}
    body = {**said, "chat_template_kwargs": {"enable_thinking": False}}
    assert httpx.post(url + path, json=body, timeout=30).status_code == 200
    assert prompts[-1].startswith(NO_THINK)
    assert httpx.post(url + path, json=said, timeout=30).status_code == 200
    assert not prompts[-1].startswith(NO_THINK)


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"chat_template": "{{ 1 }}"}, "Found unexpected chat template kwargs from request"),
        ({"x": "y" * 20_000}, "at most 16 KiB of JSON"),
        ("on", "an object of the chat template's extra arguments"),
    ],
)
def test_the_door_refuses_what_it_cannot_take(door: tuple[str, list[str]], kwargs: Any, said: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": kwargs}
    answer = httpx.post(door[0] + "/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400 and said in answer.json()["error"]["message"]


def test_a_snapshot_keeps_the_arguments_it_was_rendered_with() -> None:
    from agentkv._conversation._conversation import Message
    from agentkv._conversation._transcript import Transcript, TranscriptKey
    from agentkv._session._snapshot import SavedTranscript, load_transcript, save_transcript

    key = TranscriptKey(None, (), "schema", template_kwargs_key({"enable_thinking": False}))
    transcript = Transcript(key, (Message(role="user", content="Hi"),))
    saved = SavedTranscript.model_validate_json(save_transcript(transcript).model_dump_json())
    assert load_transcript(saved) == transcript
    older = {"system": None, "tools": [], "format": "schema", "messages": [{"role": "user", "content": "Hi"}]}
    assert load_transcript(SavedTranscript.model_validate(older)).key.template_kwargs is None  # saved before them
