"""``agentkv serve`` stopped by signals, on its own real pair: a clean stop, always.

The landing's test starts one ``agentkv serve`` (a pair of its own, ``--max-model-len 2048``) and sends SIGINT
to its whole process group, as a terminal's Ctrl-C does, while a stream and a plain request are in flight: the
engine processes are in groups of their own and never get it (``run_engine_core_in_own_group`` in
``src/_agentkv_vllm/_patches.py``), the door ends both requests with errors their clients read, stops the pool
and then the engines, and exits 0 with nothing in its output that says otherwise, no process left, no port held.

Nightly, the other moments and signals, each on a start of its own: SIGINT to the group while the engines
start, SIGTERM to the door alone while they warm up, SIGINT twice in a row while idle, SIGTERM to the group
while streaming; and a Python script holding an engine that ends on an exception (Ctrl-C to its group).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from agentkv._engines._system import alive, free_port
from freed import assert_ports_freed, listening_ports, running_pids
from test_serve_pair import RECORD  # a tool whose forced arguments keep D decoding

pytestmark = pytest.mark.pair

START_S = 900.0
"""The most a pair's start may take here (two engines on a shared 2-core machine, and the engines lock)."""
STOP_S = 120.0
"""The most an orderly stop may take: the door, the pool, then each engine (agentkv gives one 30 s)."""
NOISE = ("Traceback", "leaked", "EngineDeadError", "exited unexpectedly", "force killing")
"""What a clean stop never writes (stdout or stderr)."""


@dataclass
class Serving:
    """One ``agentkv serve`` process (a group of its own), its output (stdout and stderr) as it comes, and what it
    started."""

    process: subprocess.Popen[str]
    url: str
    running_before: set[int]
    output: list[str] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)
    """The processes below the door (engine cores, workers, helpers), as last seen."""
    ports: set[int] = field(default_factory=set)
    """Ports the door and its processes listened on, as last seen."""

    def wait_for_line(self, text: str, *, within_s: float = START_S) -> None:
        deadline = time.monotonic() + within_s
        while not any(text in line for line in self.output):
            assert self.process.poll() is None, f"agentkv serve exited early:\n{''.join(self.output)[-4000:]}"
            assert time.monotonic() < deadline, f"no {text!r} within {within_s} s:\n{''.join(self.output)[-4000:]}"
            time.sleep(0.05)
        self.look()

    def wait_until_serving(self) -> None:
        self.wait_for_line("agentkv serve: http://")
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the door did not answer /health"
            time.sleep(0.2)
        self.look()

    def look(self) -> None:
        """Note the processes below the door and the ports they hold now (for the checks after the stop)."""
        try:
            children = {p.pid for p in psutil.Process(self.process.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            return
        self.pids |= children
        self.ports |= listening_ports(held_by=children | {self.process.pid})

    def signal(self, signum: int, *, group: bool) -> None:
        self.look()
        if group:
            os.killpg(self.process.pid, signum)
        else:
            self.process.send_signal(signum)

    def assert_stopped_cleanly(self, *, code: int) -> None:
        """Exit ``code`` within `STOP_S`, nothing in the output that a clean stop never writes, no process, no
        port."""
        try:
            returned = self.process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        output = "".join(self.output)
        assert returned == code, f"exit {returned}, not {code}:\n{output[-4000:]}"
        for noise in NOISE:
            assert noise not in output, f"{noise!r} in the output:\n{output[-4000:]}"
        assert self.pids, "no engine process was seen"
        deadline = time.monotonic() + 20  # the watchdog and the resource tracker outlive the door by seconds
        while alive(self.pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(self.pids) == set(), [psutil.Process(p).cmdline()[:3] for p in alive(self.pids)]
        assert_ports_freed(self.ports, running_before=self.running_before)


@pytest.fixture
def start_serving() -> Iterator[Callable[..., Serving]]:
    """Start ``agentkv serve`` on a pair of its own, in a process group of its own; kill what is left at the end."""
    started: list[tuple[Serving, threading.Thread]] = []

    def start(*extra: str) -> Serving:
        port = free_port()
        command = [sys.executable, "-m", "agentkv", "serve", "--max-model-len", "2048", "--store", "memory"]
        process = subprocess.Popen(
            [*command, "--port", str(port), "--max-tokens", "1024", *extra],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # one stream, in order: the start-up line is printed, progress is logged
            text=True,
            start_new_session=True,  # its own group: the signals to it spare pytest
        )
        serving = Serving(process, f"http://127.0.0.1:{port}", running_pids())
        collector = threading.Thread(target=_collect, args=(process, serving.output), daemon=True)
        collector.start()
        started.append((serving, collector))
        return serving

    yield start
    for serving, collector in started:
        if serving.process.poll() is None:
            os.killpg(serving.process.pid, signal.SIGKILL)
            serving.process.wait(timeout=30)
        for pid in alive(serving.pids):
            os.kill(pid, signal.SIGKILL)
        collector.join(timeout=30)
        assert serving.process.stdout is not None
        serving.process.stdout.close()


def _collect(process: subprocess.Popen[str], lines: list[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)


"""A tool whose call the grammar makes long (300 numbers of 6 digits or more): its step decodes until max_tokens,
some 1024 tokens, whatever the model would rather say: still running when the signal comes."""


def _ask(text: str, *, stream: bool) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "tools": [RECORD],
        "tool_choice": "required",
        "max_tokens": 1024,
        "stream": stream,
    }


@dataclass
class InFlight:
    """A streamed and a plain request running on the door, each on a thread of its own."""

    stream_lines: list[str] = field(default_factory=list)
    plain: list[httpx.Response] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, url: str) -> None:
        def streamed() -> None:
            with httpx.stream(
                "POST", url + "/v1/chat/completions", json=_ask("Record the numbers.", stream=True), timeout=STOP_S
            ) as answer:
                self.stream_lines.extend(answer.iter_lines())

        def plain() -> None:
            self.plain.append(
                httpx.post(
                    url + "/v1/chat/completions", json=_ask("Record more numbers.", stream=False), timeout=STOP_S
                )
            )

        self.threads = [threading.Thread(target=streamed), threading.Thread(target=plain)]
        for thread in self.threads:
            thread.start()
        deadline = time.monotonic() + 120
        while not any(line.startswith("data: ") for line in self.stream_lines):  # its first token: decoding
            assert time.monotonic() < deadline, "the stream did not begin"
            time.sleep(0.05)
        time.sleep(3.0)  # both decode
        assert not self.plain and all(thread.is_alive() for thread in self.threads)

    def assert_ended_with_errors(self) -> None:
        for thread in self.threads:
            thread.join(timeout=STOP_S)
        data = [line.removeprefix("data: ") for line in self.stream_lines if line.startswith("data: ")]
        assert json.loads(data[-1])["error"]["code"] == "server_stopping", data[-3:]  # read, not a cut connection
        assert self.plain and self.plain[0].status_code == 503
        assert self.plain[0].json()["error"]["code"] == "server_stopping"


@pytest.mark.nightly
def test_ctrl_c_to_the_group_while_streaming_stops_everything_in_order(start_serving: Callable[..., Serving]) -> None:
    _signal_while_streaming(start_serving(), signal.SIGINT)


def _signal_while_streaming(serving: Serving, sig: signal.Signals) -> None:
    """``sig`` to the door's group while a stream and a plain request decode: both end with errors they read."""
    serving.wait_until_serving()
    requests = InFlight()
    requests.start(serving.url)
    serving.signal(sig, group=True)
    requests.assert_ended_with_errors()
    serving.assert_stopped_cleanly(code=0)


# ----------------------------------------------------------------- nightly: the other moments and signals


@pytest.mark.nightly
def test_ctrl_c_to_the_group_while_the_engines_start(start_serving: Callable[..., Serving]) -> None:
    """The start-up unwinds: the engine being started is stopped once it is up; the shell's code for SIGINT."""
    serving = start_serving()
    serving.wait_for_line("agentkv: starting the prefill engine")
    time.sleep(2.0)  # vLLM's engine core is being made
    serving.signal(signal.SIGINT, group=True)
    serving.assert_stopped_cleanly(code=128 + signal.SIGINT)


@pytest.mark.nightly
def test_sigterm_to_the_door_alone_while_the_pair_warms_up(start_serving: Callable[..., Serving]) -> None:
    serving = start_serving()
    serving.wait_for_line("agentkv: warming up")
    serving.signal(signal.SIGTERM, group=False)
    serving.assert_stopped_cleanly(code=128 + signal.SIGTERM)


@pytest.mark.nightly
def test_ctrl_c_twice_in_a_row_while_idle(start_serving: Callable[..., Serving]) -> None:
    serving = start_serving()
    serving.wait_until_serving()
    serving.signal(signal.SIGINT, group=True)
    time.sleep(0.2)
    serving.signal(signal.SIGINT, group=True)  # the stop goes on in order
    serving.assert_stopped_cleanly(code=0)
    assert any("stopping already" in line for line in serving.output)


@pytest.mark.nightly
def test_sigterm_to_the_group_while_streaming(start_serving: Callable[..., Serving]) -> None:
    _signal_while_streaming(start_serving(), signal.SIGTERM)


_SCRIPT = """
    from agentkv import Colocated

    if __name__ == "__main__":  # vLLM spawns its CPU engine processes: they import this file
        engine = Colocated(max_model_len=512, warmup=False)
        engine.start()  # opened, never closed
        print("pids", *sorted(engine.pids), flush=True)
        input()  # until the test's Ctrl-C to the group: KeyboardInterrupt, and the exit handler stops the engine
"""


@pytest.mark.nightly
def test_a_script_holding_an_engine_that_ends_on_ctrl_c_leaves_no_noise_and_no_process(tmp_path: Path) -> None:
    """The script's own traceback (KeyboardInterrupt) and nothing from the engine: it did not get the group's
    SIGINT, and the exit handler stopped it in order."""
    script = tmp_path / "holds_an_engine.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    reader, writer = socket.socketpair()  # the script's stdin: open, silent
    process = subprocess.Popen(
        [sys.executable, str(script)],
        stdin=writer.fileno(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        line = ""
        while not line.startswith("pids "):  # vLLM logs on stdout too
            line = process.stdout.readline()
            assert line, "the script ended before its engine was up"
        pids = {int(pid) for pid in line.split()[1:]}
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=STOP_S)
    finally:
        reader.close()
        writer.close()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate(timeout=30)
    assert process.returncode != 0 and "KeyboardInterrupt" in stderr, stderr[-3000:]
    for noise in NOISE[1:]:
        assert noise not in stderr, f"{noise!r} on stderr:\n{stderr[-4000:]}"
    deadline = time.monotonic() + 20
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pids and alive(pids) == set()
