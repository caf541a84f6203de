"""The idle-loop plugin: its environment, and that its patches still find their targets.

That the patched pair really sleeps is checked on the real pair (test_pair.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from typing import Any

from agentkv._engines._idle import NIXL_DELAY_ENV, PARKED_POLL_ENV, _BindingsWithDelay, idle_env


def test_the_environment_names_both_intervals() -> None:
    assert idle_env(None) == {}
    assert idle_env(50) == {NIXL_DELAY_ENV: "50000", PARKED_POLL_ENV: "50"}


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
    assert "agentkv._engines._idle:install" in names


def test_install_patches_nixl_and_vllm_in_a_fresh_process() -> None:
    """Against the installed nixl and vLLM: a version that moved a target fails here, not silently."""
    script = textwrap.dedent("""
        import inspect
        import nixl._api
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
        from vllm.v1.engine.core import EngineCoreProc
        from agentkv._engines import _idle

        step = EngineCoreProc._process_engine_step
        _idle.install()
        assert isinstance(nixl._api.nixlBind, _idle._BindingsWithDelay)
        assert nixl._api.nixlBind.nixlAgentConfig().pthrDelay == 0  # the field nixl sets exists
        assert EngineCoreProc._process_engine_step is not step
        assert SpinCondition.__init__.__name__ == "init_with_short_spin"
        source = inspect.getsource(EngineCoreProc) + inspect.getsource(EngineCoreProc.__mro__[1])
        for name in ("engines_running", "batch_queue", "scheduler", "input_queue", "_handle_client_request"):
            assert f"self.{name}" in source, name
        _idle.install()  # twice is harmless
        print("ok")
    """)
    env = {**os.environ, **idle_env(50)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_install_without_the_environment_changes_nothing() -> None:
    script = "import nixl._api as a; b = a.nixlBind; from agentkv._engines import _idle; _idle.install(); assert a.nixlBind is b"
    env = {k: v for k, v in os.environ.items() if k not in (NIXL_DELAY_ENV, PARKED_POLL_ENV)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
