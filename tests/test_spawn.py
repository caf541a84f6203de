"""An engine's turn to start its process with its environment (src/agentkv/_engines/_spawn.py), on plain child
processes: the turn ends when the child (a multiprocessing process, as vLLM's engine core is) exists, the child keeps the engine's environment, the next turn starts
while the first engine still waits, vLLM's and NIXL's logs are kept to warnings unless the caller asked, and
what the engine processes print goes to the engine log, not to the caller's terminal."""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from agentkv._engines._spawn import OUTPUT_VARIABLE, QUIET, engine_output, quiet_env, spawn_turn

VARIABLE = "AGENTKV_TEST_SPAWN_TURN"
_SPAWN = multiprocessing.get_context("spawn")  # as vLLM starts its engine core on this machine


def _report(go: Connection) -> None:
    """A stand-in engine core: waits for the word, then sends what it inherited."""
    go.recv()
    go.send(os.environ.get(VARIABLE))


def _speak(go: Connection) -> None:
    """A stand-in engine core that waits for the word (its turn is over by then), then prints on both outputs."""
    go.recv()
    print("engine out", flush=True)
    print("engine err", file=sys.stderr, flush=True)
    go.send(None)


class _Child:
    """A multiprocessing child that runs ``target`` with one end of a pipe."""

    def __init__(self, target: Callable[[Connection], None]) -> None:
        self._here, there = _SPAWN.Pipe()
        self.process = _SPAWN.Process(target=target, args=(there,))
        self.process.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def finish(self) -> object:
        """Say the word; what the child sent back."""
        self._here.send(None)
        answer = self._here.recv()
        self.process.join(30)
        return answer


def _wait_for(condition: object, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not callable(condition) or not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def _no_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    monkeypatch.setenv(OUTPUT_VARIABLE, str(tmp_path / "engines.log"))


def test_what_an_engine_prints_goes_to_the_engine_log_not_to_the_callers_outputs(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    print("caller before", flush=True)
    with spawn_turn({}) as turn:
        child = _Child(_speak)
        _wait_for(lambda: turn.cores)
        print("caller after", flush=True)  # the turn is over: this process's output is its own again
        child.finish()
    assert turn.log_path == tmp_path / "engines.log"
    logged = turn.log_path.read_text()
    assert "engine out" in logged and "engine err" in logged
    seen = capfd.readouterr()
    assert seen.out.split() == ["caller", "before", "caller", "after"] and seen.err == ""


def test_a_dash_leaves_the_engines_output_inherited(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(OUTPUT_VARIABLE, "-")
    with spawn_turn({}) as turn:
        _Child(_speak).finish()
    seen = capfd.readouterr()
    assert turn.log_path is None and (seen.out, seen.err) == ("engine out\n", "engine err\n")


def test_the_engine_log_is_under_agentkv_home_by_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(OUTPUT_VARIABLE)
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path))
    assert engine_output() == tmp_path / "logs" / f"engines-{os.getpid()}.log"


@pytest.mark.timeout(60)  # a turn held to the block's end would never let the second one start
def test_the_turn_ends_when_the_child_exists_and_the_next_starts_while_the_first_waits() -> None:
    with spawn_turn({VARIABLE: "first"}) as first:
        child = _Child(_report)
        _wait_for(lambda: first.cores)  # handed on while this block (an engine waiting for its core) goes on
        assert first.cores == first.processes() == {child.pid}
        assert VARIABLE not in os.environ  # the process's own environment is back
        with spawn_turn({VARIABLE: "second"}) as second:  # another engine's turn, not waiting for this block
            other = _Child(_report)
            _wait_for(lambda: second.cores)
        assert second.cores == {other.pid}
        assert (child.finish(), other.finish()) == ("first", "second")
    assert VARIABLE not in os.environ


@pytest.mark.timeout(60)
def test_a_command_the_build_runs_before_its_core_does_not_end_the_turn() -> None:
    """vLLM's build runs ``lscpu`` through a shell before it starts its engine core: the turn is the core's, so the
    core still gets the engine's environment (a watcher that took any new child handed on at the command)."""
    with spawn_turn({VARIABLE: "engine"}) as turn:
        command = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])  # seen by the watcher
        time.sleep(0.3)
        assert not turn.cores and os.environ[VARIABLE] == "engine"
        command.wait(30)
        core = _Child(_report)
        _wait_for(lambda: turn.cores)
    assert turn.cores == {core.pid} and command.pid not in turn.processes()
    assert core.finish() == "engine"


def test_a_build_that_makes_no_process_ends_its_turn_at_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VARIABLE, "the caller's")
    with pytest.raises(RuntimeError), spawn_turn({VARIABLE: "engine"}) as turn:
        assert os.environ[VARIABLE] == "engine"
        raise RuntimeError("the engine's configuration was refused")
    assert turn.cores == set() and os.environ[VARIABLE] == "the caller's"
    with spawn_turn({}) as again:  # the turn is free
        pass
    assert again.cores == set()


@pytest.fixture
def vllm_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("vllm")
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_engines_log_warnings_only_unless_the_caller_set_the_levels(
    monkeypatch: pytest.MonkeyPatch, vllm_logger: logging.Logger
) -> None:
    for key in QUIET:
        monkeypatch.delenv(key, raising=False)
    vllm_logger.setLevel(logging.INFO)
    assert quiet_env() == {"VLLM_LOGGING_LEVEL": "WARNING", "NIXL_LOG_LEVEL": "WARN"}
    assert vllm_logger.level == logging.WARNING  # vLLM's logger in this process too

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")  # the caller wants vLLM's start-up log
    vllm_logger.setLevel(logging.INFO)
    assert quiet_env() == {"NIXL_LOG_LEVEL": "WARN"}
    assert vllm_logger.level == logging.INFO
