"""Core split, port and process helpers; the model cache never serves a half-written folder; the pair's
configuration and the vLLM settings written from it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agentkv import EmbeddedPair, LaunchedPair, ModelPreparationError, PairConfig, UserError, prepare_model
from agentkv._engines._engine_launch import engine_launch, pair_engine_launch
from agentkv._engines._server_process import ServerSpec, server_command
from agentkv._engines._system import (
    alive,
    compute_cores,
    cpu_list,
    descendants,
    free_port,
    single_engine_cores,
    split_cores,
)
from agentkv._engines._vllm import AsyncLLMRunner
from agentkv._model import BUNDLED_MODELS, DEFAULT_MODEL
from agentkv._surfaces._cli import main


def test_cores_are_split_without_overlap() -> None:
    assert split_cores([0, 1]) == ([0], [1])
    p, d = split_cores(range(64))
    assert len(p) == len(d) == 32 and not set(p) & set(d)
    assert split_cores([0, 1, 2]) == ([0, 1], [2])
    assert split_cores([5]) == ([5], [5])  # one core: shared, with a warning


def test_a_single_engine_leaves_a_core_to_its_scheduler() -> None:
    assert compute_cores([0, 1]) == [0] and compute_cores([3, 1, 2]) == [1, 2]  # as vLLM's own binding
    assert compute_cores([4]) == [4]  # one core: the engine takes it
    assert compute_cores() == sorted(os.sched_getaffinity(0))[:-1] or len(os.sched_getaffinity(0)) == 1


def test_cpu_list_is_the_form_vllm_takes() -> None:
    assert cpu_list([0]) == "0"
    assert cpu_list([3, 0, 1, 2, 5]) == "0-3,5"


def test_free_port_and_process_helpers() -> None:
    assert 0 < free_port() < 65536
    assert os.getpid() in alive([os.getpid()])
    assert os.getpid() not in descendants(os.getpid())


def test_a_free_port_is_drawn_below_the_ephemeral_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No outgoing connection can take it between its choice and its server's bind (an engine's NIXL side
    channel: tens of seconds later); where the kernel does not say its range, or leaves no room, the OS picks."""
    from agentkv._engines import _system

    found = _system.EPHEMERAL_PORTS.read_text().split() if _system.EPHEMERAL_PORTS.exists() else []
    if found:
        low = int(found[0])
        ports = {free_port() for _ in range(20)}
        assert all(low - 12_000 <= port < low for port in ports) and len(ports) > 1
    ranges = tmp_path / "range"
    monkeypatch.setattr(_system, "EPHEMERAL_PORTS", ranges)
    ranges.write_text("40000\t60999\n")
    assert 28_000 <= free_port() < 40_000
    for unknown in ("", "abc", "2000 3000"):  # unreadable, or no room under it: the OS's pick
        ranges.write_text(unknown)
        assert 0 < free_port() < 65536
    ranges.unlink()
    assert 0 < free_port() < 65536


def test_an_interrupted_preparation_is_never_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path))
    target = tmp_path / "models" / DEFAULT_MODEL
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a folder left by an interrupted run: no completion marker
    converted: list[Path] = []

    def fake_convert(gguf: Path, out: Path, progress: object) -> None:
        converted.append(out)
        (out / "config.json").write_text(json.dumps({"fake": True}))

    monkeypatch.setattr("agentkv._model._convert_gguf", fake_convert)
    assert prepare_model() == target
    assert json.loads((target / "config.json").read_text()) == {"fake": True}
    assert converted and converted[0] != target  # written elsewhere, moved into place when complete
    assert prepare_model() == target and len(converted) == 1  # a second start reuses it


def test_unknown_models_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelPreparationError, match="neither a bundled model"):
        prepare_model(tmp_path / "nowhere")
    assert DEFAULT_MODEL in BUNDLED_MODELS


def test_a_pair_config_refuses_settings_that_cannot_work() -> None:
    for bad in (
        {"pin_ttl_s": 10},
        {"idle_poll_ms": 0},
        {"recompute_threshold": -1},
        {"kv_cache_gib": float("nan")},
        {"kv_cache_gib": 0.25},  # vLLM's CPU backend takes whole GiB: its start failed on this
        {"step_timeout_s": 0},
        {"cores": ([0], [])},
        {"max_pinned_blocks": 0},
    ):
        with pytest.raises(UserError):
            PairConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(UserError, match="unknown pair setting"):
        PairConfig.of(pin_ttl=60)
    assert PairConfig.of(PairConfig(pin_ttl_s=60), warmup=False) == PairConfig(pin_ttl_s=60, warmup=False)
    assert LaunchedPair(max_pinned_blocks=100)._max_pinned_blocks == 100  # every pair kind bounds D's pins
    with pytest.warns(DeprecationWarning, match="push_back"):  # push-back's one name; the old one still works
        assert not EmbeddedPair(bidirectional=False).config.push_back  # type: ignore[call-arg]


def test_one_function_writes_each_engines_vllm_settings(tmp_path: Path) -> None:
    config = PairConfig(prefill_prefix_cache=False, pin_ttl_s=60, recompute_threshold=32, idle_poll_ms=20)
    launches = {
        role: pair_engine_launch(
            config, role, model_path=tmp_path, cores=cores, engine_id=f"e-{role}", side_channel_port=port
        )
        for role, cores, port in (("prefill", [0, 1], 5601), ("decode", [2], 5602))
    }
    p, d = launches["prefill"], launches["decode"]
    assert p.engine_args["enable_prefix_caching"] is False and d.engine_args["enable_prefix_caching"] is True
    assert p.engine_args["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert d.engine_args["kv_transfer_config"]["kv_role"] == "kv_consumer"
    extra = d.engine_args["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra == {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 32, "decoder_kv_blocks_ttl": 60}
    assert p.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and d.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5602"
    assert p.env["AGENTKV_PARKED_KV_POLL_MS"] == "20" and p.engine_id == "e-prefill"
    # the launched server gets the same settings, as vLLM's flags
    command = server_command(ServerSpec(role="prefill", launch=p, port=8000))
    assert command[command.index("--max-model-len") + 1] == "4096"
    assert "--no-enable-prefix-caching" in command and "--enforce-eager" in command
    assert json.loads(command[command.index("--kv-transfer-config") + 1]) == p.engine_args["kv_transfer_config"]


def test_agentkv_engine_uses_the_config_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: dict[str, list[str]] = {}

    def exec_instead(file: str, args: list[str], env: dict[str, str]) -> None:
        ran["args"] = args
        raise SystemExit(0)

    monkeypatch.setattr("os.execvpe", exec_instead)
    with pytest.raises(SystemExit):
        main(["engine", "--role", "decode", "--nixl-host", "10.0.0.2"])
    kv = json.loads(ran["args"][ran["args"].index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"]["kv_recompute_threshold"] == PairConfig().recompute_threshold


def test_a_single_engine_leaves_its_scheduler_the_core_its_compute_threads_leave() -> None:
    available = sorted(os.sched_getaffinity(0))
    compute, home = single_engine_cores()
    assert home == available and compute == compute_cores(available)
    assert single_engine_cores([3, 1]) == ([3, 1], [3, 1])  # given: every thread of the engine on them, in order
    launch = engine_launch(
        name="colocated", model_path=Path("/m"), cores=[0], home_cores=[0, 1], max_model_len=1024, kv_cache_gib=1
    )
    assert launch.env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and launch.home_cores == [0, 1]
    assert AsyncLLMRunner(launch).cores == [0, 1]  # the scheduler process may run on both
    assert AsyncLLMRunner(
        engine_launch(name="p", model_path=Path("/m"), cores=[1], max_model_len=1024, kv_cache_gib=1)
    ).cores == [1]
