"""The front door's request fields: every field of vLLM's own request models is in the door's table (honoured,
refused by name, or accepted with no effect), each honoured field read as vLLM reads it, refused ones refused only
when they ask for something; logprobs written as vLLM's chat server writes them."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from agentkv import EmbeddedPair, SamplingOptions, SessionPool, UserError
from agentkv._engines._system import free_port
from agentkv._session._session import load_tokenizer
from agentkv._surfaces._logprobs import LogprobWriter
from agentkv._surfaces._openai_chat import ChatRequest, read_request
from agentkv._surfaces._openai_responses import ResponsesRequest, read_responses_request
from agentkv._surfaces._request_fields import CHAT_FIELDS, RESPONSES_FIELDS, FieldRule, check_fields
from agentkv.serve import FrontDoor
from agentkv.testing import ScriptedEngine
from scripted import with_logprobs

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def vllm_models() -> dict[str, type[BaseModel]]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest as VllmResponsesRequest

    return {"chat": ChatCompletionRequest, "responses": VllmResponsesRequest}


TABLES: dict[str, tuple[dict[str, FieldRule], type[BaseModel]]] = {
    "chat": (CHAT_FIELDS, ChatRequest),
    "responses": (RESPONSES_FIELDS, ResponsesRequest),
}


@pytest.mark.parametrize("api", TABLES)
def test_every_field_of_vllms_request_is_in_the_table(api: str, vllm_models: dict[str, type[BaseModel]]) -> None:
    table, _ = TABLES[api]
    missing = sorted(set(vllm_models[api].model_fields) - set(table))
    assert not missing, f"vLLM's {api} request has fields the door's table lacks (decide each): {missing}"


@pytest.mark.parametrize("api", TABLES)
def test_a_refused_field_takes_vllms_default(api: str, vllm_models: dict[str, type[BaseModel]]) -> None:
    table, _ = TABLES[api]
    for name, field in vllm_models[api].model_fields.items():
        rule = table[name]
        default = field.get_default(call_default_factory=False)
        if rule.status == "refused" and default is not PydanticUndefined and field.default_factory is None:
            assert any(default == accepted for accepted in rule.accepts), (name, default)
            check_fields({name: default}, table)  # vLLM's default asks for nothing


@pytest.mark.parametrize("api", TABLES)
def test_the_model_reads_exactly_the_fields_the_table_honours(api: str) -> None:
    table, model = TABLES[api]
    honoured = {name for name, rule in table.items() if rule.status == "honoured"}
    declared = set(model.model_fields)
    assert honoured <= declared, sorted(honoured - declared)
    for name in declared - honoured:  # read to be echoed (no effect) or to check a refused value
        assert table[name].status == "no effect" or len(table[name].accepts) > 1, name
    assert all(rule.reason for rule in table.values())


def test_a_refused_field_is_refused_by_name_only_when_it_asks_for_something(caplog: Any) -> None:
    table = {"n": FieldRule("refused", "one choice", (None, 1)), "model": FieldRule("no effect", "one model")}
    check_fields({"n": 1, "model": "x"}, table)
    check_fields({"n": None}, table)
    for value in (2, True, "1"):
        with pytest.raises(UserError, match="n is not supported: one choice"):
            check_fields({"n": value}, table)
    with caplog.at_level(logging.WARNING, logger="agentkv"):
        check_fields({"made_up_field": 1}, table)  # ignored, as vLLM ignores it, and said
    assert "made_up_field" in caplog.text


def chat(**fields: Any) -> ChatRequest:
    return read_request(json.dumps({"messages": USER, **fields}).encode())


def test_chat_sampling_fields_become_sampling_options_as_vllm_reads_them() -> None:
    assert chat().sampling_options() is None  # nothing asked: the pool's defaults stand
    options = chat(
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"42": 150.0},
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[7],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        bad_words=["no"],
        allowed_token_ids=[1, 2],
        logprobs=True,
        top_logprobs=3,
    ).sampling_options()
    assert options is not None
    assert (options.top_p, options.top_k, options.min_p, options.logprobs) == (0.9, 5, 0.1, 3)
    assert (options.presence_penalty, options.frequency_penalty, options.repetition_penalty) == (0.5, -0.5, 1.2)
    assert options.logit_bias == {42: 100.0}  # clamped, as vLLM clamps it
    assert (options.min_tokens, options.ignore_eos, options.stop_token_ids) == (2, True, (7,))
    assert options.include_stop_str_in_output and not options.skip_special_tokens
    assert options.bad_words == ("no",) and options.allowed_token_ids == (1, 2)
    assert options.model_fields_set == {
        "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
        "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
        "spaces_between_special_tokens", "bad_words", "allowed_token_ids", "logprobs",
    }  # fmt: skip
    step = chat(top_p=0.5).step_options()["sampling"]
    assert isinstance(step, SamplingOptions) and step.model_fields_set == {"top_p"}  # the others stay the pool's


def test_chat_logprobs_and_structured_outputs_as_vllm_reads_them() -> None:
    assert chat(logprobs=True).sampling_options().logprobs == 0  # type: ignore[union-attr]
    assert chat(top_logprobs=0).sampling_options() is None
    schema = {"type": "object"}
    json_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert chat(response_format=json_schema).sampling_options().structured_outputs == {"json": schema}  # type: ignore[union-attr]
    assert chat(response_format={"type": "text"}).sampling_options() is None
    merged = chat(response_format={"type": "json_object"}, structured_outputs={"disable_any_whitespace": True})
    assert merged.sampling_options().structured_outputs == {"disable_any_whitespace": True, "json_object": True}  # type: ignore[union-attr]
    assert chat(structured_outputs={"regex": "a+"}).sampling_options().structured_outputs == {"regex": "a+"}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"top_logprobs": 2}, "top_logprobs: when using top_logprobs, logprobs must be set to true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_p": 0}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"n": 2}, "n is not supported"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"prompt_logprobs": 0}, "prompt_logprobs"),
        ({"echo": True}, "echo"),
        ({"logprob_token_ids": [1]}, "logprob_token_ids"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template": "{{ x }}"}, "chat_template"),
        ({"documents": [{"title": "a", "text": "b"}]}, "documents"),
        ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ({"vllm_xargs": {"a": 1}}, "vllm_xargs"),
        ({"priority": 1}, "priority"),
        ({"truncate_prompt_tokens": 10}, "truncate_prompt_tokens"),
        ({"mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs"),
        ({"thinking_token_budget": 10}, "thinking_token_budget"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"include_reasoning": False}, "include_reasoning"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "continuous_usage_stats"),
    ],
)
def test_chat_fields_agentkv_cannot_honour_are_refused_by_name(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        chat(**fields)


def test_chat_defaults_and_no_effect_fields_are_taken() -> None:
    chat(
        n=1,
        use_beam_search=False,
        echo=False,
        add_generation_prompt=True,
        continue_final_message=False,
        priority=0,
        include_reasoning=True,
        length_penalty=2.0,
        mm_payload="none",
        stream_interval=4,
        truncation_side="left",
        model="anything",
        request_id="r1",
    )


def responses(**fields: Any) -> ResponsesRequest:
    return read_responses_request(json.dumps({"input": "hi", **fields}).encode())


def test_responses_sampling_fields_and_text_format_as_vllm_reads_them() -> None:
    options = responses(top_p=0.5, top_k=3, stop_token_ids=[5], logit_bias={"1": -1}).sampling_options()
    assert options is not None and (options.top_p, options.top_k, options.stop_token_ids) == (0.5, 3, (5,))
    schema = {"type": "object"}
    text = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    assert responses(text=text).sampling_options().structured_outputs == {"json": schema}  # type: ignore[union-attr]
    assert responses(text={"format": {"type": "json_object"}}).sampling_options().structured_outputs == {  # type: ignore[union-attr]
        "json_object": True
    }
    assert responses(text={"format": {"type": "text"}}).sampling_options() is None
    assert responses(top_logprobs=3).sampling_options() is None  # as vLLM: without include, no logprobs
    with pytest.raises(UserError, match="include"):
        responses(include=["message.output_text.logprobs"])


def test_a_response_id_is_the_doors_own_and_the_keys_name_the_conversation_in_order() -> None:
    """A client's request_id never names a response (it is echoed only); x-session-id, session_id,
    conversation_id, prompt_cache_key name the conversation, the first given winning; user never does."""
    from agentkv._surfaces._conversation_keys import conversation_key
    from agentkv._surfaces._openai_responses import ResponseTurn

    request = responses(request_id="abc", session_id="conv", prompt_cache_key="later", user="u1")
    turn = ResponseTurn.begin(request, None, conversation_id=conversation_key({}, request), model="m")
    assert turn.response_id.startswith("resp_") and turn.response_id != "abc" and turn.conversation_id == "conv"
    assert conversation_key({"x-session-id": "head"}, request) == "head"
    for fields, key in [
        ({"conversation_id": "c", "prompt_cache_key": "p"}, "c"),
        ({"prompt_cache_key": "p"}, "p"),
        ({"user": "u"}, None),
    ]:
        assert conversation_key({}, chat(**fields)) == key
        assert conversation_key({}, responses(**fields)) == key
    with pytest.raises(UserError, match="session_id: an id is 1 to 256"):
        conversation_key({}, chat(session_id="caf\u00e9"))


# ------------------------------------------------------------------------------------ logprobs


def test_logprob_entries_are_vllms_token_strings_sampled_first() -> None:
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    from agentkv import TokenLogprob

    engine = ScriptedEngine([])
    tokenizer = load_tokenizer(str(engine.info.model_path))
    ids = tokenizer.encode(" Paris, café", add_special_tokens=False)
    writer = LogprobWriter(tokenizer, 2)
    alternative = ids[0] + 1
    entries = writer.content([TokenLogprob(token_id=ids[0], logprob=-1.5, top=((alternative, -0.5), (ids[0], -1.5)))])
    entries += writer.content([TokenLogprob(token_id=t, logprob=float("-inf"), top=()) for t in ids[1:]])
    first = entries[0]
    assert first["token"] == convert_ids_list_to_tokens(tokenizer, [ids[0]])[0]
    assert first["bytes"] == list(first["token"].encode())
    assert [t["logprob"] for t in first["top_logprobs"]] == [-1.5, -0.5]  # the sampled token first, as vLLM
    assert entries[1]["logprob"] == -9999.0  # vLLM's floor for -inf
    assert [t["logprob"] for t in entries[1]["top_logprobs"]] == [-9999.0]  # the sampled token is listed too
    assert "".join(entry["token"] for entry in entries) == tokenizer.decode(ids)
    as_ids = LogprobWriter(tokenizer, 1, as_token_ids=True).content([TokenLogprob(token_id=ids[0], logprob=-1.0)])
    assert as_ids[0]["token"] == f"token_id:{ids[0]}" and as_ids[0]["bytes"] == first["bytes"]


@pytest.fixture(scope="module")
def door() -> Iterator[str]:
    engine = with_logprobs(ScriptedEngine)(["Paris is sunny today."] * 4)
    with engine, SessionPool(engine=engine) as pool:
        opened = FrontDoor(pool, model_name="smol", port=free_port()).start()
        try:
            yield opened.url
        finally:
            opened.stop()


def test_the_door_writes_logprobs_whole_and_streamed_alike(door: str) -> None:
    body = {"messages": USER, "logprobs": True, "top_logprobs": 2, "request_id": "r7"}
    answer = httpx.post(door + "/v1/chat/completions", json=body, timeout=60).json()
    content = answer["choices"][0]["logprobs"]["content"]
    assert answer["id"] == "chatcmpl-r7"
    assert len(content) == answer["usage"]["completion_tokens"]
    assert all(len(entry["top_logprobs"]) == 2 for entry in content)
    streamed: list[dict[str, Any]] = []
    with httpx.stream("POST", door + "/v1/chat/completions", json=body | {"stream": True}, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed += (choice.get("logprobs") or {}).get("content") or []
    assert streamed == content
    plain = httpx.post(door + "/v1/chat/completions", json={"messages": USER}, timeout=60).json()
    assert plain["choices"][0]["logprobs"] is None


DOCS = Path(__file__).parent.parent / "docs" / "serve.md"
_ROW = re.compile(r"^\| `([a-z_]+)` \| [^|]* \| (\*\*refused\*\* \(400\)|honoured|no effect): ", re.MULTILINE)


@pytest.mark.parametrize(("api", "heading"), [("chat", "### Chat completions"), ("responses", "### Responses")])
def test_the_docs_table_lists_exactly_the_fields_of_the_code_table(api: str, heading: str) -> None:
    table, _ = TABLES[api]
    page = DOCS.read_text()
    section = page[page.index("## Request fields") :]
    body = section[section.index(heading) + len(heading) :]
    body = body[: body.find("\n#")] if "\n#" in body else body
    rows = {name: status.replace("**refused** (400)", "refused") for name, status in _ROW.findall(body)}
    assert sorted(rows) == sorted(table)
    assert rows == {name: rule.status for name, rule in table.items()}


@pytest.mark.pair
def test_on_the_real_pair_the_door_honours_sampling_fields_and_writes_vllms_logprobs(pair: EmbeddedPair) -> None:
    """For the lead (needs the engines to honour `SamplingOptions`): logprobs whole and streamed, greedy's
    sampled token first and likeliest, and sampling fields a stock vLLM takes answered 200."""
    with SessionPool(engine=pair, max_tokens=16, cache_salt="request-fields") as pool:
        door = FrontDoor(pool, model_name="smol", port=free_port()).start()
        try:
            url = door.url + "/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": "Name a colour."}], "logprobs": True, "top_logprobs": 3}
            answer = httpx.post(url, json=body, headers={"x-session-id": "lp-1"}, timeout=120).json()
            content = answer["choices"][0]["logprobs"]["content"]
            assert len(content) == answer["usage"]["completion_tokens"]
            for entry in content:
                assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["token"] == entry["token"]
                assert entry["logprob"] == max(alt["logprob"] for alt in entry["top_logprobs"])
            assert "".join(e["token"] for e in content).startswith(answer["choices"][0]["message"]["content"])
            streamed: list[dict[str, Any]] = []
            headers = {"x-session-id": "lp-2"}
            with httpx.stream("POST", url, json=body | {"stream": True}, headers=headers, timeout=120) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:])["choices"]:
                            streamed += (choice.get("logprobs") or {}).get("content") or []
            assert [e["token"] for e in streamed] == [e["token"] for e in content]  # greedy: the same tokens
            sampled = {
                "messages": [{"role": "user", "content": "Hi"}],
                "temperature": 0.8,
                "top_p": 0.9,
                "top_k": 20,
                "min_p": 0.05,
                "presence_penalty": 0.5,
                "repetition_penalty": 1.1,
                "seed": 3,
                "stop_token_ids": [2],
                "response_format": {"type": "json_object"},
            }
            assert httpx.post(url, json=sampled, timeout=120).status_code == 200
        finally:
            door.stop()
