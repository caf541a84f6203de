"""agentkv's patches of vLLM and NIXL internals (``_vllm_patches.py``): the version gate, the
environment that switches the idle-loop patches on, and that every patch still finds its target.

That the patched pair really sleeps is checked on the real pair (test_pair.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from typing import Any

import pytest

from agentkv import EngineStartError
from agentkv._engines import _vllm_patches
from agentkv._engines._vllm_patches import (
    ENGINE_ENV,
    NIXL_DELAY_ENV,
    PARKED_POLL_ENV,
    SUPPORTED_VLLM,
    _BindingsWithDelay,
    check_vllm_version,
    engine_env,
)


def test_only_the_supported_vllm_series_passes() -> None:
    for version in (f"{SUPPORTED_VLLM}.0", f"{SUPPORTED_VLLM}.3", f"{SUPPORTED_VLLM}.0+cpu"):
        check_vllm_version(version)
    for version in ("0.31.2", "0.33.0", "1.0.0", "0.3.2"):
        with pytest.raises(EngineStartError, match=f"supports vLLM {SUPPORTED_VLLM}.x only"):
            check_vllm_version(version)
    check_vllm_version()  # the installed one


def test_the_environment_marks_agentkvs_engines_and_names_both_intervals() -> None:
    assert engine_env(None) == {ENGINE_ENV: "1"}
    assert engine_env(50) == {ENGINE_ENV: "1", NIXL_DELAY_ENV: "50000", PARKED_POLL_ENV: "50"}


def test_agents_get_the_delay_and_everything_else_is_nixls() -> None:
    made: list[tuple[str, Any]] = []

    class Config:
        pthrDelay = 0

    class Bindings:
        OTHER = "untouched"

        @staticmethod
        def nixlAgent(name: str, config: Any) -> str:  # noqa: N802
            made.append((name, config.pthrDelay))
            return "agent"

    bindings = _BindingsWithDelay(Bindings(), 20_000)
    assert bindings.nixlAgent("a", Config()) == "agent"
    assert made == [("a", 20_000)] and bindings.OTHER == "untouched"


def test_vllm_loads_the_plugin() -> None:
    names = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "agentkv._engines._vllm_patches:install" in names


def _run(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=300
    )


def test_every_patch_finds_its_target_in_a_fresh_process() -> None:
    """Against the installed nixl and vLLM: a version that moved a target fails here, not silently."""
    script = """
        import inspect
        import nixl._api
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState
        from vllm.v1.engine.output_processor import OutputProcessor
        from agentkv._engines import _vllm_patches as patches

        step = EngineCoreProc._process_engine_step
        handle_shutdown = EngineCoreProc._handle_shutdown
        assert "has_work" in inspect.getsource(handle_shutdown) and EngineShutdownState.SHUTTING_DOWN
        patches.install()
        assert EngineCoreProc._handle_shutdown is not handle_shutdown
        assert isinstance(nixl._api.nixlBind, patches._BindingsWithDelay)
        assert nixl._api.nixlBind.nixlAgentConfig().pthrDelay == 0  # the field nixl sets exists
        assert EngineCoreProc._process_engine_step is not step
        assert SpinCondition.__init__.__name__ == "init_with_short_spin"
        source = inspect.getsource(EngineCoreProc) + inspect.getsource(EngineCoreProc.__mro__[1])
        for name in ("engines_running", "batch_queue", "scheduler", "input_queue", "_handle_client_request"):
            assert f"self.{name}" in source, name
        patches.install()  # twice is harmless

        assert "prefill_stats" in inspect.getsource(OutputProcessor.process_outputs)
        assert "stat_loggers" in inspect.signature(AsyncLLM.from_vllm_config).parameters
        stream = OpenAIServingCompletion.completion_stream_generator
        patches.add_server_readouts(extras_field="x", extras=dict, stat_logger=object, prefill_stats={})
        assert OpenAIServingCompletion.completion_stream_generator is not stream
        print("ok")
    """
    done = _run(script, {**os.environ, **engine_env(50)})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_install_without_the_environment_changes_nothing() -> None:
    script = """
        import nixl._api as a
        from vllm.v1.engine.core import EngineCoreProc
        b, handle_shutdown = a.nixlBind, EngineCoreProc._handle_shutdown
        from agentkv._engines import _vllm_patches
        _vllm_patches.install()
        assert a.nixlBind is b and EngineCoreProc._handle_shutdown is handle_shutdown
    """
    env = {k: v for k, v in os.environ.items() if k not in (ENGINE_ENV, NIXL_DELAY_ENV, PARKED_POLL_ENV)}
    done = _run(script, env)
    assert done.returncode == 0, done.stderr[-3000:]


def _core(*statuses: str, running: bool = False) -> Any:
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    requests = {
        str(i): SimpleNamespace(status=RequestStatus[name], is_finished=lambda name=name: name.startswith("FINISHED"))
        for i, name in enumerate(statuses)
    }
    scheduler = SimpleNamespace(
        requests=requests,
        running=[object()] if running else [],
        finished_req_ids=set(),
        finished_recving_kv_req_ids=set(),
        failed_recving_kv_req_ids=set(),
        has_unfinished_requests=lambda: any(not r.is_finished() for r in requests.values()),
    )
    return SimpleNamespace(scheduler=scheduler, engines_running=False, batch_queue=None)


def test_an_engine_waiting_only_for_remote_kv_steps_at_once_then_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pull's short wait is picked up at once; a push D waiting for P's prefill stops busy-looping."""
    clock = [100.0]
    monkeypatch.setattr(_vllm_patches.time, "monotonic", lambda: clock[0])
    core = _core("WAITING_FOR_REMOTE_KVS", "FINISHED_LENGTH_CAPPED")
    assert _vllm_patches._idle_wait_s(core, parked_poll_s=0.05) is None
    clock[0] += _vllm_patches.KV_WAIT_BUSY_S / 2
    assert _vllm_patches._idle_wait_s(core, parked_poll_s=0.05) is None
    clock[0] += _vllm_patches.KV_WAIT_BUSY_S
    assert _vllm_patches._idle_wait_s(core, parked_poll_s=0.05) == _vllm_patches.KV_WAIT_POLL_S
    core.scheduler.finished_recving_kv_req_ids.add("0")  # its KV is in: the next step schedules it, at once
    assert _vllm_patches._idle_wait_s(core, parked_poll_s=0.05) is None
    core.scheduler.finished_recving_kv_req_ids.clear()
    assert _vllm_patches._idle_wait_s(core, parked_poll_s=0.05) is None  # a new wait: busy again at first
    busy = _core("WAITING_FOR_REMOTE_KVS", "RUNNING", running=True)  # something else to run: never wait
    assert _vllm_patches._idle_wait_s(busy, parked_poll_s=0.05) is None
    assert _vllm_patches._idle_wait_s(_core("FINISHED_STOPPED"), parked_poll_s=0.05) == 0.05  # only parked KV
    assert _vllm_patches._idle_wait_s(_core("WAITING"), parked_poll_s=0.05) is None  # a request to schedule
