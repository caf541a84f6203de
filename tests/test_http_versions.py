"""An HTTP pair at open: the model its servers serve, the vLLM and NIXL they run, what a stock server streams.

Against scripted servers (tests/test_http_client.py's ``ScriptedServer``: ``/v1/models``, ``/version`` and
``/v1/completions`` as vLLM's server answers them); no model runs. What is checked is what the pair refuses at
open, by name, and what it then uses.
"""

from __future__ import annotations

import pytest

from agentkv import ModelPreparationError, RemotePair, Session, UserError
from agentkv._model import prepare_model
from test_http_client import ScriptedServer

QWEN = "Qwen/Qwen3-0.6B"


def test_a_model_named_that_the_servers_do_not_serve_is_refused_at_open() -> None:
    """The bundled weights served under another model's name: a session naming the bundled model would send
    SmolLM2's token ids to what says it is a Qwen."""
    with ScriptedServer("prefill", served=QWEN) as p, ScriptedServer("decode", served=QWEN) as d:
        pair = RemotePair(p.url, d.url, model="smollm2-135m-instruct", warmup=False)
        with pytest.raises(UserError, match=f"the model named, 'smollm2-135m-instruct', is not .*'{QWEN}'"):
            pair.__enter__()
        assert not pair.is_open and not p.probes and not d.probes  # refused before anything was asked of them


def test_without_a_model_the_pair_uses_the_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    with ScriptedServer("prefill", agentkv=False) as p, ScriptedServer("decode", agentkv=False) as d:
        with RemotePair(p.url, d.url, decode_streaming=False, warmup=False) as pair:
            assert pair.info.model_path == prepare_model()  # the folder they serve, as --model reads it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with ScriptedServer("prefill", served=QWEN) as p, ScriptedServer("decode", served=QWEN) as d:
        pair = RemotePair(p.url, d.url, warmup=False)
        with pytest.raises(ModelPreparationError, match=f"the servers serve '{QWEN}'.*not in the HF cache"):
            pair.__enter__()  # theirs, not the bundled model: here it is not in the cache


def test_a_named_model_that_is_the_servers_is_accepted_under_any_of_its_names() -> None:
    folder = prepare_model()
    with ScriptedServer("prefill") as p, ScriptedServer("decode") as d:  # agentkv's servers: served as "agentkv"
        for named in ("smollm2-135m-instruct", str(folder)):
            with RemotePair(p.url, d.url, model=named, warmup=False) as pair:
                assert pair.info.model_path == folder


def test_p_and_d_serving_different_models_are_refused_by_name() -> None:
    with ScriptedServer("prefill", served=QWEN) as p, ScriptedServer("decode") as d:
        pair = RemotePair(p.url, d.url, warmup=False)
        with pytest.raises(
            UserError,
            match=f"serves '{QWEN}' \\(loaded from .*\\) and the decode server .* serves .*as 'agentkv'.*a pair's servers",
        ):
            pair.__enter__()


@pytest.mark.parametrize(
    ("p_options", "d_options", "said"),
    [
        ({"agentkv": False, "vllm": "0.32.0"}, {"agentkv": False, "vllm": "0.33.0"}, "vLLM 0.32.0, handshake 14"),
        (
            {"versions": {"vllm": "0.33.0", "nixl": "1.5.1", "nixl_handshake": 15}},
            {"versions": {"vllm": "0.34.0", "nixl": "1.5.2", "nixl_handshake": 16}},
            "vLLM 0.34.0, NIXL 1.5.2, handshake 16",
        ),
    ],
    ids=["stock-by-release", "agentkv-servers-say"],
)
def test_servers_that_cannot_handshake_are_refused_at_open(
    p_options: dict[str, object], d_options: dict[str, object], said: str
) -> None:
    with ScriptedServer("prefill", **p_options) as p, ScriptedServer("decode", **d_options) as d:  # type: ignore[arg-type]
        pair = RemotePair(p.url, d.url, decode_streaming=False, warmup=False)
        with pytest.raises(UserError, match="cannot handshake") as refused:
            pair.__enter__()
        assert said in str(refused.value) and not d.bodies


def test_the_pair_reports_what_each_server_runs() -> None:
    versions = {"vllm": "0.32.0", "nixl": "1.5.1", "nixl_handshake": 14}
    with ScriptedServer("prefill", versions=versions) as p, ScriptedServer("decode", versions=versions) as d:
        with RemotePair(p.url, d.url, warmup=False) as pair:
            assert pair.info.details["versions"] == {"prefill": versions, "decode": versions}


def test_a_stock_033_decode_server_streams_with_push_back() -> None:
    """From vLLM 0.33 on, a stock D's last streamed chunk with choices carries its handle: the pair streams and
    pushes the handle back, where 0.32's stock D is refused for streaming."""
    with (
        ScriptedServer("prefill", agentkv=False, vllm="0.33.0") as p,
        ScriptedServer("decode", agentkv=False, vllm="0.33.0") as d,
    ):
        with RemotePair(p.url, d.url, warmup=False) as pair, Session(engine=pair, max_tokens=8) as session:
            assert pair.decode_streaming and pair.handle_in_stream and pair.server_kind == "vllm"
            assert session.run_sync("Capital of France?").text == "Paris."
            second = session.run_sync("And of Italy?")
        assert second.steps[0].stats.handle_forwarded
        assert all(body.get("stream") for body in d.bodies)
        assert p.bodies[1]["kv_transfer_params"]["remote_engine_id"] == "d"
