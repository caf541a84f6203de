"""agentkv serve against vLLM's own server as the oracle: the same requests, the same answers.

The bundled model is served three ways: stock ``vllm serve`` (one engine, prefix caching, float32,
vLLM's defaults otherwise, with vLLM's hermes tool parser for ``tool_choice="auto"``), and agentkv's
door on the shared real pair and on the shared colocated engine (tests/conftest.py). Every request of
the matrix (each sampling parameter alone and some together, greedy and seeded, stop strings and stop
token ids, structured outputs, logprobs, tools, streamed and not, multi-turn with the answers fed
back) goes to all three; the answers must be identical (log probabilities within a float tolerance).
The drop-in parts too: the sampling defaults of a request that omits them (both servers given the same
``--override-generation-config``; the doors' pools take what `agentkv serve` takes from it), ``chat_template_kwargs``,
the served model name (vLLM's 404 for another), ``/tokenize`` and ``/detokenize``.
Outputs are short and each server starts once, so the module stays within the CI tier's budget.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from agentkv import Colocated, EmbeddedPair, SessionPool
from agentkv._engines._sampling import SamplingOptions
from agentkv._engines._system import free_port
from agentkv._model import prepare_model
from agentkv._surfaces._model_defaults import generation_defaults
from agentkv.serve import FrontDoor
from stock_server import stock_vllm_starting

pytestmark = pytest.mark.pair

SYSTEM = "You are a terse assistant. Answer in one short sentence."
QUESTION = "What is the capital of France, and what river runs through it?"
LOGPROB_TOLERANCE = 1e-3
OVERRIDE = {"temperature": 0.0}
"""Both servers' ``--override-generation-config``: a request that omits its temperature is greedy on both (the
matrix's other requests name theirs)."""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class _StockStart:
    """Stock ``vllm serve``, started before the suite's shared engines so that it starts beside them (a start is
    mostly processes importing vLLM, and two cores run two at once), stopped when this module ends: beside the
    shared launched pair of later modules it would not fit in memory (tests/conftest.py)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._stack = contextlib.ExitStack()
        args = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048", "--served-model-name", "smol"]
        args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        args += ["--override-generation-config", json.dumps(OVERRIDE)]
        log = tmp_path_factory.mktemp("differential") / "vllm.log"
        self.ready = self._stack.enter_context(stock_vllm_starting(prepare_model(), free_port(), args, log))

    def stop(self) -> None:
        self._stack.close()


@pytest.fixture(scope="session")
def stock_start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_StockStart]:
    start = _StockStart(tmp_path_factory)
    yield start
    start.stop()  # again at the session's end: a no-op unless the module's end did not come


@pytest.fixture(scope="module")
def servers(stock_start: _StockStart, pair: EmbeddedPair, colocated: Colocated) -> Iterator[dict[str, str]]:
    """Base URLs (``.../v1``) of stock vLLM, agentkv on the pair and agentkv on the colocated engine."""
    defaults = generation_defaults(prepare_model(), "auto", OVERRIDE)  # as agentkv serve reads them
    options: dict[str, Any] = {"max_tokens": 16, "tool_format": "native", "temperature": defaults.pop("temperature")}
    options["sampling"] = SamplingOptions(**defaults)
    try:
        stock = stock_start.ready()
        with (
            SessionPool(engine=pair, cache_salt="differential", **options) as on_pair,
            SessionPool(engine=colocated, cache_salt="differential", **options) as on_colocated,
            FrontDoor(on_pair, model_name="smol", port=free_port()) as pair_door,
            FrontDoor(on_colocated, model_name="smol", port=free_port()) as colocated_door,
        ):
            yield {"vllm": stock + "/v1", "pair": pair_door.url + "/v1", "colocated": colocated_door.url + "/v1"}
    finally:
        stock_start.stop()


def _messages(question: str = QUESTION) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _token(tokenizer: Any, text: str) -> int:
    return int(tokenizer.encode(text, add_special_tokens=False)[0])


def matrix(tokenizer: Any) -> dict[str, dict[str, Any]]:
    """Request bodies by name (``messages`` and ``model`` added when sent)."""
    paris, period, comma = _token(tokenizer, " Paris"), _token(tokenizer, "."), _token(tokenizer, ",")
    repeat = _messages("Write the word cat ten times, separated by spaces.")
    seeded = {"temperature": 0.8, "seed": 11}
    return {
        "greedy": {"temperature": 0.0},
        "seeded": seeded,
        "top_p": {"temperature": 1.0, "seed": 3, "top_p": 0.5},
        "top_k": {"temperature": 1.0, "seed": 5, "top_k": 5},
        "min_p": {"temperature": 1.0, "seed": 5, "min_p": 0.2},
        "presence_penalty": {"temperature": 0.0, "presence_penalty": 1.5, "messages": repeat, "max_tokens": 16},
        "frequency_penalty": {"temperature": 0.0, "frequency_penalty": 1.5, "messages": repeat, "max_tokens": 16},
        "repetition_penalty": {"temperature": 0.0, "repetition_penalty": 1.3, "messages": repeat, "max_tokens": 16},
        "logit_bias": {"temperature": 0.0, "logit_bias": {str(paris): 100}},
        "min_tokens": {"temperature": 0.0, "min_tokens": 12, "max_tokens": 14},
        "ignore_eos": {"temperature": 0.0, "ignore_eos": True, "max_tokens": 12},
        "stop": {"temperature": 0.0, "stop": [" river", ","]},
        "stop_token_ids": {"temperature": 0.0, "stop_token_ids": [comma]},
        "include_stop_str_in_output": {"temperature": 0.0, "stop": [","], "include_stop_str_in_output": True},
        "bad_words": {"temperature": 0.0, "bad_words": ["Paris"]},
        "allowed_token_ids": {"temperature": 1.0, "seed": 2, "allowed_token_ids": [paris, period, 2, 28, 30, 260]},
        "skip_special_tokens": {"temperature": 0.0, "skip_special_tokens": False, "ignore_eos": True},
        "logprobs": {"temperature": 0.0, "logprobs": True, "top_logprobs": 3},
        "seeded_logprobs": {**seeded, "logprobs": True, "top_logprobs": 2},
        "json_object": {"temperature": 0.0, "response_format": {"type": "json_object"}, "max_tokens": 24},
        "json_schema": {
            "temperature": 0.0,
            "max_tokens": 24,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "city",
                    "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                },
            },
        },
        "regex": {"temperature": 0.0, "structured_outputs": {"regex": "[A-Z][a-z]+ is [a-z ]+"}},
        "choice": {"temperature": 0.0, "structured_outputs": {"choice": ["Paris", "Lyon", "Rome"]}},
        "together": {
            "temperature": 0.7,
            "seed": 9,
            "top_k": 20,
            "top_p": 0.9,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.3,
            "repetition_penalty": 1.1,
            "logprobs": True,
            "top_logprobs": 2,
        },
        "server_defaults": {"max_tokens": 12},  # no temperature: the generation config's, on both
        "server_defaults_logprobs": {"logprobs": True, "top_logprobs": 2},
        "chat_template_kwargs": {
            "temperature": 0.0,
            "chat_template_kwargs": {"enable_thinking": False, "add_generation_prompt": False},  # no effect on both
        },
        "tools_none": {"temperature": 0.0, "tools": [WEATHER, TIME], "tool_choice": "none"},
        "tools_auto": {"temperature": 0.0, "tools": [WEATHER, TIME], "tool_choice": "auto"},
        "tools_required": {"temperature": 0.0, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 64},
        "tools_named": {
            "temperature": 0.0,
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "max_tokens": 64,
        },
    }


STREAMED = ("seeded", "stop", "logprobs", "tools_required", "tools_named")
MULTI_TURN = ("greedy", "together")


def _answer(completion: Any) -> dict[str, Any]:
    """What must be equal: text, finish reason, tool calls (names and arguments), logprobs (tokens, values)."""
    choice = completion.choices[0]
    message = choice.message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    logprobs = None
    if choice.logprobs is not None and choice.logprobs.content is not None:
        logprobs = [
            (item.token, item.logprob, [(top.token, top.logprob) for top in item.top_logprobs])
            for item in choice.logprobs.content
        ]
    return {"text": message.content or "", "finish": choice.finish_reason, "calls": calls, "logprobs": logprobs}


def _streamed_answer(chunks: list[Any]) -> dict[str, Any]:
    text, finish, logprobs = "", None, None
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            name, args = calls.setdefault(call.index, ["", ""])
            calls[call.index] = [name + (call.function.name or ""), args + (call.function.arguments or "")]
        if choice.logprobs is not None and choice.logprobs.content:
            logprobs = (logprobs or []) + [
                (item.token, item.logprob, [(top.token, top.logprob) for top in item.top_logprobs])
                for item in choice.logprobs.content
            ]
        finish = choice.finish_reason or finish
    parsed = [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))]
    return {"text": text, "finish": finish, "calls": parsed, "logprobs": logprobs}


def ask(url: str, body: dict[str, Any], messages: list[dict[str, Any]], *, stream: bool = False) -> dict[str, Any]:
    known = {"model", "messages", "temperature", "seed", "top_p", "presence_penalty", "frequency_penalty"}
    known |= {"logit_bias", "logprobs", "top_logprobs", "max_tokens", "stop", "response_format", "tools", "tool_choice"}
    body = dict(body)
    messages = body.pop("messages", messages)
    args = {key: value for key, value in body.items() if key in known}
    extra = {key: value for key, value in body.items() if key not in known}
    args.setdefault("max_tokens", 8)
    with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120) as client:
        if stream:
            chunks = client.chat.completions.create(
                model="smol", messages=messages, stream=True, extra_body=extra or None, **args
            )
            return _streamed_answer(list(chunks))
        return _answer(
            client.chat.completions.create(model="smol", messages=messages, extra_body=extra or None, **args)
        )


def ask_all(
    servers: dict[str, str], body: dict[str, Any], histories: dict[str, list[dict[str, Any]]], *, stream: bool = False
) -> dict[str, dict[str, Any] | Exception]:
    """The same request to every server at once (each its own engines; answered alike, sent together or not),
    each with its own history: the answers, or the error a server raised."""

    def one(where: str) -> dict[str, Any] | Exception:
        try:
            return ask(servers[where], body, histories[where], stream=stream)
        except openai.APIError as exc:
            return exc

    with ThreadPoolExecutor(len(servers)) as pool:
        return dict(zip(servers, pool.map(one, servers), strict=True))


def _each(servers: dict[str, str], messages: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    return dict.fromkeys(servers, messages)


def assert_same(name: str, oracle: dict[str, Any], answer: dict[str, Any], where: str) -> None:
    for key in ("text", "finish", "calls"):
        assert answer[key] == oracle[key], f"{name} on {where}: {key} {answer[key]!r} != vLLM's {oracle[key]!r}"
    if oracle["logprobs"] is None:
        assert answer["logprobs"] is None, f"{name} on {where}: logprobs nobody asked for"
        return
    assert answer["logprobs"] is not None and len(answer["logprobs"]) == len(oracle["logprobs"]), f"{name} on {where}"
    for position, ((token, value, top), (o_token, o_value, o_top)) in enumerate(
        zip(answer["logprobs"], oracle["logprobs"], strict=True)
    ):
        assert token == o_token, f"{name} on {where}: token {position} {token!r} != {o_token!r}"
        assert abs(value - o_value) <= LOGPROB_TOLERANCE, f"{name} on {where}: logprob {position} {value} != {o_value}"
        assert [t for t, _ in top] == [t for t, _ in o_top], f"{name} on {where}: top tokens at {position}"
        for (_, v), (_, o_v) in zip(top, o_top, strict=True):
            assert abs(v - o_v) <= LOGPROB_TOLERANCE, f"{name} on {where}: top logprob at {position}"


def test_every_request_of_the_matrix_answers_as_vllm_serve(servers: dict[str, str], tokenizer: Any) -> None:
    """Every request of the matrix is sent; the failure lists every request answered otherwise than vLLM."""
    differences = []
    for name, body in matrix(tokenizer).items():
        answers = ask_all(servers, body, _each(servers, _messages()))
        oracle = answers["vllm"]
        assert not isinstance(oracle, Exception), f"vLLM's own server refused {name}: {oracle}"
        for where in ("pair", "colocated"):
            try:
                answer = answers[where]
                if isinstance(answer, Exception):
                    raise answer
                assert_same(name, oracle, answer, where)
            except (AssertionError, openai.APIError) as exc:
                differences.append(str(exc).splitlines()[0])
    assert not differences, "\n".join(differences)


@pytest.mark.parametrize("name", STREAMED)
def test_streamed_answers_equal_vllm_serve_s(servers: dict[str, str], tokenizer: Any, name: str) -> None:
    body = matrix(tokenizer)[name]
    answers = ask_all(servers, body, _each(servers, _messages()), stream=True)
    oracle = answers["vllm"]
    assert oracle == ask(servers["vllm"], body, _messages()), f"vLLM's own {name} differs streamed"
    for where in ("pair", "colocated"):
        answer = answers[where]
        assert not isinstance(answer, Exception), f"{name} on {where}: {answer}"
        assert_same(name, oracle, answer, where)


@pytest.mark.parametrize("name", MULTI_TURN)
def test_conversations_with_the_answers_fed_back_equal_vllm_serve_s(
    servers: dict[str, str], tokenizer: Any, name: str
) -> None:
    """Three turns; each server's own answer goes back into its history; the pair pulls turns 2 and 3 back."""
    body = matrix(tokenizer)[name]
    histories = {where: _messages("Name a large city in Europe.") for where in servers}
    for follow_up in ("Name another one.", "And one more, in Italy."):
        answers = ask_all(servers, body, histories)
        replies = {where: answer for where, answer in answers.items() if not isinstance(answer, Exception)}
        assert replies.keys() == answers.keys(), answers
        for where in ("pair", "colocated"):
            assert_same(name, replies["vllm"], replies[where], where)
        for where, answer in replies.items():
            histories[where] += [
                {"role": "assistant", "content": answer["text"]},
                {"role": "user", "content": follow_up},
            ]


def _cached_tokens(url: str, messages: list[dict[str, Any]]) -> int:
    with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120) as client:
        completion = client.chat.completions.create(model="smol", messages=messages, max_tokens=8, temperature=0.0)
    details = completion.usage.prompt_tokens_details if completion.usage else None
    return int(details.cached_tokens or 0) if details else 0


def test_the_pair_reuses_the_pinned_kv_while_it_answers_as_vllm(servers: dict[str, str]) -> None:
    """The equality above is not bought by recomputing: on the pair, turn 2 of a conversation is served from KV."""
    history = _messages("Name a large city in Spain.")
    first = ask(servers["pair"], {"temperature": 0.0, "max_tokens": 8}, history)
    history += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And in Portugal?"}]
    assert _cached_tokens(servers["pair"], history) > 0


def _root(url: str) -> str:
    return url.removesuffix("/v1")


def test_the_served_model_name_is_vllm_serve_s(servers: dict[str, str]) -> None:
    """``/v1/models`` lists the same ids; a request naming another model gets vLLM's 404, the same body."""
    listed = {
        where: [m["id"] for m in httpx.get(url + "/models", timeout=30).json()["data"]]
        for where, url in servers.items()
    }
    assert listed["pair"] == listed["colocated"] == listed["vllm"] == ["smol"]
    body = {"model": "gpt-4o", "messages": _messages(), "max_tokens": 4}
    answers = {where: httpx.post(url + "/chat/completions", json=body, timeout=60) for where, url in servers.items()}
    oracle = answers["vllm"]
    assert oracle.status_code == 404
    for where in ("pair", "colocated"):
        assert (answers[where].status_code, answers[where].json()) == (404, oracle.json()), where


TOKENIZE = {
    "prompt": {"prompt": "The capital of France is Paris."},
    "prompt_special": {"prompt": "<|im_start|>user\nHi<|im_end|>", "add_special_tokens": False},
    "prompt_strs": {"prompt": "Héllo, wörld!", "return_token_strs": True},
    "messages": {"messages": _messages()},
    "messages_no_prompt": {"messages": _messages(), "add_generation_prompt": False},
    "messages_special": {"messages": _messages(), "add_special_tokens": True, "return_token_strs": True},
    "messages_kwargs": {"messages": _messages(), "chat_template_kwargs": {"enable_thinking": False}},
    "messages_tools": {"messages": _messages(), "tools": [WEATHER]},
    "named": {"model": "smol", "prompt": "x"},
    "other_model": {"model": "gpt-4o", "prompt": "x"},
}


@pytest.mark.parametrize("name", sorted(TOKENIZE))
def test_tokenize_answers_as_vllm_serve(servers: dict[str, str], name: str) -> None:
    body = TOKENIZE[name]
    answers = {where: httpx.post(_root(url) + "/tokenize", json=body, timeout=60) for where, url in servers.items()}
    oracle = answers["vllm"]
    for where in ("pair", "colocated"):
        assert answers[where].status_code == oracle.status_code, (where, answers[where].text, oracle.text)
        assert answers[where].json() == oracle.json(), where


@pytest.mark.parametrize("text", ["The capital of France is Paris.", "<|im_start|>user\nHéllo<|im_end|>\n", ""])
def test_detokenize_answers_as_vllm_serve(servers: dict[str, str], text: str) -> None:
    tokens = httpx.post(_root(servers["vllm"]) + "/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]
    answers = {
        where: httpx.post(_root(url) + "/detokenize", json={"model": "smol", "tokens": tokens}, timeout=60)
        for where, url in servers.items()
    }
    oracle = answers["vllm"]
    assert oracle.status_code == 200
    for where in ("pair", "colocated"):
        assert (answers[where].status_code, answers[where].json()) == (200, oracle.json()), where


# ----------------------------------------------------------------- POST /v1/completions

CODE = "def fibonacci(n):\n    "


def completion_matrix(tokenizer: Any) -> dict[str, dict[str, Any]]:
    """``POST /v1/completions`` bodies by name (``model`` added when sent): a text prompt and its token ids, greedy
    and seeded, stop strings, logprobs and echo."""
    ids = [int(token) for token in tokenizer.encode(CODE)]
    return {
        "text": {"prompt": CODE, "temperature": 0.0, "max_tokens": 16},
        "token_ids": {"prompt": ids, "temperature": 0.0, "max_tokens": 16},
        "default_max_tokens": {"prompt": CODE, "temperature": 0.0},
        "seeded": {"prompt": CODE, "temperature": 0.8, "seed": 7, "max_tokens": 16},
        "stop": {"prompt": CODE, "temperature": 0.0, "max_tokens": 32, "stop": ["\n"]},
        "logprobs": {"prompt": CODE, "temperature": 0.0, "max_tokens": 8, "logprobs": 3},
        "logprobs_0": {"prompt": ids, "temperature": 0.0, "max_tokens": 8, "logprobs": 0},
        "echo": {"prompt": CODE, "temperature": 0.0, "max_tokens": 8, "echo": True},
        "echo_ids": {"prompt": ids, "temperature": 0.0, "max_tokens": 8, "echo": True},
    }


def _completion_answer(body: dict[str, Any]) -> dict[str, Any]:
    choice = body["choices"][0]
    return {"text": choice["text"], "finish": choice["finish_reason"], "logprobs": choice.get("logprobs")}


def complete(url: str, body: dict[str, Any], *, stream: bool = False, headers: dict[str, str] | None = None) -> Any:
    """One completion (its text, finish reason and logprobs; streamed: the chunks joined) and its usage."""
    body = {"model": "smol", **body}
    if not stream:
        answer = httpx.post(url + "/completions", json=body, headers=headers, timeout=120)
        assert answer.status_code == 200, answer.text
        return _completion_answer(answer.json()), answer.json()["usage"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, finish, logprobs, usage = "", None, None, None
    with httpx.stream("POST", url + "/completions", json=body, headers=headers, timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
                if choice.get("logprobs"):
                    logprobs = logprobs or {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
                    for key in logprobs:
                        logprobs[key] += choice["logprobs"][key]
    return {"text": text, "finish": finish, "logprobs": logprobs}, usage


def assert_same_completion(name: str, oracle: dict[str, Any], answer: dict[str, Any], where: str) -> None:
    assert answer["text"] == oracle["text"], f"{name} on {where}: {answer['text']!r} != vLLM's {oracle['text']!r}"
    assert answer["finish"] == oracle["finish"], f"{name} on {where}: finish {answer['finish']} != {oracle['finish']}"
    mine, theirs = answer["logprobs"], oracle["logprobs"]
    if theirs is None:
        assert mine is None, f"{name} on {where}: logprobs nobody asked for"
        return
    assert mine is not None, f"{name} on {where}: no logprobs"
    for key in ("tokens", "text_offset"):
        assert mine[key] == theirs[key], f"{name} on {where}: {key} {mine[key]} != {theirs[key]}"
    for position, (value, o_value) in enumerate(zip(mine["token_logprobs"], theirs["token_logprobs"], strict=True)):
        assert abs(value - o_value) <= LOGPROB_TOLERANCE, f"{name} on {where}: logprob {position}"
    for position, (top, o_top) in enumerate(zip(mine["top_logprobs"], theirs["top_logprobs"], strict=True)):
        assert list(top) == list(o_top), f"{name} on {where}: top tokens at {position}: {list(top)} != {list(o_top)}"
        for token, value in top.items():
            assert abs(value - o_top[token]) <= LOGPROB_TOLERANCE, f"{name} on {where}: top logprob at {position}"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_answer_as_vllm_serve(servers: dict[str, str], tokenizer: Any, stream: bool) -> None:
    """Every completions request of the matrix, to the three servers: the same text, finish reason, logprobs
    (within the tolerance) and prompt tokens; the failure lists every difference."""
    differences = []
    for name, body in completion_matrix(tokenizer).items():
        oracle, oracle_usage = complete(servers["vllm"], body, stream=stream)
        for where in ("pair", "colocated"):
            try:
                answer, usage = complete(servers[where], body, stream=stream)
                assert_same_completion(name, oracle, answer, where)
                assert usage["prompt_tokens"] == oracle_usage["prompt_tokens"], f"{name} on {where}: prompt tokens"
            except AssertionError as exc:
                differences.append(str(exc).splitlines()[0])
    assert not differences, "\n".join(differences)


PIPELINE = '''"""A pipeline of compute steps, each fed the value of the step before it.

Every step is numbered, so that a failure names the step where it happened, and every value is kept, so that the
steps after a failure can be run again from the last good value without computing the ones before it once more.
A step that takes longer than its budget is stopped and reported as failed, with the value it was given, so that
it can be run again by hand; the steps before it keep their values, and the ones after it wait for the rerun.
"""


def pipeline(value_0):
'''
"""The file's head: more than one 128-token block (the CPU's), so that the second request shares a whole block."""


def test_a_growing_file_on_one_key_pulls_back_and_answers_as_vllm(servers: dict[str, str]) -> None:
    """An editor's file prefix grown by a line per request, on one conversation key: from the second request on
    the pair reuses the shared blocks (P's own cache holds them here; with P's cache off they are pulled back from
    D: tests/test_completions_pair.py), and every completion is vLLM's."""
    lines = [f"    value_{n} = compute(value_{n - 1}, {n})\n" for n in range(1, 7)]
    for count in range(1, len(lines) + 1):
        body = {"prompt": PIPELINE + "".join(lines[:count]), "temperature": 0.0, "max_tokens": 12}
        oracle, _ = complete(servers["vllm"], body)
        answer = httpx.post(
            servers["pair"] + "/completions", json={"model": "smol", **body}, headers={"x-session-id": "editor-1"}
        ).json()
        assert_same_completion("growing file", oracle, _completion_answer(answer), "pair")
        if count > 1:
            step = answer["agentkv"]["stats"]
            assert step["local_hit_tokens"] + step["pulled_tokens"] > 0, step
