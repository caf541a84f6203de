"""``agentkv serve`` as a drop-in for ``vllm serve``: its flags spelled and meaning as vLLM's (``--served-model-name``,
``--dtype``, ``--max-model-len``'s default, ``--generation-config``, ``--override-generation-config``,
``--pin-ttl-s``), on the door's doubles (tests/serve_cli.py) and the honest pair double; the same against stock
``vllm serve``: tests/test_differential.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv import SessionPool
from agentkv._engines._sampling import SamplingOptions
from agentkv._engines._system import free_port
from agentkv._surfaces._model_defaults import default_max_model_len, generation_defaults, model_context_len
from agentkv.engines import StepRequest
from agentkv.serve import FrontDoor
from agentkv.testing import HonestPairEngine
from serve_cli import serve_with_doubles

KEY = "k3y"


def _folder(tmp_path: Path, config: dict[str, Any], generation: dict[str, Any] | None = None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


SMALL = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
"""A config whose token takes 2 * 2 * 2 * 8 * 4 = 256 bytes of KV in float32."""


def test_the_context_is_the_models_own_as_vllm_derives_it(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {**SMALL, "max_position_embeddings": 8192, "n_positions": 4096})
    assert model_context_len(folder) == 4096  # the smallest of the length keys
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    assert model_context_len(folder) == 2048  # at most the tokenizer's
    folder = _folder(tmp_path, {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 2}})
    (folder / "tokenizer_config.json").unlink()
    assert model_context_len(folder) == 8192  # times a linear RoPE's factor
    folder = _folder(tmp_path, {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 4}})
    assert model_context_len(folder) == 4096  # YaRN's length is scaled already
    assert model_context_len(_folder(tmp_path, {"hidden_size": 8})) is None


def test_a_context_the_kv_cache_cannot_hold_falls_back_to_what_it_holds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _folder(tmp_path, {**SMALL, "max_position_embeddings": 8192})
    assert default_max_model_len(folder, dtype="float32", kv_cache_gib=1) == 8192
    assert default_max_model_len(folder, dtype="float32", kv_cache_gib=None) == 8192  # CUDA: vLLM checks it
    assert caplog.records == []
    huge = _folder(tmp_path, {**SMALL, "max_position_embeddings": 10_000_000})
    with caplog.at_level(logging.WARNING, logger="agentkv"):
        assert default_max_model_len(huge, dtype="float32", kv_cache_gib=1) == 2**30 // 256  # 4,194,304 tokens
        assert default_max_model_len(huge, dtype="bfloat16", kv_cache_gib=1) == 2**30 // 128
    assert "does not fit in one engine's 1 GiB KV cache in float32; serving 4194304 tokens" in caplog.text
    assert default_max_model_len(_folder(tmp_path, {}), dtype="float32", kv_cache_gib=1) == 4096


def test_sampling_defaults_are_the_generation_configs_as_vllm_takes_them(tmp_path: Path) -> None:
    generation = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 99, "do_sample": True}
    folder = _folder(tmp_path, SMALL, {**generation, "min_p": None, "bos_token_id": 1})
    expected = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 99}
    assert generation_defaults(folder) == expected
    assert generation_defaults(folder, "vllm") == {}  # vLLM's neutral defaults
    assert generation_defaults(folder, "vllm", {"temperature": 0.0}) == {"temperature": 0.0}
    assert generation_defaults(folder, "auto", {"top_k": 5, "seed": 3}) == {**expected, "top_k": 5}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1}))
    assert generation_defaults(folder, str(other)) == {"repetition_penalty": 1.1}
    no_file = _folder(tmp_path / "x", {**SMALL, "temperature": 0.3}) if (tmp_path / "x").mkdir() is None else None
    assert no_file is not None and generation_defaults(no_file) == {"temperature": 0.3}  # from config.json
    with pytest.raises(Exception, match="--generation-config takes auto, vllm or a folder"):
        generation_defaults(folder, str(tmp_path / "missing"))


def test_serve_flags_reach_the_pool_and_the_door(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    argv = ["serve", "--store", "memory", "--served-model-name", "smol", "alias", "--dtype", "float"]
    argv += ["--pin-ttl-s", "60", "--max-model-len", "2048"]
    code, pool, door = serve_with_doubles(monkeypatch, argv)
    assert code == 0 and door["model_name"] == ["smol", "alias"]
    assert pool["engine_options"] == {"max_model_len": 2048, "dtype": "float32", "pin_ttl_s": 60.0}
    # the bundled model's generation config names no sampling value: vLLM's neutral defaults, agentkv's answer length
    assert (pool["temperature"], pool["sampling"], pool["max_tokens"]) == (1.0, SamplingOptions(), 256)
    code, pool, door = serve_with_doubles(monkeypatch, ["serve", "--store", "memory"])
    assert code == 0 and "model_name" not in door and pool["engine_options"] == {"max_model_len": 8192}
    other = tmp_path / "generation"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 7, "max_new_tokens": 40}))
    override = json.dumps({"temperature": 0.0, "min_p": 0.1})
    argv = ["serve", "--store", "memory", "--generation-config", str(other), "--override-generation-config", override]
    code, pool, _ = serve_with_doubles(monkeypatch, argv)
    assert (pool["temperature"], pool["sampling"], pool["max_tokens"]) == (
        0.0,
        SamplingOptions(top_k=7, min_p=0.1),
        40,
    )
    code, pool, _ = serve_with_doubles(monkeypatch, [*argv, "--max-tokens", "12"])
    assert pool["max_tokens"] == 12  # the flag over the generation config


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--override-generation-config", "[1]"], "takes a JSON object"),
        (["--override-generation-config", '{"top_p": 7}'], "sampling defaults are not valid"),
        (["--dtype", "int8"], "invalid choice"),
        (["--pin-ttl-s", "5"], "must exceed 10 s"),
        (["--mode", "colocated", "--pin-ttl-s", "60"], "colocated is one engine, which pins nothing"),
        (["--dtype", "float32", "--remote", "http://p", "http://d"], "--remote take their vLLM arguments"),
    ],
)
def test_serve_refuses_what_it_cannot_honour(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    try:
        code, _, _ = serve_with_doubles(monkeypatch, ["serve", "--store", "memory", *argv])
    except SystemExit as exc:  # argparse's refusal of a flag's value
        code = int(str(exc.code))
    assert code == 2 and said in capsys.readouterr().err


def _echo(request: StepRequest) -> str:
    return f"t={request.sampling.temperature}"


@pytest.fixture(scope="module")
def door() -> Iterator[str]:
    with HonestPairEngine(_echo) as engine, SessionPool(engine=engine, max_tokens=16) as pool:
        front = FrontDoor(pool, model_name=["smol", "alias"], api_key=KEY, port=free_port())
        with front:
            yield front.url


def _post(url: str, path: str, body: dict[str, Any], key: str = KEY) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def test_a_request_may_name_any_served_name_and_the_reply_names_the_first(door: str) -> None:
    for name in ("smol", "alias", None, ""):
        body = {"messages": [{"role": "user", "content": "Hi"}], **({"model": name} if name is not None else {})}
        answer = _post(door, "/v1/chat/completions", body)
        assert answer.status_code == 200 and answer.json()["model"] == "smol"
    listed = httpx.get(door + "/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()
    assert [card["id"] for card in listed["data"]] == ["smol", "alias"]
    assert {card["max_model_len"] for card in listed["data"]} == {4096}
    assert httpx.get(door + "/v1/models").status_code == 401


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/completions"])
def test_another_model_name_gets_vllms_404(door: str, path: str) -> None:
    field = {"/v1/chat/completions": "messages", "/v1/responses": "input", "/v1/completions": "prompt"}[path]
    body = {"model": "gpt-4o", field: [{"role": "user", "content": "Hi"}] if field == "messages" else "Hi"}
    answer = _post(door, path, body)
    assert answer.status_code == 404
    assert answer.json() == {
        "error": {
            "message": "The model `gpt-4o` does not exist. Valid aliases: smol, alias.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_the_door_refuses_model_names_it_cannot_serve() -> None:
    with HonestPairEngine() as engine, SessionPool(engine=engine) as pool:
        for names in (["a", "a"], [""], ["a", ""]):
            with pytest.raises(Exception, match="distinct non-empty names"):
                FrontDoor(pool, model_name=names)


def test_without_served_names_the_door_takes_any_model_name() -> None:
    with HonestPairEngine(_echo) as engine, SessionPool(engine=engine, max_tokens=16) as pool:
        with FrontDoor(pool, port=free_port()) as front:
            body = {"model": "anything", "messages": [{"role": "user", "content": "Hi"}]}
            answer = httpx.post(front.url + "/v1/chat/completions", json=body, timeout=30)
            assert answer.status_code == 200 and answer.json()["model"] == front.settings.model_name
            listed = httpx.get(front.url + "/v1/models").json()["data"]
            assert [card["id"] for card in listed] == [front.settings.model_name]


def _test_tokenizer() -> Any:
    from agentkv._conversation._light_tokenizer import LightTokenizer
    from agentkv._doubles._scripted import TEST_MODEL

    return LightTokenizer(TEST_MODEL)


def test_tokenize_a_prompt_and_messages_as_vllm_answers(door: str) -> None:
    tokenizer = _test_tokenizer()
    ids = tokenizer.encode("Hello there", add_special_tokens=True)
    answer = _post(door, "/tokenize", {"model": "alias", "prompt": "Hello there"})
    assert answer.status_code == 200
    assert answer.json() == {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}
    strs = _post(door, "/tokenize", {"prompt": "Hello there", "return_token_strs": True}).json()["token_strs"]
    assert strs == tokenizer.convert_ids_to_tokens(ids)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    rendered = str(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi\nthere"}], tokenize=False, add_generation_prompt=True
        )
    )
    chat = _post(door, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False) and chat["count"] == len(
        chat["tokens"]
    )
    plain = _post(door, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert plain["tokens"] == chat["tokens"][: plain["count"]] and plain["count"] < chat["count"]


def test_detokenize_gives_the_prompt_back(door: str) -> None:
    ids = _post(door, "/tokenize", {"prompt": "<|im_start|>user\nHi"}).json()["tokens"]
    answer = _post(door, "/detokenize", {"model": "smol", "tokens": ids})
    assert answer.status_code == 200 and answer.json() == {"prompt": "<|im_start|>user\nHi"}  # special tokens kept


@pytest.mark.parametrize(
    ("path", "body", "status", "said"),
    [
        (
            "/tokenize",
            {"prompt": "x", "model": "gpt-4o"},
            404,
            "The model `gpt-4o` does not exist. Valid aliases: smol, alias.",
        ),
        (
            "/detokenize",
            {"tokens": [1], "model": "gpt-4o"},
            404,
            "The model `gpt-4o` does not exist. Valid aliases: smol, alias.",
        ),
        ("/detokenize", {"tokens": [10**9]}, 400, "out of vocabulary"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
        ("/tokenize", {"messages": [], "chat_template": "{{ 1 }}"}, 400, "--trust-request-chat-template is not set"),
        (
            "/tokenize",
            {"messages": [], "continue_final_message": True},
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ),
        ("/tokenize", {"messages": [], "chat_template_kwargs": {"x": "y" * 20_000}}, 400, "at most 16 KiB"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}] * 3000}, 400, "messages"),
        ("/tokenize", {"nothing": 1}, 400, "prompt: Field required"),
        ("/tokenize", [1, 2], 400, "body: Input should be a valid dictionary"),
    ],
)
def test_tokenize_routes_refuse_bad_input(door: str, path: str, body: Any, status: int, said: str) -> None:
    answer = _post(door, path, body)
    assert answer.status_code == status and said in answer.json()["error"]["message"]


def test_tokenize_routes_need_the_key(door: str) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert _post(door, path, body, key="wrong").status_code == 401
        assert httpx.post(door + path, json=body).status_code == 401


def test_remote_servers_without_a_model_take_vllms_neutral_defaults(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    argv = ["serve", "--store", "memory", "--remote", "http://p:1", "http://d:2"]
    with caplog.at_level(logging.WARNING, logger="agentkv"):
        code, pool, _ = serve_with_doubles(monkeypatch, [*argv, "--override-generation-config", '{"top_p": 0.5}'])
    assert code == 0 and (pool["temperature"], pool["sampling"]) == (1.0, SamplingOptions(top_p=0.5))
    assert "with --remote and no --model the model's generation config is not read" in caplog.text
