"""Many doors behind vLLM's router, for the scale-out tests (docs/scale-out.md): doors started as processes by a
command of the caller's (tests/scripted_door.py on scripted engines, or ``agentkv serve --store URL --remote P D``
on a launched pair), and ``vllm-router`` in front of them, hashing ``x-session-id`` onto the doors.

`ScaleOut` starts them (`ScaleOut.start_doors`, `ScaleOut.start_router`), each process's output in a file of its
own; at the end it stops whatever still runs, checks that their ports were freed, and, when the test failed, prints
the tail of every log (pytest shows it with the failure; a passing test stays quiet).
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import openai

from agentkv._engines._system import free_port
from freed import assert_ports_freed, running_pids

__all__ = [
    "Chat",
    "ROUTER_FLAGS",
    "DoorCommand",
    "Process",
    "ScaleOut",
    "StreamedTurn",
    "live_sessions",
    "owner",
    "placement",
    "scripted_door",
    "streamed_turn",
]

ROUTER_FLAGS = (
    "--policy",
    "consistent_hash",
    "--health-check-endpoint",
    "/health",
    "--health-check-interval-secs",
    "1",
    "--health-check-timeout-secs",
    "1",
    "--health-failure-threshold",
    "1",
    "--health-success-threshold",
    "1",
    "--worker-startup-check-interval",
    "1",
    "--log-level",
    "warning",
)
"""vllm-router's flags besides the addresses: sticky on ``x-session-id`` (its first hash key), and a door that stops
answering ``/health`` leaves the ring after one failed check a second apart (the defaults: three checks a minute
apart)."""

DoorCommand = Callable[[int, str], list[str]]
"""The command line of a door listening on a port (the first argument) with its store at a URL (the second)."""


def scripted_door(port: int, store_url: str) -> list[str]:
    """A door on a scripted engine (tests/scripted_door.py)."""
    script = Path(__file__).with_name("scripted_door.py")
    return [sys.executable, str(script), "--port", str(port), "--store", store_url]


def live_sessions(url: str) -> list[str]:
    """The named conversations a door holds live (its ``GET /v1/sessions``: the scripted doors take no key)."""
    response = httpx.get(url + "/v1/sessions", timeout=5)
    assert response.status_code == 200, response.text
    return [item["id"] for item in response.json()["data"]]


def owner(door: Process) -> str:
    """The lease owner a scripted door printed at its start (tests/scripted_door.py)."""
    found = re.search(r"\(owner ([^)]+)\)", door.log.read_text(errors="replace"))
    assert found is not None, door.tail()
    return found.group(1)


@dataclass
class Process:
    """A door or the router: its process, where it listens (``url``) and its log."""

    name: str
    url: str
    ports: tuple[int, ...]
    log: Path
    popen: subprocess.Popen[bytes] = field(repr=False)

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a machine that dies: nothing is given back, no lease released."""
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, and the wait for it to end (SIGKILL after ``timeout_s``)."""
        if not self.running:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, path: str, timeout_s: float) -> None:
        """Until ``GET <path>`` answers 200; fails, with its log, if it exits or does not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.running, f"{self.name} exited ({self.popen.returncode}):\n{self.tail()}"
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{self.name} not ready after {timeout_s:g} s:\n{self.tail()}"
            time.sleep(0.1)


class ScaleOut:
    """Doors and a router started for one test (``with ScaleOut(tmp_path) as fleet``), stopped at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.processes: list[Process] = []
        self._running_before = running_pids()

    def _start(self, name: str, argv: list[str], ports: tuple[int, ...]) -> Process:
        log = self.logs / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        process = Process(name, f"http://127.0.0.1:{ports[0]}", ports, log, popen)
        self.processes.append(process)
        return process

    def start_doors(
        self, n: int, store_url: str, door_command: DoorCommand = scripted_door, *, ready_s: float = 120.0
    ) -> list[Process]:
        """``n`` doors on one store, started at once; returns when each answers ``/health``."""
        doors: list[Process] = []
        before = sum(process.name.startswith("door-") for process in self.processes)  # numbered across calls
        for number in range(before, before + n):
            port = free_port()
            doors.append(self._start(f"door-{number}", door_command(port, store_url), (port,)))
        for door in doors:
            door.wait_ready("/health", ready_s)
        return doors

    def start_router(self, door_urls: list[str], *flags: str, ready_s: float = 60.0) -> Process:
        """vllm-router over ``door_urls`` with `ROUTER_FLAGS` (and ``flags`` after them); returns when it answers
        ``/health`` (every door healthy). Its own Prometheus page is on a port of its own (``ports[1]``)."""
        router = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
        assert router is not None, "vllm-router is not installed: pip install 'agentkv-vllm[dev]'"
        port, prometheus = free_port(), free_port()
        argv = [router, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(prometheus)]
        argv += ["--worker-urls", *door_urls, *ROUTER_FLAGS, *flags]
        process = self._start("router", argv, (port, prometheus))
        process.wait_ready("/health", ready_s)
        return process

    def __enter__(self) -> ScaleOut:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for process in reversed(self.processes):
            process.stop()
        if kind is not None:
            for process in self.processes:
                print(f"----- {process.name} ({process.url}), exit {process.popen.returncode}:\n{process.tail()}")
        ports = [port for process in self.processes for port in process.ports]
        assert_ports_freed(ports, running_before=self._running_before)


def placement(doors: list[Process]) -> dict[str, str]:
    """Which door holds each named conversation live (checked: one door only)."""
    held: dict[str, str] = {}
    for door in doors:
        for name in live_sessions(door.url):
            assert name not in held, f"{name} is live on {held[name]} and {door.name}: a turn went to another door"
            held[name] = door.name
    return held


@dataclass
class StreamedTurn:
    """A streamed chat turn as the client saw it."""

    text: str
    stats: dict[str, Any]
    """agentkv's stats of the step (the usage chunk's ``agentkv`` object)."""
    ttft_s: float
    """From the request sent to its first content chunk."""
    turn_s: float
    """From the request sent to the stream's end (the store's save comes before the last chunk)."""


def streamed_turn(
    client: openai.OpenAI, model: str, messages: list[dict[str, Any]], name: str | None, **params: Any
) -> StreamedTurn:
    """One chat turn, streamed, named by ``x-session-id`` when ``name`` is given (``params``: more request fields)."""
    started = time.perf_counter()
    text, stats, first = "", None, None
    stream = client.chat.completions.create(  # type: ignore[call-overload]
        model=model,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-session-id": name} if name else {},
        extra_body=params or None,  # merged into the JSON body as given
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter()
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            stats = (chunk.model_extra or {})["agentkv"]["stats"]
    assert stats is not None, "the stream ended without its usage chunk"
    ended = time.perf_counter()
    return StreamedTurn(text, stats, (first or ended) - started, ended - started)


@dataclass
class Chat:
    """One conversation as an OpenAI client app keeps it, streamed: the whole history goes with each request, an
    answer joins it when it came whole; a turn that fails is asked again (each failure counted)."""

    name: str | None
    model: str
    params: dict[str, Any] = field(default_factory=dict)
    """More request fields (``temperature``, ``max_tokens``)."""
    messages: list[dict[str, Any]] = field(default_factory=lambda: [{"role": "system", "content": "Be brief."}])
    answers: list[str] = field(default_factory=list)
    stats: list[dict[str, Any]] = field(default_factory=list)
    failures: list[tuple[int, str]] = field(default_factory=list)
    """(turn, what failed) for each request the client saw fail."""
    paused_s: list[float] = field(default_factory=list)
    """For each turn, the time since the last turn's answer came whole (0 for the first): how long its pin waited."""
    _answered: float | None = field(default=None, repr=False)

    def turn(self, client: openai.OpenAI, number: int, *, within_s: float = 120.0) -> None:
        question = {"role": "user", "content": f"Question {number} of {self.name or 'the unnamed one'}?"}
        deadline = time.monotonic() + within_s
        while True:
            try:
                asked = time.monotonic()
                text, stats = self._ask(client, [*self.messages, question])
                break
            except openai.APIError as exc:
                self.failures.append((number, f"{type(exc).__name__}: {exc}"))
                assert time.monotonic() < deadline, f"turn {number} of {self.name} kept failing: {self.failures}"
                time.sleep(0.2)
        self.messages += [question, {"role": "assistant", "content": text}]
        self.answers.append(text)
        self.stats.append(stats)
        self.paused_s.append(asked - self._answered if self._answered is not None else 0.0)
        self._answered = time.monotonic()

    def _ask(self, client: openai.OpenAI, messages: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
        turn = streamed_turn(client, self.model, messages, self.name, **self.params)
        return turn.text, turn.stats
