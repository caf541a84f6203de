"""An engine's turn to start its process with its environment (src/agentkv/_engines/_spawn.py), on plain child
processes: the turn ends when the child exists, the child keeps the engine's environment, the next turn starts
while the first engine still waits, vLLM's and NIXL's logs are kept to warnings unless the caller asked, and
what the engine processes print goes to the engine log, not to the caller's terminal."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentkv._engines._spawn import OUTPUT_VARIABLE, QUIET, engine_output, quiet_env, spawn_turn

VARIABLE = "AGENTKV_TEST_SPAWN_TURN"
PRINTS_IT = f"import os, sys; sys.stdin.read(); print(os.environ.get({VARIABLE!r}))"
"""A child that waits for its stdin to close, then prints what it inherited."""


def _child() -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", PRINTS_IT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _wait_for(condition: object, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not callable(condition) or not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


def _inherited(child: subprocess.Popen[str]) -> str:
    out, _ = child.communicate("", timeout=30)
    return out.strip()


SPEAKS = "import sys; sys.stdin.read(); print('engine out'); print('engine err', file=sys.stderr)"
"""A child that waits for its stdin to close (its turn is over by then), then prints on both of its outputs."""


@pytest.fixture(autouse=True)
def _no_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    monkeypatch.setenv(OUTPUT_VARIABLE, str(tmp_path / "engines.log"))


def _speaking_child() -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", SPEAKS], stdin=subprocess.PIPE, text=True)


def test_what_an_engine_prints_goes_to_the_engine_log_not_to_the_callers_outputs(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    print("caller before", flush=True)
    with spawn_turn({}) as turn:
        child = _speaking_child()
        _wait_for(lambda: turn.cores)
        print("caller after", flush=True)  # the turn is over: this process's output is its own again
        child.communicate("", timeout=30)
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
        _speaking_child().communicate("", timeout=30)
    seen = capfd.readouterr()
    assert turn.log_path is None and (seen.out, seen.err) == ("engine out\n", "engine err\n")


def test_the_engine_log_is_under_agentkv_home_by_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(OUTPUT_VARIABLE)
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path))
    assert engine_output() == tmp_path / "logs" / f"engines-{os.getpid()}.log"


@pytest.mark.timeout(60)  # a turn held to the block's end would never let the second one start
def test_the_turn_ends_when_the_child_exists_and_the_next_starts_while_the_first_waits() -> None:
    with spawn_turn({VARIABLE: "first"}) as first:
        child = _child()
        _wait_for(lambda: first.cores)  # handed on while this block (an engine waiting for its core) goes on
        assert first.cores == first.processes() == {child.pid}
        assert VARIABLE not in os.environ  # the process's own environment is back
        with spawn_turn({VARIABLE: "second"}) as second:  # another engine's turn, not waiting for this block
            other = _child()
            _wait_for(lambda: second.cores)
        assert second.cores == {other.pid}
        assert (_inherited(child), _inherited(other)) == ("first", "second")
    assert VARIABLE not in os.environ


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
