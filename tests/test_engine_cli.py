"""``agentkv engine``: the command line that runs one server of a pair on a host of its own."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentkv._surfaces._cli import main


def test_engine_runs_agentkvs_server_with_the_pair_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: dict[str, Any] = {}

    def exec_instead(file: str, args: list[str], env: dict[str, str]) -> None:
        ran.update(file=file, args=args, env=env)
        raise SystemExit(0)

    monkeypatch.setattr("os.execvpe", exec_instead)
    argv = ["engine", "--role", "prefill", "--nixl-host", "10.0.0.1", "--port", "8123", "--cores", "0-2,5"]
    with pytest.raises(SystemExit):
        main(argv)
    args, env = ran["args"], ran["env"]
    assert args[1:3] == ["-m", "agentkv._engines._server"]
    assert args[args.index("--port") + 1] == "8123" and args[args.index("--host") + 1] == "0.0.0.0"
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_producer" and kv["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.1" and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-2,5"
    assert env["AGENTKV_PARKED_KV_POLL_MS"]  # idle servers sleep, as launched ones do


@pytest.mark.parametrize("cores", ["0-x", ",", "0-2,3-1"])
def test_a_bad_core_list_is_a_usage_error(cores: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["engine", "--role", "decode", "--nixl-host", "10.0.0.1", "--cores", cores])
    assert exited.value.code == 2
    assert "--cores" in capsys.readouterr().err
