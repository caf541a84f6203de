"""Unit tests of the platform mapping: what agentkv hands vLLM on CPU and on CUDA, which GPUs each engine of a
pair gets, the user's own vLLM engine arguments (and those refused), and ``--`` on the command line.

No GPU is needed: the mapping is a function of a `Platform` value, and a CUDA one is built here. No engine
starts (the unit tier blocks them); the CPU expectations are what the code produced before platforms were
mapped (captured from it, for the same configs), so the CPU pair's settings are shown unchanged.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agentkv import Colocated, EmbeddedPair, LaunchedPair, PairConfig, UserError
from agentkv._engines import _pair_config
from agentkv._engines._engine_launch import EngineLaunch, engine_launch, pair_engine_launch
from agentkv._engines._pair_config import OWNED_ENGINE_ARGS, PUSH_CONNECTOR
from agentkv._engines._platform_settings import resolve_dtype
from agentkv._engines._platforms import (
    CPU_PLATFORM,
    SHARED_DEVICE_MEMORY_FRACTION,
    PairDevices,
    Platform,
    current_platform,
    pair_devices,
    split_devices_among_pairs,
    visible_devices,
)
from agentkv._engines._server_process import ServerSpec, parse_vllm_flags, server_command, server_env, vllm_flags
from agentkv._engines._vllm import AsyncLLMRunner
from agentkv._surfaces import _cli, _cli_pairs, _cli_serve
from agentkv._surfaces._cli import main

MODEL = Path("/m")
CPU_ONLY_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "AGENTKV_CORE_TABLE")
IDLE_ENV = ("AGENTKV_NIXL_PROGRESS_DELAY_US", "AGENTKV_PARKED_KV_POLL_MS")


def cuda(count: int, listed: str | None = None) -> Platform:
    """A CUDA host with ``count`` GPUs (``listed``: its ``CUDA_VISIBLE_DEVICES``)."""
    env = {} if listed is None else {"CUDA_VISIBLE_DEVICES": listed}
    devices, restricted = visible_devices(env, count)
    return Platform("cuda", devices, restricted)


def launch_of(config: PairConfig, role: Any, platform: Platform, **options: Any) -> EngineLaunch:
    return pair_engine_launch(
        config,
        role,
        model_path=MODEL,
        cores=options.pop("cores", None),
        engine_id=f"e-{role}",
        side_channel_port=options.pop("port", 5600),
        nixl_host="10.0.0.1",
        platform=platform,
        **options,
    )


# ----------------------------------------------------------------- CPU: today's settings, unchanged


TUNED = PairConfig(
    prefill_prefix_cache=False,
    pin_ttl_s=60,
    recompute_threshold=32,
    idle_poll_ms=20,
    dtype="float32",
    max_model_len=2048,
    kv_cache_gib=2,
)


def test_cpu_settings_are_unchanged() -> None:
    """The engine arguments and environment the code wrote before platforms were mapped, for the same configs."""
    p = launch_of(TUNED, "prefill", CPU_PLATFORM, cores=[0, 1], port=5601)
    assert p.engine_args == {
        "model": "/m",
        "dtype": "float32",
        "max_model_len": 2048,
        "max_num_seqs": 64,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "kv_cache_memory_bytes": 2 * 2**30,
        "kv_transfer_config": {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer",
            "kv_buffer_device": "cpu",
            "engine_id": "e-prefill",
            "kv_connector_extra_config": {
                "bidirectional_kv_xfer": True,
                "kv_recompute_threshold": 32,
                "decoder_kv_blocks_ttl": 60,
            },
        },
        "scheduling_policy": "priority",  # since pin releases go first (docs/engines.md)
    }
    assert list(p.engine_args) == [
        "model",
        "dtype",
        "max_model_len",
        "max_num_seqs",
        "enforce_eager",
        "enable_prefix_caching",
        "kv_cache_memory_bytes",
        "kv_transfer_config",
        "scheduling_policy",
    ]  # the order of the server's flags too
    assert p.env == {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "AGENTKV_ENGINE": "1",
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "30",
        "AGENTKV_NIXL_PROGRESS_DELAY_US": "20000",
        "AGENTKV_PARKED_KV_POLL_MS": "20",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601",
    }
    assert (p.cores, p.devices, p.engine_id, p.side_channel_port, p.where) == (
        [0, 1],
        None,
        "e-prefill",
        5601,
        "cores 0-1",
    )

    d = launch_of(PairConfig(), "decode", CPU_PLATFORM, cores=[2], port=5602, core_table="/dev/shm/t:3")
    assert d.engine_args["dtype"] == resolve_dtype("auto") and d.engine_args["max_model_len"] == 4096
    assert d.engine_args["enable_prefix_caching"] is True and d.engine_args["enforce_eager"] is True
    assert d.engine_args["kv_transfer_config"]["kv_connector_extra_config"] == {
        "bidirectional_kv_xfer": True,
        "kv_recompute_threshold": 16,
        "decoder_kv_blocks_ttl": 480.0,
    }
    assert d.env == {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "AGENTKV_ENGINE": "1",
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "30",
        "AGENTKV_NIXL_PROGRESS_DELAY_US": "50000",
        "AGENTKV_PARKED_KV_POLL_MS": "50",
        "VLLM_CPU_OMP_THREADS_BIND": "2",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5602",
        "AGENTKV_CORE_TABLE": "/dev/shm/t:3",
    }

    elastic = launch_of(TUNED, "prefill", CPU_PLATFORM, cores=[3, 1, 2], core_table="/x:0")
    assert elastic.env["VLLM_CPU_OMP_THREADS_BIND"] == "3,1,2" and elastic.env["AGENTKV_CORE_TABLE"] == "/x:0"

    raw = launch_of(PairConfig(transfer="push", push_back=False, idle_poll_ms=None), "decode", CPU_PLATFORM)
    assert raw.env == {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "AGENTKV_ENGINE": "1",
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "30",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
    }
    assert raw.engine_args["kv_transfer_config"]["kv_connector"] == "NixlPushConnector" and raw.cores is None
    pushed = launch_of(PairConfig(transfer="push"), "prefill", CPU_PLATFORM, cores=[0])
    assert {k: pushed.engine_args["kv_transfer_config"][k] for k in PUSH_CONNECTOR} == PUSH_CONNECTOR

    colocated = engine_launch(
        name="colocated",
        model_path=MODEL,
        cores=[0, 1],
        max_model_len=1024,
        kv_cache_gib=3,
        dtype="float16",
        platform=CPU_PLATFORM,
    )
    assert colocated.engine_args == {
        "model": "/m",
        "dtype": "float16",
        "max_model_len": 1024,
        "max_num_seqs": 64,
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "kv_cache_memory_bytes": 3 * 2**30,  # besides the variable, which vLLM reads only where the config is made
    }
    assert colocated.env == {
        "VLLM_CPU_KVCACHE_SPACE": "3",
        "AGENTKV_ENGINE": "1",
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "30",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    }


def test_cpu_server_command_line_is_unchanged() -> None:
    p = pair_engine_launch(
        TUNED, "prefill", model_path=MODEL, cores=[0, 1], engine_id="e", side_channel_port=5600, platform=CPU_PLATFORM
    )
    spec = ServerSpec(role="prefill", launch=p, port=8000)
    kv = json.dumps(p.engine_args["kv_transfer_config"])
    assert server_command(spec)[1:] == [
        "-m",
        "agentkv._engines._server",
        "--model",
        "/m",
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "64",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--kv-cache-memory-bytes",
        str(2 * 2**30),
        "--kv-transfer-config",
        kv,
        "--scheduling-policy",
        "priority",
        "--served-model-name",
        "agentkv",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
    ]
    assert server_env(spec)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "CUDA_VISIBLE_DEVICES" not in server_env(spec)


def test_this_host_is_vllms_cpu_platform() -> None:
    """The detection maps vLLM's platform here (vllm-cpu) to the CPU settings."""
    assert current_platform() == CPU_PLATFORM
    assert CPU_PLATFORM.pins_cores and CPU_PLATFORM.kv_buffer_device == "cpu"


@pytest.mark.parametrize(("level", "shown"), [(None, False), ("INFO", True)])
def test_the_cpu_builds_triton_notice_stays_out_of_the_terminal_unless_vllms_log_is_asked_for(
    level: str | None, shown: bool
) -> None:
    """vLLM's CPU build warns, as its engine is imported, that its Triton has no CPU backend: not for the user."""
    code = (
        "from agentkv._engines._platforms import current_platform; current_platform(); "
        "from vllm.v1.engine.async_llm import AsyncLLM"
    )
    env = {key: value for key, value in os.environ.items() if key != "VLLM_LOGGING_LEVEL"}
    if level is not None:
        env["VLLM_LOGGING_LEVEL"] = level
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert ("doesn't include CPU backend" in done.stdout + done.stderr) is shown


# ----------------------------------------------------------------- CUDA: vLLM's defaults, GPUs per engine


@pytest.mark.compat
def test_cuda_settings_are_vllms_defaults_on_each_engines_gpus() -> None:
    platform = cuda(4)
    assert not platform.pins_cores and platform.kv_buffer_device == "cuda"
    config = PairConfig(idle_poll_ms=20, kv_cache_gib=8)  # CPU settings: no effect on CUDA
    for role, devices in (("prefill", "0,1"), ("decode", "2,3")):
        launch = launch_of(config, role, platform, core_table="/dev/shm/t:0")
        args, env = launch.engine_args, launch.env
        assert "enforce_eager" not in args and "max_num_seqs" not in args  # CUDA graphs, vLLM's batch size
        assert args["dtype"] == "auto"  # the model's own
        assert args["tensor_parallel_size"] == 2
        assert "gpu_memory_utilization" not in args  # alone on its GPUs: vLLM's default fraction
        assert args["kv_transfer_config"]["kv_buffer_device"] == "cuda"
        assert env["CUDA_VISIBLE_DEVICES"] == devices
        assert not set(CPU_ONLY_ENV + IDLE_ENV) & set(env)  # no core table, no thread binding, no idle polling
        assert env["AGENTKV_ENGINE"] == "1" and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        assert launch.cores is None and launch.devices == devices.split(",") and launch.where == f"GPUs {devices}"
        command = server_command(ServerSpec(role=role, launch=launch, port=8000))
        assert command[command.index("--tensor-parallel-size") + 1] == "2" and "--enforce-eager" not in command
        assert server_env(ServerSpec(role=role, launch=launch, port=8000))["CUDA_VISIBLE_DEVICES"] == devices


@pytest.mark.compat
def test_cuda_keeps_the_dtype_asked_for_and_refuses_cores() -> None:
    launch = launch_of(PairConfig(dtype="bfloat16"), "decode", cuda(2))
    assert launch.engine_args["dtype"] == "bfloat16" and launch.engine_args["tensor_parallel_size"] == 1
    with pytest.raises(UserError, match="cores"):
        launch_of(PairConfig(), "prefill", cuda(2), cores=[0, 1])


def test_a_runner_without_cores_leaves_threads_where_vllm_put_them(monkeypatch: pytest.MonkeyPatch) -> None:
    moved: list[Any] = []
    monkeypatch.setattr("agentkv._engines._vllm.repin_threads", lambda *a: moved.append(a) or 0)
    runner = AsyncLLMRunner(launch_of(PairConfig(), "prefill", cuda(2)))
    runner.pids = {1}
    runner.repin()
    assert moved == []


# ----------------------------------------------------------------- devices of a pair


@pytest.mark.parametrize(
    ("count", "prefill", "decode"),
    [
        (2, ("0",), ("1",)),
        (4, ("0", "1"), ("2", "3")),
        (8, ("0", "1", "2", "3"), ("4", "5", "6", "7")),
    ],
)
@pytest.mark.compat
def test_the_visible_gpus_are_split_in_two_halves(
    count: int, prefill: tuple[str, ...], decode: tuple[str, ...]
) -> None:
    devices = pair_devices(cuda(count))
    assert (devices.prefill, devices.decode, devices.shared) == (prefill, decode, ())
    for role, own in (("prefill", prefill), ("decode", decode)):
        assert launch_of(PairConfig(), role, cuda(count)).engine_args["tensor_parallel_size"] == len(own)


@pytest.mark.compat
def test_one_visible_gpu_is_a_clear_error() -> None:
    with pytest.raises(UserError) as caught:
        pair_devices(cuda(1))
    message = str(caught.value)
    assert "one GPU is visible" in message and "Colocated" in message and "prefill_devices" in message
    with pytest.raises(UserError, match="no GPU is visible"):
        pair_devices(cuda(0))
    with pytest.raises(UserError, match=r"CUDA_VISIBLE_DEVICES=3"):
        pair_devices(cuda(8, "3"))


@pytest.mark.compat
def test_an_odd_count_leaves_the_last_gpu_unused(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="agentkv"):
        devices = pair_devices(cuda(3))
    assert (devices.prefill, devices.decode) == (("0",), ("1",))
    assert "GPU 2 is left unused" in caplog.text


@pytest.mark.compat
def test_cuda_visible_devices_restricts_and_names_the_gpus() -> None:
    assert visible_devices({}, 2) == (("0", "1"), False)
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}, 8) == ((), True)
    platform = cuda(8, "4,5, 6,7")
    assert platform.visible_devices == ("4", "5", "6", "7") and platform.devices_restricted
    assert launch_of(PairConfig(), "decode", platform).env["CUDA_VISIBLE_DEVICES"] == "6,7"


@pytest.mark.compat
def test_explicit_devices() -> None:
    platform = cuda(8, "4,5,6,7")
    config = PairConfig(prefill_devices=[0, 1, 2], decode_devices=["GPU-1f2e"])  # ints index the visible ones
    assert pair_devices(platform, config.prefill_devices, config.decode_devices) == PairDevices(
        ("4", "5", "6"), ("GPU-1f2e",)
    )
    p, d = (launch_of(config, role, platform) for role in ("prefill", "decode"))
    assert p.env["CUDA_VISIBLE_DEVICES"] == "4,5,6" and p.engine_args["tensor_parallel_size"] == 3
    assert d.env["CUDA_VISIBLE_DEVICES"] == "GPU-1f2e" and d.engine_args["tensor_parallel_size"] == 1
    assert "gpu_memory_utilization" not in p.engine_args
    with pytest.raises(UserError, match=r"index 4 is not among the 4 visible GPUs \(4, 5, 6, 7\)"):
        launch_of(PairConfig(prefill_devices=[4], decode_devices=[0]), "prefill", platform)
    with pytest.raises(UserError, match="names a device twice"):
        pair_devices(platform, [0, "4"], [1])
    with pytest.raises(UserError, match="go together"):
        PairConfig(prefill_devices=[0])
    with pytest.raises(UserError, match="non-empty list"):
        PairConfig(prefill_devices=[], decode_devices=[1])
    with pytest.raises(UserError, match="non-empty list"):
        PairConfig(prefill_devices=0, decode_devices=1)  # type: ignore[arg-type]
    with pytest.raises(UserError, match="CPU platform"):  # GPUs asked for on a CPU host
        launch_of(PairConfig(prefill_devices=[0], decode_devices=[1]), "prefill", CPU_PLATFORM)


@pytest.mark.compat
def test_p_and_d_on_one_gpu_split_its_memory_explicitly() -> None:
    shared = PairConfig(prefill_devices=[0], decode_devices=[0])
    for role in ("prefill", "decode"):
        launch = launch_of(shared, role, cuda(1))
        assert launch.env["CUDA_VISIBLE_DEVICES"] == "0" and launch.engine_args["tensor_parallel_size"] == 1
        assert launch.engine_args["gpu_memory_utilization"] == SHARED_DEVICE_MEMORY_FRACTION
    uneven = PairConfig(
        prefill_devices=[0],
        decode_devices=[0],
        prefill_engine_args={"gpu_memory_utilization": 0.3},
        decode_engine_args={"gpu_memory_utilization": 0.6},
    )
    assert launch_of(uneven, "decode", cuda(1)).engine_args["gpu_memory_utilization"] == 0.6
    too_much = PairConfig(prefill_devices=[0], decode_devices=[0], prefill_engine_args={"gpu_memory_utilization": 0.7})
    with pytest.raises(UserError, match=r"share GPU\(s\) 0.*0.7 and 0.45"):
        launch_of(too_much, "decode", cuda(1))


@pytest.mark.compat
def test_pairs_of_a_serve_get_their_own_gpus() -> None:
    assert split_devices_among_pairs(2, cuda(8)) == [
        PairDevices(("0", "1"), ("2", "3")),
        PairDevices(("4", "5"), ("6", "7")),
    ]
    assert split_devices_among_pairs(3, cuda(6, "0,1,2,3,4,5"))[2] == PairDevices(("4",), ("5",))
    with pytest.raises(UserError, match="2 pairs need at least 4 GPUs"):
        split_devices_among_pairs(2, cuda(3))


# ----------------------------------------------------------------- the pair's start on a GPU host, wired through


@pytest.mark.anyio
@pytest.mark.compat
async def test_an_embedded_pair_on_a_gpu_host_starts_each_engine_on_its_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[EngineLaunch] = []

    async def model(*args: Any, **kwargs: Any) -> Path:
        return MODEL

    async def start_async(self: AsyncLLMRunner, progress: Any) -> None:  # the engine, not started: recorded
        started.append(self.launch)
        cache = SimpleNamespace(block_size=16, num_gpu_blocks=100)
        self._llm = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache), errored=False)  # type: ignore[assignment]

    monkeypatch.setattr("agentkv._engines._pair.prepare_model_off_loop", model)
    monkeypatch.setattr("agentkv._engines._pair.current_platform", lambda: cuda(4))
    monkeypatch.setattr("agentkv._engines._pair.CoreTable", None)  # no core table on a GPU host
    monkeypatch.setattr(AsyncLLMRunner, "start_async", start_async)
    async with EmbeddedPair(warmup=False, engine_args={"max_num_seqs": 32}) as pair:
        info = pair.info.details
    assert [launch.env["CUDA_VISIBLE_DEVICES"] for launch in started] == ["0,1", "2,3"]
    assert [launch.engine_args["max_num_seqs"] for launch in started] == [32, 32]
    assert all(launch.cores is None and "AGENTKV_CORE_TABLE" not in launch.env for launch in started)
    assert info["platform"] == "cuda" and info["prefill_devices"] == ["0", "1"] and "core_policy" not in info

    with pytest.raises(UserError, match="prefill_devices"):
        async with EmbeddedPair(warmup=False, cores=([0], [1])):
            pass


@pytest.mark.compat
def test_a_launched_pair_gives_each_server_its_gpus(tmp_path: Path) -> None:
    pair = LaunchedPair(prefill_engine_args={"max_num_seqs": 8}, log_dir=tmp_path)
    pair._platform = cuda(2)
    pair._devices = pair_devices(pair._platform)
    servers = {role: pair._server(role, MODEL, []) for role in ("prefill", "decode")}
    for role, device in (("prefill", "0"), ("decode", "1")):
        spec = servers[role].spec  # type: ignore[index]
        assert server_env(spec)["CUDA_VISIBLE_DEVICES"] == device and spec.cores is None
        command = server_command(spec)
        assert command[command.index("--tensor-parallel-size") + 1] == "1"
        assert ("--max-num-seqs" in command) == (role == "prefill")


# ----------------------------------------------------------------- the user's vLLM engine arguments


def test_engine_args_go_over_agentkvs_per_role(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pair_config, "vllm_engine_arg_names", lambda: None)  # names checked below, with vLLM
    config = PairConfig(
        engine_args={"max_num_seqs": 8, "block_size": 32},
        decode_engine_args={"enforce_eager": False, "max_num_seqs": 16},
    )
    p, d = (launch_of(config, role, CPU_PLATFORM, cores=[0]) for role in ("prefill", "decode"))
    assert p.engine_args["max_num_seqs"] == 8 and p.engine_args["enforce_eager"] is True
    assert d.engine_args["max_num_seqs"] == 16 and d.engine_args["enforce_eager"] is False
    assert p.engine_args["block_size"] == d.engine_args["block_size"] == 32
    command = server_command(ServerSpec(role="decode", launch=d, port=8000))
    assert "--no-enforce-eager" in command and "--enforce-eager" not in command
    assert command.count("--max-num-seqs") == 1 and command[command.index("--max-num-seqs") + 1] == "16"
    tp = PairConfig(engine_args={"tensor_parallel_size": 1}, prefill_engine_args={"tensor_parallel_size": 2})
    assert launch_of(tp, "decode", cuda(4)).engine_args["tensor_parallel_size"] == 1
    assert launch_of(tp, "prefill", cuda(4)).engine_args["tensor_parallel_size"] == 2
    assert vllm_flags({"cudagraph_capture_sizes": [1, 2, 4], "compilation_config": {"mode": 3}}) == [
        "--cudagraph-capture-sizes",
        "1",
        "2",
        "4",
        "--compilation-config",
        '{"mode": 3}',
    ]


def test_p_schedules_by_priority_so_that_pin_releases_go_first_unless_the_user_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_pair_config, "vllm_engine_arg_names", lambda: None)
    p = launch_of(PairConfig(), "prefill", cuda(2))
    assert p.engine_args["scheduling_policy"] == "priority"  # on every platform, not only this CPU
    assert "scheduling_policy" not in launch_of(PairConfig(), "decode", CPU_PLATFORM, cores=[0]).engine_args
    command = server_command(ServerSpec(role="prefill", launch=p, port=8000))
    assert command[command.index("--scheduling-policy") + 1] == "priority"  # a launched P too
    fcfs = PairConfig(prefill_engine_args={"scheduling_policy": "fcfs"})
    assert launch_of(fcfs, "prefill", CPU_PLATFORM, cores=[0]).engine_args["scheduling_policy"] == "fcfs"


@pytest.mark.parametrize("name", [*OWNED_ENGINE_ARGS, "kv-transfer-config", "kv_connector_extra_config"])
def test_engine_args_agentkv_owns_are_refused_by_name(name: str) -> None:
    for setting in ("engine_args", "prefill_engine_args", "decode_engine_args"):
        with pytest.raises(UserError, match=rf"{setting} may not set what agentkv owns \({name}: "):
            PairConfig(**{setting: {name: 1}})
    with pytest.raises(UserError, match=name):
        Colocated(engine_args={name: 1})


def test_unknown_engine_args_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pair_config, "vllm_engine_arg_names", lambda: frozenset({"tensor_parallel_size"}))
    with pytest.raises(UserError, match=r"tensor_paralel_size \(did you mean tensor_parallel_size\?\)"):
        PairConfig(engine_args={"tensor_paralel_size": 2})
    with pytest.raises(UserError, match="decode_engine_args: not vLLM engine arguments.*: warp_speed"):
        PairConfig(decode_engine_args={"warp_speed": 9})
    with pytest.raises(UserError, match="a mapping"):
        PairConfig(engine_args=["tensor_parallel_size"])  # type: ignore[arg-type]
    monkeypatch.setattr(_pair_config, "vllm_engine_arg_names", lambda: None)  # no vLLM here: names pass
    assert PairConfig(engine_args={"warp_speed": 9}).engine_args == {"warp_speed": 9}


# ----------------------------------------------------------------- ``--`` on the command line (vLLM's parser)


def test_the_words_after_dashes_are_parsed_by_vllms_parser() -> None:
    """One test imports vLLM's argument parser (seconds): names checked against AsyncEngineArgs, types vLLM's."""
    assert _pair_config.vllm_engine_arg_names() is not None and "tensor_parallel_size" in (
        _pair_config.vllm_engine_arg_names() or ()
    )
    parsed = parse_vllm_flags(
        ["--tensor-parallel-size", "2", "--no-enforce-eager", "--max-num-seqs=8", "--gpu-memory-utilization", "0.5"]
    )
    assert parsed == {
        "tensor_parallel_size": 2,
        "enforce_eager": False,
        "max_num_seqs": 8,
        "gpu_memory_utilization": 0.5,
    }
    config = parse_vllm_flags(["--compilation-config", '{"mode": 3}'])["compilation_config"]
    assert config == {"mode": 3}  # plain data (no config object, no enums): a launched server gets it as JSON
    with pytest.raises(UserError, match="unrecognized arguments: --warp-speed"):
        parse_vllm_flags(["--warp-speed", "9"])
    with pytest.raises(UserError, match=r"not vLLM engine arguments .*: warp_speed"):
        PairConfig(engine_args={"warp_speed": 9})
    assert _cli._split_at_dashes(["engine", "--role", "decode", "--", "-tp", "2"]) == (
        ["engine", "--role", "decode"],
        ["-tp", "2"],
    )
    assert _cli._split_at_dashes(["chat"]) == (["chat"], None)


def _exec_instead(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    ran: dict[str, Any] = {}

    def exec_instead(file: str, args: list[str], env: dict[str, str]) -> None:
        ran.update(args=args, env=env)
        raise SystemExit(0)

    monkeypatch.setattr("os.execvpe", exec_instead)
    return ran


ENGINE = ["engine", "--role", "prefill", "--nixl-host", "10.0.0.1", "--cores", "0"]


def test_agentkv_engine_passes_the_words_after_dashes_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = _exec_instead(monkeypatch)
    with pytest.raises(SystemExit):
        main([*ENGINE, "--", "--tensor-parallel-size", "2", "--no-enforce-eager"])
    args = ran["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert "--no-enforce-eager" in args and "--enforce-eager" not in args
    assert ran["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"  # the CPU settings stay


@pytest.mark.parametrize(
    ("words", "said"),
    [
        (["--kv-transfer-config", "{}"], "may not set what agentkv owns (kv_transfer_config"),
        (["--model", "other"], "may not set what agentkv owns (model"),
        (["--max-model-len", "8192"], "max_model_len: use max_model_len="),
        (["--warp-speed", "9"], "unrecognized arguments: --warp-speed"),
    ],
)
def test_agentkv_engine_refuses_words_after_dashes_by_name(
    words: list[str], said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran = _exec_instead(monkeypatch)
    assert main([*ENGINE, "--", *words]) == 2
    assert said in capsys.readouterr().err and not ran


def test_only_engine_serve_smoke_and_bench_take_words_after_dashes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chat", "--", "--max-num-seqs", "8"]) == 2
    assert "only agentkv engine, agentkv serve, agentkv smoke and agentkv bench" in capsys.readouterr().err


def _serve_engine(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> dict[str, Any]:
    """What ``agentkv serve ARGV`` would give its pool as its engine (nothing is served)."""
    got: dict[str, Any] = {}

    def serve(args: argparse.Namespace) -> int:
        got.update(_cli_pairs.engine_options(args))
        return 0

    monkeypatch.setattr(_cli_serve, "_serve", serve)
    assert main(["serve", *argv]) == 0
    return got


def test_agentkv_serve_gives_the_words_after_dashes_to_both_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pair_config, "vllm_engine_arg_names", lambda: None)
    monkeypatch.setattr("agentkv._engines._server_process.parse_vllm_flags", lambda words: {"max_num_seqs": 8})
    own = _serve_engine(monkeypatch, ["--", "--max-num-seqs", "8"])
    assert own == {"model": None, "engine_options": {"engine_args": {"max_num_seqs": 8}}}  # the pool's own pair
    launched = _serve_engine(monkeypatch, ["--engine", "launched", "--", "--max-num-seqs", "8"])["engine"]
    assert isinstance(launched, LaunchedPair) and launched.config.engine_args == {"max_num_seqs": 8}
    assert _serve_engine(monkeypatch, []) == {"model": None}


def test_agentkv_serve_refuses_words_after_dashes_for_remote_servers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--remote", "http://p", "http://d", "--", "--max-num-seqs", "8"]) == 2
    assert "--remote take their vLLM arguments and devices where they start" in capsys.readouterr().err


def test_agentkv_serve_splits_the_gpus_among_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cli_pairs, "current_platform", lambda: cuda(8))
    group = _serve_engine(monkeypatch, ["--pairs", "2"])["engine"]
    configs = [member.engine.config for member in group._members]
    assert [(c.prefill_devices, c.decode_devices, c.cores) for c in configs] == [
        (("0", "1"), ("2", "3"), None),
        (("4", "5"), ("6", "7"), None),
    ]


def test_agentkv_serve_puts_its_pair_on_the_devices_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--prefill-devices`` / ``--decode-devices`` (one definition for serve, smoke, bench and engine)."""
    own = _serve_engine(monkeypatch, ["--prefill-devices", "0", "--decode-devices", "GPU-b"])
    assert own == {"model": None, "engine_options": {"prefill_devices": [0], "decode_devices": ["GPU-b"]}}
    launched = _serve_engine(monkeypatch, ["--engine", "launched", "--prefill-devices", "0,1", "--decode-devices", "2"])
    assert launched["engine"].config.prefill_devices == (0, 1) and launched["engine"].config.decode_devices == (2,)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["serve", "--pairs", "2", "--prefill-devices", "0", "--decode-devices", "1"],
            "--pairs splits the visible GPUs",
        ),
        (["serve", "--remote", "http://p", "http://d", "--prefill-devices", "0"], "vLLM arguments and devices"),
        (
            ["engine", "--role", "prefill", "--nixl-host", "h", "--decode-devices", "1"],
            "--decode-devices names the GPUs of",
        ),
        (
            ["engine", "--role", "decode", "--nixl-host", "h", "--decode-devices", "1"],
            "this host runs vLLM's CPU platform",
        ),
    ],
    ids=["serve-pairs", "serve-remote", "engine-other-role", "engine-on-cpu"],
)
def test_device_flags_that_cannot_apply_are_refused_by_name(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert said in capsys.readouterr().err


def test_agentkv_engine_runs_its_server_on_the_devices_of_its_role(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from agentkv._surfaces import _cli_host

    launched: dict[str, Any] = {}
    monkeypatch.setattr(_cli_host, "current_platform", lambda: cuda(4))
    monkeypatch.setattr(_cli_host, "prepare_model", lambda model, progress: MODEL)
    monkeypatch.setattr(_cli_host.os, "execvpe", lambda _file, command, env: launched.update(env=env, command=command))
    main(["engine", "--role", "decode", "--nixl-host", "10.0.0.2", "--decode-devices", "2,3"])
    assert launched["env"]["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_agentkv_bench_takes_the_model_devices_and_vllm_arguments_as_serve_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import agentkv._bench as bench

    asked: dict[str, Any] = {}

    def run_bench_sync(workload: Any, **options: Any) -> Any:
        asked.update(options)
        raise UserError("measured nothing")

    monkeypatch.setattr(bench, "run_bench_sync", run_bench_sync)
    monkeypatch.setattr("agentkv._engines._server_process.parse_vllm_flags", lambda words: {"max_num_seqs": 8})
    monkeypatch.setattr(_pair_config, "vllm_engine_arg_names", lambda: None)
    argv = ["bench", "--model", "Qwen/Qwen3-0.6B", "--prefill-devices", "0", "--decode-devices", "1"]
    assert main([*argv, "--", "--max-num-seqs", "8"]) == 2
    assert asked["model"] == "Qwen/Qwen3-0.6B" and asked["engine_args"] == {"max_num_seqs": 8}
    assert asked["prefill_devices"] == [0] and asked["decode_devices"] == [1]


@pytest.mark.compat
def test_the_cuda_build_on_a_host_without_a_gpu_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentkv._engines import _platforms

    versions = {"vllm": "0.33.0", "torch": "2.14.0+cu130"}
    monkeypatch.setattr(_platforms, "_installed", versions.get)
    said = _platforms.no_platform_message("UnspecifiedPlatform")
    assert said.startswith("no GPU found by vLLM's CUDA build (vLLM 0.33.0, torch 2.14.0+cu130); on a CPU host")
    assert "pip install 'agentkv-vllm[cpu]'" in said
    assert "this host's is RocmPlatform" in _platforms.no_platform_message("RocmPlatform")


@pytest.mark.parametrize(
    ("versions", "device_files", "refused"),
    [
        ({"vllm": "0.33.0", "torch": "2.14.0"}, (), True),
        ({"vllm": "0.33.0", "torch": "2.14.0+cu130"}, ("/dev/nvidiactl",), False),
        ({"vllm": "0.33.0", "torch": "2.14.0"}, ("/dev/dxg",), False),  # WSL 2's GPU
        ({"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"}, (), False),
        ({"vllm": "0.33.0", "torch": "2.14.0+rocm6.4"}, (), False),  # not CUDA: vLLM decides
    ],
    ids=["cuda-build-no-gpu", "cuda-build-gpu", "wsl", "cpu-build", "rocm-build"],
)
@pytest.mark.compat
def test_the_cuda_build_without_a_gpu_is_refused_before_vllm_is_imported(
    monkeypatch: pytest.MonkeyPatch, versions: dict[str, str], device_files: tuple[str, ...], refused: bool
) -> None:
    """What took 95 s before (the model prepared, then vLLM's platform read) is said from the installed versions
    and the device files, before vLLM's import."""
    from agentkv._engines import _platforms

    monkeypatch.setattr(_platforms, "_installed", versions.get)
    monkeypatch.setattr(_platforms.os.path, "exists", lambda path: path in device_files)
    assert _platforms._cuda_build_without_a_gpu() is refused
    if refused:
        with pytest.raises(UserError, match="^no GPU found by vLLM's CUDA build"):
            current_platform()


def test_a_vllm_parser_that_fails_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CUDA build parsing its arguments on a host without a GPU raised ``RuntimeError: Failed to infer
    device type``; every failure of its parser is the command line's error, with what vLLM said."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    def fail(parser: Any) -> Any:
        raise RuntimeError("Failed to infer device type")

    monkeypatch.setattr(AsyncEngineArgs, "add_cli_args", staticmethod(fail))
    with pytest.raises(UserError, match=r"vLLM could not read the engine arguments after -- \(RuntimeError: Failed"):
        parse_vllm_flags(["--max-num-seqs", "8"])
