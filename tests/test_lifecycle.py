"""No leaks: closing, dying, interrupting and exiting leave no engine process or port behind."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from agentkv import EmbeddedPair, EngineDeadError, Session
from agentkv._engines._system import alive, listening_ports
from agentkv.testing import ScriptedEngine

SYSTEM = "You are terse."


def _engine_core_pid(pids: set[int]) -> int:
    """The engine-core process among an engine's processes: the one that is our direct child."""
    for pid in pids:
        with open(f"/proc/{pid}/stat") as handle:
            if int(handle.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                return pid
    raise AssertionError(f"no engine core among {pids}")


@pytest.mark.pair
def test_a_dead_engine_is_replaced_and_nothing_leaks() -> None:
    """The session starts its own pair, loses D, and starts another for the next turn."""
    with Session(system=SYSTEM, max_tokens=8, engine_options={"max_model_len": 1024, "pin_ttl_s": 30}) as own:
        first = own.engine
        assert isinstance(first, EmbeddedPair)
        own.run_sync("What is 2 + 2?")
        first_pids, ports = first.pids, list(first.ports)

        os.kill(_engine_core_pid(first._d.pids if first._d else set()), signal.SIGKILL)  # D's engine core dies
        before = own.messages
        with pytest.raises(EngineDeadError):
            own.run_sync("And 3 + 3?")
        assert own.messages == before
        assert alive(first_pids) == set()  # the dead pair's other processes were stopped too

        again = own.run_sync("And 3 + 3?")  # the session starts a new pair; the conversation goes on
        assert again.text and own.engine is not first
        assert [m.role for m in own.messages][-4:] == ["user", "assistant", "user", "assistant"]
        second = own.engine
        assert isinstance(second, EmbeddedPair)
        assert not set(second.ports) & set(ports)
        second_pids, ports = second.pids, ports + list(second.ports)
    assert alive(second_pids) == set()
    assert not set(ports) & listening_ports()


@pytest.mark.pair
@pytest.mark.parametrize("ending", ["exit", "sigkill"])
def test_a_process_that_ends_without_closing_leaves_no_engine(ending: str) -> None:
    """A normal exit stops the engine (exit handler); SIGKILL of the parent too (the watchdog)."""
    script = textwrap.dedent(f"""
        import os, signal
        from agentkv import Colocated
        engine = Colocated(max_model_len=512, warmup=False)
        engine.__enter__()  # opened, never closed
        print("PIDS", *sorted(engine.pids), flush=True)
        if {ending!r} == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == (0 if ending == "exit" else -signal.SIGKILL), done.stderr[-3000:]
    marked = [line for line in done.stdout.splitlines() if line.startswith("PIDS ")]
    pids = {int(pid) for pid in marked[0].split()[1:]}
    assert pids
    deadline = time.monotonic() + 20
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive(pids) == set()


def test_ctrl_c_during_a_turn_cancels_it_and_keeps_the_conversation() -> None:
    with ScriptedEngine(["first", "never seen", "second"], delay_s=0.3) as engine, Session(engine=engine) as session:
        session.run_sync("one")
        before = session.token_ids
        engine._delay_s = 30  # the next step hangs until interrupted
        # Python raises KeyboardInterrupt wherever the main thread is; inside a __del__ that the
        # garbage collector runs (objects of earlier tests) it is printed and lost. No collection
        # may run in the main thread while it waits for Ctrl-C here.
        gc.collect()
        gc.disable()
        try:
            threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
            started = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                session.run_sync("two")
        finally:
            gc.enable()
        assert time.monotonic() - started < 10
        assert session.token_ids == before
        engine._delay_s = 0
        assert session.run_sync("two").text == "never seen"  # the interrupted step consumed nothing


@pytest.mark.pair
def test_launched_servers_do_not_outlive_a_killed_parent() -> None:
    """The servers of a LaunchedPair run in their own sessions; the watchdog still stops them."""
    script = textwrap.dedent("""
        import os, signal
        from agentkv import LaunchedPair
        pair = LaunchedPair(max_model_len=512, warmup=False)
        pair.__enter__()
        print("PIDS", *sorted(pair.pids), flush=True)
        print("PORTS", *pair.ports, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    lines = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines() if line[:4] in ("PIDS", "PORT")}
    pids, ports = {int(pid) for pid in lines["PIDS"]}, {int(port) for port in lines["PORTS"]}
    assert len(pids) >= 4  # two servers, each with an engine core and a worker at least
    deadline = time.monotonic() + 30
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive(pids) == set()
    assert not ports & listening_ports()
