"""An engine's turn to start its process with its environment (src/agentkv/_engines/_spawn.py), on plain child
processes: the turn ends when the child exists, the child keeps the engine's environment, the next turn starts
while the first engine still waits, and vLLM's and NIXL's logs are kept to warnings unless the caller asked."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from agentkv._engines._spawn import QUIET, quiet_env, spawn_turn

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


@pytest.fixture(autouse=True)
def _no_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)


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
